"""The OpenAI-compatible API's plumbing for day 3.5's server (provided: not a task).

Everything here is the ecosystem's contract rather than the engine's: the request bodies as pydantic
models with OpenAI's field ranges, errors in OpenAI's format, the prompt a request asks for, the
response objects, `/metrics` through `prometheus_client` with vLLM's metric names, and the HTTP
extras a deployment expects (an API key, CORS, a request-id header, an access log). `server.py` holds
what the chapter teaches: the engine thread, streaming, stop strings, aborts.

The rule for a request field: served, or refused with a 400 that names it; never silently ignored.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
import uuid
from typing import Annotated, Any, Literal

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .sequence import (LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_SEED, PENALTY_RANGE,
                       SamplingParams)
from .structured import Constraint, make_constraint

logger = logging.getLogger("tiny_llm.server")
access_logger = logging.getLogger("tiny_llm.access")

MAX_STOP_STRINGS = 4  # as OpenAI's API
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none (up to the context)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """A request that cannot be served: `status` and an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


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


class StreamOptions(BaseModel):
    """`stream_options`: whether the stream ends with a `usage` chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
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
    # Typed loosely: `output_constraint` reads it and names what is wrong (day 4.5).
    response_format: Any = None
    # Not served (checked against NOT_SERVED): typed loosely so the 400 names the field.
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt: one engine request each
    store: Any = None

    def refuse_unserved(self) -> None:
        """A 400 naming the first field (in the schema's order) set to something this server does not do."""
        for name in [name for name in type(self).model_fields if name in NOT_SERVED and name in self.model_fields_set]:
            if getattr(self, name) not in NOT_SERVED[name]:
                raise APIError(400, f"'{name}' is not supported by this server (only {NOT_SERVED[name][-1]!r})",
                               param=name, code="unsupported_parameter")

    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int, choice_index: int = 0, constraint: Constraint | None = None) -> SamplingParams:
        """The engine's `SamplingParams`: every value already in the engine's ranges (checked above).

        With a seed and `n > 1`, choice i samples with seed + i (wrapping within the range), so the
        choices differ and each is reproducible.
        """
        seed = None if self.seed is None else (self.seed + choice_index) % (MAX_SEED + 1)
        logit_bias = {int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, seed=seed, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_p=self.min_p, logit_bias=logit_bias, ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs(), constraint=constraint)

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


class TextPart(BaseModel):
    """One part of a message's content given as a list: only text parts are served."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: a role this server can template, and text (a string or text parts). No tool calls."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


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

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(kind: type[SamplingRequest], raw: bytes, model_name: str) -> SamplingRequest:
    """The body as a `kind`, or an APIError: 400 for anything malformed, 404 for another model."""
    try:
        # pydantic's own JSON parser: NaN, lone surrogates and absurd nesting are errors here, not 500s.
        body = kind.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error) from None
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    body.refuse_unserved()
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


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Token ids of the chat template applied to `messages`, ready for the assistant's answer."""
    plain = [{"role": message.role, "content": message.text()} for message in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


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


def check_logit_bias(body: SamplingRequest, vocab_size: int) -> None:
    """Every token `logit_bias` names must be in the vocabulary."""
    if body.logit_bias and max(int(token) for token in body.logit_bias) >= vocab_size:
        raise APIError(400, f"'logit_bias' names a token id outside the vocabulary (0 .. {vocab_size - 1})",
                       param="logit_bias")


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


async def merge(streams: list, generations: list):
    """The streams' pieces as `(index, piece, finish_reason, first, logprobs)` chunks, in the order they come.

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
            merged.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s, g)) for i, (s, g) in enumerate(zip(streams, generations))]
    try:
        running = len(tasks)
        while running:
            chunk = await merged.get()
            if chunk is None:
                running -= 1
            else:
                yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------- /metrics

# vLLM's metric names (after the `tiny_llm:` prefix instead of `vllm:`) and vLLM's histogram buckets,
# so a vLLM dashboard carries over with one substitution. Every sample has a `model_name` label.
PREFIX = "tiny_llm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """The engine's gauges and counters, read from the engine thread's last published snapshot at each scrape."""

    def __init__(self, stats: callable, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats = self.stats()
        families = [
            (GaugeMetricFamily, "num_requests_running", "Requests holding KV blocks and generating.", "num_running"),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting for admission.", "num_waiting"),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
             "kv_cache_usage"),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            (CounterMetricFamily, "num_preemptions", "Preemptions (a sequence's blocks taken back).", "num_preemptions"),
            (CounterMetricFamily, "prompt_tokens", "Prompt tokens prefilled.", "prompt_tokens"),
            (CounterMetricFamily, "generation_tokens", "Tokens generated.", "generation_tokens"),
        ]
        for family, name, help_text, key in families:
            metric = family(PREFIX + name, help_text, labels=["model_name"])
            metric.add_metric([self.model_name], stats[key])
            yield metric


class ServerMetrics:
    """/metrics: the engine's snapshot (`EngineCollector`) and latencies measured where the client feels them."""

    def __init__(self, model_name: str, stats: callable):
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def histogram(name: str, help_text: str, buckets):
            return prometheus_client.Histogram(PREFIX + name, help_text, buckets=buckets, **labels).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from reaching the engine to its first step.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from the first step to the first token.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from the first step to the last token.",
                                   REQUEST_BUCKETS)
        self.success = prometheus_client.Counter(PREFIX + "request_success", "Requests finished, by reason.",
                                                 ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST


# ---------------------------------------------------------------- HTTP extras


def install_http_extras(app: FastAPI, api_key: str | None, cors_origins: list[str]) -> None:
    """OpenAI's error format for every error, an API key, CORS, a request-id header and an access log."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}").response()

    app.add_middleware(RequestIdKeyAndLog, api_key=api_key)
    if cors_origins:  # added last, so outermost: a browser's preflight never needs the key
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id"])


class RequestIdKeyAndLog:
    """ASGI middleware: checks the API key on /v1, adds `x-request-id` (the client's, or a new one) to every
    response, and writes one access-log line per request. Pure ASGI, so a stream's chunks pass straight through."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    def authorized(self, scope, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None or not scope["path"].startswith("/v1"):
            return True
        sent = headers.get(b"authorization", b"").decode("latin-1")
        return secrets.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        status = 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            if self.authorized(scope, headers):
                await self.app(scope, receive, send_with_id)
            else:
                response = APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                    code="invalid_api_key").response()
                await response(scope, receive, send_with_id)
        finally:
            client = scope.get("client")
            access_logger.info('%s "%s %s" %s %.1f ms id=%s', client[0] if client else "-", scope["method"],
                               scope["path"], status or "-", 1000 * (time.perf_counter() - start), request_id)
