"""Serving the engine over HTTP: an OpenAI-compatible API with streaming, metrics and clean errors.

A request's path, from socket to token and back:

    client ─HTTP─> uvicorn ─> FastAPI handler (event loop) ──inbox (queue.Queue)──> engine thread
                                     ^                                                  │ engine.step()
                                     └── asyncio.Queue <── loop.call_soon_threadsafe ───┘

- The event loop does the cheap, many things: parse and validate requests, apply the chat template,
  detokenize, cut at stop strings, write server-sent events, notice disconnects.
- The engine thread does the one expensive thing, `engine.step()`, in a loop, and is the only caller
  of the engine (it is single-threaded by contract). Requests reach it through a thread-safe queue;
  tokens leave it through each request's `asyncio.Queue`, filled with `loop.call_soon_threadsafe`
  because an asyncio queue may only be touched from its own loop's thread.
- A client that goes away is noticed by the handler, which asks the engine thread to `abort` the
  request: its KV blocks return to the pool at once.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .sequence import SamplingParams

# Seconds; the buckets of the latency histograms on /metrics (a final +Inf bucket is implied).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_STOP_STRINGS = 4  # as OpenAI's API
DISCONNECT_POLL_SECONDS = 0.5  # how often a non-streaming handler checks whether its client left


# ---------------------------------------------------------------- wire formats


def sse_event(payload: dict | str) -> str:
    """One server-sent event carrying `payload`: a dict as compact JSON, or a string (`[DONE]`) as is.

    An event is a `data: ` line followed by a blank line; a JSON payload must fit on that one line.
    """
    # BEGIN TASK Week 3 Day 5 Task 1: server-sent event
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
    # END TASK


def find_stop(text: str, stops: list[str]) -> tuple[int, bool]:
    """How much of `text` may be sent to the client now, and whether a stop string was found.

    Returns `(end, stopped)`. If a stop string occurs in `text`, `end` is where the earliest one starts
    and `stopped` is True: the client gets `text[:end]`, never the stop string itself. Otherwise `end`
    holds back the longest tail of `text` that is the beginning of some stop string (the next tokens
    may complete it), and `stopped` is False.
    """
    # BEGIN TASK Week 3 Day 5 Task 2: stop strings
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    if found:
        return min(found), True
    held_back = 0
    for stop in stops:
        # The longest k < len(stop) such that text ends with stop[:k].
        for k in range(min(len(stop) - 1, len(text)), held_back, -1):
            if text.endswith(stop[:k]):
                held_back = k
                break
    return len(text) - held_back, False
    # END TASK


@dataclass
class Histogram:
    """A Prometheus histogram: counts of observations at or below each bucket bound, their sum and count."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Record one observation (seconds)."""
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break


@dataclass
class Metric:
    """One gauge or counter for /metrics: a name, its help line, a kind, and its value."""

    name: str
    help: str
    kind: str  # "gauge" | "counter"
    value: float


