"""The OpenAI-compatible API's protocol for day 3.5's server (provided: not a task).

Everything here is the ecosystem's contract rather than the engine's: the request bodies as pydantic
models with OpenAI's field ranges (and vLLM's extensions), errors in OpenAI's format, the prompt a
request asks for, the response objects, and several choices merged into one response. Beside it:
`prometheus_metrics.py` (/metrics), `http_extras.py` (body limit, API key, CORS, request id, access
log), `text_stream.py` (tokens to text); `server.py` holds the engine thread and the request's life.

The rule for a request field: served, or refused with a 400 that names it; never silently ignored.
An explicit JSON `null` means the field's default, as in OpenAI's schema and vLLM. A new field: a
typed field on the body (with its range), then either `sampling()` hands it to the engine or
`refuse_unserved` refuses it (`NOT_SERVED`, or a check of its own there).

Day 4.5 adds what constrains an answer: `response_format` (a JSON Schema) and `tools` (a tool call is a
JSON object {"name": ..., "arguments": ...} that a schema built from the tools describes; `CallReader`
reads it back out of the text and answers with OpenAI's `tool_calls`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from .sequence import (LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_SEED, PENALTY_RANGE,
                       SamplingParams)
from .structured import DEAD, Constraint, make_constraint

logger = logging.getLogger("tiny_llm.server")

MAX_STOP_STRINGS = 4  # as OpenAI's API
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none (up to the context)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """A request that cannot be served: `status` and an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def response(self) -> JSONResponse:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field (never echoing the input back)."""
    first = error.errors(include_url=False, include_input=False)[0]
    location = [str(part) for part in first["loc"]]
    param = location[0] if location else None
    where = ".".join(location) if location else "the request body"
    return APIError(400, f"{where}: {first['msg']}", param=param, code=first["type"])


# ---------------------------------------------------------------- request bodies

# Fields of OpenAI's (and vLLM's) schemas this server does not serve, with the value that means "not
# used": a request that sets one to anything else gets a 400 naming it.
NOT_SERVED: dict[str, Any] = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "store": (None, False),
}
MAX_CHOICES = 128  # OpenAI's most `n`; here also the most prompts x n of one request

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]  # the engine's range (sequence.MAX_SEED): see the chapter
StopStrings = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
# The engine's ranges (sequence.py), stated once in the chapter.
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
# OpenAI's logit_bias: {"token id as a string": bias}.
LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                 Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]]


class NullMeansDefault(BaseModel):
    """A body where an explicit JSON `null` is the same as leaving the field out: its default."""

    @model_validator(mode="before")
    @classmethod
    def drop_nulls(cls, data):
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class StreamOptions(NullMeansDefault):
    """`stream_options`: whether the stream ends with a `usage` chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(NullMeansDefault):
    """The fields both endpoints share: OpenAI's names, types and ranges (vLLM's for its extensions)."""

    # strict: "9" is not 9 and true is not 1; extra: an unknown field is a 400 naming it, not silence.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None  # absent: this server's model, as mlx_lm.server
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    seed: Seed | None = None
    stop: str | StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: only logged
    priority: int = 0  # vLLM's extension, used by --scheduling-policy priority (larger first; vLLM's: lower first)
    service_tier: Literal["auto", "default"] | None = None
    metadata: dict[str, str] | None = None  # OpenAI's stored-completion tags: accepted, not stored
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)  # vLLM's extension; 1: off
    min_p: float = Field(0.0, ge=0, le=1)  # vLLM's extension; 0: off
    logit_bias: LogitBias | None = None
    ignore_eos: bool = False  # vLLM's extension
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: no EOS or stop token before this many tokens
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's extension: they end the output
    # Typed loosely: `output_constraint` reads it and names what is wrong (day 4.5).
    response_format: Any = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt: one engine request each
    # Not served (checked against NOT_SERVED): typed loosely so the 400 names the field.
    store: Any = None

    def refuse_unserved(self) -> None:
        """A 400 naming the first field (in the schema's order) set to something this server does not do."""
        given = self.model_dump(include=set(NOT_SERVED) & self.model_fields_set)  # read by name, not getattr
        for name in [name for name in type(self).model_fields if name in given]:
            if given[name] not in NOT_SERVED[name]:
                raise APIError(400, f"'{name}' is not supported by this server (only {NOT_SERVED[name][-1]!r})",
                               param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")

    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int, choice_index: int = 0, constraint: Constraint | None = None) -> SamplingParams:
        """The engine's `SamplingParams`: every value already in the engine's ranges (checked above).

        With a seed and `n > 1`, choice i samples with seed + i (wrapping within the range), so the
        choices differ and each is reproducible.
        """
        seed = None if self.seed is None else (self.seed + choice_index) % (MAX_SEED + 1)
        logit_bias = {int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) is more than max_tokens ({max_tokens})",
                           param="min_tokens")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, seed=seed, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_p=self.min_p, logit_bias=logit_bias, ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs(), min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              constraint=constraint)

    def num_logprobs(self) -> int | None:
        """How many alternatives per token the response reports (None: no log-probabilities); each endpoint
        names the field its own way."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1)])
    logprobs: NumLogprobs | None = None  # the chosen token's and this many alternatives' log-probabilities
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(NullMeansDefault):
    """One part of a message's content given as a list: only text parts are served."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(NullMeansDefault):
    """The function an earlier assistant message called, and its arguments as a JSON text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str
    parsed_arguments: Any = None  # what OpenAI's client adds (`parse`) and sends back; kept out of the prompt


class ToolCall(NullMeansDefault):
    """One call in an assistant message's `tool_calls`, as this server (or another) answered it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(NullMeansDefault):
    """A message: a role this server can template, and text (a string or text parts); an assistant's message
    may carry the `tool_calls` it made instead of text, and a "tool" message answers one (`tool_call_id`).
    No `name` (Qwen's chat template has no place for a participant's name: refused, not dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # day 4.5
    tool_call_id: str | None = None  # day 4.5: the call a "tool" message answers
    # What OpenAI's client sends back with an assistant message it answered (`parse` adds `parsed`); kept out of the prompt.
    refusal: str | None = None
    parsed: Any = None

    @model_validator(mode="after")
    def check_tool_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("'content' is missing (only an assistant message with 'tool_calls' may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has 'tool_calls'")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("a 'tool' message needs 'tool_call_id' (the call it answers), and no other message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_text(self) -> str:
        """What the chat template gets as this message's content: its text, then each call it made, written as
        a call is asked for (`tools_instruction`), one a line."""
        calls = [f'{{"name": {json.dumps(call.function.name)}, "arguments": {call.function.arguments}}}'
                 for call in self.tool_calls or []]
        text = [self.text()] if self.text() else []
        return "\n".join(text + calls)


class FunctionSpec(NullMeansDefault):
    """A tool's function: its name, what it does, and the JSON Schema of its arguments (day 4.5)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # served either way: every call here meets its schema


