"""Several choices per request (n): each a seeded engine request of its own, merged into one
response or one stream, all aborted together."""
import json

import pytest

from engine.sampling import SamplingParams
from tests.test_http_api import (COMPLETIONS, MESSAGES, MODEL, _disconnect_mid_stream, _wait_until_idle,  # noqa: F401
                                 client, offline, raw, served)


def _sampled(max_tokens, seed, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **extra)


def test_chat_choices_are_the_seeded_requests_one_by_one(client, offline):
    want = [offline.generate([MESSAGES], _sampled(8, 7 + i))[0] for i in range(3)]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7,
                                          n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [w.text for w in want]
    assert len({c.message.content for c in resp.choices}) > 1  # seeds differ per choice
    assert resp.usage.completion_tokens == 24 and resp.usage.prompt_tokens == want[0].num_prompt_tokens
    assert all(c.finish_reason == "length" for c in resp.choices)


def test_streamed_choices_add_up_to_the_whole_ones(client):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11, n=3,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    texts, roles, finishes = {}, {}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role == "assistant")
        if choice.finish_reason:
            finishes[choice.index] = finishes.get(choice.index, 0) + 1
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: 1, 1: 1, 2: 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_completion_choices_with_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0, n=2,
                                     logprobs=1, extra_body={"ignore_eos": True})
    a, b = resp.choices
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens and len(a.logprobs.tokens) == 5
    assert resp.usage.completion_tokens == 10


def test_choices_share_the_prompts_cached_blocks(client, served):
    prompt = "Choices share a prompt: " + "one block after another of the same words. " * 4
    before = served.engine.stats()["prefix_hit_tokens"]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.5, n=4)
    assert served.engine.stats()["prefix_hit_tokens"] - before >= 4 * 16


def test_disconnect_aborts_every_choice(served, raw):
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 200, "n": 3,
                       "temperature": 0, "ignore_eos": True}).encode()
    _disconnect_mid_stream(served, raw, body, events=8, running=3)


def test_a_rejected_choice_rejects_the_request_and_leaves_nothing(served, raw):
    _wait_until_idle(served.engine)
    resp = raw.post(COMPLETIONS, content=json.dumps({"model": MODEL, "prompt": [5] * 300, "n": 3}).encode())
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    _wait_until_idle(served.engine)