def _number(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a decimal point, infinities as +Inf/-Inf."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_prometheus(metrics: list[Metric | Histogram]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of `metrics`.

    Each metric gets `# HELP` and `# TYPE` lines, then its samples. A histogram `h` writes cumulative
    `h_bucket{le="..."}` samples (each counts every observation at or below its bound), ending with
    `le="+Inf"` equal to the count, then `h_sum` and `h_count`. The text ends with a newline.
    """
    # BEGIN TASK Week 3 Day 5 Task 3: Prometheus text
    lines = []
    for metric in metrics:
        kind = "histogram" if isinstance(metric, Histogram) else metric.kind
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {kind}")
        if isinstance(metric, Histogram):
            cumulative = 0
            for bound, count in zip(metric.buckets, metric.counts):
                cumulative += count
                lines.append(f'{metric.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
            lines.append(f'{metric.name}_bucket{{le="+Inf"}} {metric.count}')
            lines.append(f"{metric.name}_sum {_number(metric.total)}")
            lines.append(f"{metric.name}_count {metric.count}")
        else:
            lines.append(f"{metric.name} {_number(metric.value)}")
    return "\n".join(lines) + "\n"
    # END TASK


# ---------------------------------------------------------------- the engine thread


@dataclass
class RequestHandle:
    """What the engine thread needs to serve one request, and where it sends what happens to it.

    The engine thread puts events on `events` (through `loop`): first `Accepted()` or `Rejected(error)`,
    then one `StepOutput` per token, the last one with `finished` True.
    """

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


@dataclass
class Accepted:
    """The engine took the request."""


@dataclass
class Rejected:
    """The engine refused the request (`add_request` raised): the handler answers with a 4xx or 5xx."""

    error: Exception


class EngineThread:
    """Runs the engine in its own thread; the only code that calls `engine.add_request/step/abort`.

    Handlers call `submit(handle)` and `abort(request_id)` from the event loop: both only put a command
    on `inbox`, a thread-safe queue. The thread turns commands into engine calls between steps, and
    after each step also publishes `stats`, a snapshot of the engine's gauges for /metrics (read
    from the event loop while the engine keeps changing).
    """

    def __init__(self, engine):
        """A thread for `engine` (an `LLMEngine`, or anything with its interface); `start()` starts it."""
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[str, RequestHandle] = {}
        self.stats: dict[str, float] = {}
        self.error: BaseException | None = None  # what killed the thread, if anything did
        self.running = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.running = True
        self.publish_stats()
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to finish its current step and exit; wait for it."""
        self.inbox.put(("stop", None))
        self._thread.join()

    def submit(self, handle: RequestHandle) -> None:
        self.inbox.put(("add", handle))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def send(self, handle: RequestHandle, event) -> None:
        """Put `event` on the handle's asyncio queue, safely, from this (non-event-loop) thread."""
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)

    def publish_stats(self) -> None:
        engine = self.engine
        self.stats = {
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "kv_cache_usage": engine.kv_cache_usage,
            "prefix_cache_hit_rate": engine.prefix_cache_hit_rate,
            "prompt_tokens_total": engine.prompt_tokens_total,
            "generation_tokens_total": engine.generation_tokens_total,
        }

    def run_once(self) -> bool:
        """One turn of the engine thread: apply the commands in `inbox`, then run one engine step.

        With no work in the engine, wait for a command instead of spinning. "add": call
        `engine.add_request(handle.prompt, handle.sampling, request_id=...)`, remember the handle, and
        send it `Accepted()`, or `Rejected(error)` if add_request raised ValueError/TypeError. "abort":
        `engine.abort(request_id)` and forget the handle (its client is gone). "stop": return False.
        After a step, send each `StepOutput` to its request's handle (forget the handle when the output
        is finished), then `publish_stats()`. Returns True to keep running.
        """
        # BEGIN TASK Week 3 Day 5 Task 4: the engine thread's turn
        block = not self.engine.has_work()
        while True:
            try:
                command, argument = self.inbox.get(block=block)
            except queue.Empty:
                break
            block = False  # after the first command, only take what is already there
            if command == "stop":
                return False
            if command == "add":
                try:
                    self.engine.add_request(argument.prompt, argument.sampling, request_id=argument.request_id)
                except (ValueError, TypeError) as error:
                    self.send(argument, Rejected(error))
                    continue
                self.handles[argument.request_id] = argument
                self.send(argument, Accepted())
            elif command == "abort" and self.handles.pop(argument, None) is not None:
                self.engine.abort(argument)
        if self.engine.has_work():
            for output in self.engine.step():
                handle = self.handles.get(output.request_id)
                if handle is None:
                    continue
                self.send(handle, output)
                if output.finished:
                    del self.handles[output.request_id]
        self.publish_stats()
        return True
        # END TASK

    def _run(self) -> None:
        try:
            while self.run_once():
                pass
        except BaseException as error:  # noqa: BLE001 - a dead engine thread must fail every waiting request
            self.error = error
            for handle in self.handles.values():
                self.send(handle, Rejected(error))
            self.handles.clear()
            # Requests still in the inbox would wait forever: refuse them too.
            while not self.inbox.empty():
                command, argument = self.inbox.get()
                if command == "add":
                    self.send(argument, Rejected(error))
        finally:
            self.running = False


# ---------------------------------------------------------------- request parsing


class APIError(Exception):
    """A client error, answered with `status` and an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _field(body: dict, name: str, kinds: tuple[type, ...], default, kind_name: str):
    """body[name] if it has one of `kinds` (bool is never a number here), `default` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {kind_name}, got {type(value).__name__}", param=name)
    return value


def _in_range(name: str, value, low, high, low_open: bool = False):
    if value < low or (low_open and value == low) or value > high:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"'{name}' must be in {bound}, got {value}", param=name)
    return value