class Tool(NullMeansDefault):
    """One of a chat request's `tools`: only functions."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(NullMeansDefault):
    """The function a `NamedToolChoice` names."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(NullMeansDefault):
    """`tool_choice` naming the function the answer must call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


def refuse_names(messages: list[ChatMessage]) -> None:
    """A 400 naming the first message with a `name`: Qwen's chat template has no place for it."""
    for index, message in enumerate(messages):
        if message.name is not None:
            raise APIError(400, f"'messages[{index}].name' is not supported by this server (the chat template "
                           f"has no place for it)", param="messages", code="unsupported_parameter")


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name: wins over max_tokens
    logprobs: bool = False  # the chosen tokens' log-probabilities
    top_logprobs: NumLogprobs | None = None  # and this many alternatives' (needs logprobs)
    tools: list[Tool] | None = None  # day 4.5
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # absent: "auto" with tools
    parallel_tool_calls: bool | None = None  # allowed either way: an answer here makes at most one call
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        refuse_names(self.messages)

    def chosen_tools(self) -> tuple[list[Tool], str | None]:
        """(the tools the answer may call, how): "auto", "required", a function's name, or None (no call)."""
        tools = self.tools or []
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in [tool.function.name for tool in tools]:
                raise APIError(400, f"'tool_choice' names the function '{self.tool_choice.function.name}', which is "
                               f"not among 'tools'", param="tool_choice")
            return tools, self.tool_choice.function.name
        if self.tool_choice in ("auto", "required") and not tools:
            raise APIError(400, f"'tool_choice': '{self.tool_choice}' needs 'tools'", param="tool_choice")
        if not tools or self.tool_choice == "none":
            return [], None
        return tools, self.tool_choice or "auto"

    def prompt_tools(self) -> list[Tool]:
        """The tools the prompt describes: none with tool_choice "none" (the answer is text, as without tools)."""
        return self.chosen_tools()[0]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletion(NullMeansDefault):
    """POST /tokenize with a prompt (vLLM's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(NullMeansDefault):
    """POST /tokenize with messages, through the chat template (vLLM's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # described in the prompt as a chat request's are (day 4.5)


class Detokenize(NullMeansDefault):
    """POST /detokenize (vLLM's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


TOKENIZE_BODY = TypeAdapter(TokenizeChat | TokenizeCompletion)


def parse_body(kind, raw: bytes, model_name: str):
    """The body as a `kind` (a model, or a `TypeAdapter`), or an APIError: 400 for anything malformed, 404
    for another model; a completion request's unserved fields refused."""
    try:
        # pydantic's own JSON parser: NaN, lone surrogates and absurd nesting are errors here, not 500s.
        body = kind.validate_json(raw) if isinstance(kind, TypeAdapter) else kind.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error) from None
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    if isinstance(body, SamplingRequest):
        body.refuse_unserved()
    if isinstance(body, TokenizeChat):
        refuse_names(body.messages)
    return body


