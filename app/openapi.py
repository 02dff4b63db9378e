"""The HTTP API's OpenAPI 3.1 description, served at GET /openapi.json.

Request bodies start from the pydantic models in app/openai_api.py, so a field added there
shows up here; then they are narrowed by what app/openai_api.py and engine/sampling.py check
after parsing (ranges, roles, prompt forms), because a schema that admits what the server
rejects would make schema-driven clients and fuzzers report false failures.
"""
from __future__ import annotations

from typing import Any

from engine.sampling import SamplingParams

from . import openai_api as oa

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _pydantic_schema(model: type, components: dict) -> dict:
    """The model's JSON schema with its nested models hoisted into `components`."""
    schema = model.model_json_schema(ref_template=_REF)
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    return schema


def _set_branch(prop: dict, schema: dict) -> None:
    """Replaces the non-null branch of a pydantic `X | None` property (keeping its title/default)."""
    for i, branch in enumerate(prop["anyOf"]):
        if branch.get("type") != "null":
            prop["anyOf"][i] = schema
            return
    raise AssertionError(f"no non-null branch in {prop}")


def _sampling_fields(props: dict, model_name: str, max_tokens_max: int | None) -> None:
    stop_string = {"type": "string", "minLength": 1, "maxLength": SamplingParams.MAX_STOP_LEN}
    # pydantic says only "string or null": the model name is checked after parsing (404)
    _set_branch(props["model"], {"type": "string", "enum": [model_name]})
    for name in ("max_tokens", "max_completion_tokens"):
        bound: dict[str, Any] = {"type": "integer", "minimum": 1}
        if max_tokens_max is not None:
            bound["maximum"] = max_tokens_max
        _set_branch(props[name], bound)
    props["max_completion_tokens"]["description"] = "Wins over max_tokens when both are set."
    _set_branch(props["temperature"], {"type": "number", "minimum": 0})
    _set_branch(props["top_p"], {"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    _set_branch(props["top_k"], {"type": "integer", "minimum": -1})
    props["top_k"]["description"] = "Extension: -1 or 0 turn it off."
    props["stop"]["anyOf"] = [stop_string,
                              {"type": "array", "items": stop_string, "maxItems": SamplingParams.MAX_STOP_STRINGS},
                              {"type": "null"}]
    _set_branch(props["stop_token_ids"], {"type": "array", "items": {"type": "integer", "minimum": 0}})
    props["stop_token_ids"]["description"] = "Extension: token ids that end the generation."
    props["n"].update(type="integer", minimum=1, maximum=oa.MAX_CHOICES,
                      description="Choices: each is sampled apart (with a seed, choice i uses seed + i).")
    for name in ("presence_penalty", "frequency_penalty"):
        _set_branch(props[name], {"type": "number", "minimum": -2, "maximum": 2})
    _set_branch(props["repetition_penalty"], {"type": "number", "exclusiveMinimum": 0, "maximum": 100})
    props["repetition_penalty"]["description"] = ("Extension (as in vLLM): divides a positive logit of a token "
                                                  "already in the prompt or output, multiplies a negative one.")
    _set_branch(props["logit_bias"], {"type": "object", "maxProperties": SamplingParams.MAX_LOGIT_BIAS,
                                      "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    props["logit_bias"]["description"] = "Token id (as a string) -> a bias added to its logit before sampling."
    props["ignore_eos"]["description"] = "Extension: keep generating past the end-of-sequence token."
    _set_branch(props["min_tokens"], {"type": "integer", "minimum": 0})
    props["min_tokens"]["description"] = ("Extension (as in vLLM): until this many tokens are out, the end-of-sequence "
                                          "and stop tokens are not sampled and stop strings do not end the answer; "
                                          "at most max_tokens.")
    props["session_id"]["description"] = ("Extension: session key for cache affinity; the session header "
                                          "and `user` take precedence.")


def _logprobs_fields(chat: dict, completion: dict) -> None:
    k = {"type": "integer", "minimum": 0, "maximum": SamplingParams.MAX_LOGPROBS}
    props = chat["properties"]
    props["logprobs"]["description"] = ("Return the log-probability of each output token: the model's own "
                                        "distribution, before temperature, penalties, logit_bias, top_k and top_p.")
    _set_branch(props["top_logprobs"], k)
    props["top_logprobs"]["description"] = "The most likely alternatives per token; needs logprobs true."
    chat["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}}
    chat["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    for schema in (chat, completion):
        _set_branch(schema["properties"]["prompt_logprobs"], k)
        schema["properties"]["prompt_logprobs"]["description"] = (
            "Extension (as in vLLM): each prompt token's log-probability, its rank and this many alternatives, "
            "as prompt_logprobs (the response's for chat, each choice's for completions). The prompt is then "
            "computed whole, not read from the prefix cache. Not with stream.")
    _set_branch(completion["properties"]["logprobs"], k)
    completion["properties"]["logprobs"]["description"] = (
        "The most likely alternatives per token (0: the sampled token's log-probability only); the "
        "model's own distribution, before temperature, penalties, logit_bias, top_k and top_p.")


def _unsupported_fields(chat: dict, completion: dict) -> None:
    """Fields narrowed to the values that ask for nothing this server lacks (the rest are 400s)."""
    completion["echo"].update(type="boolean", description=(
        "Return the prompt before the completion; with logprobs, each prompt token's too (the first: "
        "null), computed over the whole prompt rather than read from the prefix cache. With max_tokens "
        "0, the prompt alone (scoring it)."))
    for name in ("max_tokens", "max_completion_tokens"):  # 0: the prompt alone, with echo (below)
        for branch in completion[name]["anyOf"]:
            if branch.get("type") == "integer":
                branch["minimum"] = 0
    _set_branch(completion["best_of"], {"type": "integer", "enum": [1]})
    completion["suffix"]["description"] = (
        "Fill in the middle: the completion is what goes between the prompt (a text) and this text, "
        "as DeepSeek's FIM completion. Needs a model whose tokenizer has the fill-in-the-middle tokens; "
        "not with echo.")
    chat["tools"]["description"] = ("Functions the model may call (DeepSeek's tool-call format); its calls come "
                                    "back as message.tool_calls with finish_reason \"tool_calls\".")
    chat["tool_choice"]["description"] = (
        "\"none\" leaves the tools out of the prompt; \"required\" or a named function forces a call: the "
        "answer is then constrained to the calls' JSON (with tools given; a named function must be one of them).")
    chat["parallel_tool_calls"]["description"] = "false: a forced (\"required\") answer makes one call at most."
    _set_branch(chat["chat_template_kwargs"], {"type": "object", "propertyNames": {
        "pattern": "^[A-Za-z_][A-Za-z0-9_]*$", "not": {"enum": sorted(oa.TEMPLATE_ARGUMENTS)}}})
    chat["chat_template_kwargs"]["description"] = (
        "Extension (as in vLLM and SGLang): more variables for the chat template, e.g. {\"thinking\": true} "
        "for DeepSeek-V3.1's thinking mode.")


def _structured_fields(props: dict, components: dict) -> None:
    """response_format and vLLM's structured_outputs: what the server checks beyond the models."""
    schema_format = components["JSONSchemaFormat"]
    schema_format["properties"]["schema"]["description"] = "A JSON schema the answer follows (absent: any JSON)."
    props["response_format"]["description"] = (
        "{\"type\": \"json_object\"}: the answer is a JSON object; {\"type\": \"json_schema\", \"json_schema\": "
        "{\"name\", \"schema\"}}: JSON following the schema (decoding is constrained; a schema that cannot be "
        "compiled is a 400). Not with structured_outputs or a forced tool call.")
    components["ResponseFormat"]["if"] = {"properties": {"type": {"const": "json_schema"}}}
    components["ResponseFormat"]["then"] = {"required": ["json_schema"],
                                            "properties": {"json_schema": {"type": "object"}}}
    so = components["StructuredOutputs"]
    for key, schema in (("json", {"anyOf": [{"type": "object"}, {"type": "string"}]}),
                        ("regex", {"type": "string", "minLength": 1}), ("grammar", {"type": "string", "minLength": 1}),
                        ("choice", {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                                    "maxItems": 1024}),
                        ("json_object", {"const": True})):
        so["properties"][key] = dict(schema, title=so["properties"][key].get("title", key))
    so.update(minProperties=1, maxProperties=1, description=(
        "Extension (as in vLLM): exactly one of a JSON schema, a regex, a choice of strings, an EBNF grammar "
        "(xgrammar's) or any JSON object."))


def _request_schemas(components: dict, model_name: str, max_tokens_max: int | None,
                     vocab_size: int | None) -> tuple[dict, dict]:
    chat = _pydantic_schema(oa.ChatCompletionRequest, components)
    completion = _pydantic_schema(oa.CompletionRequest, components)
    for schema in (chat, completion):
        _sampling_fields(schema["properties"], model_name, max_tokens_max)
        # unknown fields (metadata, store, ...) are ignored, as OpenAI ignores them
        schema["additionalProperties"] = True
    _logprobs_fields(chat, completion)
    _unsupported_fields(chat["properties"], completion["properties"])
    for schema in (chat, completion):
        _structured_fields(schema["properties"], components)
    completion["if"] = {"anyOf": [{"required": [name], "properties": {name: {"const": 0}}}
                                  for name in ("max_tokens", "max_completion_tokens")]}
    completion["then"] = {"required": ["echo"], "properties": {"echo": {"const": True}}}

    chat["properties"]["messages"]["minItems"] = 1
    message = components["ChatMessage"]
    message["properties"]["role"]["enum"] = sorted({"system", "developer", "user", "assistant", "tool"})
    components["Tool"]["properties"]["type"]["enum"] = ["function"]
    message["additionalProperties"] = True
    part = components["TextPart"]
    # the model accepts any part and leaves the rejection of non-text ones to chat_messages()
    part["properties"]["type"]["enum"] = ["text"]
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]
    part["additionalProperties"] = True

    token = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    token_ids = {"type": "array", "items": token, "minItems": 1}
    completion["properties"]["prompt"]["anyOf"] = [
        {"type": "string"},
        token_ids,
        # OpenAI's batch forms, limited here to a batch of one
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1},
    ]
    completion["properties"]["prompt"]["description"] = (
        "Text or token ids; together with max_tokens it must fit the model's context "
        "(else 400 context_length_exceeded).")
    return chat, completion


def _response_schemas() -> dict:
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                      "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
            # with a reasoning parser: the completion tokens spent thinking
            "completion_tokens_details": {"type": "object", "required": ["reasoning_tokens"],
                                          "properties": {"reasoning_tokens": {"type": "integer", "minimum": 0}}},
        },
    }
    finish = {"anyOf": [{"type": "string", "enum": ["stop", "length", "tool_calls"]}, {"type": "null"}]}
    call = {"type": "object", "required": ["id", "type", "function"],
            "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    # A call's first delta has its id, type and name; later ones (a forced call's arguments as they
    # stream) only more of the arguments.
    call_delta = {"type": "object", "required": ["index", "function"],
                  "properties": {"index": {"type": "integer", "minimum": 0}, "id": {"type": "string"},
                                 "type": {"type": "string", "enum": ["function"]},
                                 "function": {"type": "object", "properties": {
                                     "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    text_or_null = {"anyOf": [{"type": "string"}, {"type": "null"}]}

    def envelope(obj: str, choice: dict, *, streamed: bool) -> dict:
        required = ["id", "object", "created", "model", "choices"]
        if not streamed:
            required.append("usage")
        return {
            "type": "object",
            "required": required,
            "properties": {
                "id": {"type": "string", "pattern": "^(chatcmpl|cmpl)-"},
                "object": {"type": "string", "enum": [obj]},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": choice, **({} if streamed else {"minItems": 1})},
                "usage": _nullable(_ref("Usage")) if streamed else _ref("Usage"),
            },
        }

    def choice(logprobs: str, **fields: dict) -> dict:
        return {"type": "object", "required": ["index", *fields, "finish_reason"],
                "properties": {"index": {"type": "integer", "minimum": 0}, **fields,
                               "logprobs": _nullable(_ref(logprobs)), "finish_reason": finish}}

    # content is null only beside tool calls; reasoning_content only with a reasoning parser (app/reasoning.py)
    reasoning = {"type": "string", "description": "A reasoning model's thinking, before its content."}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": text_or_null,
                              "reasoning_content": reasoning,
                              "tool_calls": {"type": "array", "items": call, "minItems": 1}}}
    delta = {"type": "object", "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": text_or_null,
                                              "reasoning_content": reasoning,
                                              "tool_calls": {"type": "array", "items": call_delta, "minItems": 1}}}
    # vLLM's prompt_logprobs: per prompt token (the first null), {token id: {logprob, rank, decoded_token}}
    prompt_logprobs = {"type": "array", "items": {"anyOf": [{"type": "null"}, {
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {
            "type": "object", "required": ["logprob", "rank", "decoded_token"],
            "properties": {"logprob": {"type": "number"}, "rank": {"type": "integer", "minimum": 1},
                           "decoded_token": {"type": "string"}}}}]}}
    chat_completion = envelope("chat.completion", choice("ChatLogprobs", message=message), streamed=False)
    chat_completion["properties"]["prompt_logprobs"] = prompt_logprobs
    text_completion = envelope("text_completion", choice("CompletionLogprobs", text={"type": "string"}),
                               streamed=False)
    text_completion["properties"]["choices"]["items"]["properties"]["prompt_logprobs"] = prompt_logprobs
    return {
        "Usage": usage,
        "ChatCompletion": chat_completion,
        "TextCompletion": text_completion,
        "ChatCompletionChunk": envelope("chat.completion.chunk", choice("ChatLogprobs", delta=delta), streamed=True),
        "TextCompletionChunk": envelope("text_completion", choice("CompletionLogprobs", text={"type": "string"}),
                                        streamed=True),
        **_logprobs_schemas(),
        "Error": {
            "type": "object",
            "required": ["error"],
            "additionalProperties": False,
            "properties": {"error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
                    "param": text_or_null,
                    "code": text_or_null,
                },
            }},
        },
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "max_model_len": {"type": "integer", "minimum": 1}},
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"type": "string", "enum": ["list"]},
                           "data": {"type": "array", "items": _ref("Model")}},
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            # the rest is the engine's statistics, which differ by backend
            "properties": {"status": {"type": "string", "enum": ["ok"]}, "model": {"type": "string"}},
        },
        "Unhealthy": {
            "type": "object",
            "required": ["status", "error"],
            "properties": {"status": {"type": "string", "enum": ["unhealthy"]}, "error": {"type": "string"}},
        },
    }


