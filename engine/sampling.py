"""Sampling parameters (validated) and the sampler."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from wideep_kernels import kernel_or_reference, triton_ok
from wideep_kernels.nucleus import nucleus_threshold
from wideep_kernels.race import race_sample_triton

from .structured import validate_spec


FP32_MAX = torch.finfo(torch.float32).max


class SamplingError(ValueError):
    """An invalid sampling parameter, named in the message."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: until this many tokens are out, the end-of-sequence and stop tokens cannot be
    # sampled and stop strings do not end the answer (a grammar's end still does)
    min_tokens: int = 0
    n: int = 1
    # The log-probability of each sampled token and of this many most likely alternatives
    # (0: the sampled token's only); None: none.
    logprobs: int | None = None
    # The log-probability of each prompt token after the first given those before it, and of this
    # many most likely alternatives (vLLM's prompt_logprobs); the first token's record has none
    # (logprob None). The prompt is then computed whole, not read from the prefix cache.
    prompt_logprobs: int | None = None
    # The first output carries the prompt's text (prompt_text), for an API that echoes it.
    echo: bool = False
    # OpenAI's penalties: subtracted from a token's logit, once if it is in the output so far
    # (presence) and once per time it is (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and transformers': a logit of a token in the prompt or the output so far is divided
    # by it when positive, multiplied when negative (1: off).
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Structured output: {"kind": json | json_object | regex | choice | grammar, "value": ...,
    # "reasoning_end": marker or None} (engine/structured.py); every token sampled is one its
    # grammar allows next, and the request stops once the grammar is complete.
    structured_output: dict | None = None

    MAX_STOP_STRINGS = 64
    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 300
    MAX_STOP_LEN = 256

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.structured_output is not None:
            try:
                self.structured_output = validate_spec(self.structured_output)
            except ValueError as e:
                raise SamplingError(f"invalid structured_output: {e}") from None
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise SamplingError(f"invalid {name}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not (
                0 <= self.min_tokens <= self.max_tokens):
            bad("min_tokens", f"must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", f"must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= self.MAX_LOGPROBS):
                bad(name, f"must be an integer in 0..{self.MAX_LOGPROBS}, got {v!r}")
        for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
            v = getattr(self, name)
            if not _is_number(v) or not low <= v <= high:
                bad(name, f"must be a number in [{low}, {high}], got {v!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", f"must be a number in (0, 100] (1: off), got {self.repetition_penalty!r}")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            if not _is_number(b) or not -100 <= b <= 100:
                bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r} for token {t}")
        if self.n != 1:
            bad("n", f"only n=1 is supported, got {self.n!r}")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            bad("stop", f"at most {self.MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > self.MAX_STOP_LEN:
                bad("stop", f"each stop string must be a non-empty string of at most {self.MAX_STOP_LEN} chars")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad("stop_token_ids", f"must be non-negative integers, got {t!r}")

    # Below this temperature sampling is greedy: the distribution is a point anyway, and dividing
    # the logits by a tiny temperature overflows to infinities whose softmax is NaN (vLLM's bound).
    GREEDY_TEMPERATURE = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_TEMPERATURE or self.top_k == 1

    # Asked of every row on every step, so computed once: a request's parameters do not change
    # once it is admitted.
    @cached_property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, biases): a step gathers its rows' from these, not from dicts."""
        return (np.fromiter(self.logit_bias.keys(), np.float64, len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), np.float64, len(self.logit_bias)))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def host_to_device(device: torch.device, data: list | np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A short host list (or array) as a tensor on `device`. The copy goes through pinned memory:
    a plain copy to a GPU waits for everything queued on the stream, a decode step launched ahead
    included (engine/llm_engine.py)."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class Sampler:
    """Samples one token per row. Rows with a seed draw from their own generator, so a
    seeded request gives the same tokens whatever else is in the batch."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        return self.sample(logits, params, generators).tolist()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """The tokens as an int64 tensor on the logits' device, queued without waiting for it."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:  # the fp32 cast is exact, so the same argmax; two calls a step fewer
            return logits.argmax(-1)
        logits = logits.float()
        dev = logits.device
        # one copy; a temperature past fp32's range would be inf there, and a logit masked to -inf
        # (a grammar, min_tokens) divided by it NaN, which the argmax could pick
        both = host_to_device(dev, [[i, min(params[i].temperature, FP32_MAX)] for i in rows], torch.float32)
        idx = both[:, 0].long()
        tokens = (self._race(logits, [params[i] for i in rows], [generators[i] for i in rows], idx, both[:, 1])
                  if triton_ok(logits) else None)
        if tokens is not None:
            if len(rows) == len(params):  # no greedy row: no argmax of the whole batch
                return tokens
            out = logits.argmax(-1)
            out[idx] = tokens
            return out
        out = logits.argmax(-1)
        sub = logits[idx]
        probs = self._filter(sub / both[:, 1:], [params[i] for i in rows]).softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Unseeded rows draw
        # in one call; a seeded row draws its own row from its generator (the same numbers
        # as a draw of that row alone); then one argmax and one write for every row: a few
        # launches a step instead of four a row.
        e = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
        if not seeded:
            e.exponential_(1.0)
        elif len(seeded) < len(rows):
            unseeded = [j for j in range(len(rows)) if generators[rows[j]] is None]
            e[host_to_device(dev, unseeded)] = torch.empty(
                len(unseeded), e.shape[1], device=e.device).exponential_(1.0)
        for j in seeded:
            e[j].exponential_(1.0, generator=generators[rows[j]])
        out[idx] = (probs / e).argmax(-1)
        return out

    def _race(self, logits: torch.Tensor, params: list[SamplingParams], generators: list, idx: torch.Tensor,
              temperature: torch.Tensor) -> torch.Tensor:
        """The GPU's draw (wideep_kernels/race.py): one pass over each row of logits[idx], with no
        softmax or probabilities written. A row with a seed takes its uniforms' seed from its
        generator, so its tokens do not depend on the batch; the others' come from the default
        generator. None where the kernel cannot run here: the torch draw takes over (the
        kernel's own reference recomputes Philox in torch, far slower)."""
        if any(p.top_k > 0 or p.top_p < 1 for p in params):  # the cuts need the scaled rows themselves
            source = self._filter(logits[idx] / temperature[:, None], params)
            rows, inv_temperature = torch.arange(len(params), device=logits.device), torch.ones_like(temperature)
        else:
            source, rows, inv_temperature = logits, idx, 1.0 / temperature
        seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (len(params),), dtype=torch.long, device=logits.device)
        for j, g in enumerate(generators):
            if g is not None:
                seeds[j:j + 1] = torch.randint(-2 ** 63, 2 ** 63 - 1, (1,), dtype=torch.long, device=logits.device,
                                               generator=g)
        return kernel_or_reference("race", race_sample_triton, None, source, rows, inv_temperature, seeds)

    # Past this many candidates a row's top-k is no cheaper than sorting the row.
    TOPK_LIMIT = 1024

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """`logits` with every token outside each row's top-k, then outside its top-p nucleus of
        what is left, set to -inf; tokens tied with the last one kept are kept. Both cuts are
        found among each row's largest `C` logits (one topk: C is the largest k asked) instead of
        a sort of the whole vocabulary, which costs a batch of 64 rows of 129K tokens 1.4 ms on an
        H200 against 0.5 for the topk (bench.sampling). A row with top-p alone needs its whole row:
        on a GPU its cut is found without a sort (wideep_kernels/nucleus.py), elsewhere the row is
        sorted (C = vocab). The cuts become a threshold per row, so no scatter back to vocabulary
        order."""
        vocab = logits.shape[-1]
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        nucleus = any(p < 1 for p in top_p)
        whole_row = any(p < 1 and not k for k, p in zip(top_k, top_p))  # a nucleus not bounded by a top-k
        k_max = max(top_k)
        if not k_max and not nucleus:
            return logits
        # every row's parameters in one copy: its k-th candidate, whether it has a top-k, its
        # top-p, whether it has one
        rows = host_to_device(logits.device, [[k - 1 if k else 0, not k, p, p == 1] for k, p in zip(top_k, top_p)],
                              torch.float32)
        k_index, no_k, p_row, no_p = rows[:, :1].long(), rows[:, 1:2] > 0, rows[:, 2:3], rows[:, 3:4] > 0
        if whole_row and k_max <= Sampler.TOPK_LIMIT and triton_ok(logits):
            floor = torch.full_like(p_row, float("-inf"))
            if k_max:
                floor = torch.where(no_k, floor, logits.topk(k_max, -1).values.gather(1, k_index))
            cut = nucleus_threshold(logits, floor[:, 0], p_row[:, 0])[:, None]
            threshold = torch.where(no_p, floor, torch.maximum(floor, cut))
            return logits.masked_fill(logits < threshold, float("-inf"))
        width = vocab if whole_row else k_max
        if width > Sampler.TOPK_LIMIT:
            values = logits.sort(-1, descending=True).values
        else:
            values = logits.topk(width, -1).values
        threshold = torch.where(no_k, float("-inf"), values.gather(1, k_index))
        if nucleus:
            # the nucleus of what top-k left, normalised over all of it (ties past the candidates
            # too; sorted whole rows hold all of it)
            left = values.masked_fill(values < threshold, float("-inf"))
            if values.shape[1] == vocab:
                probs = left.softmax(-1)
            else:
                probs = (left - logits.masked_fill(logits < threshold, float("-inf")).logsumexp(-1, keepdim=True)).exp()
            # keep tokens until the mass before them reaches top_p; the top token always stays
            kept = ((probs.cumsum(-1) - probs) < p_row).sum(-1, keepdim=True)
            kept.clamp_(min=1)  # a row of infinite logits (a tiny temperature) has NaN masses: keep its top
            # a row without top-p may have fewer candidates than it keeps: it is not cut here
            threshold = torch.where(no_p, threshold, torch.maximum(threshold, values.gather(1, kept - 1)))
        return logits.masked_fill(logits < threshold, float("-inf"))

    @staticmethod
    def filter_by_sort(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """_filter's plain form, kept as its reference (tests, bench.sampling): the top-k cut from
        a sort of each row, then the top-p cut from a second sort, scattered back."""
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            k = host_to_device(logits.device, [min(k, vocab) if k > 0 else vocab for k in top_k])
            sorted_desc = logits.sort(-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1 for p in top_p):
            p = host_to_device(logits.device, top_p)[:, None]
            sorted_logits, order = logits.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop tokens once the mass before them already reaches top_p; the top token always stays
            # (a row without top-p is left whole: its mass before the tail can round up to 1)
            drop = ((probs.cumsum(-1) - probs) >= p) & (p < 1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return logits