def max_tokens_for(body: SamplingRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The request's output budget: OpenAI's precedence and defaults, checked against the context."""
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if requested is None:
        # Chat: up to the context, as OpenAI and vLLM; completions: OpenAI's 16.
        requested = max_model_len - prompt_tokens + 1 if isinstance(body, ChatCompletionRequest) \
            else COMPLETIONS_DEFAULT_MAX_TOKENS
    # The last output token is never fed back, so prompt + max_tokens - 1 positions must fit.
    if requested < 1 or prompt_tokens + requested - 1 > max_model_len:
        raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) exceeds this "
                       f"server's context of {max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[Tool] | None = None) -> list[int]:
    """Token ids of the chat template applied to `messages`, by default ready for the assistant's answer;
    `tools` described in the system message (day 4.5)."""
    plain = [{"role": message.role, "content": message.template_text()} for message in messages]
    if tools:
        # The course's templates (Qwen2's, SmolLM2's) have no place for tools: the system message says them.
        if plain[0]["role"] == "system":
            plain[0]["content"] += "\n\n" + tools_instruction(tools)
        else:
            plain.insert(0, {"role": "system", "content": tools_instruction(tools)})
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def text_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` as /tokenize asks (with the tokenizer's special tokens, by default)."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def completion_prompt_ids(tokenizer, prompt, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt of /v1/completions' `prompt`: a string, token ids, or a list of either."""
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    ids = [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    if any(max(p, default=0) >= vocab_size for p in ids):
        raise APIError(400, f"'prompt' holds a token id outside the vocabulary (0 .. {vocab_size - 1})",
                       param="prompt")
    if any(not p for p in ids):
        raise APIError(400, "'prompt' is empty once tokenized: there is nothing to prefill", param="prompt")
    return ids


def prompt_size(prompt) -> int:
    """How big /v1/completions' `prompt` is: its characters (a string or strings) or token ids."""
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    return sum(len(p) for p in prompts)


def check_token_ids(body: SamplingRequest, vocab_size: int) -> None:
    """Every token `logit_bias` or `stop_token_ids` names must be in the vocabulary."""
    if body.logit_bias and max(int(token) for token in body.logit_bias) >= vocab_size:
        raise APIError(400, f"'logit_bias' names a token id outside the vocabulary (0 .. {vocab_size - 1})",
                       param="logit_bias")
    if body.stop_token_ids and max(body.stop_token_ids) >= vocab_size:
        raise APIError(400, f"'stop_token_ids' names a token id outside the vocabulary (0 .. {vocab_size - 1})",
                       param="stop_token_ids")


def output_schema(body: SamplingRequest) -> dict | str | None:
    """`response_format` (day 4.5): None for text, "json_object", or json_schema's schema; a 400 if malformed."""
    fmt = body.response_format
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param="response_format")
    if fmt["type"] == "json_object":
        return "json_object"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "'response_format.json_schema' needs a 'name' and a 'schema' object", param="response_format")
    return spec["schema"]


@functools.lru_cache(maxsize=16)
def cached_constraint(schema_text: str, tokenizer, vocab_size: int) -> Constraint:
    """One compiled `Constraint` per schema (by its JSON text, property order kept): its masks are reused."""
    schema = schema_text if schema_text == "json_object" else json.loads(schema_text)
    return make_constraint(schema, tokenizer, vocab_size)


