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


def logprob_records(packed: list[list[float]], tokens: list[int], ks: list[int], token_text) -> list[dict]:
    """The rows of token_logprobs()'s tensor (read back as lists) as one record per sampled token:
    {"token_id", "token", "logprob", "top": [{"token_id", "token", "logprob"}, ...]}, the top
    list holding the row's own k (each row was computed with the batch's largest k).
    token_text(id) -> str names a token."""
    out = []
    for row, token, k in zip(packed, tokens, ks):
        width = (len(row) - 1) // 2
        top = [_record(int(row[1 + width + j]), row[1 + j], token_text) for j in range(min(k, width))]
        out.append(dict(_record(token, row[0], token_text), top=top))
    return out


def _record(token: int, logprob: float, token_text) -> dict:
    return {"token_id": token, "token": token_text(token), "logprob": min(max(logprob, LOGPROB_FLOOR), 0.0)}
