"""Engine figures turned into Ray metrics (deployments/metrics.py): counters get the growth of the
engine's running totals between two reports."""
from deployments.metrics import EngineMetrics


def _stats(**kw):
    return dict(dict(running=1, waiting=0, kv_blocks_used=3, prefix_hit_tokens=0, replayed_tokens=0,
                     steps_ahead=0), **kw)


def test_counters_take_the_growth_between_reports():
    m = EngineMetrics("decode", 0)
    added = []
    for name in ("prefix_hit", "replayed", "steps_ahead", "group_wait", "graph_captures", "graph_capture_s",
                 "grammar_compiles", "grammar_compile_s"):
        getattr(m, name).inc = lambda value, tags, name=name: added.append((name, value))
    m.observe_stats(_stats(steps_ahead=7, group_wait_s=0.25, prefix_hit_tokens=16, graph_captures=2,
                           graph_capture_s=0.06))
    m.observe_stats(_stats(steps_ahead=9, group_wait_s=0.75, prefix_hit_tokens=16, graph_captures=2,
                           graph_capture_s=0.06, grammar_compiles=3, grammar_compile_s=0.2))
    assert added == [("prefix_hit", 16), ("steps_ahead", 7), ("group_wait", 0.25), ("graph_captures", 2),
                     ("graph_capture_s", 0.06), ("steps_ahead", 2), ("group_wait", 0.5), ("grammar_compiles", 3),
                     ("grammar_compile_s", 0.2)]
    # an engine outside a decode group reports no group wait
    plain = EngineMetrics("prefill", 0)
    plain.group_wait.inc = lambda *a: added.append("group_wait of a plain engine")
    plain.graph_captures.inc = lambda *a: added.append("graph captures of an engine without graphs")
    plain.observe_stats(_stats(steps_ahead=1))
    assert "group_wait of a plain engine" not in added
    assert "graph captures of an engine without graphs" not in added