def output_constraint(body: SamplingRequest, tokenizer, vocab_size: int) -> Constraint | None:
    """The engine's constraint for `response_format` (None: free text); an unsupported schema keyword is a 400 naming it."""
    schema = output_schema(body)
    if schema is None:
        return None
    if body.ignore_eos:
        raise APIError(400, "'ignore_eos' cannot go with 'response_format': the output ends where the schema does",
                       param="ignore_eos")
    return compiled(schema, tokenizer, vocab_size, "response_format")


def compiled(schema: dict | str, tokenizer, vocab_size: int, param: str) -> Constraint:
    """The (cached) constraint of `schema`; a schema it cannot serve is a 400 naming the keyword, for `param`."""
    try:
        return cached_constraint(schema if schema == "json_object" else json.dumps(schema), tokenizer, vocab_size)
    except ValueError as error:  # an unsupported keyword, a recursive $ref, a bound out of range
        raise APIError(400, f"'{param}': {error}", param=param, code="unsupported_schema") from None
    except (TypeError, AttributeError, KeyError) as error:  # a keyword's value of the wrong JSON type
        raise APIError(400, f"'{param}': a malformed schema ({type(error).__name__}: {error})",
                       param=param, code="invalid_schema") from None


# ---------------------------------------------------------------- tools (day 4.5): a tool call is a constrained output


def tools_instruction(tools: list[Tool]) -> str:
    """What the system message tells the model about `tools`: each function, and how to write a call."""
    listed = "\n".join(json.dumps(tool.function.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    return ("You can call these functions (each with the JSON Schema of its arguments):\n" + listed +
            '\nTo call one, answer with nothing but a JSON object {"name": <function name>, "arguments": <arguments>}.')


def call_schema(tools: list[Tool]) -> dict:
    """A call of any one of `tools` as JSON Schema: {"name": its name, "arguments": its parameters}, a branch each.

    A tool's `$defs` (pydantic writes its nested models there) move to the root, where their `#/$defs/...`
    references point once the parameters sit under "arguments"; two tools may share a name only with the same
    definition.
    """
    branches, shared = [], {}
    for tool in tools:
        parameters = dict(tool.function.parameters)
        for section in ("$defs", "definitions"):
            for name, definition in dict(parameters.pop(section, {})).items():
                if shared.setdefault(section, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"two tools define '{section}/{name}' differently")
        branches.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "arguments": parameters},
                         "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": branches, **shared}


@dataclass
class ToolCalls:
    """How a chat request's answers may call its tools: `forced` ("required" or a named function: decoding is
    constrained to a call), and the constraint of a call, which also tells a call in free text ("auto")."""

    forced: bool
    constraint: Constraint


