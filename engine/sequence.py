"""A request as the engine tracks it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


class Status(enum.Enum):
    AWAITING_KV = "awaiting_kv"   # blocks reserved, a prefill server is writing the prompt's KV
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None   # stop | length | abort | error
    error: str | None = None
    # KV bookkeeping. Positions < num_cached_tokens have their global KV in shared
    # prefix-cache blocks (not rewritten); compute resumes at num_computed_tokens, which
    # is below num_cached_tokens while the window KV is being replayed.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
    prefix_hash: bytes = b""      # chain hash of the last hashed block
    # Chain hash of each full block of token_ids, computed once (the tokens only grow): admission
    # (retried every step while the pool is full) and publishing read them instead of re-hashing.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    window_slot: int | None = None
    table_cache: tuple | None = field(default=None, repr=False)  # (block_table list, its int32 array)
    generator: torch.Generator | None = None
    penalty_row: int | None = None   # its row of engine.penalties.TokenCounts, when penalized
    penalty_counted: int = 0         # output ids already counted there
    # A request retried after a rank failed continues from a prompt that ends with the tokens
    # produced before: the frequency and presence penalties still count these as outputs.
    prior_output_ids: list[int] = field(default_factory=list, repr=False)
    # With params.prompt_logprobs: a record per prompt position computed so far, the first without a
    # logprob (nothing comes before it); complete once it holds one per prompt token.
    prompt_logprobs: list | None = field(default=None, repr=False)
    # With params.structured_output: its place in the grammar (engine/structured.py Constraint).
    constraint: object = field(default=None, repr=False)
    hold_kv: bool = False           # prefill side: keep the blocks after finishing, until released
    # statistics
    prefix_hit_tokens: int = 0
    remote_tokens: int = 0          # prompt tokens whose KV arrived from a prefill server
    replayed_tokens: int = 0
    num_preemptions: int = 0
    text: str = ""
    detok: object = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:end] + (self.output_ids[:end - p] if end > p else [])

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position's log-probabilities are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int      # prompt tokens served from the prefix cache
    error: str | None = None
    prompt_token_ids: list[int] | None = None  # on a request's first token only
    # a record per new token (engine/logprobs.py entries) when the request asked for logprobs
    logprobs: list[dict] | None = None
    # on the first token, with prompt_logprobs asked: a record per prompt token (the first's logprob None)
    prompt_logprobs: list[dict | None] | None = None
    prompt_text: str | None = None  # on the first token, when the request asked for echo
    # The sequence's output ids (a list that only grows by appends) and how many of them are this
    # output's: copied when read, not per token (a copy per token costs a step O(length) per
    # sequence, 10 us at 8K output tokens, and streaming never reads it).
    output_ids_source: list[int] = field(default_factory=list, repr=False)
    num_output_ids: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """Every token generated so far, this output's included (a new list on each read)."""
        return self.output_ids_source[:self.num_output_ids]

    def __getstate__(self) -> dict:  # pickled (another process): only this output's ids travel
        return dict(self.__dict__, output_ids_source=self.output_token_ids)

    def stream_dict(self) -> dict:
        """The per-token record streamed between processes and to the HTTP layer."""
        return {"text_delta": self.text_delta, "new_token_ids": list(self.new_token_ids), "finished": self.finished,
                "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "error": self.error,
                **({"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids is not None else {}),
                **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
                **({"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}),
                **({"prompt_text": self.prompt_text} if self.prompt_text is not None else {})}
