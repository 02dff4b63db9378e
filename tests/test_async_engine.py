import asyncio
import time

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling import SamplingParams


@pytest.fixture
def aengine(tiny_ckpt):
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False))
    yield engine
    engine.shutdown()


def test_concurrent_streams_match_offline_generation(aengine, tiny_ckpt):
    offline = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    prompts = ["hello", "The quick brown fox", "def main():"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expect = [o.output_token_ids for o in offline.generate(prompts, params)]

    async def one(i, prompt):
        tokens = []
        async for out in aengine.generate(f"req-{i}", prompt, params):
            tokens += out.new_token_ids
        return tokens, out
    async def all_of_them():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    results = asyncio.run(asyncio.wait_for(all_of_them(), 60))
    assert [r[0] for r in results] == expect
    assert all(r[1].finished and r[1].finish_reason == "length" for r in results)


def test_cancelled_stream_aborts_and_frees_blocks(aengine):
    async def main():
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        seen = 0
        async for _ in aengine.generate("long", "hello", params):
            seen += 1
            if seen == 3:
                break  # what a client disconnect does to the handler's iteration
        return seen
    assert asyncio.run(asyncio.wait_for(main(), 60)) == 3
    stats = aengine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


def test_callers_get_the_engine_between_two_steps(aengine):
    """While a request decodes step after step, a caller (stats, an abort) gets the engine's lock
    within a step or two of asking, not after hundreds: a plain Lock is not fair, and the loop
    would take it back first each time (the abort of a disconnected client then waited 200+
    steps, its event loop blocked)."""
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)

    async def main():
        stream = aengine.generate("long", "hello", params)
        await anext(stream)
        waited = []
        for _ in range(30):
            asked = aengine.engine.num_steps
            waited.append(aengine.stats()["steps"] - asked)
            await asyncio.sleep(0.002)
        steps = aengine.engine.num_steps
        aengine.abort("long")
        aborted_after = aengine.engine.num_steps - steps
        await stream.aclose()
        return waited, aborted_after
    waited, aborted_after = asyncio.run(asyncio.wait_for(main(), 60))
    assert max(waited) <= 2 and aborted_after <= 2, (waited, aborted_after)
    assert aengine.stats()["running"] == 0


def test_bad_request_raises_to_the_caller(aengine):
    async def main():
        async for _ in aengine.generate("bad", [], SamplingParams()):
            pass
    with pytest.raises(RequestError, match="empty"):
        asyncio.run(main())


def test_cancel_during_admission_still_aborts(aengine):
    """A caller cancelled while its admission waits for the engine (the lock is held for a whole
    step) must not leave the request queued once the admission lands."""
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def scenario():
        aengine._lock.acquire()  # the engine is mid-step: admission blocks in its thread
        try:
            task = asyncio.create_task(anext(aengine.generate("late", "hello there", params)))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            aengine._lock.release()
        for _ in range(200):  # the admission lands, then its abort runs
            await asyncio.sleep(0.01)
            if not aengine.engine.has_unfinished_requests() and "late" not in aengine.engine.requests:
                break
    asyncio.run(scenario())
    assert not aengine.engine.has_unfinished_requests()
    assert aengine.stats()["kv_blocks_used"] == 0 and "late" not in aengine._streams


def test_stream_of_a_closed_event_loop_is_aborted_and_the_engine_lives_on(aengine):
    """A caller's event loop closed without finishing its stream (no cancellation reached the
    generator): delivering to it fails, so the request is aborted; other callers are served."""
    import time
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    loop = asyncio.new_event_loop()
    stream = aengine.generate("orphan", "hello", params)
    loop.run_until_complete(anext(stream))
    loop.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and aengine.run_locked(lambda e: "orphan" in e.requests):
        time.sleep(0.01)
    assert aengine.dead is None
    assert not aengine.run_locked(lambda e: "orphan" in e.requests)

    async def other():
        return [out async for out in aengine.generate("next", "hello", SamplingParams(max_tokens=3))][-1]
    assert asyncio.run(asyncio.wait_for(other(), 30)).finished
    assert aengine.stats()["kv_blocks_used"] == 0


def test_a_new_grammar_compiles_while_the_running_requests_step(aengine, monkeypatch):
    """A schema new to the engine compiles outside its lock: the requests already running keep
    stepping meanwhile, and the request then runs under its grammar; one that does not compile
    is refused before it is queued."""
    from engine.structured import GrammarCompiler
    compile_ = GrammarCompiler.compile
    window = {}

    def slow_compile(self, kind, value):
        window["start"] = counted[0]
        time.sleep(0.5)
        window["end"] = counted[0]
        return compile_(self, kind, value)
    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    counted = [0]

    async def main():
        running = aengine.generate("running", "hello", SamplingParams(max_tokens=100_000, temperature=0,
                                                                        ignore_eos=True))
        await anext(running)

        async def count():
            async for _ in running:
                counted[0] += 1
        counter = asyncio.ensure_future(count())
        text = ""
        async for out in aengine.generate("shaped", "hello", SamplingParams(
                max_tokens=20, temperature=0, structured_output={"kind": "regex", "value": "[0-9]{3}"})):
            text = out.text
        with pytest.raises(RequestError, match="regex cannot be compiled"):
            async for _ in aengine.generate("bad", "hello", SamplingParams(
                    max_tokens=2, structured_output={"kind": "regex", "value": "(ab"})):
                pass
        counter.cancel()
        return text
    text = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(text) == 3 and text.isdigit()
    assert window["end"] - window["start"] >= 3  # the running request streamed while it compiled
    stats = aengine.stats()
    assert stats["waiting"] == 0
