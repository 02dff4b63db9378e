"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression,
a choice of strings or an EBNF grammar) compiled against the vocabulary, and a matcher per
sequence that says which tokens may come next. The grammars are xgrammar's, as vLLM's and
SGLang's are: it walks the vocabulary once per grammar at compile time, so a step's mask costs
microseconds of host time per row."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict

import torch

# The forms a request may ask for, and what its `value` is: a JSON schema (an object, or its
# JSON text), nothing, a regex, a list of strings, EBNF text, an xgrammar structural tag (an
# object, or its JSON text: free text with tagged parts held to their formats, as tool calls are).
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_WHITESPACE = 32  # characters in a run of whitespace inside JSON
# Objects and arrays inside one another in a schema's JSON. The compile time grows with the cube
# of the depth: a schema of 200 nested objects (400 levels) took 0.8 s on one core, 800 objects
# 49 s, all within MAX_SPEC_CHARS. Tool schemas nest a few levels (OpenAI's strict mode allows 5
# objects deep).
MAX_NESTING = 128


class StructuredOutputError(ValueError):
    """A grammar that cannot be compiled, named in the message."""


def validate_spec(spec) -> dict:
    """The canonical form of a request's structured_output: {"kind", "value", "reasoning_end"}.
    reasoning_end: the marker (one token) after which the grammar applies; before it the answer
    is a reasoning model's free thinking. Raises ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"must be an object with a kind, got {type(spec).__name__}")
    unknown = set(spec) - {"kind", "value", "reasoning_end"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    kind, value = spec.get("kind"), spec.get("value")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if kind in ("json", "structural_tag"):
        what = "JSON schema" if kind == "json" else "structural tag"
        if isinstance(value, dict) and _object_depth(value) > MAX_NESTING:
            raise ValueError(f"the {what} nests deeper than {MAX_NESTING} levels")
        if isinstance(value, (dict, bool)):
            try:
                value = json.dumps(value)
            except (RecursionError, ValueError, TypeError) as e:
                raise ValueError(f"the {what} cannot be written as JSON: {type(e).__name__}") from None
        if not isinstance(value, str):
            raise ValueError(f"a {kind} kind's value must be a {what} (an object or its JSON text)")
        if _text_depth(value) > MAX_NESTING:
            raise ValueError(f"the {what} nests deeper than {MAX_NESTING} levels")
    elif kind == "json_object":
        value = None
    elif kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"a choice kind's value must be a list of 1..{MAX_CHOICES} non-empty strings")
    elif not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} kind's value must be a non-empty string")
    if value is not None and (len(value) if isinstance(value, str) else sum(map(len, value))) > MAX_SPEC_CHARS:
        raise ValueError(f"the {kind} is longer than {MAX_SPEC_CHARS} characters")
    end = spec.get("reasoning_end")
    if end is not None and (not isinstance(end, str) or not end):
        raise ValueError("reasoning_end must be a non-empty string")
    return {"kind": kind, "value": value, "reasoning_end": end}


def _object_depth(value) -> int:
    """How deep dicts and lists nest in `value` (past MAX_NESTING + 1 not counted), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:  # past the limit the answer is known
                stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _text_depth(text: str) -> int:
    """How deep objects and arrays nest in JSON text (brackets inside strings not counted)."""
    deepest = depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices`."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _clean(e: Exception) -> str:
    # xgrammar's messages start with a time and a source location: "[07:40:01] x.cc:5082: ..."
    text = str(e).strip()
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    return text.splitlines()[0] if text else type(e).__name__


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer and vocabulary, keeping the most recent
    (agents send the same schema on every turn)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128,
                 vocabulary: list[str] | None = None):
        """vocabulary: each token's text, in place of a tokenizer (bench/structured.py's synthetic
        vocabularies); reasoning_end is then not available."""
        import xgrammar as xgr

        self._xgr = xgr
        if vocabulary is not None:
            info = xgr.TokenizerInfo(vocabulary, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        else:
            info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._cache_size = cache_size
        self.compiles, self.compile_s = 0, 0.0  # grammars compiled (not found in the cache), and their time
        self._tokenizer = hf_tokenizer
        self.vocab_size = vocab_size

    def compile(self, kind: str, value) -> object:
        """Thread-safe: requests' grammars are compiled outside the engine's lock."""
        key = (kind, value if not isinstance(value, list) else tuple(value))
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        c = self._compiler
        start = time.perf_counter()
        try:
            if kind in ("json", "json_object"):
                compiled = c.compile_grammar(self._json_grammar(value if kind == "json" else '{"type": "object"}'))
            elif kind == "regex":
                compiled = c.compile_regex(value)
            elif kind == "choice":
                compiled = c.compile_regex(choice_regex(value))
            elif kind == "structural_tag":
                compiled = c.compile_grammar(self._patched(self._xgr.Grammar.from_structural_tag(value)))
            else:
                compiled = c.compile_grammar(value)
        except Exception as e:  # the compiler's own errors are RuntimeErrors naming the problem
            raise StructuredOutputError(f"the {kind} cannot be compiled: {_clean(e)}") from None
        with self._cache_lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - start
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    # xgrammar 0.2.9 lets a string with a length bound hold raw control characters, which JSON
    # forbids (json.loads refuses them); its unbounded strings exclude them, as here. A structural
    # tag's JSON parts have the same rule.
    _LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
    _STRING_CHAR = r'[^\0-\x1f\"\\]'

    def _patched(self, grammar):
        text = str(grammar)
        if self._LOOSE_STRING_CHAR in text:
            grammar = self._xgr.Grammar.from_ebnf(text.replace(self._LOOSE_STRING_CHAR, self._STRING_CHAR))
        return grammar

    def _json_grammar(self, schema: str):
        # OpenAI's json_object is an object with any members. Whitespace between tokens is free,
        # as in vLLM, but a run of it is bounded: a model looping on blanks still has to write the
        # next value.
        return self._patched(self._xgr.Grammar.from_json_schema(schema, strict_mode=True,
                                                                 max_whitespace_cnt=MAX_WHITESPACE))

    def constraint(self, spec: dict) -> "Constraint":
        """A fresh matcher of a request's (validated) structured_output."""
        end_token = None
        if spec.get("reasoning_end"):
            ids = self._tokenizer.encode(spec["reasoning_end"], add_special_tokens=False)
            if len(ids) != 1:
                raise StructuredOutputError(f"the reasoning end marker {spec['reasoning_end']!r} is not one token")
            end_token = ids[0]
        constraint = Constraint(self._xgr.GrammarMatcher(self.compile(spec["kind"], spec["value"])), end_token)
        probe = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        constraint.fill(probe, 0)
        if not probe.any():  # e.g. a left-recursive rule: no answer could be sampled
            raise StructuredOutputError(f"the {spec['kind']} allows no first token")
        return constraint


# Threads that fill a step's masks together, while the GPU computes the step's forward. 64 rows
# of a tool's schema at 129K tokens took 26.1 ms on one thread, 4.7 ms over 8 and 3.6 over 16
# (bench/structured.py on an H100's host, RESULTS "Fortieth session"); a GPU of a serving node
# shares its host's cores with seven others.
FILL_THREADS = max(1, min(8, (os.cpu_count() or 1)))
_batch_matchers: dict[int, object] = {}  # by thread count


# Below this many rows the fills run on the calling thread. On 2 cores (bench/structured.py,
# RESULTS): 8 rows of a 2K vocabulary took 0.4 ms either way; at 129K, 16 rows 0.82 ms over
# threads against 1.0 one after another, 64 rows 3.2 against 4.4.
FILL_THREADS_FROM_ROWS = 8


def fill_masks(constraints: list["Constraint"], mask: torch.Tensor, threads: int | None = None) -> None:
    """Row j of `mask` [len(constraints), words] int32: the tokens constraints[j] allows next.
    threads: how many fill them together (FILL_THREADS unless given)."""
    threads = threads or FILL_THREADS
    if len(constraints) < FILL_THREADS_FROM_ROWS or threads == 1:
        for j, c in enumerate(constraints):
            c.fill(mask, j)
        return
    matcher = _batch_matchers.get(threads)
    if matcher is None:
        import xgrammar as xgr
        matcher = _batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    matcher.batch_fill_next_token_bitmask([c.matcher for c in constraints], mask)


class Constraint:
    """One sequence's place in its grammar. Before `end_token` (a reasoning model's end of thinking)
    appears in the output, nothing is constrained."""

    def __init__(self, matcher, end_token: int | None = None):
        self.matcher = matcher
        self.end_token = end_token
        self.active = end_token is None

    def fill(self, mask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it."""
        if not self.active:
            self.active = token == self.end_token
            return True
        return self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.active and self.matcher.is_terminated()
