"""Fill in the middle: a legacy completion's `suffix` (DeepSeek's FIM completion) runs the prompt
BOS <fim_begin> prefix <fim_hole> suffix <fim_end>, and the completion is the middle."""
import pytest
from tokenizers import Tokenizer as RawTokenizer, models
from transformers import PreTrainedTokenizerFast

from engine.errors import RequestError
from engine.prompts import PromptReader
from engine.tokenizer import FIM_BEGIN, FIM_END, FIM_HOLE, Tokenizer
from tests.test_http_api import MODEL, client, greedy, offline, raw, served  # noqa: F401

PREFIX, SUFFIX = "def fib(a):\n", "    return fib(a - 1) + fib(a - 2)\n"


def test_fim_prompt_is_deepseeks_layout(offline):
    tok = offline.tokenizer
    begin, hole, end = (tok.hf.convert_tokens_to_ids(m) for m in (FIM_BEGIN, FIM_HOLE, FIM_END))
    ids = tok.fill_in_middle(PREFIX, SUFFIX)
    assert ids == [tok.hf.bos_token_id, begin, *tok.encode(PREFIX), hole, *tok.encode(SUFFIX), end]
    assert len({begin, hole, end}) == 3 and tok.fim_ids == (begin, hole, end)


def test_completion_with_suffix_is_the_middle(client, offline):
    ids = offline.tokenizer.fill_in_middle(PREFIX, SUFFIX)
    want = offline.generate([ids], greedy(8))[0]
    kw = dict(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    resp = client.completions.create(**kw)
    assert resp.choices[0].text == want.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == want.text
    # the same prompt without a suffix, or with an empty one, is a plain completion
    plain = offline.generate([PREFIX], greedy(8))[0]
    del kw["suffix"]
    for extra in ({}, {"suffix": ""}):
        resp = client.completions.create(**kw, **extra)
        assert resp.choices[0].text == plain.text
        assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(PREFIX))


def test_a_tokenizer_without_fim_tokens_refuses_a_suffix(tmp_path, offline):
    raw_tok = RawTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=raw_tok, unk_token="[UNK]").save_pretrained(str(tmp_path))
    plain = Tokenizer(tmp_path)
    assert plain.fim_ids is None
    reader = PromptReader(plain, 3, None)
    with pytest.raises(RequestError, match="no fill-in-the-middle tokens"):
        reader.prompt_ids({"prefix": "a", "suffix": "b"}, None)
    reader = PromptReader(offline.tokenizer, 512, None)
    with pytest.raises(RequestError, match="needs a tokenizer"):
        PromptReader(None, 512, None).prompt_ids({"prefix": "a", "suffix": "b"}, None)
    for bad in ({"prefix": "a"}, {"prefix": "a", "suffix": 3}, {"prefix": "a", "suffix": "b", "x": "c"}):
        with pytest.raises(RequestError, match="prefix, suffix"):
            reader.prompt_ids(bad, None)