def _logprobs_schemas() -> dict:
    logprob = {"type": "number", "maximum": 0}
    token = {"type": "object", "required": ["token", "logprob", "bytes"],
             "properties": {"token": {"type": "string"}, "logprob": logprob,
                            "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}}
    with_top = {**token, "required": [*token["required"], "top_logprobs"],
                "properties": {**token["properties"], "top_logprobs": {"type": "array", "items": token}}}
    return {
        "ChatLogprobs": {"type": "object", "required": ["content"],
                         "properties": {"content": {"type": "array", "items": with_top}}},
        "CompletionLogprobs": {
            "type": "object",
            "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            "properties": {
                "tokens": {"type": "array", "items": {"type": "string"}},
                # null: an echoed prompt's first token, which has nothing before it
                "token_logprobs": {"type": "array", "items": _nullable(logprob)},
                "top_logprobs": {"type": "array", "items": _nullable({"type": "object", "additionalProperties": logprob})},
                "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            },
        },
    }


def _error(description: str, headers: dict | None = None) -> dict:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


def _sse_event(chunk: str) -> dict:
    """One server-sent event of a stream: its `data` is a chunk, an error, or the [DONE] sentinel.
    Before OpenAPI 3.2 (itemSchema) the `schema` of text/event-stream describes each event."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"type": "string", "const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}},
        ]}},
    }


def _generation_operation(summary: str, request: str, body: str, chunk: str, max_body_bytes: int | None,
                          auth: bool) -> dict:
    too_large = "The body is larger than the server's limit"
    if max_body_bytes is not None:
        too_large += f" ({max_body_bytes} bytes)"
    responses = {
        "200": {
            "description": (f"A {body} object, or with stream=true a server-sent event stream: one "
                            f"`data: <{chunk} JSON>` event per piece of text, a last chunk with the "
                            "finish_reason (and, with stream_options.include_usage, one more with `usage` "
                            "and no choices), then `data: [DONE]`. A failure mid-stream is sent as a "
                            "`data: <Error JSON>` event before [DONE]."),
            "headers": {"x-request-id": {"schema": {"type": "string"}}},
            "content": {"application/json": {"schema": _ref(body)},
                        "text/event-stream": {"schema": _sse_event(chunk)}},
        },
        "400": _error("Invalid body: not UTF-8 JSON, a wrong field, a value out of range, or a prompt "
                      "that does not fit the context (code context_length_exceeded); `param` names the field."),
        "404": _error("The model is not the one this server serves (code model_not_found)."),
        "413": _error(too_large + " (code request_too_large)."),
        "500": _error("The engine failed before the first token (type server_error)."),
        "503": _error("Overloaded (code overloaded); retry after Retry-After seconds.",
                      {"Retry-After": {"schema": {"type": "string"}}}),
    }
    if auth:
        responses["401"] = _error("Missing or wrong API key (code invalid_api_key).",
                                  {"WWW-Authenticate": {"schema": {"type": "string"}}})
    return {"post": {
        "summary": summary,
        "operationId": request[0].lower() + request[1:],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": responses,
        **({"security": [{"bearerAuth": []}]} if auth else {}),
    }}


def _token_operation(summary: str, request: str, response: str, max_body_bytes: int | None, auth: bool) -> dict:
    """vLLM's /tokenize and /detokenize: one JSON request, one JSON response."""
    responses = {
        "200": {"description": summary + ".", "content": {"application/json": {"schema": _ref(response)}}},
        "400": _error("Invalid body, or a prompt, message or token id the engine cannot take; `param` names it."),
        "404": _error("The model is not the one this server serves (code model_not_found)."),
        "413": _error("The body is larger than the server's limit"
                      + (f" ({max_body_bytes} bytes)" if max_body_bytes is not None else "") + "."),
        "500": _error("The engine failed (type server_error)."),
    }
    if auth:
        responses["401"] = _error("Missing or wrong API key (code invalid_api_key).",
                                  {"WWW-Authenticate": {"schema": {"type": "string"}}})
    return {"post": {"summary": summary, "operationId": request[0].lower() + request[1:-len("Request")],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
                     "responses": responses, **({"security": [{"bearerAuth": []}]} if auth else {})}}


def _token_schemas(components: dict, model_name: str) -> None:
    tokenize = _pydantic_schema(oa.TokenizeRequest, components)
    detokenize = _pydantic_schema(oa.DetokenizeRequest, components)
    for schema in (tokenize, detokenize):
        _set_branch(schema["properties"]["model"], {"type": "string", "enum": [model_name]})
        schema["additionalProperties"] = True
    tokenize["description"] = ("Extension (as in vLLM): the token ids the engine would run for a text prompt (no "
                               "special tokens added, as completions run it), or for chat messages through the chat "
                               "template (with tools and chat_template_kwargs). Exactly one of prompt and messages.")
    tokenize["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    detokenize["description"] = "Extension (as in vLLM): the text of token ids, special tokens included."
    components.update(TokenizeRequest=tokenize, DetokenizeRequest=detokenize, TokenizeResponse={
        "type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {"count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer", "minimum": 1},
                       "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                       "token_strs": _nullable({"type": "array", "items": {"type": "string"}})}},
        DetokenizeResponse={"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}})


def openapi_spec(model_name: str, *, max_model_len: int | None = None, max_tokens_limit: int | None = None,
                 max_body_bytes: int | None = None, vocab_size: int | None = None, auth: bool = False) -> dict:
    """The OpenAPI document of build_http_app() serving `model_name`. The optional limits make the
    schemas as tight as the server that is configured with them; `auth`: an API key is required."""
    components: dict[str, Any] = {}
    max_tokens_max = None
    if max_model_len is not None:
        # even a one-token prompt leaves only max_model_len - 1 tokens to generate
        max_tokens_max = max_model_len - 1
    if max_tokens_limit is not None:
        max_tokens_max = min(max_tokens_limit, max_tokens_max or max_tokens_limit)
    chat, completion = _request_schemas(components, model_name, max_tokens_max, vocab_size)
    components.update(ChatCompletionRequest=chat, CompletionRequest=completion, **_response_schemas())
    _token_schemas(components, model_name)

    models_responses: dict[str, Any] = {"200": {"description": "The served model.",
                                                "content": {"application/json": {"schema": _ref("ModelList")}}}}
    if auth:
        models_responses["401"] = _error("Missing or wrong API key (code invalid_api_key).")
    spec = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "wideep-serve", "version": "1",
                 "description": f"OpenAI-compatible API serving {model_name!r}. Every 4xx body is an "
                                "OpenAI-style error object."},
        "paths": {
            "/v1/chat/completions": _generation_operation(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk",
                max_body_bytes, auth),
            "/v1/completions": _generation_operation(
                "Legacy text completion (max_tokens defaults to 16)", "CompletionRequest", "TextCompletion",
                "TextCompletionChunk", max_body_bytes, auth),
            "/tokenize": _token_operation("The token ids of a prompt or a conversation", "TokenizeRequest",
                                          "TokenizeResponse", max_body_bytes, auth),
            "/detokenize": _token_operation("The text of token ids", "DetokenizeRequest", "DetokenizeResponse",
                                            max_body_bytes, auth),
            "/v1/models": {"get": {
                "summary": "The served model", "operationId": "listModels", "responses": models_responses,
                **({"security": [{"bearerAuth": []}]} if auth else {})}},
            "/health": {"get": {
                "summary": "Liveness of the engine (needs no API key)", "operationId": "health",
                "responses": {
                    "200": {"description": "Healthy, with the engine's statistics.",
                            "content": {"application/json": {"schema": _ref("Health")}}},
                    "503": {"description": "The engine stopped.",
                            "content": {"application/json": {"schema": _ref("Unhealthy")}}},
                }}},
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
    }
    return spec
