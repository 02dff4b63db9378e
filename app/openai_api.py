"""OpenAI wire format, the request's side: request models, their conversion to engine sampling
parameters, and the error objects. The answer's side is app/openai_responses.py. No I/O here;
app/http.py does the serving."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling import SamplingError, SamplingParams
from engine.structured import MAX_WHITESPACE, validate_spec

from .call_grammars import calls_tag, forced_call_schema

# torch generators take seeds in the signed-to-unsigned 64-bit range; outside it they overflow.
SEED_MIN, SEED_MAX_EXCLUSIVE = -(2**63), 2**64
# OpenAI's own default for legacy completions when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Choices per request (n): each is an engine request of its own.
MAX_CHOICES = 64


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON with this status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        # keyword-only fields: the default reduce would lose them when the error crosses processes
        return (_rebuild_api_error, (self.status, self.message, self.type, self.param, self.code, self.headers))

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def _rebuild_api_error(status, message, type, param, code, headers) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# requests ---------------------------------------------------------------------------------

class _Request(BaseModel):
    # strict: "5" is not a number and 1.0 is not an integer, as in OpenAI's API; extra keys
    # (metadata, store, parallel_tool_calls, ...) are ignored as OpenAI ignores unknown ones.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    # assistant turns that only carried tool calls have null content
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool's answer: to which call


class ToolFunction(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # the calls' arguments held to `parameters` (app/call_grammars.py)


class Tool(_Request):
    type: str
    function: ToolFunction


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    name: str
    # "schema" is a BaseModel attribute's name: the field takes it as its alias
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of these."""
    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class _SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, lt=SEED_MAX_EXCLUSIVE)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    session_id: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # JSON object keys are strings: {"1234": -100}
    logit_bias: dict[str, float] | None = None
    # OpenAI's structured output (chat's, and completions' as in vLLM), and vLLM's own form
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: each prompt token's log-probability and this many alternatives (whole responses only)
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        """A 400 for a known field asking for what this server does not do: answering as if it
        were absent would give the client something other than it asked for, silently."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's extension: more variables for the chat template (DeepSeek-V3.1's `thinking`)
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise bad_request(f"tools[{i}].type {tool.type!r} is not supported; only \"function\"",
                                  param="tools")
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            names = [t.function.name for t in self.tools or ()]
            if not names:
                raise bad_request("tool_choice forces a tool call, but no tools were given", param="tool_choice")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise bad_request(f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                                  f"not among the tools ({', '.join(map(repr, names))})", param="tool_choice")

    def forced_tool_choice(self) -> str | None:
        """"required", or the name of the function every answer must call; None: the model chooses."""
        if self.tool_choice is None or self.tool_choice in ("none", "auto"):
            return None
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.function.name

    def engine_logprobs(self) -> int | None:
        """How many alternatives the engine reports per token (None: no logprobs)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{SamplingParams.MAX_LOGPROBS}, got {k}",
                              param="top_logprobs")
        return k


class CompletionRequest(_SamplingFields):
    # a string, token ids, or OpenAI's batch forms holding exactly one of those
    prompt: str | list[int] | list[str] | list[list[int]]
    # legacy form: the number of alternatives per token (0: the sampled token's logprob only)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise bad_request(f"only best_of=1 is supported, got {self.best_of}", param="best_of")
        if self.suffix and self.echo:  # the prompt echoed would be the prefix, apart from the suffix
            raise bad_request("echo cannot be combined with suffix", param="suffix")

    def engine_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in 0..{SamplingParams.MAX_LOGPROBS}, got {self.logprobs}",
                              param="logprobs")
        return self.logprobs


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text prompt, or chat messages (with tools and template variables)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# Chat roles the chat template renders; "developer" is OpenAI's newer name for "system".
_ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool"}


