"""Synthetic multi-turn agent sessions shaped like AgentX, and the replayable request form.

A session is what a coding agent sends to the model:

    system prompt (shared by every session)  +  task (unique; opens with a first-turn nonce)
    then per turn: the assistant's short answer  +  a tool-output burst (usually small,
    sometimes large), each turn sent after a think time.

Request t of a session carries the whole history, so request t's prompt extends request
t-1's prompt: the reusable prefix grows turn by turn. Everything is drawn from one seeded
`random.Random`, so a spec and a seed always give the same trace.

Sizes are parameters (`WorkloadSpec`); the defaults fit a model with a 2,048-token context.
Sessions stop growing before prompt + answer would pass `max_context_tokens`.

The trace form written by `write_trace` (one JSON object per line, one line per request):

    session_id, turn, api ("chat" or "completions"), max_tokens, think_time_s (wait after the
    session's previous answer before sending), timestamp_s (nominal arrival: session start +
    think times, ignoring service time), input_tokens (exact when a tokenizer counted them,
    else an estimate), nonce (the session's first-turn marker), and either
      messages                         (api "chat": the full OpenAI message list), or
      hash_ids + block_tokens          (api "completions": token ids are synthesised per
                                        block at replay time, see bench/agentx/traces.py)

`read_trace` also accepts the public AgentX / Mooncake form (see traces.py).
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Words an agent's context is made of; any fixed list works.
_WORDS = (
    "def return import class self value index list dict key error file path line test assert "
    "config model token cache block prefill decode rank expert router session request stream "
    "the a of to in for with on is not and or if else while print len range open read write "
    "fix patch diff build run check pass fail trace stack output input result sum max min"
).split()

# Without a tokenizer to calibrate against, assume what a production BPE gives for such words.
TOKENS_PER_WORD = 1.3


@dataclass
class WorkloadSpec:
    """Sizes in tokens (estimated unless a tokenizer counts them); times in seconds."""
    sessions: int = 8
    min_turns: int = 3
    max_turns: int = 6
    system_tokens: int = 400          # shared by all sessions: the agent's instructions and tools
    task_tokens: int = 150            # per session: the issue to solve
    answer_tokens: tuple[int, int] = (12, 40)       # assistant outputs are short
    tool_tokens: tuple[int, int] = (30, 120)        # a usual tool result
    large_tool_tokens: tuple[int, int] = (250, 500)  # a file dump or a long test log
    large_tool_prob: float = 0.2
    think_time_mean_s: float = 0.5    # exponential, capped at think_time_max_s
    think_time_max_s: float = 3.0
    session_interarrival_s: float = 1.0
    max_context_tokens: int = 1900
    api: str = "chat"                 # "chat" (messages) or "completions" (hash_ids -> token ids)
    block_tokens: int = 16            # tokens per hash block in "completions" traces
    seed: int = 0

    def __post_init__(self):
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {self.api!r}")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}, {self.max_turns}")
        for name in ("answer_tokens", "tool_tokens", "large_tool_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(lo, hi)}")


@dataclass
class Request:
    session_id: str
    turn: int
    api: str
    max_tokens: int
    think_time_s: float
    timestamp_s: float
    input_tokens: int
    nonce: str = ""
    messages: list[dict] | None = None
    hash_ids: list | None = None
    block_tokens: int = 0
    # tokens this prompt shares with the session's previous prompt; None: known only at replay
    # (chat prompts are counted by the server's tokenizer)
    shared_prefix_tokens: int | None = field(default=None)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None and not (k == "block_tokens" and not v)}


def _text(rng: random.Random, tokens: int, per_word: float) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, round(tokens / per_word))))


def _tokens_per_word(count_messages) -> float:
    """Calibrate sizes to the tokenizer that will count them (a small random-weight
    checkpoint's BPE splits these words far more than a production one)."""
    if count_messages is None:
        return TOKENS_PER_WORD
    words = " ".join(_WORDS * 4)
    base = count_messages([{"role": "user", "content": ""}])
    return max(0.5, (count_messages([{"role": "user", "content": words}]) - base) / (4 * len(_WORDS)))


def _sized(rng: random.Random, span: tuple[int, int]) -> int:
    return rng.randint(span[0], span[1])


def generate(spec: WorkloadSpec, count_messages: Callable[[list[dict]], int] | None = None) -> list[Request]:
    """The trace's requests, session by session, turns in order.

    count_messages: the exact prompt length of a message list (the model's chat template and
    tokenizer); without it chat prompt lengths are estimates."""
    rng = random.Random(spec.seed)
    table: dict = {}
    per_word = _tokens_per_word(count_messages) if spec.api == "chat" else TOKENS_PER_WORD
    text = lambda n: _text(rng, n, per_word)  # noqa: E731
    system = text(spec.system_tokens)
    requests: list[Request] = []
    start = 0.0
    for s in range(spec.sessions):
        sid = f"agx-{spec.seed}-{s:04d}"
        # the session index keeps nonces unique even if two random draws collide
        nonce = f"{s:04d}{rng.getrandbits(48):012x}"
        turns = rng.randint(spec.min_turns, spec.max_turns)
        # segments: (name, tokens, text); "system" is the only one shared across sessions
        segments = [("system", spec.system_tokens, system),
                    (f"{sid}/task", spec.task_tokens, f"[task {nonce}] " + text(spec.task_tokens))]
        t_arrive, think = start, 0.0
        for t in range(turns):
            answer = _sized(rng, spec.answer_tokens)
            req = _request(spec, sid, t, nonce, segments, answer, think, t_arrive, count_messages, table)
            if req.input_tokens + answer > spec.max_context_tokens:
                break
            requests.append(req)
            # the next turn appends what this one answered and the tool output it triggered
            span = spec.large_tool_tokens if rng.random() < spec.large_tool_prob else spec.tool_tokens
            tool = _sized(rng, span)
            segments = segments + [(f"{sid}/a{t}", answer, text(answer)),
                                   (f"{sid}/tool{t}", tool, f"[tool output {t}] " + text(tool))]
            think = min(rng.expovariate(1 / spec.think_time_mean_s), spec.think_time_max_s) \
                if spec.think_time_mean_s > 0 else 0.0
            t_arrive += think
        start += rng.expovariate(1 / spec.session_interarrival_s) if spec.session_interarrival_s > 0 else 0.0
    fill_shared_prefix(requests)
    return requests


def _messages(segments) -> list[dict]:
    msgs = [{"role": "system", "content": segments[0][2]}, {"role": "user", "content": segments[1][2]}]
    for i in range(2, len(segments), 2):
        msgs.append({"role": "assistant", "content": segments[i][2]})
        msgs.append({"role": "user", "content": segments[i + 1][2]})
    return msgs


def _request(spec, sid, turn, nonce, segments, answer, think, t_arrive, count_messages, table) -> Request:
    common = dict(session_id=sid, turn=turn, api=spec.api, max_tokens=answer, think_time_s=round(think, 4),
                  timestamp_s=round(t_arrive, 4), nonce=nonce)
    if spec.api == "chat":
        msgs = _messages(segments)
        n = count_messages(msgs) if count_messages else sum(tok for _, tok, _ in segments) + 2 * len(msgs)
        return Request(**common, input_tokens=n, messages=msgs)
    n = sum(tok for _, tok, _ in segments)
    return Request(**common, input_tokens=n, hash_ids=block_hashes(segments, spec.block_tokens, n, table),
                   block_tokens=spec.block_tokens)


def block_hashes(segments, block_tokens: int, n: int, table: dict) -> list[int]:
    """One id per block of `block_tokens` (the last may be partial): equal ids mean equal
    content *and* equal prefix before it, as in chained prefix-cache hashes. Segments are
    identified by name, so only "system" blocks are shared across sessions. `table` numbers
    the chains in order of first appearance, so ids depend on the trace alone."""
    ids, chain, pos, seg, off = [], (), 0, 0, 0
    while pos < n:
        take, content = min(block_tokens, n - pos), []
        while take:
            name, tok, _ = segments[seg]
            step = min(take, tok - off)
            content.append((name, off, off + step))
            off, take, pos = off + step, take - step, pos + step
            if off == tok:
                seg, off = seg + 1, 0
        chain = (chain, tuple(content))
        ids.append(table.setdefault(chain, len(table)))
    return ids


def shared_hash_tokens(prev: Request, cur: Request) -> int:
    """Tokens of `cur` covered by the leading hash ids it has in common with `prev`."""
    k = 0
    for a, b in zip(prev.hash_ids, cur.hash_ids):
        if a != b:
            break
        k += 1
    return min(k * cur.block_tokens, prev.input_tokens, cur.input_tokens)


def fill_shared_prefix(requests: list[Request]) -> None:
    for session in sessions_of(requests):
        session[0].shared_prefix_tokens = 0
        for prev, r in zip(session, session[1:]):
            hashed = r.hash_ids is not None and prev.hash_ids is not None
            r.shared_prefix_tokens = shared_hash_tokens(prev, r) if hashed else None


def sessions_of(requests: list[Request]) -> list[list[Request]]:
    """Requests grouped by session (in order of first appearance), each session by turn."""
    by: dict[str, list[Request]] = {}
    for r in requests:
        by.setdefault(r.session_id, []).append(r)
    return [sorted(v, key=lambda r: r.turn) for v in by.values()]


def write_trace(path: str | Path, requests: list[Request]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_trace(path: str | Path, **agentx_options) -> list[Request]:
    """Our trace form or the public AgentX form (decided per file by its first line)."""
    from .traces import TraceError, load_agentx, request_from_json

    path = Path(path)
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    if not lines:
        raise TraceError(f"{path}: the trace holds no requests")
    objs = []
    for i, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{i}: each line must be a JSON object, got {type(obj).__name__}")
        objs.append((i, obj))
    if "api" in objs[0][1]:
        requests = [request_from_json(obj, f"{path}:{i}") for i, obj in objs]
        fill_shared_prefix(requests)
        return requests
    return load_agentx(objs, str(path), **agentx_options)
