"""Fused MoE routing: sigmoid scores, group-limited top-k, weights, physical slots and the
per-slot token count, in one kernel launch; at decode batch sizes the router's fp32 logits come
from one more launch, as partial sums that the routing kernel adds (`gate_parts_triton`).

The unfused torch sequence (engine/moe.py `route`, `ExpertMap.slots_for` and the slot count)
is a couple of dozen small launches per MoE layer, which dominates at decode batch sizes;
here one program takes a block of tokens and does all of it in registers. For one token (a
batch-1 decode step) the routing kernel can also lay out the pairs for the expert kernels
(`align`), and the router's partial logits can take the RMSNorm before them
(`gate_parts_norm_triton`): two launches fewer per MoE layer.

`route_reference` defines the semantics; `route_triton` must match it (ids and slots exactly
when the scores have no ties, weights to float32 rounding); `fused_route` picks one.
"""
from __future__ import annotations

import torch

from . import triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .rmsnorm import _rstd, cast_rne
except Exception:  # the reference path must keep working where triton is absent
    triton = None


def _check(logits, bias, n_group, topk_group, top_k, log2phys, num_replicas, slot_load) -> None:
    if logits.dim() != 2:
        raise ValueError("logits must be [T, E]")
    e = logits.shape[1]
    if bias.shape != (e,):
        raise ValueError(f"bias must be [{e}]")
    if n_group < 1 or e % n_group:
        raise ValueError(f"n_group={n_group} must divide E={e}")
    group_size = e // n_group
    if n_group > 1 and group_size < 2:
        raise ValueError("a group's score is the sum of its two best experts: groups need >= 2 experts")
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    eligible = topk_group * group_size if n_group > 1 else e
    if not 1 <= top_k <= eligible:
        raise ValueError(f"top_k={top_k} must be in [1, {eligible}] (experts in the eligible groups)")
    if log2phys.dim() != 2 or log2phys.shape[0] != e or num_replicas.shape != (e,):
        raise ValueError(f"log2phys must be [{e}, R] and num_replicas [{e}]")
    if log2phys.dtype != torch.long or num_replicas.dtype != torch.long:
        raise ValueError("log2phys and num_replicas must be int64")
    if slot_load is not None and (slot_load.dim() != 1 or slot_load.dtype != torch.long):
        raise ValueError("slot_load must be a 1-D int64 tensor")


def _check_real(real: torch.Tensor, t: int) -> None:
    if real.numel() != t or real.dtype != torch.bool or not real.is_contiguous():
        raise ValueError(f"real must be {t} bools (one a token row), got {list(real.shape)} {real.dtype}")


