"""The OpenAI endpoints' logic over a backend, shared by the HTTP routes (app/http.py) and the
Python handle API of the Serve ingress. Ray-free and transport-free.

Backend contract::

    model_name: str; max_model_len: int
    async def generate(request: dict, session_id: str | None) -> AsyncIterator[dict]
    async def tokenize(request: dict) -> dict; async def detokenize(token_ids) -> str
    async def health() -> dict

`request` holds request_id, prompt, prompt_token_ids, messages and sampling (SamplingParams
fields); each yielded dict holds text_delta, new_token_ids, finished, finish_reason,
num_prompt_tokens, num_cached_tokens and error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Literal, Protocol

import anyio
from pydantic import BaseModel

from engine.errors import GrammarError, Overloaded, RequestError
from engine.sampling import SamplingError
from engine.tokenizer import THINK_END

from . import openai_api as oa
from . import openai_responses as responses
from .openai_api import APIError, bad_request
from .reasoning import ReasoningStream, reasoning_tokens, split_reasoning, starts_in_reasoning
from .call_grammars import ForcedCallStream, forced_calls
from .tool_calls import ToolCallStream, openai_tool_call, split_tool_calls

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]


class Backend(Protocol):
    model_name: str
    max_model_len: int

    def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]: ...

    async def tokenize(self, request: dict) -> dict: ...  # LLMEngine.tokenize's

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def health(self) -> dict: ...


def is_context_length_error(exc: BaseException) -> bool:
    return getattr(exc, "code", None) == "context_length_exceeded"


def api_error_from(exc: BaseException, prompt_param: str | None = None, grammar_param: str | None = None
                   ) -> APIError:
    """What a backend's exception means to the client; prompt_param and grammar_param: the fields
    a prompt too long and a grammar that does not compile are blamed on."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), type="server_error", code="overloaded",
                        headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
    if is_context_length_error(exc):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, GrammarError):
        return bad_request(str(exc), param=grammar_param)
    if isinstance(exc, (SamplingError, RequestError)):
        return bad_request(str(exc))
    log.exception("backend failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")


def _usage(choices: list["_Choice"], reasons: bool = False) -> dict:
    """The prompt counted once (choice 0's cached tokens), the completions added up; `reasons`:
    with the tokens spent thinking."""
    first = choices[0].last
    return responses.usage(first.get("num_prompt_tokens", 0), sum(c.num_tokens for c in choices),
                    first.get("num_cached_tokens", 0),
                    sum(reasoning_tokens(c.pieces, c.piece_tokens) for c in choices) if reasons else None)


def _wants_logprobs(engine_request: dict) -> bool:
    return engine_request.get("sampling", {}).get("logprobs") is not None


