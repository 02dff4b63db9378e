"""Builds, before serving, the indexer scoring launch's variants that only long contexts meet.

Triton builds a kernel once per variant (constexpr values, pointer dtypes and alignment, integer
classes). The engine's warm-up requests are short, so they build the scoring kernel
(wideep_kernels/index_score.py _score_tile_kernel) only as short rows launch it: one tile a program, the
one-launch select's flags. Rows past FUSED_MAX_WIDTH zero the radix histograms instead, FP8 keys
take several tiles a program once the batch has enough of them, and the threshold select's rows
also write the group maxima; each is a build of its own, which the first decode step that meets
it would wait for (a second or so, every running request with it). Prompt rows past index_topk
positions take the launch of wideep_kernels/index_score_rows.py, whose wide variants are built here too.

`remember` notes the dtypes, strides and alignment of each scoring call's inputs (the engine's
warm-up makes them); `build_wide_variants` then runs the indexer on stand-ins with those layouts
at row shapes that take each wide path. Block tables of zeros make every position read the one
block of keys, so the stand-ins are small.
"""
from __future__ import annotations

import torch

_SEEN: dict[tuple, tuple] = {}


def _device(device) -> torch.device:
    """The device with its index: tensors on "cuda" report "cuda:0" (the current one), and the
    engine may name it either way."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _layout(t: torch.Tensor) -> tuple:
    """What of a tensor a Triton build depends on, with the row count left out."""
    return t.dtype, tuple(t.shape[1:]), t.stride(), t.data_ptr() % 16 == 0


def remember(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, key_scale: torch.Tensor | None,
             block_size: int, w_scale: float, topk: int) -> None:
    """Note a scoring call's input layouts (cheap after the first call of each)."""
    key = (_device(q.device), _layout(q), _layout(w), _layout(index_keys), key_scale is not None, block_size,
           float(w_scale), topk)
    if key not in _SEEN:
        _SEEN[key] = key


def _stand_in(layout: tuple, rows: int, device) -> torch.Tensor:
    """Zeros of `rows` rows with the layout's dtype, strides and 16-byte alignment or its lack."""
    dtype, shape, stride, aligned = layout
    shape = (rows, *shape)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    offset = 0 if aligned else 1
    base = torch.zeros(span + offset, dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


def wide_shapes() -> list[tuple[int, int]]:
    """(rows, width) that take each wide path: the one-launch select with FP8 keys several tiles
    a program, the radix passes with one tile a program and with several, and the threshold
    select (group maxima in the scoring launch, several tiles a program)."""
    from .indexer import FUSED_MAX_WIDTH, THRESHOLD_MIN_POSITIONS
    shapes = [(1, max(2 * FUSED_MAX_WIDTH, 65536)), (8, THRESHOLD_MIN_POSITIONS // 16),
              (16, THRESHOLD_MIN_POSITIONS // 16)]
    if FUSED_MAX_WIDTH:
        shapes.insert(0, (16, FUSED_MAX_WIDTH))
    return shapes


def layouts_on(device) -> list[tuple]:
    """The remembered scoring layouts on `device` ("cuda" and "cuda:0" are the same one)."""
    device = _device(device)
    return [k for k in _SEEN if k[0] == device]


def build_wide_variants(device) -> int:
    """Run the indexer on stand-ins of every remembered layout on `device` at wide_shapes();
    returns the number of layouts."""
    from .index_score_rows import prompt_row_groups
    from .indexer import indexer_topk_triton
    device = torch.device(device)
    layouts = layouts_on(device)
    for _, q_layout, w_layout, keys_layout, scaled, block_size, w_scale, topk in layouts:
        keys = _stand_in(keys_layout, block_size, device)
        scale = torch.ones(block_size, device=device) if scaled else None
        for rows, width in wide_shapes():
            width = -(-width // block_size) * block_size
            tables = torch.zeros(rows, width // block_size, dtype=torch.int32, device=device)
            g_lens = torch.full((rows,), width, dtype=torch.int32, device=device)
            # as decode rows, and as one prompt's rows (scored several to a program)
            groups = prompt_row_groups(torch.zeros(rows, dtype=torch.int64, device=device), q_layout[1][0], 1)
            for row_groups in [None] + ([groups] if groups is not None else []):
                indexer_topk_triton(_stand_in(q_layout, rows, device), _stand_in(w_layout, rows, device), keys,
                                    tables, g_lens, block_size, topk, key_scale=scale, w_scale=w_scale,
                                    row_groups=row_groups)
    return len(layouts)
