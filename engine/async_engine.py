"""An asyncio front for LLMEngine: a background thread steps the engine while callers
await a stream of outputs per request. The deployments wrap this."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator, Awaitable, Callable

from .llm_engine import LOCKSTEP_IDLE_POLL_S, LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.lockstep = engine.ep  # expert parallelism: every rank steps together (see engine.ep)
        self._lock = threading.Lock()          # guards the engine between the loop thread and callers
        # Callers waiting for the lock, and a caller's signal that it has it (_locked): a Lock is
        # not fair, and a busy loop would take it back step after step while they wait (an abort
        # waited 200+ steps so on a 2-core host, its event loop blocked all the while).
        self._waiting = 0
        self._count_lock = threading.Lock()
        self._entered = threading.Event()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt=None, params: SamplingParams | None = None,
                       messages: list[dict] | None = None, hold_kv: bool = False, tools: list[dict] | None = None,
                       remote_prefill: Callable[[dict], Awaitable[dict | None]] | None = None,
                       prior_output_ids: list[int] | None = None, chat_template_kwargs: dict | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per new token; the last has finished=True.
        Cancelling the iteration (e.g. a client disconnect) aborts the request.

        remote_prefill (decode side): called with the block reservation; it has a prefill
        server write the prompt's KV and returns {"first_token", "first_logprobs" (optional)},
        or None when the transfer failed, in which case the prompt is prefilled here. hold_kv (prefill side): keep the
        KV blocks after finishing, until release_held(). prior_output_ids and
        chat_template_kwargs: as LLMEngine.add_request's."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def admit():  # the lock is held for a whole step: take it off the event loop
            self.engine.compile_grammar(params)  # outside the lock: the running requests do not wait for it
            with self._locked():
                if remote_prefill is None:
                    self.engine.add_request(request_id, prompt, params, messages=messages, hold_kv=hold_kv,
                                            tools=tools, prior_output_ids=prior_output_ids,
                                            chat_template_kwargs=chat_template_kwargs)
                    reservation = None
                else:
                    reservation = self.engine.reserve_remote(request_id, prompt, params, messages=messages,
                                                             tools=tools, prior_output_ids=prior_output_ids,
                                                             chat_template_kwargs=chat_template_kwargs)
                self._streams[request_id] = (loop, queue)
                return reservation
        admission = asyncio.ensure_future(asyncio.to_thread(admit))
        try:
            reservation = await asyncio.shield(admission)
        except asyncio.CancelledError:
            # The admission runs on in its thread and will queue the request: abort it once
            # it has, or it would hold KV (or a reservation) with nobody reading its stream.
            admission.add_done_callback(
                lambda t: t.cancelled() or t.exception() is not None
                or loop.run_in_executor(None, self.abort, request_id))
            raise
        finished = False
        try:
            if reservation is not None:
                first = await remote_prefill(reservation)
                with self._locked():
                    if first is None:
                        self.engine.fallback_local(request_id)
                    else:
                        out = self.engine.commit_remote(request_id, first["first_token"],
                                                        first.get("first_logprobs"))
                        if out is not None:
                            queue.put_nowait(out)
            self._wake.set()
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._locked():
            self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)

    @contextlib.contextmanager
    def _locked(self):
        """The engine's lock for a caller, taken between two of the loop's steps."""
        with self._count_lock:
            self._waiting += 1
        try:
            with self._lock:
                self._entered.set()
                yield
        finally:
            with self._count_lock:
                self._waiting -= 1

    def run_locked(self, fn):
        """fn(engine) between two steps (e.g. reading load counters the forward updates)."""
        with self._locked():
            return fn(self.engine)

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, or None while it runs."""
        return self._dead

    def held_blocks(self, request_id: str) -> list[int]:
        with self._locked():
            return self.engine.held_blocks(request_id)

    def release_held(self, request_id: str) -> None:
        with self._locked():
            self.engine.release_held(request_id)

    def stats(self) -> dict:
        with self._locked():
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._wake.clear()  # before looking for work, so a request added meanwhile is not missed
                due = None
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    # A lockstep rank steps every time, work or not: its step's agreement (engine.ep)
                    # tells every rank whether any of them has work.
                    outputs = self.engine.step() if busy or self.lockstep is not None else []
                    if self.lockstep is not None:
                        busy = self.lockstep.busy
                    if not busy:
                        due = self.engine.housekeeping()
                    self._entered.clear()  # a caller sets it only once it has the lock: after this
                self._deliver_all([(out.request_id, out) for out in outputs])
                if self._waiting:
                    # let a waiting caller in before the next step (bounded, as a safeguard)
                    self._entered.wait(timeout=0.1)
                if not busy:
                    # lockstep ranks poll together; a lone engine sleeps until a request comes, or
                    # housekeeping is due (at least a millisecond off the lock, for an admission)
                    timeout = LOCKSTEP_IDLE_POLL_S if self.lockstep is not None else 0.5
                    self._wake.wait(timeout=timeout if due is None else min(timeout, max(due, 0.001)))
        except BaseException as e:  # the loop must not die silently: every waiter hears of it
            self._dead = e
            self._deliver_all([(rid, EngineDeadError(f"engine loop died: {e!r}")) for rid in list(self._streams)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand each item to its request's queue: one wake-up of each event loop a step, not one
        per output (64 outputs a step took 130 us of this thread one by one, 10 us batched)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, object]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((request_id, target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that caller's event loop is closed: nobody reads these streams
                for request_id, _, _ in puts:
                    self.abort(request_id)


def _put_all(puts: list[tuple[str, asyncio.Queue, object]]) -> None:
    for _, queue, item in puts:
        queue.put_nowait(item)
