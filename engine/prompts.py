"""A request's inputs read before it reaches the scheduler: its prompt (text, token ids or chat
messages) as token ids, and its structured output as a grammar matcher. Reads only the tokenizer
and the compiled grammars, so any thread may call it without the engine's lock (engine/async_engine.py
compiles a new schema there, outside the step every running request waits for)."""
from __future__ import annotations

import threading

from .errors import GrammarError, RequestError
from .sampling import SamplingParams
from .structured import Constraint, GrammarCompiler, StructuredOutputError
from .tokenizer import Tokenizer


class PromptReader:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.grammars: GrammarCompiler | None = None  # made when a request first asks for structured output
        self._grammars_error: str | None = None  # why it could not be made
        self._grammars_lock = threading.Lock()

    def prompt_ids(self, prompt, messages, tools=None, chat_template_kwargs=None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if messages is not None:
            if self.tokenizer is None:
                raise RequestError("chat messages need a tokenizer")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and (
                        isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
                    for m in messages):
                raise RequestError("messages must be a non-empty list of {role, content} objects "
                                   "(content null only beside tool_calls)")
            try:
                ids = self.tokenizer.apply_chat_template(messages, tools=tools, template_kwargs=chat_template_kwargs)
            except Exception as e:  # a checkpoint's own template may refuse a conversation's shape
                raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):  # fill in the middle: {"prefix", "suffix"}, both text
            if self.tokenizer is None:
                raise RequestError("a fill-in-the-middle prompt needs a tokenizer")
            if set(prompt) != {"prefix", "suffix"} or not all(isinstance(v, str) for v in prompt.values()):
                raise RequestError("a fill-in-the-middle prompt is {prefix, suffix}, both text")
            try:
                ids = self.tokenizer.fill_in_middle(prompt["prefix"], prompt["suffix"])
            except ValueError as e:
                raise RequestError(str(e)) from None
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt token ids must be integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        else:
            raise RequestError(f"prompt must be a string, a list of token ids or {{prefix, suffix}}, "
                               f"got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        return ids

    def tokenize(self, request: dict) -> dict:
        """{"tokens", "token_strs"}: the token ids a request of this prompt (a string) or these messages
        (with tools and chat_template_kwargs) would run, and with request["return_token_strs"] each
        one's text. Reads only the tokenizer: any thread, no lock."""
        ids = self.prompt_ids(request.get("prompt"), request.get("messages"), request.get("tools"),
                               request.get("chat_template_kwargs"))
        return {"tokens": ids, "token_strs": [self.token_text(t) for t in ids] if request.get("return_token_strs")
                else None}

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of these token ids, special tokens included. Any thread, no lock."""
        if self.tokenizer is None:
            raise RequestError("detokenizing needs a tokenizer")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self.tokenizer.hf.decode(token_ids, skip_special_tokens=False)

    def token_text(self, token: int) -> str:
        # special tokens by name too (an end-of-sequence token shows as such, not as "")
        return self.tokenizer.token_text(token) if self.tokenizer is not None else f"token_id:{token}"

    def compile_grammar(self, params: SamplingParams | None) -> None:
        """Compile a request's grammar ahead of add_request, which then finds it compiled: a
        schema new to this engine takes tens of milliseconds (bench/structured.py), which a caller
        on another thread (engine/async_engine.py) spends outside the engine's lock, not in a
        step every running request waits for. Thread-safe."""
        if params is None or params.structured_output is None:
            return
        spec = params.structured_output
        try:
            self.grammar_compiler().compile(spec["kind"], spec["value"])
        except StructuredOutputError as e:
            raise GrammarError(str(e)) from None

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is not None:  # made here, or given (bench/structured.py's synthetic vocabulary)
            return self.grammars
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer")
        with self._grammars_lock:  # the vocabulary's walk takes most of a second at 129K tokens: once
            if self.grammars is None:
                if self._grammars_error is None:
                    try:
                        self.grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, [self.eos_token_id])
                    except Exception as e:  # a tokenizer the grammar library cannot read: once, not per request
                        self._grammars_error = ("structured output is not available with this model's tokenizer: "
                                                f"{type(e).__name__}: {e}")
            if self.grammars is None:
                raise GrammarError(self._grammars_error)
        return self.grammars

    def constraint(self, spec: dict, prior: list[int]) -> Constraint:
        """A request's grammar matcher, past the outputs of an earlier attempt (prior)."""
        grammars = self.grammar_compiler()
        try:
            constraint = grammars.constraint(spec)
        except StructuredOutputError as e:
            raise GrammarError(str(e)) from None
        if not all(constraint.accept(t) for t in prior):
            raise RequestError("prior_output_ids do not follow the request's structured output")
        return constraint
