"""Independent branches of a captured decode step, side by side on a second CUDA stream.

At decode batch sizes most kernels of a layer fill a few SMs for a few microseconds, and one
stream runs them one after another. Some chains do not depend on each other: the indexer's
top-k against the query projections, the shared experts against the router and the routed
experts. Captured from two streams, a CUDA graph holds both chains and the GPU runs them at
once. (SGLang and vLLM run DeepSeek's shared experts on a second stream for the same reason.)

Only while a CUDA graph is being captured: replay is where the time goes, and inside a
capture every allocation of either stream comes from the graph's private pool, so a tensor
made on one stream and read on the other cannot be handed to someone else while in use.
Eager steps run every branch inline, as before.
"""
from __future__ import annotations

import torch

_side: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of a CUDA device (made once, before any capture needs it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side:
        stream = torch.cuda.Stream(device=index)
        # cuBLAS keeps a workspace per stream, made at the stream's first GEMM: make it here,
        # outside any capture, not inside one from a graph's pool.
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.ones(16, 16, device=f"cuda:{index}", dtype=dtype)
                a @ a
        stream.synchronize()
        _side[index] = stream
    return _side[index]


class Branch:
    """fn(*args), on the side stream when `overlap` is asked and the current stream is capturing
    a CUDA graph, inline otherwise. join() returns fn's value and makes the current stream wait
    for it: call it before the value is read, and always before the capture ends (an unjoined
    stream fails the capture). The side branch reads only tensors made before the fork; they must
    outlive the join, which holds when the fork and the join sit in one function."""

    def __init__(self, overlap: bool, fn, *args):
        self.stream = None
        if overlap and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            main = torch.cuda.current_stream()
            self.stream = side_stream(main.device)
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                self.value = fn(*args)
        else:
            self.value = fn(*args)

    @property
    def forked(self) -> bool:
        return self.stream is not None

    def join(self):
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.stream = None
        return self.value