class OpenAIService:
    def __init__(self, backend: Backend, max_tokens_limit: int | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str = "deepseek_v31"):
        """reasoning_parser: how chat answers' reasoning is told from their content (app/reasoning.py);
        tool_call_parser: the form strict tools' calls are held to (app/call_grammars.py)."""
        self.backend = backend
        self.max_tokens_limit = max_tokens_limit
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser

    # requests ---------------------------------------------------------------------------
    def parse(self, kind: Kind, body: Any) -> tuple[Any, dict]:
        """An OpenAI request body (dict or one of our request models) -> (request model,
        engine request). Every problem is an APIError (4xx)."""
        if isinstance(body, BaseModel):
            body = body.model_dump(exclude_unset=True, by_alias=True)  # "schema", "json": fields under aliases
        b = self.backend
        tools = template_kwargs = None
        if kind == "chat":
            req = oa.parse_request(oa.ChatCompletionRequest, body)
            messages, text, token_ids = oa.chat_messages(req), None, None
            tools, template_kwargs = oa.chat_tools(req), oa.chat_template_kwargs(req)
            # chat has no default cap in OpenAI's API; the engine ends the answer at the context
            default_max = min(self.max_tokens_limit or b.max_model_len, b.max_model_len - 1)
        else:
            req = oa.parse_request(oa.CompletionRequest, body)
            messages, (text, token_ids) = None, oa.completion_prompt(req)
            default_max = min(oa.COMPLETIONS_DEFAULT_MAX_TOKENS, b.max_model_len - 1)
        self._check_model(req.model)
        params = oa.sampling_params(req, default_max_tokens=default_max, max_model_len=b.max_model_len,
                                    max_tokens_limit=self.max_tokens_limit, tool_call_parser=self.tool_call_parser)
        if params.structured_output is not None and kind == "chat" and starts_in_reasoning(
                self.reasoning_parser, template_kwargs):
            params.structured_output["reasoning_end"] = THINK_END  # the grammar holds for the answer, not the thinking
        forced = req.forced_tool_choice() if kind == "chat" else None
        # the field a grammar that does not compile is blamed on
        grammar_field = oa.structured_output(req, self.tool_call_parser)[1] if params.structured_output else None
        return req, {"request_id": responses.new_request_id(kind), "prompt": text, "prompt_token_ids": token_ids,
                     "messages": messages, "tools": tools, "chat_template_kwargs": template_kwargs,
                     "sampling": oa.sampling_dict(params), "n": req.n,
                     **({"prompt_only": True} if oa.scores_prompt_only(req) else {}),
                     **({"forced_tool_choice": forced} if forced is not None else {}),
                     **({"structured_field": grammar_field} if grammar_field else {})}

    async def tokenize(self, body: Any) -> dict:
        """vLLM's /tokenize: the token ids the engine would run for a prompt or a conversation."""
        if isinstance(body, BaseModel):
            body = body.model_dump(exclude_unset=True, by_alias=True)
        req = oa.parse_request(oa.TokenizeRequest, body)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        request = {"prompt": req.prompt, "return_token_strs": req.return_token_strs}
        if req.messages is not None:
            request.update(messages=oa.chat_messages(req), tools=oa.chat_tools(req),
                           chat_template_kwargs=oa.chat_template_kwargs(req))
        field = "messages" if req.messages is not None else "prompt"
        try:
            out = await self.backend.tokenize(request)
        except RequestError as e:
            raise bad_request(str(e), param=field) from None
        except Exception as e:
            raise api_error_from(e, field) from None
        return {"count": len(out["tokens"]), "max_model_len": self.backend.max_model_len, **out}

    async def detokenize(self, body: Any) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        if isinstance(body, BaseModel):
            body = body.model_dump(exclude_unset=True)
        req = oa.parse_request(oa.DetokenizeRequest, body)
        self._check_model(req.model)
        try:
            return {"prompt": await self.backend.detokenize(req.tokens)}
        except RequestError as e:
            raise bad_request(str(e), param="tokens") from None
        except Exception as e:
            raise api_error_from(e) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.backend.model_name!r}",
                           param="model", code="model_not_found")

    # running ----------------------------------------------------------------------------
    async def open(self, kind: Kind, engine_request: dict, session_id: str | None
                   ) -> tuple[AsyncIterator[dict], list[dict]]:
        """Starts the request's choices and waits for the first output of each, so a rejected
        request is an APIError before any response byte goes out. Returns the stream of the
        outputs after those, and those first outputs; each output's "index" is its choice's
        (absent: 0). n choices are n backend requests, in one session, so that they share the
        prompt's cached KV."""
        n = engine_request.get("n", 1)
        if n == 1:
            stream = self.backend.generate(engine_request, session_id)
            return stream, [await self._first(kind, engine_request, stream)]
        rid, sampling = engine_request["request_id"], engine_request["sampling"]
        requests = [dict(engine_request, request_id=f"{rid}-{i}", n=1,
                         sampling=dict(sampling, seed=oa.choice_seed(sampling.get("seed"), i))) for i in range(n)]
        streams = [self.backend.generate(r, session_id) for r in requests]
        firsts = await asyncio.gather(*[self._first(kind, r, st) for r, st in zip(requests, streams)],
                                      return_exceptions=True)
        failed = [f for f in firsts if isinstance(f, BaseException)]
        if failed:
            with anyio.CancelScope(shield=True):
                for st in streams:
                    await st.aclose()
            raise failed[0]
        return _merge(streams), [dict(f, index=i) for i, f in enumerate(firsts)]

    def _reasons(self, engine_request: dict) -> bool:
        return starts_in_reasoning(self.reasoning_parser, engine_request.get("chat_template_kwargs"))

    async def _first(self, kind: Kind, engine_request: dict, stream: AsyncIterator[dict]) -> dict:
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the backend produced no output", type="server_error") from None
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            if isinstance(e, Exception):
                raise api_error_from(e, "messages" if kind == "chat" else "prompt",
                                     engine_request.get("structured_field")) from None
            raise
        if first.get("error"):  # failed before any output: a server fault, answered as such
            await stream.aclose()
            log.error("request %s failed: %s", engine_request["request_id"], first["error"])
            raise APIError(500, f"generation failed: {first['error']}", type="server_error")
        return first

    async def collect(self, kind: Kind, req, engine_request: dict, stream: AsyncIterator[dict],
                      firsts: list[dict]) -> dict:
        """The whole (non-streaming) response object."""
        choices = [_Choice(_wants_logprobs(engine_request), engine_request.get("prompt_only", False)) for _ in firsts]
        rid = engine_request["request_id"]
        try:
            async with aclosing(_outputs(firsts, stream, len(choices))) as outputs:
                async for out in outputs:
                    choices[out.get("index", 0)].add(out)
                    if out.get("error"):
                        log.error("request %s failed: %s", rid, out["error"])
                        raise APIError(500, f"generation failed: {out['error']}", type="server_error")
        except APIError:
            raise
        except Exception as e:
            raise api_error_from(e) from None
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        k = req.prompt_logprobs  # vLLM's prompt_logprobs, beside echo's own view of the same records
        if kind == "chat":
            reasons = self._reasons(engine_request)
            built = [_chat_choice(i, c, bool(engine_request.get("tools")), reasons,
                                  engine_request.get("forced_tool_choice")) for i, c in enumerate(choices)]
        else:
            built = [_text_choice(i, c, getattr(req, "logprobs", None)) for i, c in enumerate(choices)]
            if k is not None:
                for choice, c in zip(built, choices):
                    choice["prompt_logprobs"] = responses.vllm_prompt_logprobs(c.prompt_logprobs or [], k)
        response = responses.completion_response(kind, rid, self.backend.model_name, int(time.time()), built,
                                                 _usage(choices, kind == "chat" and self._reasons(engine_request)))
        if k is not None and kind == "chat":  # vLLM's place for chat: the response's, the prompt being shared
            response["prompt_logprobs"] = responses.vllm_prompt_logprobs(choices[0].prompt_logprobs or [], k)
        return response

    async def chunks(self, kind: Kind, req, engine_request: dict, stream: AsyncIterator[dict],
                     firsts: list[dict]) -> AsyncIterator[dict]:
        """The stream-chunk objects of a streaming response. A failure mid-stream ends it with
        an error object ({"error": ...}); the backend streams are closed however it ends."""
        chunks = responses.StreamChunks(kind, engine_request["request_id"], self.backend.model_name, req.include_usage)
        choices = [_Choice(False, engine_request.get("prompt_only", False)) for _ in firsts]
        forced = engine_request.get("forced_tool_choice")
        for c in choices:
            if forced is not None:
                c.forced = ForcedCallStream(forced)
            elif engine_request.get("tools"):
                c.tool_calls = ToolCallStream()
            if kind == "chat" and self._reasons(engine_request):
                c.reasoning = ReasoningStream()
        try:
            async with aclosing(_outputs(firsts, stream, len(choices))) as outputs:
                async for out in outputs:
                    i = out.get("index", 0)
                    c = choices[i]
                    if out.get("error"):
                        log.error("request %s failed mid-stream: %s", chunks.request_id, out["error"])
                        yield oa.error_body(f"generation failed: {out['error']}", "server_error")
                        return
                    if not c.opened:
                        c.opened = True
                        role = chunks.role(i)
                        if role is not None:
                            yield role
                    if out.get("prompt_text") is not None:  # echo: the prompt goes out first
                        c.lead = len(out["prompt_text"])
                        records = out.get("prompt_logprobs")
                        at = responses.prompt_offsets(records, out["prompt_text"]) if records else 0
                        yield chunks.delta(out["prompt_text"], records, index=i, text_offset=at)
                    offset = c.lead + c.text_len
                    c.add(out)
                    if c.prompt_only:  # echo with max_tokens 0: the completion's token is left out
                        if out.get("finished"):
                            yield chunks.finish("length", index=i)
                        continue
                    text, calls, reasoning = out.get("text_delta", ""), [], None
                    if c.reasoning is not None:
                        reasoning, text = c.reasoning.feed(text)
                        if out.get("finished"):
                            rest_reasoning, rest = c.reasoning.finish()
                            reasoning, text = reasoning + rest_reasoning, text + rest
                    if c.tool_calls is not None:
                        text, calls = c.tool_calls.feed(text)
                        if out.get("finished"):
                            rest, more = c.tool_calls.finish()
                            text, calls = text + rest, calls + more
                    if c.forced is not None:  # the answer is the calls' JSON
                        calls = c.forced.feed(text)
                        text = ""
                        if out.get("finished"):
                            calls += c.forced.finish()
                            if not c.forced.num_calls:  # "required" cut short: what was written, as content
                                text = c.forced.text
                    if text or reasoning or out.get("logprobs"):
                        yield chunks.delta(text, out.get("logprobs"), offset, index=i, reasoning=reasoning)
                    if calls:
                        yield chunks.tool_calls(calls, index=i)
                    if out.get("finished"):
                        reason = out.get("finish_reason")
                        if reason == "stop" and (c.tool_calls or c.forced) is not None and (
                                c.tool_calls or c.forced).num_calls:
                            reason = "tool_calls"
                        yield chunks.finish(reason, index=i)
            if chunks.include_usage:
                yield chunks.usage(_usage(choices, kind == "chat" and self._reasons(engine_request)))
        except Exception as e:
            err = api_error_from(e)
            yield oa.error_body(err.message, err.type, None, err.code)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled response must still abort upstream
                await stream.aclose()


