"""Registers, spills, shared memory and MMA instructions of the MLA decode kernels' sm_90 (H100 /
H200) builds, on a machine without a GPU: Triton compiles for the target and its own ptxas
reports the resources. Builds follow what the launcher specialises on the GPU (pointers and
integer arguments divisible by 16, except those the kernel leaves unspecialised).

    python -m bench.sm90_builds                     # the engine's shape, each kernel form
    python -m bench.sm90_builds --json builds.jsonl
    python -m bench.sm90_builds --select             # the indexer's one-launch top-k select
    python -m bench.sm90_builds --wide               # the wide rows' k-th score (wideep_kernels/wide_select.py)
    python -m bench.sm90_builds --score-rows         # the prompt rows' scoring (wideep_kernels/index_score_rows.py)

The figures depend on the Triton release: compare builds under the one the GPU runs.
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from wideep_kernels.mla_decode import _split_kernel
from wideep_kernels.mla_decode_gluon import _gluon_split_kernel
from wideep_kernels.mla_decode_rows import _rows_split_kernel

HEADS, KV_LORA, ROPE = 16, 512, 64
POINTER_TYPES = dict(q_ptr="*bf16", qr_ptr="*bf16", kv_ptr="*bf16", win_ptr="*bf16", fresh_ptr="*bf16",
                     scale_ptr="*fp32", table_ptr="*i32", glen_ptr="*i32", topk_ptr="*i32", wvalid_ptr="*u8",
                     ring_slot_ptr="*i64", write_idx_ptr="*i64", part_acc_ptr="*fp32", part_m_ptr="*fp32",
                     part_l_ptr="*fp32")
# (kernel, keys per tile, warps, stages): the tuned table's choices for the H200 and their neighbours
BUILDS = [(_split_kernel, 32, 4, 2), (_split_kernel, 64, 8, 2), (_rows_split_kernel, 64, 4, 2),
          (_rows_split_kernel, 64, 8, 2)]
# the Gluon form (wideep_kernels/mla_decode_gluon.py): its two buffers are written out, not a pipeliner's stages
GLUON_BUILDS = [(_gluon_split_kernel, 64, 4, 1), (_gluon_split_kernel, 64, 8, 1)]


def _ptxas() -> str:
    from triton.backends.nvidia import compiler
    tool = compiler.get_ptxas(90)
    return tool.path


def build(fn, block_n: int, warps: int, stages: int, fp8: bool = False) -> dict:
    consts = dict(BLOCK_H=HEADS, BLOCK_C=KV_LORA, BLOCK_R=ROPE, BLOCK_N=block_n, IS_FP8=fp8, HAS_TOPK=True,
                  HAS_WINDOW=True, RING=True, PREC="tf32", SLOTS=True, Q_RELOAD=False, UPCAST=False)
    if fn is _gluon_split_kernel:
        consts["num_warps"] = warps
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    types = dict(POINTER_TYPES, kv_ptr="*fp8e4nv" if fp8 else "*bf16")
    plain = set(fn.do_not_specialize) | {fn.arg_names.index(n) for n in fn.do_not_specialize if isinstance(n, str)}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if i not in plain and name not in plain and name not in ("num_heads", "keys_per_split"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    if fn is _gluon_split_kernel:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                 attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    return dict(kernel=fn.__name__, block_n=block_n, num_warps=warps, num_stages=stages, kv="fp8" if fp8 else "bf16",
                **_ptxas_info(ptx), shared_kb=round(kernel.metadata.shared / 1024, 1), wgmma=ptx.count("wgmma.mma_async"),
                mma_sync=ptx.count("mma.sync"), cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                triton=triton.__version__)


def build_select(first: int, last: int, record: bool = True, many: bool = False) -> dict:
    """The indexer's one-launch top-k select (wideep_kernels/row_select.py): phases first..last,
    with or without the last pass's kept positions, with a decode step's counting options or a
    prompt chunk's (`many`)."""
    from wideep_kernels import row_select as rs
    fn = rs._select_kernel
    consts = dict(FIRST=first, LAST=last, BLOCK=rs.BLOCK, PARTS=rs.MAX_PARTS, FILL=1024,
                  SPARSE_FROM=rs.MANY_SPARSE_FROM if many else rs.SPARSE_FROM,
                  SPARSE_MAX=rs.MANY_SPARSE_MAX if many else rs.SPARSE_MAX, RECORD=record, REC=rs.RECORDS)
    ptx = _launch_build(fn, consts, {"scores_ptr"}, 4)
    return dict(kernel=fn.__name__, phases=f"{first}-{last}", record=record, many=many, **_ptxas_info(ptx),
                vector_loads=ptx.count("ld.global.v4"), triton=triton.__version__)