def parse_request(cls: type[_Request], body: Any) -> Any:
    """Validate a decoded JSON body, turning pydantic's errors into one 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        field = errors[0]["loc"][0] if errors[0]["loc"] else None
        # among a union's failed branches the deepest one is the most specific complaint
        same_field = [err for err in errors if err["loc"] and err["loc"][0] == field] or errors[:1]
        worst = max(same_field, key=lambda err: len(err["loc"]))
        path = _json_path(worst["loc"])
        if worst["type"] == "missing":
            msg = f"missing required field {path!r}"
        else:
            msg = f"invalid {path or 'body'}: {worst['msg']}"
            if "input" in worst and worst["type"] != "model_type":
                msg += f" (got {_short(worst['input'])})"
        others = len({err["loc"][0] for err in errors if err["loc"]} - {field})
        if others:
            msg += f"; and problems in {others} more field{'s' if others > 1 else ''}"
        raise bad_request(msg, param=str(field) if field is not None else None) from None


def _json_path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content', dropping pydantic's union-branch labels."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_union_label(part):
            path += f".{part}" if path else str(part)
    return path


def _is_union_label(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or part.startswith(("list[", "dict[", "function-", "constrained-", "literal["))
                                      or part in {"TextPart", "ChatMessage", "StreamOptions", "Tool",
                                                  "ToolFunction", "MessageToolCall", "FunctionCall",
                                                  "NamedToolChoice", "NamedFunction", "ResponseFormat",
                                                  "JSONSchemaFormat", "StructuredOutputs", "TokenizeRequest",
                                                  "DetokenizeRequest"})


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """The engine's message form: known roles, content flattened to one string."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        role = _ROLE_ALIASES.get(m.role)
        if role is None:
            raise bad_request(f"messages[{i}].role {m.role!r} is not supported; use system, developer, user, "
                              "assistant or tool", param="messages")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, "
                                      f"got type {part.type!r}", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and role == "assistant":
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if role == "tool":
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def scores_prompt_only(req: _SamplingFields) -> bool:
    """A legacy completion with echo and max_tokens 0: the prompt (and its logprobs) alone."""
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return bool(getattr(req, "echo", False)) and limit == 0


def chat_template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any] | None:
    """The variables a request adds to the chat template, checked."""
    kwargs = req.chat_template_kwargs
    if not kwargs:
        return None
    for key in kwargs:
        if not key.isidentifier() or key in TEMPLATE_ARGUMENTS:
            raise bad_request(f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs")
    return dict(kwargs)


def chat_tools(req: ChatCompletionRequest | TokenizeRequest) -> list[dict] | None:
    """The tools the chat template describes to the model; none with tool_choice "none"."""
    if not req.tools or getattr(req, "tool_choice", None) == "none":
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]


def structured_output(req: _SamplingFields, tool_call_parser: str = "deepseek_v31") -> tuple[dict | None, str | None]:
    """The engine's structured_output (engine/structured.py) a request asks for through
    response_format, structured_outputs, a forced tool call or its tools, and the field that
    asked; a 400 when two ask that cannot both hold, or one is malformed.

    A forced call is the whole answer, so a response_format has nothing to hold then (it holds
    the answer the model gives once the tools have answered). Tools in auto mode keep a
    response_format from shutting calls out: the answer is that format or the calls. They hold
    the calls themselves when a tool is strict, in the form `tool_call_parser` names."""
    asked: list[tuple[str, dict]] = []
    rf = req.response_format
    schema = None  # a response_format's JSON schema
    if rf is not None and rf.type == "json_object":
        schema = {"type": "object"}
        asked.append(("response_format", {"kind": "json_object"}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema: {name, schema}",
                              param="response_format")
        schema = {} if rf.json_schema.schema_ is None else rf.json_schema.schema_
        asked.append(("response_format", {"kind": "json", "value": schema}))
    if req.structured_outputs is not None:
        given = {k: v for k, v in req.structured_outputs.model_dump(by_alias=True).items() if v is not None}
        if given.get("json_object") is False:
            raise bad_request("structured_outputs.json_object can only be true", param="structured_outputs")
        if len(given) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
                              param="structured_outputs")
        (key, value), = given.items()
        asked.append(("structured_outputs", {"kind": key, "value": value} if key != "json_object"
                      else {"kind": "json_object"}))
    chat = isinstance(req, ChatCompletionRequest)
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or ()] if chat else []
    forced = req.forced_tool_choice() if chat else None
    if forced is not None:
        asked = [a for a in asked if a[0] != "response_format"]
        asked.append(("tool_choice", {"kind": "json", "value": forced_call_schema(
            functions, forced, req.parallel_tool_calls)}))
    if len(asked) > 1:
        raise bad_request(f"{asked[0][0]} and {asked[1][0]} both constrain the answer; give one",
                          param=asked[1][0])
    strict = any(f.get("strict") for f in functions) and forced is None and req.tool_choice != "none"
    if strict and asked and asked[0][0] == "structured_outputs":
        raise bad_request("structured_outputs and strict tools both constrain the answer; give one",
                          param="structured_outputs")
    if chat and functions and forced is None and req.tool_choice != "none" and (
            strict or asked and asked[0][0] == "response_format"):
        answer = None if schema is None else {"type": "json_schema", "json_schema": schema,
                                              "max_whitespace_cnt": MAX_WHITESPACE}
        asked = [("tools" if strict else "response_format",
                  {"kind": "structural_tag", "value": calls_tag(functions, req.parallel_tool_calls, answer,
                                                                 v3=tool_call_parser == "deepseek_v3")})]
    if not asked:
        return None, None
    field, spec = asked[0]
    try:
        return validate_spec(spec), field
    except ValueError as e:
        raise bad_request(f"invalid {field}: {e}", param=field) from None


