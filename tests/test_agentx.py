"""bench/agentx: workload generator, AgentX trace import, report math, and a replay against the
Serve application on the tiny model."""
import asyncio
import json
import math
import os

import pytest

from bench.agentx import client, report
from bench.agentx.traces import TraceError, synthesise_prompt
from bench.agentx.workload import WorkloadSpec, generate, read_trace, sessions_of, write_trace

SMALL = dict(sessions=5, min_turns=3, max_turns=5, system_tokens=120, task_tokens=40, answer_tokens=(4, 10),
             tool_tokens=(10, 30), large_tool_tokens=(80, 120), large_tool_prob=0.3, think_time_mean_s=0.4,
             think_time_max_s=1.0, max_context_tokens=2000)


def _json(reqs):
    return [r.to_json() for r in reqs]


def test_generator_is_deterministic_by_seed():
    assert _json(generate(WorkloadSpec(**SMALL, seed=3))) == _json(generate(WorkloadSpec(**SMALL, seed=3)))
    assert _json(generate(WorkloadSpec(**SMALL, seed=3))) != _json(generate(WorkloadSpec(**SMALL, seed=4)))


def test_chat_sessions_grow_a_shared_prefix_with_unique_first_turn_markers():
    spec = WorkloadSpec(**SMALL, seed=1)
    sessions = sessions_of(generate(spec))
    assert len(sessions) == spec.sessions
    nonces = [s[0].nonce for s in sessions]
    assert len(set(nonces)) == len(nonces) and all(nonces)
    systems = {s[0].messages[0]["content"] for s in sessions}
    assert len(systems) == 1                      # the system prompt is shared by every session
    for s, nonce in zip(sessions, nonces):
        assert nonce in s[0].messages[1]["content"]
        assert spec.min_turns <= len(s) <= spec.max_turns
        assert [r.turn for r in s] == list(range(len(s)))
        assert s[0].think_time_s == 0 and s[0].shared_prefix_tokens == 0
        for prev, cur in zip(s, s[1:]):
            # each prompt is the previous one plus an assistant answer and a tool output
            assert cur.messages[:len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
            assert cur.input_tokens > prev.input_tokens
            # think times are in the trace and the nominal timestamps honour them
            assert 0 <= cur.think_time_s <= spec.think_time_max_s
            assert cur.timestamp_s == pytest.approx(prev.timestamp_s + cur.think_time_s, abs=1e-3)
        for r in s:
            assert 1 <= r.max_tokens <= spec.answer_tokens[1]
            assert r.input_tokens + r.max_tokens <= spec.max_context_tokens
    assert any(r.think_time_s > 0 for s in sessions for r in s[1:])


def test_hash_id_sessions_share_whole_blocks_and_round_trip(tmp_path):
    spec = WorkloadSpec(**SMALL, seed=2, api="completions", block_tokens=16)
    reqs = generate(spec)
    sessions = sessions_of(reqs)
    sys_blocks = spec.system_tokens // 16
    assert len({tuple(s[0].hash_ids[:sys_blocks]) for s in sessions}) == 1
    assert len({s[0].hash_ids[sys_blocks + 1] for s in sessions}) == len(sessions)
    for s in sessions:
        for prev, cur in zip(s, s[1:]):
            full = prev.input_tokens // 16
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            if prev.input_tokens % 16:                             # the partial last block grew
                assert cur.hash_ids[full] != prev.hash_ids[full]
            assert cur.shared_prefix_tokens == full * 16
    write_trace(tmp_path / "t.jsonl", reqs)
    assert _json(read_trace(tmp_path / "t.jsonl")) == _json(reqs)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_agentx_trace_common_hashes_give_identical_token_blocks(tmp_path):
    trace = _write(tmp_path / "agentx.jsonl", [
        {"session_id": "a", "turn": 0, "timestamp": 1000, "input_length": 10, "output_length": 3,
         "hash_ids": [7, 8, 9], "block_size": 4},
        {"session_id": "a", "turn": 1, "timestamp": 2500, "input_length": 15, "output_length": 2,
         "hash_ids": [7, 8, 11, 12], "block_size": 4, "think_time": 0.25},
        # aliases: another session that shares only the first block
        {"conversation_id": "b", "timestamp_s": 3.0, "input_tokens": 6, "completion_tokens": 4,
         "block_hashes": [7, 99], "block_size": 4, "think_time_ms": 100},
    ])
    reqs = read_trace(trace)
    a0, a1, b0 = reqs
    assert (a0.session_id, a1.session_id, b0.session_id) == ("a", "a", "b")
    assert a1.think_time_s == 0.25 and a0.think_time_s == 0 and a1.timestamp_s == 2.5
    assert a1.shared_prefix_tokens == 8 and b0.shared_prefix_tokens == 0
    p0, p1, pb = (synthesise_prompt(r, vocab_size=512, salt="x") for r in (a0, a1, b0))
    assert (len(p0), len(p1), len(pb)) == (10, 15, 6)
    assert p0[:8] == p1[:8] and p0[8:10] != p1[8:10]
    assert pb[:4] == p0[:4] and pb[4:] != p0[4:6]
    assert all(16 <= t < 512 for t in p0 + p1 + pb)
    # another salt (another sweep level) gives other tokens with the same sharing
    q0, q1 = (synthesise_prompt(r, vocab_size=512, salt="y") for r in (a0, a1))
    assert q0 != p0 and q0[:8] == q1[:8]


def test_agentx_blocks_scale_to_the_replay_block_and_long_sessions_end(tmp_path):
    trace = _write(tmp_path / "big.jsonl", [
        {"session_id": "s", "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]},
        {"session_id": "s", "input_length": 1536, "output_length": 64, "hash_ids": [1, 2, 3]},
        {"session_id": "s", "input_length": 99999, "output_length": 64, "hash_ids": list(range(196))},
    ])
    reqs = read_trace(trace, replay_block_tokens=16, max_context_tokens=100)
    assert [(r.input_tokens, r.max_tokens, r.block_tokens) for r in reqs] == [(32, 2, 16), (48, 2, 16)]
    assert reqs[1].shared_prefix_tokens == 32


@pytest.mark.parametrize("rows, needle", [
    (['{"input_length": 4, "output_length": 1, "hash_ids": [1]}', "{not json"], ":2: not valid JSON"),
    ([{"input_length": 4, "output_length": 1, "hash_ids": [1]}, {"output_length": 1, "hash_ids": [1]}],
     ":2: missing field 'input_length'"),
    ([{"input_length": 4, "output_length": 0, "hash_ids": [1]}], ":1: field 'output_length' must be an integer >= 1"),
    ([{"input_length": 4, "output_length": 2, "hash_ids": [[1]]}], ":1: field 'hash_ids' must be a non-empty list"),
    ([{"input_length": 900, "output_length": 2, "hash_ids": [1]}], ":1: field 'hash_ids' has 1 blocks of 512"),
    ([{"input_length": 4, "output_length": 2, "hash_ids": [1], "think_time": -1}], ":1: field 'think_time'"),
    ([{"api": "chat", "session_id": "s", "turn": 0, "max_tokens": 2, "think_time_s": 0, "timestamp_s": 0,
       "input_tokens": 5}], ":1: field 'messages' must be"),
])
def test_bad_trace_lines_are_named(tmp_path, rows, needle):
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path / "bad.jsonl", rows))
    assert needle in str(e.value) and "bad.jsonl" in str(e.value)


