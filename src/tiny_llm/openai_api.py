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
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from .sequence import (LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_SEED, PENALTY_RANGE,
                       SamplingParams)
from .structured import Constraint, make_constraint

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
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
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


class ChatMessage(NullMeansDefault):
    """A message: a role this server can template, and text (a string or text parts). No tool calls, and no
    `name` (Qwen's chat template has no place for a participant's name: refused, not dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


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
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        refuse_names(self.messages)

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
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of the chat template applied to `messages`, by default ready for the assistant's answer."""
    plain = [{"role": message.role, "content": message.text()} for message in messages]
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
    try:
        return cached_constraint(schema if schema == "json_object" else json.dumps(schema), tokenizer, vocab_size)
    except ValueError as error:  # an unsupported keyword, a recursive $ref, a bound out of range
        raise APIError(400, f"'response_format': {error}", param="response_format", code="unsupported_schema") from None
    except (TypeError, AttributeError, KeyError) as error:  # a keyword's value of the wrong JSON type
        raise APIError(400, f"'response_format': a malformed schema ({type(error).__name__}: {error})",
                       param="response_format", code="invalid_schema") from None


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