def route_reference(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                    norm_topk_prob: bool, scaling: float, log2phys: torch.Tensor, num_replicas: torch.Tensor,
                    slot_load: torch.Tensor | None = None,
                    real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused torch sequence; see `fused_route` for the contract."""
    if logits.dim() == 3:  # parts of the logits (gate_parts_triton)
        logits = logits.sum(0)
    _check(logits, bias, n_group, topk_group, top_k, log2phys, num_replicas, slot_load)
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    # A replicated expert spreads its tokens over its replicas by token row.
    tok = torch.arange(t, device=ids.device)[:, None]
    slots = log2phys[ids, tok % num_replicas[ids]]
    if real is not None:
        _check_real(real, t)
        slots = torch.where(real.view(t, 1).bool(), slots, -1)
    if slot_load is not None:
        flat = slots.flatten()
        flat = flat[flat >= 0]  # -1: a slot of no one here
        slot_load.scatter_add_(0, flat, torch.ones_like(flat))
    return ids, weights, slots


if triton is not None:
    # token counts vary with the batch: as plain integers they share one build
    @triton.jit(do_not_specialize=["T"])
    def _gate_parts_kernel(x_ptr, stride_x, w_ptr, stride_w, out_ptr, T, E, H, k_per_part,
                           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
        """Partial router logits: out[part, t, e] = sum over this part's hidden columns k of
        float(x[t, k]) * float(w[e, k]), in fp32 FMAs (the products of the fp32 reference)."""
        pdl_enter(PDL)
        rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        part = tl.program_id(1)
        row_ok = rows < T
        e_ok = experts < E
        k_end = tl.minimum((part + 1) * k_per_part, H)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for k0 in range(part * k_per_part, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_w + ks[None, :],
                        mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        tl.store(out_ptr + (part * T + rows[:, None]).to(tl.int64) * E + experts[None, :], acc,
                 mask=row_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _norm_gate_parts_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, stream_ptr, h_ptr, E, H, k_per_part,
                                eps, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                                PDL: tl.constexpr = 0):
        """_gate_parts_kernel for one token whose row is still to be normalised: every program
        normalises the row (h = x + residual, then rms_norm, rounded as wideep_kernels/rmsnorm.py does)
        instead of a launch of its own doing it; the first program writes h into stream and the
        normalised row into h_ptr for the experts."""
        experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        part = tl.program_id(1)
        e_ok = experts < E
        ks = part * k_per_part + tl.arange(0, BLOCK_K)
        k_ok = (ks < H) & (ks < (part + 1) * k_per_part)
        # The router's weight before the wait: no kernel of the step writes it.
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * H + ks[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        pdl_enter(PDL)
        X_DTYPE: tl.constexpr = res_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_H)
        c_ok = cols < H
        x = tl.load(x_ptr + cols, mask=c_ok, other=0.0)
        if x_ptr.dtype.element_ty != X_DTYPE:  # the routed experts' unrounded fp32 sum
            x = cast_rne(x.to(tl.float32), X_DTYPE)
        h = cast_rne(x.to(tl.float32) + tl.load(res_ptr + cols, mask=c_ok, other=0.0).to(tl.float32), X_DTYPE)
        hf = h.to(tl.float32)
        rstd = _rstd(tl.sum(hf * hf, axis=0), H, eps)
        if (tl.program_id(0) == 0) & (part == 0):
            tl.store(stream_ptr + cols, h, mask=c_ok)
            y = cast_rne(tl.load(norm_w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
                         * cast_rne(hf * rstd, X_DTYPE).to(tl.float32), X_DTYPE)
            tl.store(h_ptr + cols, y, mask=c_ok)
        # This part's columns of the normalised row, recomputed from their (cached) inputs: a
        # register row cannot be sliced at a run-time offset.
        xs = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if x_ptr.dtype.element_ty != X_DTYPE:
            xs = cast_rne(xs.to(tl.float32), X_DTYPE)
        hs = cast_rne(xs.to(tl.float32) + tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32), X_DTYPE)
        ys = cast_rne(tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                      * cast_rne(hs.to(tl.float32) * rstd, X_DTYPE).to(tl.float32), X_DTYPE).to(tl.float32)
        acc = tl.sum(w * ys[None, :], axis=1)
        tl.store(out_ptr + part * E + experts, acc, mask=e_ok)

    @triton.jit(do_not_specialize=["stride_p"])
    def _route_kernel(logits_ptr, bias_ptr, log2phys_ptr, num_replicas_ptr, slot_load_ptr, real_ptr,
                      ids_ptr, weights_ptr, slots_ptr, row_pair_ptr, tile_slot_ptr, counts_ptr,
                      T, E, stride_t, stride_p, R, scaling, num_slots,
                      N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      TOP_K: tl.constexpr, NORM: tl.constexpr, COUNT: tl.constexpr, NUM_PARTS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_K: tl.constexpr, ALIGN_M: tl.constexpr = 0, BLOCK_S: tl.constexpr = 16,
                      REAL: tl.constexpr = 0, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < T
        col_ok = cols < E
        neg_inf = float("-inf")

        # the logits, or the sum of their parts in a fixed order (no atomics: the same inputs
        # always route the same way)
        x = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for p in tl.static_range(NUM_PARTS):
            x += tl.load(logits_ptr + p * stride_p + rows[:, None].to(tl.int64) * stride_t + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        scores = 1.0 / (1.0 + tl.exp(-x))
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        # Padding columns must never win a selection round.
        choice = tl.where(col_ok[None, :], scores + bias[None, :], neg_inf)

        if N_GROUP > 1:
            group_of = cols // GROUP_SIZE
            gcols = tl.arange(0, BLOCK_G)
            group_score = tl.full([BLOCK_T, BLOCK_G], neg_inf, tl.float32)
            for g in tl.static_range(N_GROUP):
                v = tl.where((group_of == g)[None, :], choice, neg_inf)
                best = tl.max(v, axis=1)
                # Drop one occurrence of the best (not all equal ones) so a tie still counts twice, as topk(2) does.
                first = tl.min(tl.where(v == best[:, None], cols[None, :], BLOCK_E), axis=1)
                second = tl.max(tl.where(cols[None, :] == first[:, None], neg_inf, v), axis=1)
                group_score = tl.where(gcols[None, :] == g, (best + second)[:, None], group_score)
            keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                gbest = tl.max(group_score, axis=1)
                gi = tl.min(tl.where(group_score == gbest[:, None], gcols[None, :], BLOCK_G), axis=1)
                keep = tl.where(group_of[None, :] == gi[:, None], 1, keep)
                group_score = tl.where(gcols[None, :] == gi[:, None], neg_inf, group_score)
            choice = tl.where(keep != 0, choice, neg_inf)

        # top_k rounds of argmax-and-mask give ids in descending choice order, like torch.topk.
        kcols = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
        weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            best = tl.max(choice, axis=1)
            idx = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == idx[:, None]
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            choice = tl.where(hit, neg_inf, choice)
            ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
            weights = tl.where(kcols[None, :] == k, w[:, None], weights)
        if NORM:
            weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
        weights = weights * scaling

        out_ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
        nrep = tl.load(num_replicas_ptr + ids, mask=out_ok, other=1)
        replica = rows[:, None].to(tl.int64) % nrep
        slots = tl.load(log2phys_ptr + ids.to(tl.int64) * R + replica, mask=out_ok, other=0)
        if REAL:  # padding rows (expert parallelism) are nobody's: slot -1
            is_real = tl.load(real_ptr + rows, mask=row_ok, other=0) != 0
            slots = tl.where(is_real[:, None], slots, -1)

        out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_ok)
        tl.store(weights_ptr + out, weights, mask=out_ok)
        tl.store(slots_ptr + out, slots, mask=out_ok)
        if COUNT:
            tl.atomic_add(slot_load_ptr + slots, tl.full([BLOCK_T, BLOCK_K], 1, tl.int64), mask=out_ok & (slots >= 0))
        if ALIGN_M > 0:
            # One token (one program): its pairs' layout for the expert kernels, as
            # wideep_kernels/moe_align.py align_pairs lays them out, without the alignment's launch. Its
            # TOP_K slots are distinct (distinct experts), so each pair is a tile of ALIGN_M rows
            # of its own, the tiles in slot order.
            kept = tl.max(tl.where(out_ok, slots, -1), axis=0)  # [BLOCK_K]: the pairs' slots, -1 past TOP_K
            kept_r = kept[None, :]
            kept_c = kept[:, None]
            real = (kcols < TOP_K)[None, :] & (kcols < TOP_K)[:, None]
            tile_of = tl.sum((real & (kept_r < kept_c)).to(tl.int32), axis=1)  # [BLOCK_K] by pair
            # pair and slot of each tile (tile index along axis 0, pair along axis 1)
            at_tile = real & (tile_of[None, :] == kcols[:, None])
            tile_pair = tl.sum(tl.where(at_tile, kcols[None, :], 0), axis=1)
            tile_slot = tl.sum(tl.where(at_tile, kept_r, 0), axis=1)
            t_ok = kcols < TOP_K
            tl.store(tile_slot_ptr + kcols, tile_slot.to(tl.int32), mask=t_ok)
            m = tl.arange(0, ALIGN_M)
            tl.store(row_pair_ptr + kcols[:, None] * ALIGN_M + m[None, :],
                     tl.where(m[None, :] == 0, tile_pair[:, None], -1).to(tl.int32), mask=t_ok[:, None])
            for s0 in range(0, num_slots, BLOCK_S):
                ss = s0 + tl.arange(0, BLOCK_S)
                held = tl.sum(((kept_r == ss[:, None]) & (kcols < TOP_K)[None, :]).to(tl.int32), axis=1)
                tl.store(counts_ptr + ss, held, mask=ss < num_slots)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch_config(t: int, e: int) -> tuple[int, int]:
    """(tokens per program, warps). Measured on an H200 (E=256, T from 1 to 16384): one token
    per program and one warp was fastest or within noise everywhere; bigger token blocks spill
    registers (16 tokens: 4-7x slower). A wider expert row gets more warps."""
    return 1, max(1, min(4, _pow2(e) // 256))


def route_triton(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 norm_topk_prob: bool, scaling: float, log2phys: torch.Tensor, num_replicas: torch.Tensor,
                 slot_load: torch.Tensor | None = None,
                 block_t: int | None = None, align: tuple[int, int] | None = None, real: torch.Tensor | None = None):
    """The Triton kernel; see `fused_route` for the contract. `block_t` overrides the tokens per
    program. logits may also be [P, T, E]: parts of the logits, summed in order of P first.
    `align` (num_slots, block_m), for one token only: also return its pairs' layout for the
    expert kernels (wideep_kernels/moe_align.py AlignedPairs, as align_pairs gives it), from the same
    launch."""
    if triton is None:
        raise RuntimeError("triton is not available")
    parts = logits if logits.dim() == 3 else logits[None]
    logits = parts[0]
    _check(logits, bias, n_group, topk_group, top_k, log2phys, num_replicas, slot_load)
    t, e = logits.shape
    dev = logits.device
    ids = torch.empty(t, top_k, dtype=torch.long, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    slots = torch.empty(t, top_k, dtype=torch.long, device=dev)
    aligned = None
    if align is not None:
        num_slots, block_m = align
        if t != 1 or block_m < 1 or block_m & (block_m - 1) or num_slots < top_k:
            raise ValueError(f"align needs one token, a power-of-two block_m and at least top_k slots; got "
                             f"{t} tokens, block_m {block_m}, {num_slots} slots")
        # each pair a tile of its own: what align_pairs gives for one token's distinct slots
        aligned = (torch.empty(top_k * block_m, dtype=torch.int32, device=dev),
                   torch.empty(top_k, dtype=torch.int32, device=dev),
                   torch.empty(num_slots, dtype=torch.int32, device=dev))
    if real is not None:
        _check_real(real, t)
    if t == 0:
        return ids, weights, slots
    if parts.stride(2) != 1:
        parts = parts.contiguous()
    cfg_block_t, warps = _launch_config(t, e)
    block_t = 1 if aligned is not None else block_t or cfg_block_t
    row_pair, tile_slot, counts = aligned if aligned is not None else (slots, slots, slots)  # unread without
    _route_kernel[(triton.cdiv(t, block_t),)](
        parts, bias.contiguous(), log2phys.contiguous(), num_replicas.contiguous(),
        slot_load if slot_load is not None else slots,  # a dummy pointer when not counting
        real if real is not None else slots,  # unread without
        ids, weights, slots, row_pair, tile_slot, counts,
        t, e, parts.stride(1), parts.stride(0), log2phys.shape[1], float(scaling),
        align[0] if align is not None else 0,
        N_GROUP=n_group, GROUP_SIZE=e // n_group, TOPK_GROUP=topk_group if n_group > 1 else 1,
        TOP_K=top_k, NORM=bool(norm_topk_prob), COUNT=slot_load is not None, NUM_PARTS=parts.shape[0],
        BLOCK_T=block_t, BLOCK_E=_pow2(e), BLOCK_G=max(2, _pow2(n_group)), BLOCK_K=max(2, _pow2(top_k)),
        ALIGN_M=align[1] if align is not None else 0, BLOCK_S=min(1024, _pow2(align[0])) if align else 16,
        REAL=real is not None, num_warps=warps, **pdl_launch(parts))
    if aligned is not None:
        return ids, weights, slots, aligned
    return ids, weights, slots


def fused_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                norm_topk_prob: bool, scaling: float, log2phys: torch.Tensor, num_replicas: torch.Tensor,
                slot_load: torch.Tensor | None = None, align: tuple[int, int] | None = None,
                real: torch.Tensor | None = None):
    """DeepSeek-V3 routing of router logits [T, E] (or [P, T, E] parts of them, summed over P) to
    (ids, weights, slots), each [T, top_k].

    scores = sigmoid(logits) in fp32; choice = scores + bias. With n_group > 1 only the best
    `topk_group` groups (group score: the sum of its two largest choice values) are eligible.
    ids: the top_k logical experts by choice among the eligible, in descending choice order.
    weights (fp32): scores at ids, divided by (their sum + 1e-20) if norm_topk_prob, times scaling.
    slots: log2phys[e, t % num_replicas[e]] for expert e of token row t.
    slots of -1 (a map's entry for no slot here) are returned as they are.
    real [T] (bool), when given: the rows that are not real (expert parallelism's padding) get
    slot -1 for all their pairs.
    slot_load [S] (int64), when given, is incremented by the number of (token, k) pairs per slot
    (slot -1 counts nowhere).
    align (num_slots, block_m), for one token: a fourth result, the pairs' layout for the expert
    kernels (row_pair, tile_slot, counts of wideep_kernels/moe_align.py AlignedPairs), so that they need
    no alignment launch of their own.
    Triton on CUDA tensors (or anywhere under TRITON_INTERPRET=1), the torch reference elsewhere.
    """
    if triton is not None and triton_ok(logits):
        return route_triton(logits, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, log2phys,
                            num_replicas, slot_load, align=align, real=real)
    routed = route_reference(logits, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, log2phys,
                             num_replicas, slot_load, real)
    if align is None:
        return routed
    from .moe_align import align_pairs_reference
    return routed + (tuple(align_pairs_reference(routed[2].flatten(), *align)),)


# Above this many tokens (prefill) one GEMM of the whole batch beats partial sums per program.
GATE_FUSED_MAX_TOKENS = 256


def gate_parts_triton(x: torch.Tensor, weight: torch.Tensor, parts: int | None = None, *,
                      block_t: int | None = None, block_e: int = 16, num_warps: int = 2) -> torch.Tensor:
    """Router logits of x [T, H] against the gate weight [E, H] as [P, T, E] fp32 partial sums over
    P slices of H (their sum in order is x.float() @ weight.float().T). One launch replaces the
    input cast, the GEMM and its split-K reduction at decode batch sizes. block_t, block_e (tokens
    and experts a program) and num_warps: launch choices (bench.probe_moe --gate times them)."""
    if triton is None:
        raise RuntimeError("triton is not available")
    t, h = x.shape
    e = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(f"gate weight {tuple(weight.shape)} does not match hidden size {h}")
    # One 64-column slice a program (up to 32 slices), so the programs' loads all go out at once:
    # 3 us at batch 1 on the H200. Eight 256-column slices, four loads in turn a program, took
    # 7 us, no less than the cast, GEMM and reduction they replace.
    block_k = 64
    parts = parts or min(32, triton.cdiv(h, block_k))
    k_per_part = triton.cdiv(triton.cdiv(h, parts), block_k) * block_k
    parts = triton.cdiv(h, k_per_part)
    out = torch.empty(parts, t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    # All of a decode batch's tokens a program, up to 64: each slice of the weight is then read
    # once. On the H200 (bench.probe_moe --gate-only, bench/RESULTS.md): 4.2 against 7.1 us at 64
    # tokens with 16 a program; at 1 and 16 tokens 16 a program stays the best.
    block_t = block_t or min(64, max(16, _pow2(t)))
    _gate_parts_kernel[(triton.cdiv(e, block_e), parts, triton.cdiv(t, block_t))](
        x, x.stride(0), weight, weight.stride(0), out, t, e, h, k_per_part,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=num_warps, **pdl_launch(x))
    return out


def gate_norm_applies(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      weight: torch.Tensor) -> bool:
    """Whether gate_parts_norm_triton takes this row: one token with a residual, on a device where
    the kernels run, the norm's weight in the residual's dtype (16-bit), a row of at most
    GATE_NORM_MAX_HIDDEN."""
    return (triton is not None and residual is not None and residual.dim() == 2 and residual.shape[0] == 1
            and x.shape == residual.shape and residual.dtype in (torch.bfloat16, torch.float16)
            and x.dtype in (residual.dtype, torch.float32) and norm_weight.dtype == residual.dtype
            and norm_weight.shape == (x.shape[1],) and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and x.shape[1] <= GATE_NORM_MAX_HIDDEN and x.device == residual.device == weight.device
            and triton_ok(x))


# A program holds the whole row in registers to normalise it.
GATE_NORM_MAX_HIDDEN = 8192


def gate_parts_norm_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, stream: torch.Tensor,
                           block_e: int = 16, num_warps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_parts_triton(rms_norm(x + residual), weight) for one token, the norm in the same
    launch (every program normalises the row itself; see _norm_gate_parts_kernel). Returns
    (partial logits [P, 1, E], the normalised row [1, H]); x + residual is written into
    `stream`. The products are the fp32 ones of gate_parts_triton, summed by the route kernel."""
    t, h = x.shape
    e = weight.shape[0]
    if stream.shape != residual.shape or stream.dtype != residual.dtype or not stream.is_contiguous():
        raise ValueError("`stream` must be a contiguous tensor of the residual's shape and dtype")
    # gate_parts_triton's slices (64 columns a program up to 32 slices), each loaded whole
    parts = min(32, triton.cdiv(h, 64))
    k_per_part = triton.cdiv(triton.cdiv(h, parts), 64) * 64
    parts = triton.cdiv(h, k_per_part)
    out = torch.empty(parts, t, e, dtype=torch.float32, device=x.device)
    normed = torch.empty_like(residual)
    x, residual = x.contiguous(), residual.contiguous()
    weight = weight if weight.stride(-1) == 1 and weight.stride(0) == h else weight.contiguous()
    _norm_gate_parts_kernel[(triton.cdiv(e, block_e), parts)](
        x, residual, norm_weight.contiguous(), weight, out, stream, normed, e, h, k_per_part, float(eps),
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k_per_part), BLOCK_H=triton.next_power_of_2(h),
        num_warps=max(num_warps, triton.next_power_of_2(h) // 1024),
        enable_fp_fusion=False, **pdl_launch(x))
    return out, normed


def gate_fused_ok(x: torch.Tensor) -> bool:
    """Whether `gate_parts_triton` + the route kernel should replace the fp32 router GEMM for x."""
    return triton is not None and triton_ok(x) and x.dim() == 2 and x.shape[0] <= GATE_FUSED_MAX_TOKENS