def _launch_build(fn, consts: dict, fp32: set, warps: int, types: dict | None = None, stages: int | None = None,
                  asm: str = "ptx") -> str:
    """PTX of fn for sm_90 as the launcher builds it on an H200: pointers and the integers it
    specialises (all but do_not_specialize) taken as multiples of 16. `types`: pointer types
    other than fp32 (named in `fp32`) and i32, and float arguments; integers equal to 1 (unit
    strides), which the launcher makes constants, go in `consts`. `asm`: "ttgir" for Triton's IR."""
    types = types or {}
    plain = set(fn.do_not_specialize) | {fn.arg_names[i] for i in fn.do_not_specialize if isinstance(i, int)}
    # constexprs left out take their defaults, as a launch that leaves them out does
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts
                 and p.default is not inspect.Parameter.empty}, **consts}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, "*fp32" if name in fp32 else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = "i32"
            if name not in plain:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = dict(num_warps=warps, **({"num_stages": stages} if stages else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm[asm]


def build_score_rows() -> list[dict]:
    """The prompt rows' scoring launch (wideep_kernels/index_score_rows.py) for the bench model's
    indexer (8 heads of 64, 16 rows a program) with the threshold select's group maxima, bf16 and
    FP8 keys, its live tiles' loop built with one stage and with three: copies of the next tiles'
    keys (cp.async) appear only with more than one."""
    from wideep_kernels import index_score_rows as rows
    types = dict(q_ptr="*bf16", w_ptr="*bf16", keys_ptr="*bf16", scale_ptr="*fp32", first_ptr="*i64",
                 out_ptr="*fp32", m_ptr="*fp32", w_scale="fp32")
    unit = dict(stride_qd=1, stride_kd=1, stride_tm=1, stride_wh=1)
    out = []
    for fp8 in (False, True):
        for stages in (1, 3):
            consts = dict(unit, ROWS=16, HEADS=8, DIM=64, TILE=rows.ROWS_TILE, PRECISION="tf32", UPCAST=False,
                          SCALED=fp8, ZERO=True, SKIP_DEAD=False, F16=fp8, MAXIMA=True, NARROW_HEADS=16, PDL=2)
            kinds = dict(types, keys_ptr="*fp8e4nv" if fp8 else "*bf16")
            ptx = _launch_build(rows._score_rows_kernel, consts, set(), rows.ROWS_WARPS, kinds, stages)
            ttgir = _launch_build(rows._score_rows_kernel, consts, set(), rows.ROWS_WARPS, kinds, stages, "ttgir")
            out.append(dict(kernel="_score_rows_kernel", keys="fp8" if fp8 else "bf16", num_stages=stages,
                            **_ptxas_info(ptx), async_copies=ttgir.count("async_copy_global_to_local"),
                            wgmma=ptx.count("wgmma.mma_async"), triton=triton.__version__))
    return out


def build_wide() -> list[dict]:
    """The wide rows' k-th score (wideep_kernels/wide_select.py): group maxima, candidates and each byte
    pass (with its atomics for sparse blocks), with and without g_lens (with them the candidates keep their positions), the
    positions emitted from the candidates, the radix passes' sparse atomics, and the count and emit
    passes over whole rows and the one launch that replaces them, as launched on an H200
    (dependent launches on, integers specialised as the launcher does: pointers and the widths
    and strides it keeps)."""
    from wideep_kernels import radix_select
    from wideep_kernels import wide_select as ws
    fp32 = {"scores_ptr", "m_ptr", "cand_ptr", "kth_ptr"}
    builds = []
    for lens in (False, True):
        builds.append((ws._group_max_kernel, dict(HAS_LENS=lens, TILE=ws.GROUP_TILE, ROWS=ws.GROUP_ROWS), 4))
        builds.append((ws._candidate_kernel, dict(HAS_LENS=lens, BLOCK=ws.CANDIDATE_BLOCK, POSITIONS=lens,
                                                  BOUND_PASS=ws.MAXIMA_PASSES - 1), 4))
        builds += [(ws._pass_kernel, dict(PASS=p, HAS_LENS=lens, BLOCK=ws.BLOCK, SPARSE_FROM=ws.PASS_SPARSE_FROM,
                                          SPARSE_MAX=ws.PASS_SPARSE_MAX), 8) for p in range(4)]
    builds.append((ws._emit_candidates_kernel, dict(BLOCK=ws.BLOCK, FILL=1024), 4))
    # the radix passes over whole rows, with their last two bytes' atomics for sparse blocks
    chunk = radix_select._SELECT_BLOCK
    builds += [(radix_select._radix_pass_kernel, dict(PASS=p, BLOCK=chunk, SPARSE=True,
                                                      SPARSE_MAX=radix_select.SPARSE_MAX), 8) for p in (2, 3)]
    # the count and emit passes over whole rows, several chunks a program after the threshold select
    builds.append((radix_select._count_chunk_kernel, dict(CHUNK=chunk, RADIX=True, FITTED=True), 4))
    builds.append((radix_select._emit_chunk_kernel, dict(CHUNK=chunk, FILL=1024, FITTED=True), 4))
    # the positions in one launch after the radix passes, and after the threshold passes
    builds += [(radix_select._emit_rows_kernel, dict(CHUNK=chunk, FILL=1024, FITTED=fitted), 4)
               for fitted in (False, True)]
    rows = []
    for fn, consts, warps in builds:
        consts = dict(consts, PDL=2)
        ptx = _launch_build(fn, consts, fp32, warps)
        rows.append(dict(kernel=fn.__name__,
                         **{k: v for k, v in consts.items() if k in ("PASS", "HAS_LENS", "POSITIONS", "SPARSE")},
                         **_ptxas_info(ptx), vector_loads=ptx.count("ld.global.v4"), triton=triton.__version__))
    return rows


def _ptxas_info(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        info = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", str(path), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    if regs is None:
        raise RuntimeError(f"ptxas gave no register count:\n{info[-2000:]}")
    return dict(registers=int(regs.group(1)), spill_store_bytes=int(spills.group(1)) if spills else 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp8", action="store_true", help="FP8 KV instead of bf16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--select", action="store_true",
                    help="instead: the indexer's one-launch top-k select, in one launch and phase by phase")
    ap.add_argument("--wide", action="store_true",
                    help="instead: the wide rows' k-th score by candidates above group maxima")
    ap.add_argument("--score-rows", action="store_true",
                    help="instead: the prompt rows' scoring launch with one and three pipeline stages")
    args = ap.parse_args(argv)
    if args.select or args.wide or args.score_rows:
        rows = build_wide() if args.wide else build_score_rows() if args.score_rows else (
            [build_select(0, 5)] + [build_select(p, p) for p in range(6)]
            + [build_select(0, 5, record=False), build_select(4, 4, record=False), build_select(0, 5, many=True)])
        for r in rows:
            print(json.dumps(r))
        if args.json:
            with open(args.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    rows = [build(fn, n, w, s, args.fp8) for fn, n, w, s in BUILDS + GLUON_BUILDS]
    print("| kernel | KV | tile, warps, stages | registers | spill bytes | shared KB | wgmma | mma.sync |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['kv']} | {r['block_n']}, {r['num_warps']}, {r['num_stages']} | {r['registers']} | "
              f"{r['spill_store_bytes']} | {r['shared_kb']} | {r['wgmma']} | {r['mma_sync']} |")
    version = subprocess.run([_ptxas(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"Triton {triton.__version__}, {version[-1] if version else 'ptxas'}")
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