def completion_prompt(req: CompletionRequest) -> tuple[str | dict | None, list[int] | None]:
    """(text prompt, token-id prompt): exactly one is set. With a suffix the text prompt is the
    engine's fill-in-the-middle form, {"prefix", "suffix"}: DeepSeek's FIM completion."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ({"prefix": prompt, "suffix": req.suffix} if req.suffix else prompt), None
    if req.suffix:
        raise bad_request("suffix needs a text prompt (the middle is found between two texts)", param="suffix")
    return None, list(prompt)


_SAMPLING_ERROR_FIELD = re.compile(r"^invalid (\w+):")


def sampling_params(req: _SamplingFields, *, default_max_tokens: int, max_model_len: int,
                    max_tokens_limit: int | None = None, tool_call_parser: str = "deepseek_v31") -> SamplingParams:
    """Validated engine parameters; every problem is a 400 naming the field."""
    req.refuse_unsupported()
    # both limits are checked when both are given; the newer max_completion_tokens wins
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, field)
        if value is None:
            continue
        if value < 1 and not (value == 0 and getattr(req, "echo", False)):
            raise bad_request(f"{field} must be at least 1 (0 only with echo), got {value}", param=field)
        if max_tokens_limit is not None and value > max_tokens_limit:
            raise bad_request(f"{field} is {value}; this server allows at most {max_tokens_limit}", param=field)
        if value >= max_model_len:
            # even a one-token prompt leaves only max_model_len - 1 tokens to generate
            raise bad_request(f"{field} is {value}; the model's context is {max_model_len} tokens "
                              "including the prompt", param=field, code="context_length_exceeded")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    # max_tokens 0 with echo scores the prompt alone: the engine still samples the token after it
    # (in the prompt's last step, no forward more), and the service leaves it out
    max_tokens = max(max_tokens, 1)
    if not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n must be in 1..{MAX_CHOICES}, got {req.n}", param="n")
    # n choices are n engine requests (app/service.py), each of one
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos,
                              "logprobs": req.engine_logprobs()}
    if getattr(req, "echo", False):  # legacy completions: the prompt, and its logprobs, come back first
        kwargs.update(echo=True, prompt_logprobs=kwargs["logprobs"])
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be in 0..{SamplingParams.MAX_LOGPROBS}, got {req.prompt_logprobs}",
                              param="prompt_logprobs")
        if req.stream:
            raise bad_request("prompt_logprobs is not supported when streaming", param="prompt_logprobs")
        # with echo's too, the engine computes the larger number of alternatives; each view takes its own
        asked = kwargs.get("prompt_logprobs")
        kwargs["prompt_logprobs"] = req.prompt_logprobs if asked is None else max(asked, req.prompt_logprobs)
    for name in ("temperature", "top_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if req.top_k is not None:
        kwargs["top_k"] = -1 if req.top_k == 0 else req.top_k  # 0 means "off" in vLLM and SGLang too
    kwargs["structured_output"] = structured_output(req, tool_call_parser)[0]
    try:
        return SamplingParams(**kwargs)
    except SamplingError as e:
        m = _SAMPLING_ERROR_FIELD.match(str(e))
        raise bad_request(str(e), param=m.group(1) if m else None) from None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 12:
            raise bad_request(f"logit_bias keys must be token ids, got {_short(key)}", param="logit_bias")
        out[int(key)] = value
    return out


def sampling_dict(params: SamplingParams) -> dict:
    """SamplingParams as plain data, so a backend in another process can rebuild it."""
    return dataclasses.asdict(params)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: seeded choices differ from each other and repeat run to run."""
    if seed is None:
        return None
    seed += index
    return seed - 2**64 if seed >= SEED_MAX_EXCLUSIVE else seed