class _Choice:
    """One choice's outputs, added up."""

    def __init__(self, logprobs: bool, prompt_only: bool = False):
        self.prompt_only = prompt_only  # echo with max_tokens 0: the prompt alone is answered
        self.pieces: list[str] = []
        self.piece_tokens: list[int] = []  # how many tokens made each piece
        self.text_len = self.num_tokens = 0
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.offsets: list[int] = []  # where each logprobs record's token starts in the text
        self.last: dict = {}
        self.opened = False  # streaming: its role chunk went out
        self.tool_calls: ToolCallStream | None = None  # streaming with tools: the calls found so far
        self.forced: ForcedCallStream | None = None  # streaming a forced tool call
        self.reasoning: ReasoningStream | None = None  # streaming a reasoning answer: where it is
        self.prompt_text: str | None = None  # echo: the prompt's text and logprob records
        self.prompt_logprobs: list[dict] | None = None
        self.lead = 0  # streaming with echo: the length of the prompt's text sent first

    def add(self, out: dict) -> None:
        if out.get("prompt_text") is not None:
            self.prompt_text = out["prompt_text"]
        if out.get("prompt_logprobs") is not None:
            self.prompt_logprobs = out["prompt_logprobs"]
        self.last = out
        if self.prompt_only:
            return
        if self.logprobs is not None and out.get("logprobs"):
            self.logprobs += out["logprobs"]
            self.offsets += [self.text_len] * len(out["logprobs"])
        self.pieces.append(out.get("text_delta", ""))
        self.piece_tokens.append(len(out.get("new_token_ids", ())))
        self.text_len += len(self.pieces[-1])
        self.num_tokens += self.piece_tokens[-1]