def _rec(turn, e2e, out, prompt, cached, shared, ttft, ok=True):
    return {"ok": ok, "turn": turn, "e2e_s": e2e, "output_tokens": out, "prompt_tokens": prompt,
            "cached_tokens": cached, "uncached_tokens": prompt - cached, "shared_prefix_tokens": shared,
            "ttft_s": ttft, "itl_s": [0.01, 0.03]}


def test_report_math_against_hand_computed_figures(tmp_path):
    records = [
        _rec(0, 1.0, 10, 100, 0, 0, 0.2),
        _rec(1, 2.0, 10, 150, 112, 100, 0.4),   # theoretical 96 (100 rounded down to 16s)
        _rec(0, 3.0, 20, 50, 32, 0, 0.6),       # a first turn that hit the shared system prompt
        _rec(1, 0.5, 5, 90, 32, 50, 0.1),       # theoretical 48
        {"ok": False, "turn": 2, "e2e_s": 9.0, "ttft_s": None, "itl_s": [], "error": "HTTP 500"},
    ]
    m = report.level_metrics(records, wall_s=10.0, gpus=2, kv_block_size=16)
    assert (m["requests"], m["failed"]) == (5, 1)
    assert (m["input_cached_tokens"], m["input_uncached_tokens"], m["output_tokens"]) == (176, 214, 45)
    assert m["throughput_per_gpu"] == pytest.approx((176 + 214 + 45) / 10 / 2)          # 21.75
    # e2e/output = 0.1, 0.2, 0.15, 0.1 -> sorted .1 .1 .15 .2; P90 at rank 2.7 = .15 + .7 * .05
    assert m["per_user_tok_s"] == pytest.approx(1 / 0.185, abs=1e-3)
    # TTFT sorted .1 .2 .4 .6: P50 = .3, P90 = .4 + .7 * .2
    assert (m["ttft_p50_ms"], m["ttft_p90_ms"]) == (pytest.approx(300), pytest.approx(540))
    assert m["itl_p50_ms"] == pytest.approx(20)
    assert (m["prefix_hit_tokens"], m["theoretical_reuse_tokens"]) == (144, 144)
    assert m["prefix_hit_ratio"] == 1.0 and m["prefix_hit_ratio_capped"] == pytest.approx(128 / 144, abs=1e-4)
    assert m["first_turn_cached_tokens"] == 32

    levels = [{"concurrency": 1, "wall_s": 10.0, "records": records}]
    written = report.write_run(tmp_path / "run", levels, {"label": "hand", "gpus": 2, "kv_block_size": 16})
    assert (tmp_path / "run" / "throughput_vs_speed.png").stat().st_size > 1000
    assert (tmp_path / "run" / "ttft_cdf.png").stat().st_size > 1000
    again = report.rerender(tmp_path / "run")
    assert again["levels"] == written["levels"]
    assert math.isclose(report.rerender(tmp_path / "run", gpus=1)["levels"][0]["throughput_per_gpu"], 43.5)
    assert "| hand | 1 | 5 (1) |" in report.table({"hand": written})


