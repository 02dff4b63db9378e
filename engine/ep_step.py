"""One forward of an expert-parallel rank: the group agrees on the step's shape, then every
rank replays a graph of that shape, or every rank runs eagerly.

NCCL allows a captured collective only where every rank of the communicator captures it and
replays it together, so the choice of graph is made from values all ranks share (engine/ep.py,
`agree`): a rank with fewer sequences pads to the group's rows, an idle rank replays the
same graph with padding rows only. A step in which every rank decodes replays a decode graph;
one in which some rank computes a prompt chunk (a short prompt, the window replay after a KV
handoff) replays a chunk graph on every rank, the decoding ranks' tokens each a row of it; a
step that some rank cannot replay (a batch or chunk past the largest graph) runs eagerly on all.

A decode step launched ahead (async scheduling, where the agreement runs on the host) takes part
like any other: its input tokens are still on the device, written into the graph's inputs (or the
eager step's) after the host's part is uploaded.
"""
from __future__ import annotations

import torch


def run_lockstep(runner, batch, ahead_ids: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
    """ModelRunner.run for a rank of a lockstep group (runner.ep set); with ahead_ids, its
    run_ahead (a decode step whose input tokens are these, on the device)."""
    ep, graphs = runner.ep, runner.graphs
    b = len(batch)
    if ahead_ids is not None:  # one position past each sequence's last known token
        longest = max(seq.num_tokens for seq in batch.seqs) + 1
    else:
        longest = runner.decode_length(batch) if b else 0
    decode = b == 0 or longest > 0
    rows = b if decode else sum(batch.num_tokens)
    # tokens of the longest sequence once this step is done: its block table and sparse flag follow them
    reach = longest or max((seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens)), default=0)
    graph = decode and graphs is not None and graphs.covers(b)
    # a decode step has no prompt rows; a prompt whose logprobs are asked needs the eager forward
    chunk = runner.chunk_graphs_take(rows) and (decode or not runner.wants_prompt_rows(batch))
    step = ep.agree(rows, graph, runner.decode_width(batch, reach) if reach else 0,
                    reach > 0 and runner.needs_sparse(reach), chunk)
    if step.rows == 0:  # nobody has a token to compute
        return [], None
    if step.graph:
        if longest:
            runner.model.model.rotary.ensure(longest)
        shape = graphs.group_shape(step.rows, step.width, step.sparse)
        ep.set_rows(shape[0])
        return list(range(b)), graphs.run(batch, longest or None, ahead_ids, shape=shape)[:b]
    if step.chunk:
        shape = graphs.group_chunk_shape(step.rows, step.width, step.sparse)
        ep.set_rows(shape[0])
        return runner.run_chunk(batch, shape[0], shape, ahead_ids)
    if b == 0:
        runner.run_idle()
        return [], None
    return runner.run_eager(batch, longest, ahead_ids)