def tool_calls_for(body: SamplingRequest, tokenizer, vocab_size: int) -> ToolCalls | None:
    """The request's `ToolCalls` (None: its answers are text); a tool schema it cannot serve is a 400 naming why."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    tools, choice = body.chosen_tools()
    if choice is None:
        return None
    if output_schema(body) is not None:
        raise APIError(400, "'response_format' cannot go with 'tools' (unless tool_choice is \"none\"): an answer "
                       "is either a call or a formatted text", param="response_format")
    forced = choice != "auto"
    if forced and body.ignore_eos:
        raise APIError(400, "'ignore_eos' cannot go with a forced tool call: the output ends where the call does",
                       param="ignore_eos")
    if forced and choice != "required":
        tools = [tool for tool in tools if tool.function.name == choice]
    try:
        schema = call_schema(tools)
    except (ValueError, TypeError, AttributeError) as error:
        raise APIError(400, f"'tools': {error}", param="tools", code="invalid_schema") from None
    return ToolCalls(forced, compiled(schema, tokenizer, vocab_size, "tools"))


JSON_WHITESPACE = " \t\n\r"


def call_head(text: str) -> tuple[str, int] | None:
    """(the function's name, where its arguments start) once `text` has written both the name and the
    arguments' first character; None before (or if it is no call). A call writes "name" first, as its
    schema declares."""
    decoder = json.JSONDecoder()
    at, name = 0, None
    for expected in ("{", '"name"', ":", None, ",", '"arguments"', ":"):
        at = skip_whitespace(text, at)
        if expected is None:
            try:
                name, at = decoder.raw_decode(text, at)
            except ValueError:  # not written yet
                return None
        elif text.startswith(expected, at):
            at += len(expected)
        else:
            return None
    at = skip_whitespace(text, at)
    return (name, at) if isinstance(name, str) and at < len(text) else None


def skip_whitespace(text: str, at: int) -> int:
    """The first position from `at` on that is not JSON whitespace (`len(text)` if none)."""
    while at < len(text) and text[at] in JSON_WHITESPACE:
        at += 1
    return at


def arguments_end(text: str) -> int:
    """Where a call's arguments may end in `text`: before the last "}" and the whitespace around it, which may
    close the call itself (until the text is over, nothing tells that "}" from one inside the arguments)."""
    end = len(text.rstrip(JSON_WHITESPACE))
    if text[:end].endswith("}"):
        end = len(text[:end - 1].rstrip(JSON_WHITESPACE))
    return end


class CallReader:
    """One choice's text read as a tool call while it may be one: the deltas (or message) OpenAI sends for it.

    Forced ("required" or named), the text is a call by construction: once its head is written the call's id,
    type and name go out, then its arguments piece by piece. "auto": the text is held while the call's automaton
    still accepts a prefix of it; once it does not, everything goes out as content and the rest streams as
    text; a text the automaton accepts at the end is a call, sent whole.
    """

    def __init__(self, calls: ToolCalls, call_id: str):
        self.calls, self.call_id = calls, call_id
        self.automaton = calls.constraint.automaton
        self.state = self.automaton.start  # after the text's bytes, leading (and, once complete, trailing) blanks skipped
        self.text = ""
        self.mode = "held"  # "held": may still be a call; "call": its head went out; "text": content
        self.sent = 0  # characters of `text` sent (as content, or as the call's arguments)

    def add(self, piece: str) -> dict:
        """The delta for one more piece of text (may be empty)."""
        self.text += piece
        if self.mode != "text":
            self.walk(piece.encode())
        if self.mode == "held":
            if self.state == DEAD:
                self.mode = "text"
            elif self.calls.forced and (head := call_head(self.text)) is not None:
                self.mode, self.sent = "call", head[1]
                return self.call_delta(head[0], self.arguments(arguments_end(self.text)))
        if self.mode == "text":
            return self.content(len(self.text))
        return self.arguments_delta(arguments_end(self.text)) if self.mode == "call" else {}

    def finish(self, finish_reason: str) -> tuple[dict, str]:
        """The last delta, and the choice's finish reason: "tool_calls" for a complete call."""
        if self.mode != "text" and self.state != DEAD and self.automaton.accepts(self.state) and finish_reason != "abort":
            name, start = call_head(self.text)
            end = arguments_end(self.text)
            if self.mode == "held":
                self.sent = start
                return self.call_delta(name, self.arguments(end)), "tool_calls"
            return self.arguments_delta(end), "tool_calls"
        if self.mode == "call":  # cut short (max_tokens, a stop string): the arguments as far as they got
            return self.arguments_delta(len(self.text)), finish_reason
        return self.content(len(self.text)), finish_reason

    def answer(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The whole text as one message: OpenAI's `tool_calls` for a call, else content; and the finish reason."""
        deltas = [self.add(text)]
        last, finish_reason = self.finish(finish_reason)
        deltas.append(last)
        content = "".join(delta.get("content", "") for delta in deltas)
        parts = [part for delta in deltas for part in delta.get("tool_calls", [])]
        if not parts:
            return {"role": "assistant", "content": content}, finish_reason
        call = {**parts[0], "function": {"name": parts[0]["function"]["name"],
                                         "arguments": "".join(part["function"]["arguments"] for part in parts)}}
        del call["index"]
        return {"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason

    def walk(self, data: bytes) -> None:
        for byte in data:
            blank = chr(byte) in JSON_WHITESPACE
            if blank and (self.state == self.automaton.start or self.automaton.is_complete(self.state)):
                continue
            self.state = self.automaton.step(self.state, byte)

    def content(self, end: int) -> dict:
        piece, self.sent = self.text[self.sent:end], end
        return {"content": piece} if piece else {}

    def arguments(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return piece

    def call_delta(self, name: str, arguments: str) -> dict:
        return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def arguments_delta(self, end: int) -> dict:
        piece = self.arguments(end)
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}

    def chunk_choice(self, index: int, piece: str, finish_reason: str | None, first: bool,
                     logprobs: dict | None) -> dict:
        """A stream chunk's choice for `piece` (as `choice` makes one), the call's deltas in it."""
        delta = self.add(piece)
        if finish_reason is not None:
            last, finish_reason = self.finish(finish_reason)
            delta = merge_deltas(delta, last)
        if first:
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}


def merge_deltas(first: dict, second: dict) -> dict:
    """Two deltas of one choice as one: content joined; a call's parts joined (the head keeps its id and name)."""
    if not first or not second:
        return first or second
    if "content" in first:
        return {"content": first["content"] + second.get("content", "")}
    head, tail = first["tool_calls"][0], second["tool_calls"][0]
    function = {**head["function"], "arguments": head["function"]["arguments"] + tail["function"]["arguments"]}
    return {"tool_calls": [{**head, "function": function}]}


def check_choices(num_prompts: int, n: int) -> None:
    """Every prompt times `n` is one engine request: at most MAX_CHOICES of them."""
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x n={n} is more than {MAX_CHOICES} choices", param="n")


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """A response's `usage`: token counts, and how many prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_field(chat: bool, entries: list, decode, text_offset: int = 0) -> dict | None:
    """A choice's `logprobs` for the tokens' `TokenLogprobs` (None when the request asked for none).

    Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`; completions:
    `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, offsets counted from `text_offset`.
    `decode(token_id)` is a token's text.
    """
    if entries is None:
        return None

    def named(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    if chat:
        return {"content": [{**named(e.token, e.logprob), "top_logprobs": [named(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [decode(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def choice(chat: bool, index: int, text: str, finish_reason: str | None, streaming: bool,
           first: bool = False, logprobs: dict | None = None) -> dict:
    """One choice of a response (`streaming`: of a chunk): chat's message or delta, or a completion's text."""
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    if not streaming:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": logprobs}
    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}


def object_kind(chat: bool, streaming: bool) -> str:
    """The `object` field of a response or of a stream's chunk."""
    if chat:
        return "chat.completion.chunk" if streaming else "chat.completion"
    return "text_completion"


def model_card(model_name: str) -> dict:
    """The served model as /v1/models lists it."""
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "tiny-llm"}


# ---------------------------------------------------------------- several choices in one response


async def collect_all(streams: list, watcher: asyncio.Task) -> list[str]:
    """Each stream's whole text, gathered side by side; if one fails, the others are cancelled (aborted)."""
    tasks = [asyncio.ensure_future(_join(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()


async def _join(stream) -> str:
    return "".join([piece async for piece in stream])


KEEP_ALIVE = None  # what `merge` yields when no choice had anything to say for `keepalive` seconds
_ENDED = object()  # a choice's stream is over


async def merge(streams: list, generations: list, keepalive: float):
    """The streams' pieces as `(index, piece, finish_reason, first, logprobs)` chunks, in the order they come,
    and `KEEP_ALIVE` after each `keepalive` seconds without one (the client learns the stream is alive).

    `generations[i].finish_reason` is set once stream i is done. A choice sends a first chunk (chat
    puts the role in it), a chunk per non-empty piece, and a last one with its finish reason. A failed
    choice ends, unfinished; the others go on. `logprobs`: the `TokenLogprobs` of the tokens since the
    choice's last chunk (`generations[i].take_logprobs()`; None when the request asked for none).
    """
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream, generation):
        first = True
        try:
            async for piece in stream:
                done = generation.finish_reason is not None
                if piece or first or not done:
                    merged.put_nowait((index, piece, None, first, generation.take_logprobs()))
                    first = False
                if done:
                    merged.put_nowait((index, "", generation.finish_reason, False, generation.take_logprobs()))
        except APIError as error:
            logger.warning("choice %d of a stream failed: %s", index, error.message)
        finally:
            merged.put_nowait(_ENDED)

    tasks = [asyncio.ensure_future(pump(i, s, g)) for i, (s, g) in enumerate(zip(streams, generations))]
    try:
        running = len(tasks)
        while running:
            try:
                chunk = await asyncio.wait_for(merged.get(), keepalive)
            except TimeoutError:
                yield KEEP_ALIVE
                continue
            if chunk is _ENDED:
                running -= 1
            else:
                yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