def test_report_flags_latency_measured_on_fewer_text_chunks_than_tokens():
    """3 chunks for 10 tokens (and a request whose tokens streamed no text at all) make the
    TTFT / ITL figures unreliable: the summary counts it and the table says so. Records
    written before `text_chunks` existed get it from their ITL samples."""
    full = dict(_rec(0, 1.0, 3, 100, 0, 0, 0.2), text_chunks=3)             # 3 chunks, 3 tokens
    short = dict(_rec(1, 1.0, 10, 150, 96, 100, 0.3), text_chunks=3)        # 3 chunks, 10 tokens
    silent = dict(_rec(1, 1.0, 5, 120, 96, 100, None), itl_s=[], text_chunks=0)
    legacy = {k: v for k, v in _rec(1, 1.0, 3, 120, 96, 100, 0.1).items()}  # no text_chunks: 2 ITL + 1
    m = report.level_metrics([full, short, silent, legacy], wall_s=1.0, gpus=1, kv_block_size=16)
    assert report.text_chunks(legacy) == 3 and report.text_chunks(dict(silent, text_chunks=None)) == 0
    assert (m["short_stream_requests"], m["ttft_missing"], m["text_chunks"]) == (2, 1, 9)
    assert (m["itl_samples"], m["itl_expected"]) == (6, 2 + 9 + 4 + 2)
    text = report.table({"x": {"levels": [{"concurrency": 1, **m}]}})
    assert "| 6 / 17 |" in text and "* some requests streamed fewer text chunks" in text
    clean = report.level_metrics([full, legacy], wall_s=1.0, gpus=1, kv_block_size=16)
    assert clean["short_stream_requests"] == 0 and "*" not in report.table({"x": {"levels": [{"concurrency": 1, **clean}]}})


