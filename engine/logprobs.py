"""Log-probabilities of the sampled tokens and of the most likely alternatives.

They are the model's own distribution (a log-softmax of the raw logits), before temperature,
top-k and top-p, as vLLM and SGLang return them by default: a greedy and a sampled request over
the same text get the same numbers."""
from __future__ import annotations

import torch

from .sampling import host_to_device

# JSON has no -inf; a token the model rules out completely is reported with this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """For the rows `rows` of `logits` [n, vocab] and their sampled `tokens` [n]: one fp32
    tensor [len(rows), 1 + 2k] on the logits' device, each row the sampled token's
    log-probability, then the k largest, then their token ids (exact as floats below 2**24),
    packed so that one copy reads them back. Queued, not waited for."""
    idx = host_to_device(logits.device, rows)
    lp = logits.index_select(0, idx).float().log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])
    if k == 0:
        return chosen
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def prompt_logprob_rows(seqs: list, num_tokens: list[int]) -> tuple[list[int], list[int], list[tuple]]:
    """For a step computing num_tokens[i] positions of seqs[i] from its num_computed_tokens, a
    row per position in order: the rows whose next token is a prompt token still without a
    log-probability record (a prompt recomputed after preemption has them already), those tokens,
    and (sequence, records it gets) in order."""
    rows, targets, owners = [], [], []
    row = 0
    for seq, n in zip(seqs, num_tokens):
        if seq.needs_prompt_logprobs:
            start = seq.num_computed_tokens
            # position p predicts token p + 1; the records so far cover tokens before len(records)
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(start + n, len(seq.prompt_ids) - 1)
            if last > first:
                rows += range(row + first - start, row + last - start)
                targets += seq.prompt_ids[first + 1:last + 1]
                owners.append((seq, last - first))
        row += n
    return rows, targets, owners


# A prompt's logits are made this many rows at a time: [rows, vocab] fp32 is 132 MB at 129K tokens.
PROMPT_SLICE_ROWS = 256


def prompt_token_logprobs(compute_logits, hidden: torch.Tensor, rows: list[int], targets: list[int],
                          k: int) -> torch.Tensor:
    """token_logprobs() of the prompt tokens `targets`, each predicted by its row of `hidden`
    (compute_logits: hidden rows -> logits), a slice of rows at a time, each row led by the
    target's rank in its distribution (1: the most likely; vLLM's prompt_logprobs report it)."""
    dev = hidden.device
    idx, tgt = host_to_device(dev, rows), host_to_device(dev, targets)
    parts = []
    for a in range(0, len(rows), PROMPT_SLICE_ROWS):
        logits = compute_logits(hidden.index_select(0, idx[a:a + PROMPT_SLICE_ROWS])).float()
        packed = token_logprobs(logits, tgt[a:a + PROMPT_SLICE_ROWS], list(range(logits.shape[0])), k)
        # the logits' order is the log-softmax's: the rank needs no second pass over the vocabulary
        chosen = logits.gather(1, tgt[a:a + PROMPT_SLICE_ROWS, None])
        rank = (logits > chosen).sum(-1, keepdim=True).float() + 1
        parts.append(torch.cat([rank, packed], dim=1))
    return torch.cat(parts)


def logprob_records(packed: list[list[float]], tokens: list[int], ks: list[int], token_text) -> list[dict]:
    """The rows of token_logprobs()'s tensor (read back as lists) as one record per sampled token:
    {"token_id", "token", "logprob", "top": [{"token_id", "token", "logprob"}, ...]}, the top
    list holding the row's own k (each row was computed with the batch's largest k).
    token_text(id) -> str names a token. Built inline, without a call per entry: a batch of 64
    with 20 alternatives makes 1,344 records a step."""
    out = []
    floor = LOGPROB_FLOOR
    for row, token, k in zip(packed, tokens, ks):
        width = (len(row) - 1) // 2
        n = min(k, width)
        top = [{"token_id": t, "token": token_text(t),
                "logprob": 0.0 if lp > 0.0 else lp if lp > floor else floor}
               for t, lp in zip(map(int, row[1 + width:1 + width + n]), row[1:1 + n])]
        lp = row[0]
        out.append({"token_id": token, "token": token_text(token),
                    "logprob": 0.0 if lp > 0.0 else lp if lp > floor else floor, "top": top})
    return out