def parse_sampling(body: dict) -> tuple[SamplingParams, list[str]]:
    """The request's sampling parameters and stop strings, validated (APIError 400 naming the field)."""
    max_tokens = _field(body, "max_tokens", (int,), None, "an integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), 16, "an integer")
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    top_k = _field(body, "top_k", (int,), 0, "an integer")
    seed = _field(body, "seed", (int,), None, "an integer")
    n = _field(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    stop = _field(body, "stop", (str, list), [], "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, f"'stop' must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    sampling = SamplingParams(
        temperature=float(_in_range("temperature", temperature, 0, 2)),
        top_p=float(_in_range("top_p", top_p, 0, 1, low_open=True)),
        top_k=0 if top_k == -1 else _in_range("top_k", top_k, 0, 1 << 31),  # -1 also means off, as vLLM
        max_tokens=_in_range("max_tokens", max_tokens, 1, 1 << 31),
        seed=seed,
    )
    return sampling, stops


def chat_prompt(tokenizer, messages) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]), through the tokenizer's chat template.

    `content` is a string or a list of text parts ({"type": "text", "text": ...}), joined.
    """
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts", param="messages")
        plain.append({"role": message["role"], "content": content})
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def completion_prompt(tokenizer, prompt) -> list[int]:
    """Token ids for /v1/completions' `prompt`: a string, or a list of token ids."""
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise APIError(400, "'prompt' holds a token id outside the vocabulary", param="prompt")
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")


# ---------------------------------------------------------------- text out


class TextStream:
    """Turns one request's tokens into the text pieces its client receives: detokenized, cut at stop strings.

    The text is the tokenizer's decoding of all tokens so far (so the pieces add up to exactly what
    `tokenizer.decode` gives); a token that ends inside a multi-byte character decodes to a trailing
    U+FFFD, which is held back until the next tokens complete the character.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.stops = stops
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.stopped = False  # a stop string was found: the request is over

    def add(self, token: int | None, finished: bool) -> str:
        """The new piece of text after `token` (may be empty); at `finished`, everything still held back."""
        if token is not None and token not in self.eos_token_ids:
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not finished:
            text = text.rstrip("\ufffd")
        end, self.stopped = find_stop(text, self.stops)
        if finished and not self.stopped:
            end = len(text)  # nothing more can complete a stop string
        piece = text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


# ---------------------------------------------------------------- the app


class ServerMetrics:
    """Latency histograms measured where the client feels them (the handler), in seconds from `clock`."""

    def __init__(self):
        self.ttft = Histogram("tiny_llm_time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = Histogram("tiny_llm_inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = Histogram("tiny_llm_e2e_request_latency_seconds", "Time from request arrival to its last token.")
        self.finished: dict[str, int] = {}  # finish reason -> requests

    def render(self, stats: dict[str, float]) -> str:
        gauges = [
            Metric("tiny_llm_num_requests_running", "Requests holding KV blocks and generating.", "gauge",
                   stats["num_running"]),
            Metric("tiny_llm_num_requests_waiting", "Requests waiting for admission.", "gauge", stats["num_waiting"]),
            Metric("tiny_llm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).", "gauge",
                   stats["kv_cache_usage"]),
            Metric("tiny_llm_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
                   "gauge", stats["prefix_cache_hit_rate"]),
            Metric("tiny_llm_prompt_tokens_total", "Prompt tokens processed.", "counter", stats["prompt_tokens_total"]),
            Metric("tiny_llm_generation_tokens_total", "Tokens generated.", "counter",
                   stats["generation_tokens_total"]),
            Metric("tiny_llm_requests_finished_total", "Requests finished (any reason, aborts included).", "counter",
                   sum(self.finished.values())),
        ]
        return render_prometheus([*gauges, self.ttft, self.itl, self.e2e])


@dataclass
class Generation:
    """What a handler learned about one request while it ran."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None


def create_app(engine, tokenizer, model_name: str, clock: Callable[[], float] = time.perf_counter,
               max_model_len: int | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving `engine` (started and stopped with the app's lifespan).

    `model_name` is the id clients send as "model" and that /v1/models lists. The engine thread is
    `app.state.engine_thread`. `clock` times the latency histograms. `max_model_len` (optional)
    rejects prompts that, with max_tokens, could never fit.
    """
    engine_thread = EngineThread(engine)
    metrics = ServerMetrics()

    async def lifespan(app):
        engine_thread.start()
        yield
        engine_thread.stop()

    app = FastAPI(title="tiny-llm", lifespan=lifespan)
    app.state.engine_thread = engine_thread
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        requested = body.get("model", model_name)  # absent means this server's model, as mlx_lm.server
        if requested != model_name:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        stream = _field(body, "stream", (bool,), False, "a boolean")
        options = _field(body, "stream_options", (dict,), {}, "an object")
        body["stream"], body["include_usage"] = stream, bool(options.get("include_usage", False))
        return body

    async def start(prompt: list[int], sampling: SamplingParams, prefix: str) -> tuple[RequestHandle, float]:
        """Hand the request to the engine thread; wait until it is accepted (or answer its refusal)."""
        if max_model_len is not None and len(prompt) + sampling.max_tokens > max_model_len:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) "
                           f"exceeds this server's {max_model_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        if not engine_thread.running:
            raise APIError(503, f"the engine is not running: {engine_thread.error!r}")
        arrival = clock()
        handle = RequestHandle(f"{prefix}-{uuid.uuid4().hex}", prompt, sampling, asyncio.get_running_loop(),
                               asyncio.Queue())
        engine_thread.submit(handle)
        first = await handle.events.get()
        if isinstance(first, Rejected):
            if isinstance(first.error, (ValueError, TypeError)):
                raise APIError(400, str(first.error), code="invalid_request")
            raise APIError(500, f"the engine failed: {first.error!r}")
        return handle, arrival

    async def tokens(handle: RequestHandle, stops: list[str], generation: Generation, arrival: float):
        """The request's text pieces, one per token; aborts the request if the consumer stops early."""
        text = TextStream(tokenizer, stops)
        last = None
        try:
            while True:
                output = await handle.events.get()
                if isinstance(output, Rejected):
                    raise APIError(500, f"the engine failed: {output.error!r}")
                now = clock()
                if output.token is not None and output.token not in text.eos_token_ids:
                    generation.completion_tokens += 1
                    if last is None:
                        metrics.ttft.observe(now - arrival)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                piece = text.add(output.token, output.finished)
                if text.stopped:
                    generation.finish_reason = "stop"
                elif output.finished:
                    generation.finish_reason = "length" if output.finish_reason == "length" else "stop"
                yield piece
                if generation.finish_reason is not None:
                    return
        finally:
            if generation.finish_reason is None or text.stopped:
                # The client left, the engine failed, or a stop string ended it early: free its blocks now.
                engine_thread.abort(handle.request_id)
            reason = generation.finish_reason or "abort"
            metrics.finished[reason] = metrics.finished.get(reason, 0) + 1
            metrics.e2e.observe(clock() - arrival)

    def usage(generation: Generation) -> dict:
        return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens,
                "total_tokens": generation.prompt_tokens + generation.completion_tokens}

    async def collect(request: Request, pieces) -> str:
        """All of a non-streaming request's text; stops (and so aborts the request) if the client leaves."""
        text = []
        iterator = pieces.__aiter__()
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            while not step.done():
                await asyncio.wait([step], timeout=DISCONNECT_POLL_SECONDS)
                if not step.done() and await request.is_disconnected():
                    step.cancel()
                    await pieces.aclose()
                    raise APIError(499, "client disconnected")
            try:
                text.append(step.result())
            except StopAsyncIteration:
                return "".join(text)

    async def respond(request: Request, body: dict, prompt: list[int], chat: bool):
        sampling, stops = parse_sampling(body)
        prefix = "chatcmpl" if chat else "cmpl"
        handle, arrival = await start(prompt, sampling, prefix)
        generation = Generation(handle.request_id, prompt_tokens=len(prompt))
        pieces = tokens(handle, stops, generation, arrival)
        created = int(time.time())
        head = {"id": handle.request_id, "created": created, "model": model_name}

        def choice(piece: str, finish_reason: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": piece} if first else ({"content": piece} if piece else {})
                return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return {"index": 0, "text": piece, "finish_reason": finish_reason, "logprobs": None}

        if not body["stream"]:
            text = await collect(request, pieces)
            if chat:
                message = {"role": "assistant", "content": text}
                choices = [{"index": 0, "message": message, "finish_reason": generation.finish_reason,
                            "logprobs": None}]
            else:
                choices = [{"index": 0, "text": text, "finish_reason": generation.finish_reason, "logprobs": None}]
            kind = "chat.completion" if chat else "text_completion"
            return JSONResponse({**head, "object": kind, "choices": choices, "usage": usage(generation)})

        kind = "chat.completion.chunk" if chat else "text_completion"

        async def events():
            # Cancelled here (the client left) or not, `pieces`' finally aborts an unfinished request.
            try:
                first = True
                async for piece in pieces:
                    done = generation.finish_reason is not None
                    if piece or first or not done:
                        yield sse_event({**head, "object": kind, "choices": [choice(piece, None, first)]})
                        first = False
                    if done:
                        yield sse_event({**head, "object": kind, "choices": [choice("", generation.finish_reason)]})
                if body["include_usage"]:
                    yield sse_event({**head, "object": kind, "choices": [], "usage": usage(generation)})
                yield sse_event("[DONE]")
            finally:
                await pieces.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        prompt_text = chat_prompt(tokenizer, body.get("messages"))
        return await respond(request, body, tokenizer.encode(prompt_text, add_special_tokens=False), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        return await respond(request, body, completion_prompt(tokenizer, body.get("prompt")), chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tiny-llm"}]}

    @app.get("/health")
    async def health():
        if not engine_thread.running:
            return JSONResponse({"status": "error", "error": repr(engine_thread.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(engine_thread.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
