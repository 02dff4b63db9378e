"""bench.sm90_builds: the MLA decode kernels compiled for sm_90 on a machine without a GPU."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_keys_as_rows_builds_use_warpgroup_mmas(tmp_path):
    # a fresh process: the kernels must be compiled, not interpreted (TRITON_INTERPRET is read
    # when they are defined)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "builds.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.sm90_builds", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(0 < row["registers"] <= 255 for row in rows)
    heads = [row for row in rows if row["kernel"] == "_split_kernel"]
    keys = [row for row in rows if row["kernel"] == "_rows_split_kernel"]
    assert all(row["mma_sync"] > 0 and row["wgmma"] == 0 for row in heads)
    assert all(row["wgmma"] > 0 and row["mma_sync"] == 0 for row in keys)
    # two stages of 64 x 576 bf16 key tiles are staged in shared memory
    assert all(row["shared_kb"] > 2 * 64 * 576 * 2 / 1024 for row in keys)
    assert "| _rows_split_kernel |" in r.stdout
    # the Gluon form: its copies are cp.async into two written-out buffers, its products wgmma,
    # and it keeps everything in registers
    gluon = [row for row in rows if row["kernel"] == "_gluon_split_kernel"]
    assert len(gluon) == 2 and all(row["wgmma"] > 0 and row["cp_async"] > 0 and row["mma_sync"] == 0
                                   and row["spill_store_bytes"] == 0 for row in gluon)
    assert all(2 * 64 * 576 * 2 / 1024 < row["shared_kb"] <= 227 for row in gluon)


def test_gluon_fp8_build_fits(tmp_path):
    """The Gluon kernel's FP8 form (byte tiles dequantized into a bf16 tile in shared memory) builds
    for sm_90 with wgmma and cp.async, and at 8 warps without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "builds.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.sm90_builds", "--fp8", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    gluon = [json.loads(line) for line in out.read_text().splitlines()]
    gluon = [row for row in gluon if row["kernel"] == "_gluon_split_kernel"]
    assert [row["kv"] for row in gluon] == ["fp8", "fp8"]
    assert all(row["wgmma"] > 0 and row["cp_async"] > 0 and row["shared_kb"] <= 227 for row in gluon)
    assert [row["spill_store_bytes"] for row in gluon if row["num_warps"] == 8] == [0]


def test_one_launch_select_builds_without_spills(tmp_path):
    """The indexer's one-launch select (barriers between phases) and each phase alone compile
    for sm_90, and so do the one launch and the count phase without the last pass's kept
    positions, and the one launch with a prompt chunk's counting options: the interpreter, which
    runs it on CPU, does not type-check the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "select.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.sm90_builds", "--select", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["phases"] for row in rows] == ["0-5"] + [f"{p}-{p}" for p in range(6)] + ["0-5", "4-4", "0-5"]
    assert [(row["record"], row["many"]) for row in rows][-3:] == [(False, False), (False, False), (True, True)]
    assert all(0 < row["registers"] <= 255 and row["spill_store_bytes"] == 0 for row in rows)


def test_wide_select_builds_without_spills(tmp_path):
    """The wide rows' k-th score (wideep_kernels/wide_select.py): group maxima, candidates and the four
    byte passes, with and without g_lens, the emit from the candidates, the radix passes'
    atomics for sparse blocks, the chunk passes and the one-launch emit compile for sm_90 with
    dependent launches; the row loads are vector loads (the masks at multiples of 16 keep them so)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "wide.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.sm90_builds", "--wide", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["kernel"] for row in rows] == (2 * (["_group_max_kernel", "_candidate_kernel"] + 4 * ["_pass_kernel"])
                                              + ["_emit_candidates_kernel"] + 2 * ["_radix_pass_kernel"]
                                              + ["_count_chunk_kernel", "_emit_chunk_kernel"]
                                              + 2 * ["_emit_rows_kernel"])
    assert all(0 < row["registers"] <= 255 and row["spill_store_bytes"] == 0 for row in rows)
    assert all(row["vector_loads"] > 0 for row in rows)


def test_prompt_scoring_live_tiles_loop_pipelines(tmp_path):
    """The prompt rows' scoring launch (wideep_kernels/index_score_rows.py): its live tiles' loop has
    no branch inside, so with more than one stage Triton copies the next tiles' keys ahead
    (cp.async), for bf16 and FP8 keys; one stage builds without them. No spills either way."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "score_rows.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.sm90_builds", "--score-rows", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["keys"], row["num_stages"]) for row in rows] == [("bf16", 1), ("bf16", 3), ("fp8", 1), ("fp8", 3)]
    assert all(0 < row["registers"] <= 255 and row["spill_store_bytes"] == 0 and row["wgmma"] > 0 for row in rows)
    assert all((row["async_copies"] > 0) == (row["num_stages"] > 1) for row in rows)
