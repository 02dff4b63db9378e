"""Penalties and logit bias: the logits of the rows that ask for them, adjusted before sampling.

A penalized sequence keeps its output-token counts on the device (TokenCounts), grown by the
tokens added since its last step: a step costs its new tokens, not the whole output."""
from __future__ import annotations

import torch

from .sampling import SamplingParams, host_to_device


class TokenCounts:
    """One sequence's output tokens counted per vocabulary entry, and for the repetition
    penalty which tokens its prompt holds."""

    def __init__(self, vocab: int, device: torch.device, prompt_ids: list[int], repetition: bool):
        self.counts = torch.zeros(vocab, device=device)
        self.counted = 0  # output ids already in `counts`
        self.in_prompt = None
        if repetition:
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.in_prompt[host_to_device(device, prompt_ids)] = True

    def update(self, output_ids: list[int]) -> "TokenCounts":
        new = output_ids[self.counted:]
        if new:
            ids = host_to_device(self.counts.device, new)
            self.counts.index_put_((ids,), torch.ones(len(new), device=ids.device), accumulate=True)
            self.counted = len(output_ids)
        return self


def token_counts(seq, vocab: int, device: torch.device) -> TokenCounts:
    """The sequence's counts, up to date with its output so far (made on its first step)."""
    if seq.token_counts is None:
        seq.token_counts = TokenCounts(vocab, device, seq.prompt_ids, seq.params.repetition_penalty != 1)
    return seq.token_counts.update(seq.output_ids)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  counts: list[TokenCounts | None] | None) -> torch.Tensor:
    """A fp32 copy of `logits` [rows, vocab] with each row's penalties (counts[i] for a
    penalized row i), then its logit bias. The input is left as it is: logprobs report the
    model's own distribution."""
    logits = logits.float().clone()
    dev, vocab = logits.device, logits.shape[-1]
    pen = [i for i, p in enumerate(params) if p.penalized]
    if pen:
        idx = host_to_device(dev, pen)
        c = torch.stack([counts[i].counts for i in pen])
        seen = c > 0
        for j, i in enumerate(pen):
            if counts[i].in_prompt is not None:
                seen[j] |= counts[i].in_prompt
        sub = logits.index_select(0, idx)
        rep = host_to_device(dev, [params[i].repetition_penalty for i in pen])[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = host_to_device(dev, [params[i].frequency_penalty for i in pen])[:, None]
        pres = host_to_device(dev, [params[i].presence_penalty for i in pen])[:, None]
        logits[idx] = sub - freq * c - pres * (c > 0).float()
    flat, bias = [], []
    for i, p in enumerate(params):
        for token, b in p.logit_bias.items():
            if token < vocab:  # the engine rejects ids outside the vocabulary at admission
                flat.append(i * vocab + token)
                bias.append(b)
    if flat:
        logits.view(-1).index_add_(0, host_to_device(dev, flat), host_to_device(dev, bias, torch.float32))
    return logits
