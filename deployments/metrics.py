"""Ray metrics (Prometheus; shown in the Ray dashboard) for engines and routing."""
from __future__ import annotations

from ray.util import metrics

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class EngineMetrics:
    """One engine's figures, tagged with its role ("prefill" / "decode") and rank."""

    def __init__(self, role: str, rank: int | str):
        self.tags = {"role": role, "rank": str(rank)}
        keys = ("role", "rank")
        self.ttft = metrics.Histogram("wideep_ttft_s", "Time to first token (s)", _LATENCY_BOUNDARIES, keys)
        self.itl = metrics.Histogram("wideep_inter_token_latency_s", "Time between output tokens (s)",
                                     _LATENCY_BOUNDARIES, keys)
        self.running = metrics.Gauge("wideep_running_requests", "Requests being computed", keys)
        self.waiting = metrics.Gauge("wideep_waiting_requests", "Requests queued for KV blocks or a batch slot", keys)
        self.kv_used = metrics.Gauge("wideep_kv_blocks_used", "KV blocks in use", keys)
        self.prefix_hit = metrics.Counter("wideep_prefix_hit_tokens", "Prompt tokens served from the prefix cache", keys)
        self.replayed = metrics.Counter("wideep_replayed_tokens", "Tokens recomputed to rebuild window KV", keys)
        self.kv_bytes = metrics.Counter("wideep_kv_transfer_bytes", "KV bytes moved between prefill and decode", keys)
        self.pd = metrics.Counter("wideep_prefill_path_total", "Requests by prefill path (remote, local, fallback)",
                                  keys + ("path",))
        self.steps_ahead = metrics.Counter(
            "wideep_steps_ahead", "Decode steps launched before the previous step's tokens were read back "
            "(async scheduling)", keys)
        self.group_wait = metrics.Counter(
            "wideep_group_wait_seconds", "Time a decode-group rank waited for the others in the per-step "
            "agreement (s): the ranks that wait least are the ones the group waits for", keys)
        self.graph_captures = metrics.Counter(
            "wideep_graph_captures", "CUDA graphs captured while requests waited on them (each stalls every "
            "running request); those captured at start or ahead in idle time are not counted", keys)
        self.graph_capture_s = metrics.Counter(
            "wideep_graph_capture_seconds", "Time running requests stalled on CUDA graph captures (s)", keys)
        self.grammar_compiles = metrics.Counter(
            "wideep_grammar_compiles", "Structured output's grammars compiled (a schema, regex or grammar new "
            "to the engine; the last 128 are kept)", keys)
        self.grammar_compile_s = metrics.Counter(
            "wideep_grammar_compile_seconds", "Time spent compiling structured output's grammars (s), while "
            "their requests waited to be admitted", keys)
        self._last = {"prefix_hit_tokens": 0, "replayed_tokens": 0, "steps_ahead": 0, "group_wait_s": 0.0,
                      "graph_captures": 0, "graph_capture_s": 0.0, "grammar_compiles": 0, "grammar_compile_s": 0.0}

    def observe_stats(self, stats: dict) -> None:
        self.running.set(stats["running"], self.tags)
        self.waiting.set(stats["waiting"], self.tags)
        self.kv_used.set(stats["kv_blocks_used"], self.tags)
        for key, counter in (("prefix_hit_tokens", self.prefix_hit), ("replayed_tokens", self.replayed),
                             ("steps_ahead", self.steps_ahead), ("group_wait_s", self.group_wait),
                             ("graph_captures", self.graph_captures), ("graph_capture_s", self.graph_capture_s),
                             ("grammar_compiles", self.grammar_compiles),
                             ("grammar_compile_s", self.grammar_compile_s)):
            # group_wait_s: expert-parallel ranks only; graph_*: CUDA graphs only; grammar_*: once asked
            if key not in stats:
                continue
            delta = stats[key] - self._last[key]
            if delta > 0:
                counter.inc(delta, self.tags)
            self._last[key] = stats[key]

    def prefill_path(self, path: str) -> None:
        self.pd.inc(1, dict(self.tags, path=path))
