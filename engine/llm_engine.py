"""The engine's Python API: add and abort requests, step, generate."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import ensure_checkpoint, load_model
from .config import EngineConfig, ModelConfig
from .errors import ContextLengthError, RequestError
from .logprobs import logprob_records, token_logprobs
from .model import DeepseekForCausalLM
from .model_runner import ModelRunner
from .prompts import PromptReader
from .sampling import SamplingParams, host_to_device
from .scheduler import ScheduledBatch, Scheduler
from .sequence import RequestOutput, Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .warmup import warm_up

# How often a lockstep rank's serving loop steps while its group is idle (engine/async_engine.py):
# the group's idle steps stand for its idle time (housekeeping).
LOCKSTEP_IDLE_POLL_S = 0.005


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that a stop string starts with (held back)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def _reads_previous_token(seqs: list[Sequence]) -> bool:
    """Whether sampling any of these reads the token sampled just before (penalties count it, a
    grammar's mask follows it, min_tokens counts the tokens out): a step launched ahead then
    samples once that token is known."""
    return any(seq.params.penalized or seq.constraint is not None or len(seq.output_ids) < seq.params.min_tokens
               for seq in seqs)


def context_limit(model_cfg, cfg: EngineConfig) -> int:
    """Prompt + output tokens one request may reach: the model's positions, the KV pool, the
    configured max_model_len, whichever is least."""
    limit = min(model_cfg.max_position_embeddings, cfg.num_blocks * cfg.block_size)
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds what the model and KV pool allow ({limit})")
    return cfg.max_model_len or limit


@dataclass
class LaunchedStep:
    """A forward queued on the device whose tokens have not been read yet."""
    batch: ScheduledBatch
    done: list[int] = field(default_factory=list)   # rows whose next token was sampled
    tokens: torch.Tensor | None = None              # on the device, one per done row
    host: torch.Tensor | None = None                # their pinned copy, valid once `ready`
    logprob_rows: list[int] = field(default_factory=list)  # of `done`, those whose request asked for logprobs
    logprobs: torch.Tensor | None = None            # their token_logprobs(), then its pinned copy
    prompt: tuple | None = None                     # ModelRunner.prompt_records of the step, copied likewise
    ready: torch.cuda.Event | None = None
    error: Exception | None = None
    # Launched ahead, not sampled yet: its sampling reads the previous step's token (_sample_deferred).
    logits: torch.Tensor | None = None
    write_blocks: list[int] = field(default_factory=list)  # a step ahead: the block of each row's position


class LLMEngine:
    def __init__(self, model: DeepseekForCausalLM, tokenizer: Tokenizer | None, cfg: EngineConfig | None = None,
                 ep=None):
        """ep (engine.ep.ExpertParallel): this engine is one DP rank of an expert-parallel group;
        every step then runs a forward, an idle one when this rank has nothing to compute."""
        self.cfg = cfg = cfg or EngineConfig()
        self.ep = ep
        if ep is not None:
            ep.attach(model.moe_layers())
        self.model_cfg = model.cfg
        self.tokenizer = tokenizer
        self.max_model_len = context_limit(model.cfg, cfg)
        self.runner = ModelRunner(model, cfg)
        if ep is not None:
            self.runner.attach_ep(ep)
        self.scheduler = Scheduler(model.cfg, cfg)
        self.requests: dict[str, Sequence] = {}
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self.prompts = PromptReader(tokenizer, model.cfg.vocab_size, self.eos_token_id)
        self.runner.eos_token_id = self.eos_token_id  # min_tokens holds it back
        self.num_steps = 0
        self.num_steps_ahead = 0  # of num_steps, those launched before the previous step's tokens were read
        self._inflight: LaunchedStep | None = None
        self._last_step, self._idle_steps = time.monotonic(), 0
        cuda = self.runner.device.type == "cuda"
        # A lockstep rank runs ahead only where its group agrees on the host: an agreement over
        # the GPU's own collectives would wait for the step in flight.
        self._run_ahead = (cuda if cfg.async_scheduling is None else cfg.async_scheduling) and (
            cfg.decode_kernels and (ep is None or ep.host_agreement))
        # Pinned landing places of the sampled tokens of the (at most two) steps in flight.
        self._token_buffers = ([torch.empty(cfg.max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
                               if self._run_ahead and cuda else None)
        # An expert-parallel rank's forwards are its group's: every rank builds its engine, and
        # so warms up, at the same time (deployments/decode_rank.py).
        if cfg.warmup and self.runner.device.type == "cuda":
            self.warmup()

    def warmup(self) -> None:
        """Run short requests before the first real one (engine/warmup.py): kernel builds and graph
        captures at start, not met by the first users. Leaves no request, used block or statistic
        behind. On a rank of an expert-parallel group every rank calls it at the same time."""
        warm_up(self)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, cfg: EngineConfig | None = None,
                        progress: bool = True, ep=None) -> "LLMEngine":
        """A checkpoint directory, or a preset name (its random checkpoint is written on first use)."""
        cfg = cfg or EngineConfig()
        path = ensure_checkpoint(str(name_or_path))
        model = load_model(path, device=cfg.device, dtype=getattr(torch, cfg.dtype), progress=progress,
                           local_phys2log=ep.local_phys2log() if ep is not None else None,
                           fp8_experts=cfg.fp8_experts(ModelConfig.from_file(path)))
        return cls(model, Tokenizer(path), cfg, ep)

    # requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict | None = None,
                    params: SamplingParams | None = None, messages: list[dict] | None = None,
                    hold_kv: bool = False, tools: list[dict] | None = None,
                    prior_output_ids: list[int] | None = None, chat_template_kwargs: dict | None = None) -> Sequence:
        """Queue a request. prompt: text, token ids, or {"prefix", "suffix"} (fill in the middle: the
        model writes what goes between them). hold_kv (prefill servers): keep its KV blocks after it finishes,
        until release_held(), so they can be sent to a decode engine. tools: function definitions
        the chat template describes to the model (with messages); chat_template_kwargs: more
        variables for the template (e.g. DeepSeek-V3.1's `thinking`). prior_output_ids: the end of
        the prompt (token ids) was produced by an earlier attempt at this request; penalties
        count it as output."""
        seq = self._new_sequence(request_id, prompt, params, messages, tools, prior_output_ids, chat_template_kwargs)
        seq.hold_kv = hold_kv
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, request_id, prompt, params, messages, tools=None, prior_output_ids=None,
                      chat_template_kwargs=None) -> Sequence:
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.scheduler.held:
            raise RequestError(f"duplicate request id {request_id!r}")
        outside = [t for t in params.logit_bias if t >= self.model_cfg.vocab_size]
        if outside:
            raise RequestError(f"logit_bias token id {outside[0]} is outside the vocabulary "
                               f"(0..{self.model_cfg.vocab_size - 1})")
        ids = self.prompts.prompt_ids(prompt, messages, tools, chat_template_kwargs)
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens; the context limit is {self.max_model_len} "
                               "(prompt plus at least one output token)")
        prior = list(prior_output_ids or [])
        if prior and (not all(isinstance(t, int) and not isinstance(t, bool) for t in prior)
                      or ids[len(ids) - len(prior):] != prior or len(prior) >= len(ids)):
            raise RequestError("prior_output_ids must be token ids ending the prompt's token ids")
        seq = Sequence(request_id, ids, params, arrival=time.monotonic(), prior_output_ids=prior)
        if params.structured_output is not None:
            seq.constraint = self.prompts.constraint(params.structured_output, prior)
        if params.prompt_logprobs is not None:  # the first token has nothing before it: no logprob
            first = {"token_id": ids[0], "token": self.prompts.token_text(ids[0]), "logprob": None, "top": []}
            seq.prompt_logprobs = [first]
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer)
        self.requests[request_id] = seq
        return seq

    def compile_grammar(self, params: SamplingParams | None) -> None:
        """Compile a request's grammar ahead of add_request, which then finds it compiled.
        Thread-safe: a caller on another thread compiles outside the engine's lock."""
        self.prompts.compile_grammar(params)

    def tokenize(self, request: dict) -> dict:
        """{"tokens", "token_strs"}: the token ids a request of this prompt (a string) or these messages
        (with tools and chat_template_kwargs) would run, and with request["return_token_strs"] each
        one's text. Any thread, no lock."""
        return self.prompts.tokenize(request)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of these token ids, special tokens included. Any thread, no lock."""
        return self.prompts.detokenize(token_ids)

    # prefill/decode hand-off ------------------------------------------------------------
    def reserve_remote(self, request_id: str, prompt=None, params: SamplingParams | None = None,
                       messages: list[dict] | None = None, tools: list[dict] | None = None,
                       prior_output_ids: list[int] | None = None, chat_template_kwargs: dict | None = None
                       ) -> dict | None:
        """Decode side: allocate blocks for the prompt's KV, to be written by a prefill server.
        Returns what the prefill server needs, or None when the pool is full right now (the
        request is then queued for local prefill instead)."""
        seq = self._new_sequence(request_id, prompt, params, messages, tools, prior_output_ids, chat_template_kwargs)
        # The step in flight may still write into free blocks (those of its sequences that ended
        # since its launch); a writer outside the device's stream order must not get them. They
        # sit out this reservation, rather than the host waiting out the step, which would cost
        # a decode rank a step's overlap on every hand-off.
        if seq.needs_prompt_logprobs:  # its prompt is computed here, every position
            self.scheduler.add(seq)
            return None
        busy = self._blocks_written_in_flight()
        if any(self.scheduler.blocks.block_hash[b] is not None for b in busy):
            self.wait_inflight()  # a cached prefix cannot sit out (a hit may revive it)
            busy = []
        with self.scheduler.blocks.withheld(busy):
            reserved = self.scheduler.reserve_for_remote(seq)
        if reserved is None and busy:  # those few blocks were the difference: wait for them
            self.wait_inflight()
            reserved = self.scheduler.reserve_for_remote(seq)
        if reserved is None:
            self.scheduler.add(seq)
            return None
        cached_blocks, dst_blocks = reserved
        return {"prompt_token_ids": list(seq.prompt_ids), "cached_blocks": cached_blocks,
                "dst_blocks": dst_blocks, "block_size": self.cfg.block_size}

    def commit_remote(self, request_id: str, first_token: int, first_logprobs: dict | None = None
                      ) -> RequestOutput | None:
        """Decode side: the prompt's KV has landed and the prefill server sampled first_token
        (first_logprobs: its record, when the request asked for logprobs)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None  # aborted meanwhile; its blocks are already free
        self.scheduler.kv_arrived(seq)
        return self._append(seq, first_token, first_logprobs)

    def fallback_local(self, request_id: str) -> None:
        """Decode side: the transfer failed or timed out; prefill here instead. The reserved
        blocks sit out cfg.remote_kv_grace_s, in case the write still lands."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.kv_failed(seq, time.monotonic() + self.cfg.remote_kv_grace_s)

    def housekeeping(self) -> float | None:
        """Work due with no request to step: return quarantined blocks whose time is up and, once
        idle for cuda_graph_ahead_idle_s, capture a graph that serving would otherwise meet
        (DecodeGraphs.capture_ahead), one per call so that a request arriving waits for one at
        most. Returns in how many seconds it has more to do (0: at once), None: nothing. On a
        lockstep rank, call it after each step its group was idle in, as every rank does."""
        now = time.monotonic()
        self.scheduler.release_quarantine(now)
        graphs, wait = self.runner.graphs, self.cfg.cuda_graph_ahead_idle_s
        if graphs is None or wait is None:
            return None
        if self.ep is not None:
            # The group's ranks capture together, at one step: they count the steps the group was
            # idle in, the same on every rank (each step's agreement says whether any had work),
            # where their clocks would disagree.
            self._idle_steps += 1
            if self._idle_steps * LOCKSTEP_IDLE_POLL_S < wait:
                return None
            return 0.0 if graphs.capture_ahead() else None
        due = self._last_step + wait - now
        if due > 0:
            return due if graphs.ahead_shapes() else None
        return 0.0 if graphs.capture_ahead() else None

    def held_blocks(self, request_id: str) -> list[int]:
        """Prefill side: the blocks of a finished hold_kv request, in position order."""
        return list(self.scheduler.held[request_id].block_table)

    def release_held(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward and return its outputs. With async scheduling the next decode step is
        launched before this one's tokens are read back, and stays in flight past the return:
        the host's work between two steps (outputs, stop checks, the next step's inputs) then
        overlaps the GPU's."""
        cur, self._inflight = self._inflight, None
        if cur is not None and all(seq.is_finished for seq in cur.batch.seqs):
            cur.logits = None
            self._complete(cur)  # ran ahead of requests that have ended since: nothing to report
            cur = None
        if cur is not None and cur.logits is not None:
            self._sample_deferred(cur)
        if cur is None:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                if self.ep is not None:  # the other ranks' MoE layers need this rank's collectives
                    self.runner.run(batch)
                    self.num_steps += int(self.ep.busy)  # an idle forward, unless the whole group is idle
                    if self.ep.busy:
                        self._idle_steps = 0
                return []
            cur = self._launch(batch)
        self._last_step, self._idle_steps = time.monotonic(), 0  # housekeeping waits for idleness
        rows = self._ahead_rows(cur)
        if rows:
            self._inflight = self._launch_ahead(cur, rows)
        return self._complete(cur)

    def _launch(self, batch: ScheduledBatch, ahead_ids: torch.Tensor | None = None) -> "LaunchedStep":
        """Queue a forward and its sampling on the device; the tokens are read by _complete.
        ahead_ids: a decode step whose input tokens are these, sampled by the step before and
        still on the device."""
        self.num_steps += 1
        step = LaunchedStep(batch)
        try:
            if ahead_ids is None:
                step.done, logits = self.runner.run(batch)
            else:
                step.done, logits = list(range(len(batch))), self.runner.run_ahead(batch, ahead_ids)
            step.prompt, self.runner.prompt_records = self.runner.prompt_records, None
            if step.done and ahead_ids is not None and _reads_previous_token(batch.seqs):
                step.logits = logits  # sampled by step() once the previous step's tokens are read
            elif step.done:
                self._sample(step, logits)
        except Exception as e:  # a failed step fails its requests, never leaks their blocks
            step.error = e
            return step
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.scheduler.blocks.publish(seq)
        self._read_back(step)
        return step

    def _sample(self, step: "LaunchedStep", logits: torch.Tensor) -> None:
        seqs = [step.batch.seqs[i] for i in step.done]
        live = [j for j, seq in enumerate(seqs) if not seq.is_finished]
        if len(live) < len(seqs):
            # a deferred step's sequences that ended when the previous step's tokens were read: their
            # tokens are dropped, and sampling them would read state that is no longer theirs
            step.tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
            if live:
                idx = host_to_device(logits.device, live)
                step.tokens[idx] = self.runner.sample([seqs[j] for j in live], logits.index_select(0, idx))
        else:
            step.tokens = self.runner.sample(seqs, logits)
        step.logprob_rows = [j for j, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if step.logprob_rows:
            k = max(seqs[j].params.logprobs for j in step.logprob_rows)
            step.logprobs = token_logprobs(logits, step.tokens, step.logprob_rows, k)

    def _sample_deferred(self, step: "LaunchedStep") -> None:
        """Sample a step launched ahead whose sampling reads the token before it (penalties, a
        grammar's mask, min_tokens), now that it is known: the forward was queued a step earlier, so the host's
        work here (a grammar's masks) overlaps it on the device."""
        logits, step.logits = step.logits, None
        try:
            self._sample(step, logits)
        except Exception as e:
            step.error = e
            return
        self._read_back(step)

    def _read_back(self, step: "LaunchedStep") -> None:
        if self._token_buffers is None:
            return
        # Read back through pinned memory and an event: reading the tokens directly would wait
        # for everything queued after them, the step launched ahead included. A step whose
        # sampling waits still records one: it says when the forward's KV writes are done.
        if step.tokens is not None:
            step.host = self._token_buffers[self.num_steps % 2][:len(step.done)]
            step.host.copy_(step.tokens, non_blocking=True)
        if step.logprobs is not None:
            step.logprobs = step.logprobs.to("cpu", non_blocking=True)
        if step.prompt is not None and step.prompt[2].device.type != "cpu":
            owners, targets, packed = step.prompt
            step.prompt = (owners, targets, packed.to("cpu", non_blocking=True))
        step.ready = torch.cuda.Event()
        step.ready.record()

    def _complete(self, step: "LaunchedStep") -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs. Sequences that ended
        while it ran (aborted, or stopped by the step before when this one ran ahead) get none."""
        live = [seq for seq in step.batch.seqs if not seq.is_finished]
        if step.error is not None:
            e, outputs = step.error, []
            for seq in live:
                self.scheduler.finish(seq, "error", f"{type(e).__name__}: {e}")
                self.requests.pop(seq.request_id, None)
                outputs.append(self._output(seq, [], ""))
            return outputs
        if step.ready is not None and (step.tokens is not None or step.prompt is not None):
            step.ready.synchronize()
        if step.prompt is not None:
            self._add_prompt_records(*step.prompt)
        if step.tokens is None:
            return []
        tokens = (step.host if step.host is not None else step.tokens).tolist()
        records: list[dict | None] = [None] * len(tokens)
        if step.logprobs is not None:
            rows = step.logprob_rows
            ks = [step.batch.seqs[step.done[j]].params.logprobs for j in rows]
            for j, record in zip(rows, logprob_records(step.logprobs.tolist(), [tokens[j] for j in rows], ks,
                                                       self.prompts.token_text)):
                records[j] = record
        return [self._append(step.batch.seqs[i], token, record)
                for i, token, record in zip(step.done, tokens, records) if not step.batch.seqs[i].is_finished]

    def _add_prompt_records(self, owners: list, targets: list[int], packed: torch.Tensor) -> None:
        at = 0
        rows = packed.tolist()  # each row: the target's rank, then token_logprobs()'s row
        for seq, n in owners:
            records = logprob_records([r[1:] for r in rows[at:at + n]], targets[at:at + n],
                                      [seq.params.prompt_logprobs] * n, self.prompts.token_text)
            for record, row in zip(records, rows[at:at + n]):
                record["rank"] = int(row[0])
            seq.prompt_logprobs += records
            at += n

    def _ahead_rows(self, cur: "LaunchedStep") -> list[int]:
        """The rows of `cur` whose next step can be launched before cur's tokens are known: those
        still running that cur's token cannot end by length (a stop token or string shows only
        once read: such a row is computed and dropped). Nothing when cur did not sample every row
        (a prefill chunk), when the scheduler runs other sequences, when a waiting request could
        be admitted (the scheduler plans that step), or when the pool lacks a block for one more
        position of each (preemption is the scheduler's)."""
        if not self._run_ahead or cur.tokens is None:
            return []
        s, seqs = self.scheduler, cur.batch.seqs
        live = [seq for seq in seqs if not seq.is_finished]
        if (len(cur.done) != len(seqs) or len(s.running) != len(live)
                or any(a is not b for a, b in zip(s.running, live))):
            return []
        if s.waiting and len(s.running) < self.cfg.max_num_seqs:
            return []
        rows, need = [], 0
        for i, seq in enumerate(seqs):
            if (seq.is_finished or seq.hold_kv or len(seq.output_ids) + 1 >= seq.params.max_tokens
                    or seq.num_tokens + 1 >= self.max_model_len):
                continue
            rows.append(i)
            need += s.blocks.blocks_needed(seq.num_tokens + 1) - len(seq.block_table)
        return rows if need <= s.blocks.num_free_blocks else []

    def _launch_ahead(self, cur: "LaunchedStep", rows: list[int]) -> "LaunchedStep":
        seqs = [cur.batch.seqs[i] for i in rows]
        for seq in seqs:
            self.scheduler.blocks.grow(seq, seq.num_tokens + 1)
        self.num_steps_ahead += 1
        ids = cur.tokens
        if len(rows) < len(cur.batch):
            ids = ids.index_select(0, host_to_device(ids.device, rows))
        step = self._launch(ScheduledBatch(seqs=seqs, num_tokens=[1] * len(seqs)), ahead_ids=ids)
        bs = self.cfg.block_size
        step.write_blocks = [seq.block_table[seq.num_tokens // bs] for seq in seqs]
        return step

    def wait_inflight(self) -> None:
        """Block until the step in flight (if any) has finished on the device."""
        if self._inflight is not None and self._inflight.ready is not None:
            self._inflight.ready.synchronize()

    def _blocks_written_in_flight(self) -> list[int]:
        """Free blocks that the step in flight writes a position into: those of its sequences
        that ended (stopped, aborted) after it was launched. Empty once it has finished."""
        step = self._inflight
        if step is None or step.ready is None or step.ready.query():
            return []
        free = self.scheduler.blocks.free
        return [b for seq, b in zip(step.batch.seqs, step.write_blocks) if seq.is_finished and b in free]

    def _append(self, seq: Sequence, token: int, logprob: dict | None = None) -> RequestOutput:
        seq.output_ids.append(token)
        p = seq.params
        reason = None
        if seq.constraint is not None and not seq.constraint.accept(token):
            # a token its mask allowed always follows: this is a bug, not the client's
            self.scheduler.finish(seq, "error", f"token {token} does not follow the request's structured output")
            self.requests.pop(seq.request_id, None)
            return self._output(seq, [token], "")
        stops = len(seq.output_ids) > p.min_tokens  # before, neither stop tokens nor stop strings end it
        if ((stops and ((not p.ignore_eos and token == self.eos_token_id) or token in p.stop_token_ids))
                or (seq.constraint is not None and seq.constraint.finished)):
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        delta = ""
        if seq.detok is not None:
            text = seq.detok.text_for(seq.output_ids, final=reason is not None)
            if p.stop and stops:
                # Emitted text (past min_tokens) never holds a stop string or the start of one,
                # so a match can only begin in the part not yet emitted.
                hit = min((i for i in (text.find(s, len(seq.text)) for s in p.stop) if i >= 0), default=-1)
                if hit >= 0:
                    text, reason = text[:hit], "stop"
                elif reason is None:
                    text = text[:len(text) - _stop_prefix_len(text, p.stop)]
            delta = text[len(seq.text):] if text.startswith(seq.text) else ""
            seq.text += delta
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
        return self._output(seq, [token], delta, None if logprob is None else [logprob])

    def _output(self, seq: Sequence, new_ids: list[int], delta: str, logprobs: list[dict] | None = None
                ) -> RequestOutput:
        first = len(seq.output_ids) == 1 and bool(new_ids)
        prompt_text = None
        if first and seq.params.echo:
            prompt_text = self.tokenizer.decode(seq.prompt_ids) if self.tokenizer is not None else ""
        return RequestOutput(
            prompt_token_ids=list(seq.prompt_ids) if first else None,
            request_id=seq.request_id, new_token_ids=new_ids,
            output_ids_source=seq.output_ids, num_output_ids=len(seq.output_ids),
            text_delta=delta, text=seq.text, finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids), num_cached_tokens=seq.prefix_hit_tokens, error=seq.error,
            logprobs=logprobs, prompt_text=prompt_text,
            prompt_logprobs=list(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None)

    # one-process convenience ------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs the given prompts (strings, token-id lists, or message lists) to completion. On a
        rank of an expert-parallel group every rank calls it at the same time, each with its own
        prompts or none: it steps until the whole group is idle, as the others' forwards need
        this rank's collectives."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"generate-{self.num_steps}-{i}-{time.monotonic_ns()}"
            is_chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
            self.add_request(rid, None if is_chat else prompt, p, messages=prompt if is_chat else None)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        first: dict[str, RequestOutput] = {}  # a request's first output, which carries the prompt's records
        lockstep = self.ep
        while self.has_unfinished_requests() or lockstep is not None:
            for out in self.step():
                first.setdefault(out.request_id, out)
                if out.finished:
                    out.prompt_logprobs = first[out.request_id].prompt_logprobs
                    out.prompt_text = first[out.request_id].prompt_text
                    final[out.request_id] = out
            # every rank sees the same agreement: all leave after the same step
            if lockstep is not None and not lockstep.busy and not self.has_unfinished_requests():
                break
        return [final[r] for r in ids]

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "running": len(s.running), "waiting": len(s.waiting),
            "kv_blocks_used": s.blocks.num_used_blocks, "kv_blocks_total": s.blocks.num_blocks,
            "prefix_hit_tokens": s.prefix_hit_tokens, "replayed_tokens": s.replayed_tokens,
            "awaiting_kv": len(s.awaiting_kv), "held_kv": len(s.held),
            "quarantined_blocks": sum(len(b) for _, b in s.quarantine),
            "preemptions": s.num_preemptions, "steps": self.num_steps, "steps_ahead": self.num_steps_ahead,
            # structured output: grammars compiled (each new schema, regex or grammar) and the seconds
            # they took, outside the engine's lock
            **({"grammar_compiles": grammars.compiles, "grammar_compile_s": grammars.compile_s}
               if (grammars := self.prompts.grammars) is not None else {}),
            # expert parallelism: seconds this rank waited in the group's per-step agreement
            **({"group_wait_s": self.ep.wait_s} if self.ep is not None else {}),
            # CUDA graphs captured while requests waited on them, the seconds they took, and
            # those captured ahead in idle time
            **({"graph_captures": g.captures_serving, "graph_capture_s": g.capture_serving_s,
                "graph_captures_ahead": g.captures_ahead} if (g := self.runner.graphs) is not None else {}),
        }