def test_replay_against_the_served_app(tiny_ckpt, tmp_path):
    """2 sessions x 2 turns at concurrency 2 through Ray Serve: every request succeeds, the
    token counts agree with the trace, and each second turn finds its first turn's prefix."""
    from bench.agentx.__main__ import LocalServe, _counter, _wait_ready

    spec = WorkloadSpec(sessions=2, min_turns=2, max_turns=2, system_tokens=80, task_tokens=30,
                        answer_tokens=(4, 8), tool_tokens=(10, 20), large_tool_prob=0, think_time_mean_s=0.05,
                        max_context_tokens=1000, seed=5)
    sessions = sessions_of(generate(spec, _counter(str(tiny_ckpt))))
    args = {"model": {"path": str(tiny_ckpt), "name": "tiny"},
            "engine": {"block_size": 16, "num_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256},
            "prefill": {"replicas": 1}, "decode": {"dp_size": 2},
            "kv_transport": {"backend": "nixl", "local_prefill_max_tokens": 64, "timeout_s": 20},
            "eplb": {"enabled": False}}
    with LocalServe(args, num_cpus=2) as srv:
        _wait_ready(srv.url, "tiny", limit_s=180)
        level = asyncio.run(client.run_level(srv.url, sessions, 2, 2, model="tiny", progress=False))
    assert not os.path.exists(srv.temp_dir)  # a clean run leaves no Ray temp dir behind
    recs = level["records"]
    assert len(recs) == 4 and all(r["ok"] for r in recs), [r.get("error") for r in recs]
    trace = {(s[0].session_id, r.turn): r for s in sessions for r in s}
    # the server counts what the trace counted, plus the replay's markers (the same for every request)
    extra = {r["prompt_tokens"] - trace[(r["session_id"].split(".")[0], r["turn"])].input_tokens for r in recs}
    assert len(extra) == 1 and 0 < extra.pop() < 64
    for r in recs:
        req = trace[(r["session_id"].split(".")[0], r["turn"])]
        assert r["output_tokens"] == req.max_tokens
        assert r["cached_tokens"] + r["uncached_tokens"] == r["prompt_tokens"]
        assert len(r["itl_s"]) <= r["output_tokens"] - 1 and r["ttft_s"] <= r["e2e_s"]
        # the random checkpoint only emits ids with text, so every token is its own chunk
        assert r["text_chunks"] == r["output_tokens"] == len(r["itl_s"]) + 1
    second = [r for r in recs if r["turn"] == 1]
    assert len({r["session_id"] for r in second}) == 2
    for r in second:
        assert r["cached_tokens"] > 0
        first = next(f for f in recs if f["session_id"] == r["session_id"] and f["turn"] == 0)
        assert r["shared_prefix_tokens"] == first["prompt_tokens"]
    m = report.level_metrics(recs, level["wall_s"], gpus=1, kv_block_size=16)
    assert m["failed"] == 0 and m["throughput_per_gpu"] > 0 and m["theoretical_reuse_tokens"] > 0


def test_serve_replay_ttft_smoke(tiny_v4_ckpt, tmp_path, capsys):
    """bench.serve_replay_ttft through Ray Serve on CPU: each mode's next turn finds the first
    turn's prefix, and a context past the app's limit is refused before anything starts."""
    import yaml

    from bench import serve_replay_ttft
    cfg = tmp_path / "app.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_v4_ckpt), "name": "tiny"},
        "engine": {"block_size": 16, "num_blocks": 128, "max_num_seqs": 4, "max_num_batched_tokens": 128},
        "prefill": {"replicas": 0}, "kv_transport": {"backend": "none"}, "decode": {"dp_size": 1},
        "eplb": {"enabled": False}}))
    out = tmp_path / "rows.jsonl"
    assert serve_replay_ttft.main(["--config", str(cfg), "--contexts", "96", "200", "--modes", "bounded", "exact",
                                   "--new-tokens", "8", "--warmup", "1", "--num-cpus", "2", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["context"]) for r in rows] == [("bounded", 96), ("bounded", 200), ("exact", 96), ("exact", 200)]
    for r in rows:
        assert r["none_ttft_ms"] > 0 and r["hit_ttft_ms"] > 0
        assert r["context"] - 16 < r["hit_cached_tokens"] <= r["context"]  # whole blocks of the first turn
    assert "| bounded | 200 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serve_replay_ttft.main(["--config", str(cfg), "--contexts", "100000"])