def _text_choice(index: int, c: _Choice, k: int | None = None) -> dict:
    """k: the request's logprobs, how many alternatives an echoed prompt's records show (the engine
    may have computed more, for prompt_logprobs)."""
    text, logprobs, offsets = "".join(c.pieces), c.logprobs, c.offsets
    prompt_records = c.prompt_logprobs
    if prompt_records is not None and k is not None:
        prompt_records = [dict(r, top=r["top"][:k]) for r in prompt_records]
    if c.prompt_only:
        scored = logprobs is not None
        return responses.text_choice(index, c.prompt_text or "", "length", prompt_records if scored else None,
                                     responses.prompt_offsets(prompt_records, c.prompt_text) if scored else None)
    if c.prompt_text is not None:  # echo
        lead = c.prompt_text
        if logprobs is not None and prompt_records is not None:
            logprobs = prompt_records + logprobs
            offsets = responses.prompt_offsets(prompt_records, lead) + [len(lead) + o for o in offsets]
        text = lead + text
    return responses.text_choice(index, text, c.last.get("finish_reason"), logprobs, offsets)


def _chat_choice(index: int, c: _Choice, tools: bool, reasons: bool, forced: str | None = None) -> dict:
    """forced: the request's forced tool choice ("required" or a function's name), whose answer
    is the calls' JSON."""
    text, reason, calls, reasoning = "".join(c.pieces), c.last.get("finish_reason"), [], None
    if reasons:
        reasoning, text = split_reasoning(text)
    if forced is not None:
        calls = forced_calls(text, forced)
        text = "" if calls else text
    elif tools:
        text, calls = split_tool_calls(text)
    if calls and reason == "stop":
        reason = "tool_calls"
    return responses.chat_choice(index, text, reason, c.logprobs, [openai_tool_call(call) for call in calls], reasoning)


async def _outputs(firsts: list[dict], stream: AsyncIterator[dict], n: int) -> AsyncIterator[dict]:
    """The first outputs, then the stream's, up to the n-th choice's last (or an error): the
    stream is not read past it. Closing this leaves the stream to its owner."""
    finished, pending = 0, iter(firsts)
    while True:
        out = next(pending, None)
        if out is None:
            out = await anext(stream, None)
            if out is None:
                return
        yield out
        if out.get("error"):
            return
        if out.get("finished"):
            finished += 1
            if finished == n:
                return


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The outputs of several choices' streams as they come, each tagged with its index.
    Closing it closes every stream (aborting what is still running)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for out in stream:
                queue.put_nowait(dict(out, index=i))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        with anyio.CancelScope(shield=True):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for st in streams:
                await st.aclose()
