"""Tokenizer and chat template from a checkpoint directory; an offline-built one for random checkpoints."""
from __future__ import annotations

from pathlib import Path

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# DeepSeek's tool-call markers (V3.1's form: <calls_begin><call_begin>name<sep>arguments<call_end>...
# <calls_end>). They decode as text, not as special tokens: the API finds tool calls in the text.
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOL_MARKERS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP, OUTPUT_BEGIN, OUTPUT_END]
# A reasoning model's thinking comes between these (app/reasoning.py); text too, as in DeepSeek's tokenizer.
THINK_BEGIN, THINK_END = "<think>", "</think>"
# Fill in the middle (a completion's `suffix`): the model writes what goes between a prefix and a
# suffix given as BOS <begin> prefix <hole> suffix <end>, DeepSeek's layout; text tokens, as there.
FIM_BEGIN, FIM_HOLE, FIM_END = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"
TEXT_MARKERS = TOOL_MARKERS + [THINK_BEGIN, THINK_END, FIM_BEGIN, FIM_HOLE, FIM_END]

# DeepSeek-style chat template: the tools described first, then system text, user/assistant turns
# marked by special tokens, an assistant's tool calls and the tools' outputs by the markers. With
# `thinking` (chat_template_kwargs), the answer is opened inside its reasoning, as DeepSeek-V3.1's is.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}## Tools\nYou have access to the following tools:\n{% for t in tools %}"
    "\n### {{ t['function']['name'] }}\nDescription: {{ t['function'].get('description', '') }}\n"
    "Parameters: {{ t['function'].get('parameters', {}) | tojson }}\n{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}" + CALLS_BEGIN + "{% for c in m['tool_calls'] %}" + CALL_BEGIN
    + "{{ c['function']['name'] }}" + CALL_SEP + "{{ c['function']['arguments'] }}" + CALL_END
    + "{% endfor %}" + CALLS_END + "{% endif %}" + EOS
    + "{% elif m['role'] == 'tool' %}" + OUTPUT_BEGIN + "{{ m['content'] }}" + OUTPUT_END + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% if thinking is defined and thinking %}" + THINK_BEGIN
    + "{% endif %}{% endif %}"
)

# A small corpus to learn merges from; no model hub or dataset is reachable where these are made.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving system turns requests into tokens and tokens
into answers. Hello, who are you? I am a language model served by a mixture of experts. Experts are
small feed-forward networks; a router picks a few of them for every token. The key value cache keeps
what attention has already seen, so each new token costs little. Prefill reads the whole prompt at
once; decode adds one token at a time. def main(): print("hello world") return 0
import torch; x = torch.zeros(4, 8); for i in range(10): total += i * 2
User: please write a function that sorts a list. Assistant: Here is a function that sorts a list.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { } " ' - + = * / %
""" * 4


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with DeepSeek's special tokens, trained offline in well under a second."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, USER, ASSISTANT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    learned = max(vocab_size, 256 + len(specials) + len(TEXT_MARKERS)) - len(TEXT_MARKERS)
    trainer = trainers.BpeTrainer(vocab_size=learned, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in TEXT_MARKERS])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE, model_max_length=1 << 30)


def text_token_ids(tokenizer) -> list[int]:
    """Ids that decode, each on its own, to non-empty valid text: no special tokens, and no
    byte-level token holding part of a UTF-8 sequence (decoded alone it gives U+FFFD, which
    streaming holds back). `tokenizer`: a transformers tokenizer."""
    special = set(tokenizer.all_special_ids)
    ids = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if i not in special and text and "\ufffd" not in text:
            ids.append(i)
    return ids


class Tokenizer:
    """What the engine needs of a tokenizer: encode, decode, chat template, EOS."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise FileNotFoundError(f"no tokenizer in {path} (tokenizer.json / tokenizer_config.json)")
        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id = self.hf.eos_token_id
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary token
        vocab = self.hf.get_vocab()
        fim = [vocab.get(m) for m in (FIM_BEGIN, FIM_HOLE, FIM_END)]
        # None: the checkpoint's tokenizer has no fill-in-the-middle tokens (the model was not trained for it)
        self.fim_ids: tuple[int, int, int] | None = None if None in fim else tuple(fim)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def fill_in_middle(self, prefix: str, suffix: str) -> list[int]:
        """The prompt that asks for what goes between `prefix` and `suffix`."""
        if self.fim_ids is None:
            raise ValueError("this model's tokenizer has no fill-in-the-middle tokens "
                             f"({FIM_BEGIN}, {FIM_HOLE}, {FIM_END})")
        begin, hole, end = self.fim_ids
        bos = [] if self.hf.bos_token_id is None else [self.hf.bos_token_id]
        return bos + [begin] + self.encode(prefix) + [hole] + self.encode(suffix) + [end]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (a lone byte of a multi-byte character
        shows as U+FFFD)."""
        text = self._token_texts.get(token)
        if text is None:  # a decode call costs microseconds; a step with logprobs names up to 21 tokens a row
            text = self._token_texts[token] = self.hf.decode([token], skip_special_tokens=False)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """template_kwargs: more variables for the template (a request's chat_template_kwargs,
        e.g. DeepSeek-V3.1's `thinking`)."""
        if not self.hf.chat_template:
            raise ValueError("this checkpoint has no chat template")
        text = self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        return self.encode(text)


class IncrementalDetokenizer:
    """Text of a growing list of output ids, for streaming deltas, decoding only the newest
    tokens each step (with the previous token as context, so a tokenizer that drops a
    leading space at the start of a decode still spaces words right).

    Leaves out a trailing incomplete UTF-8 sequence (decoded as U+FFFD) until it completes,
    unless the output is final.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix = 0  # first id of the context window
        self.read = 0    # ids before this one are in self.text

    def text_for(self, output_ids: list[int], final: bool = False) -> str:
        decode = self.tokenizer.decode
        seen = decode(output_ids[self.prefix:self.read])
        window = decode(output_ids[self.prefix:])
        if len(window) > len(seen) and (final or not window.endswith("\ufffd")):
            self.text += window[len(seen):]
            self.prefix, self.read = max(self.read - 1, 0), len(output_ids)
        return self.text
