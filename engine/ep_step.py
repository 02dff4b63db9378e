"""One forward of an expert-parallel rank: the group agrees on the step's shape, then every
rank replays a decode graph of that shape, or every rank runs eagerly.

NCCL allows a captured collective only where every rank of the communicator captures it and
replays it together, so the choice of graph is made from values all ranks share (engine/ep.py,
`agree`): a rank with fewer sequences pads to the group's rows, an idle rank replays the
same graph with padding rows only, and a step that any rank cannot replay (a prompt chunk,
a batch past the largest graph) runs eagerly on all of them.
"""
from __future__ import annotations

import torch


def run_lockstep(runner, batch) -> tuple[list[int], torch.Tensor | None]:
    """ModelRunner.run for a rank of a lockstep group (runner.ep set)."""
    ep, graphs = runner.ep, runner.graphs
    b = len(batch)
    longest = runner.decode_length(batch) if b else 0
    decode = b == 0 or longest > 0
    graph = decode and graphs is not None and graphs.covers(b)
    step = ep.agree(b if decode else sum(batch.num_tokens), graph,
                    runner.decode_width(batch, longest) if longest else 0,
                    longest > 0 and runner.needs_sparse(longest))
    if step.rows == 0:  # nobody has a token to compute
        return [], None
    if step.graph:
        if longest:
            runner.model.model.rotary.ensure(longest)
        shape = graphs.group_shape(step.rows, step.width, step.sparse)
        ep.set_rows(shape[0])
        return list(range(b)), graphs.run(batch, longest or None, shape=shape)[:b]
    if b == 0:
        runner.run_idle()
        return [], None
    return runner.run_eager(batch, longest)
