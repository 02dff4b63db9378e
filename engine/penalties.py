"""Penalties and logit bias: the logits of the rows that ask for them, adjusted before sampling."""
from __future__ import annotations

import numpy as np
import torch

from wideep_kernels.penalties import apply_penalties

from .sampling import SamplingParams, host_to_device


class TokenCounts:
    """The output tokens of the penalized sequences counted per vocabulary entry, a row each in
    one tensor on the device, and for the repetition penalty which tokens each one's prompt
    holds. A step adds its rows' new tokens in one scatter, whatever the batch (a launch or two
    per row would cost a batch of 64 a millisecond), and the penalties read the rows in place.
    A sequence keeps its row (`seq.penalty_row`) until it finishes; rows grow in number as needed."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, device=device)
        self.in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.owners: list = []  # the sequence holding each row, or None

    def rows(self, seqs: list) -> list[int]:
        """The rows of these sequences, their outputs so far counted in them."""
        rows, new_rows, new_tokens = [], [], []
        for seq in seqs:
            if seq.penalty_row is None or self.owners[seq.penalty_row] is not seq:
                self._assign(seq)
            new = seq.output_ids[seq.penalty_counted:]
            new_rows += [seq.penalty_row] * len(new)
            new_tokens += new
            seq.penalty_counted += len(new)
            rows.append(seq.penalty_row)
        if new_tokens:
            at = host_to_device(self.device, [new_rows, new_tokens])
            self.counts.index_put_((at[0], at[1]), torch.ones(len(new_tokens), device=self.device), accumulate=True)
        return rows

    def seen(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), vocab] bool: the tokens in each row's output so far, or in its prompt where
        its repetition penalty reads the prompt."""
        idx = torch.tensor(rows, device=self.device)
        return (self.counts[idx] > 0) | self.in_prompt[idx]

    def _assign(self, seq) -> None:
        free = [r for r, owner in enumerate(self.owners) if owner is None or owner.is_finished]
        if not free:
            grow = max(len(self.owners), 8)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(grow, self.vocab)])
            free = [len(self.owners)]
            self.owners += [None] * grow
        row = free[0]
        self.owners[row] = seq
        seq.penalty_row, seq.penalty_counted = row, 0
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        if seq.params.repetition_penalty != 1:
            self.in_prompt[row, host_to_device(self.device, seq.prompt_ids)] = True
        if seq.prior_output_ids:
            at = host_to_device(self.device, seq.prior_output_ids)
            self.counts[row].index_put_((at,), torch.ones(len(seq.prior_output_ids), device=self.device),
                                        accumulate=True)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], counts: TokenCounts | None = None,
                  count_rows: list[int] | None = None) -> torch.Tensor:
    """A fp32 copy of `logits` [rows, vocab] with each row's penalties, then its logit bias.
    counts, count_rows: the penalized rows' counts, count_rows[j] the row of the j-th penalized
    row (TokenCounts.rows()). The input is left as it is: logprobs report the model's own
    distribution."""
    logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
    dev, vocab = logits.device, logits.shape[-1]
    # Each kind of adjustment takes one copy to the device, whatever the batch: a copy or a
    # Python loop per row or per biased token cost a batch of 64 milliseconds.
    pen = [(i, p) for i, p in enumerate(params) if p.penalized]
    if pen:
        # rows and count rows as floats: exact below 2**24
        table = host_to_device(dev, [[i, row, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                     for (i, p), row in zip(pen, count_rows, strict=True)], torch.float32)
        apply_penalties(logits, table[:, 0].int(), table[:, 1].int(), counts.counts, counts.in_prompt,
                        table[:, 2:].contiguous())
    biased = [(i, p.bias_arrays) for i, p in enumerate(params) if p.logit_bias]
    if biased:
        # flat positions and biases as one float64 array (positions exact below 2**53); the engine
        # rejects token ids outside the vocabulary at admission
        both = host_to_device(dev, np.concatenate([np.stack([ids + i * vocab, values]) for i, (ids, values) in biased],
                                                  axis=1))
        logits.view(-1).index_add_(0, both[0].long(), both[1].float())
    return logits
