"""Serving the engine over HTTP: an OpenAI-compatible API with streaming, stop strings and aborts.

A request's path, from socket to token and back:

    client ─HTTP─> uvicorn ─> FastAPI handler (event loop) ──inbox (queue.Queue)──> engine thread
                                     ^                                                  │ engine.step()
                                     └── asyncio.Queue <── loop.call_soon_threadsafe ───┘

- The event loop does the cheap, many things: parse and validate requests (`openai_api`), detokenize,
  cut at stop strings (`text_stream`), write server-sent events, notice disconnects. Tokenizing a long
  prompt, which can take seconds, runs on a worker thread so the loop (and the short prompts) keep
  being served.
- The engine thread does the one expensive thing, `engine.step()`, in a loop, and is the only caller
  of the engine (it is single-threaded by contract). Requests reach it through a thread-safe queue;
  tokens leave it through each request's `asyncio.Queue`, all of one step's in one
  `loop.call_soon_threadsafe` (an asyncio queue may only be touched from its own loop's thread).
- Every engine request is one `RequestHandle`, from `Server.admit` to `Server.close`: its reply queue,
  what the engine thread noted (answered, first scheduled) and what the handler learned (tokens,
  finish reason). `Completion` is one HTTP request's choices on their way to one answer or stream.
- A client that goes away is noticed by the handler, which asks the engine thread to `abort` the
  request: its KV blocks return to the pool before the next step.
- A step that fails fails the requests the engine dropped; the thread logs it and keeps serving.
- What the server reads of the engine is `engine.stats()` (an `EngineStats`), nothing else.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics
(Prometheus, vLLM's names). The protocol is `openai_api.py`, the metrics `prometheus_metrics.py`,
the body limit, API key, CORS and access log `http_extras.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .http_extras import install_http_extras, server_version
from .openai_api import (KEEP_ALIVE, TOKENIZE_BODY, APIError, CallReader, ChatCompletionRequest, CompletionRequest,
                         Detokenize, TokenizeChat, ToolCalls, chat_prompt_ids, check_choices, check_token_ids, choice,
                         collect_all, completion_prompt_ids, logprobs_field, text_ids, max_tokens_for, merge, model_card,
                         object_kind, output_constraint, parse_body, prompt_size, tool_calls_for, usage)
from .prometheus_metrics import ServerMetrics
from .sequence import SamplingParams
from .text_stream import IncrementalDetokenizer, TextStream, find_stop  # noqa: F401 (day 3.5's tasks: server.X too)

logger = logging.getLogger("tiny_llm.server")

LONG_PROMPT_CHARS = 16_384  # longer prompts are tokenized on a worker thread (milliseconds and up)
ARRIVAL_WAIT = 0.01  # seconds a step may wait for requests still arriving (a step on a CPU: 0.1 s and up)
KEEPALIVE_SECONDS = 5.0  # a stream with nothing to send for this long gets an SSE comment (proxies close idle ones)
MAX_BODY_BYTES = 8 * 2**20  # a larger request body is a 413: a 2 MB prompt is already far past any context
MAX_PENDING_REQUESTS = 256  # engine requests (choices) in flight; beyond it a 429 with Retry-After
RETRY_AFTER_SECONDS = 1


# ---------------------------------------------------------------- wire formats


def sse_event(payload: dict | str) -> str:
    """One server-sent event carrying `payload`: a dict as compact JSON, or a string (`[DONE]`) as is.

    An event is a `data: ` line followed by a blank line; a JSON payload must fit on that one line.
    """
    # BEGIN TASK Week 3 Day 5 Task 1: server-sent event
    # TODO: a dict as compact JSON (json.dumps escapes newlines), a string as it is; "data: ...\n\n"
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
    # END TASK


SSE_KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment line: clients skip it, the connection stays busy


# ---------------------------------------------------------------- one request


@dataclass
class RequestHandle:
    """One engine request (one choice of an HTTP request) from its submission to its end, and its reply queue.

    The engine thread puts events on `events` (through `loop`): first `Accepted()` or `Rejected(error)`,
    then one `StepOutput` per token, the last one with `finished` True. The handler keeps what it
    learns here too, so a request's whole state is this one object.
    """

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    priority: int = 0
    submitted: float = 0.0  # when the handler submitted it (the app's clock)
    # Set by the engine thread.
    answered: bool = False  # Accepted or Rejected was sent
    scheduled: float | None = None  # when it was first in a step, for /metrics
    # Set by the handler.
    completion_tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served (known when the engine finishes it)
    logprobs: list | None = None  # the tokens' TokenLogprobs not yet sent; None: the request asked for none
    text_offset: int = 0  # where the next token's text starts in the choice's text (completions' logprobs)
    first_token: float | None = None
    last_token: float | None = None
    closed: bool = False  # its end was handled (`Server.close`): aborted if unfinished, counted in the metrics

    def __post_init__(self):
        if self.sampling.logprobs is not None:
            self.logprobs = []

    def take_logprobs(self) -> list | None:
        """The log-probabilities gathered since the last call (None when the request asked for none)."""
        if self.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken


@dataclass
class Accepted:
    """The engine took the request."""


@dataclass
class Rejected:
    """The engine refused or dropped the request: the handler answers with a 4xx or 5xx."""

    error: Exception


@dataclass
class ClientLeft:
    """The handler's own note on its queue: the client disconnected."""


@dataclass
class ServerStopping:
    """The server's note on a request's queue: shutting down, end the request now (finish reason "abort")."""


# ---------------------------------------------------------------- the engine thread


class EngineThread:
    """Runs the engine in its own thread; the only code that calls `engine.add_request/step/abort`.

    Handlers call `submit(handle)` and `abort(request_id)` from the event loop: both only put a command
    on `inbox`, a thread-safe queue. The thread turns commands into engine calls between steps, and
    after each step also publishes `stats`, the engine's `EngineStats` for /metrics (read from the
    event loop while the engine keeps changing).
    """

    def __init__(self, engine, clock: Callable[[], float] = time.perf_counter):
        """A thread for `engine` (an `LLMEngine`, or anything with its interface); `start()` starts it.
        `clock` times when requests are first scheduled (the app's clock)."""
        self.engine = engine
        self.clock = clock
        self.turn_began = clock()  # when this turn's commands were taken: its step follows at once
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[str, RequestHandle] = {}
        self.stats = engine.stats()
        self.error: BaseException | None = None  # what killed the thread, if anything did
        self.running = False
        self.outbox: list[tuple[RequestHandle, object]] = []  # this turn's events, delivered together
        self.taken: list[RequestHandle] = []  # the requests this turn took from the inbox
        self.preparing = 0  # requests a handler has begun (parsing, tokenizing) but not yet submitted
        self.prepared = threading.Condition()  # notified whenever `preparing` drops
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

    @contextmanager
    def arriving(self):
        """Around a handler's work from a request's arrival to its `submit`: a step about to start waits
        (at most ARRIVAL_WAIT) for it, so requests that arrive together start in the same step (provided)."""
        with self.prepared:
            self.preparing += 1
        try:
            yield
        finally:
            with self.prepared:
                self.preparing -= 1
                self.prepared.notify_all()

    def commands(self, block: bool):
        """The commands for this turn (provided): with `block`, wait for the first one and whatever else
        arrives in the next ARRIVAL_WAIT seconds; then wait (at most ARRIVAL_WAIT) until no handler is still
        preparing a request; then take whatever is in the inbox.

        Requests of a burst reach the server milliseconds apart. Without the waits, the first one's step
        would start at once and the others, a step (0.1 s and up) later, would wait all of it for their
        first token. From idle the first request pays at most ARRIVAL_WAIT for that; while the engine is
        busy nobody does, unless a handler is preparing a request at that very moment.
        """
        self.taken = []
        if block:
            yield self.take(self.inbox.get())
            deadline = time.monotonic() + ARRIVAL_WAIT
            while (left := deadline - time.monotonic()) > 0:
                try:
                    yield self.take(self.inbox.get(timeout=left))
                except queue.Empty:
                    break
        with self.prepared:
            self.prepared.wait_for(lambda: self.preparing == 0, timeout=ARRIVAL_WAIT)
        self.turn_began = self.clock()
        while True:
            try:
                yield self.take(self.inbox.get_nowait())
            except queue.Empty:
                self.flush()  # the turn's answers (Accepted, Rejected) go out now, not a whole step later
                return

    def take(self, command: tuple):
        """A command taken from the inbox; an "add" is remembered until the turn answers it (provided)."""
        if command[0] == "add":
            self.taken.append(command[1])
        return command

    def send(self, handle: RequestHandle, event) -> None:
        """Queue `event` for the handle; the turn's events reach the event loop together at its end."""
        if isinstance(event, (Accepted, Rejected)):
            handle.answered = True
        else:
            self.mark_scheduled(handle)  # a token (or an end): it was in this turn's step, if not before
        self.outbox.append((handle, event))

    def mark_scheduled(self, handle: RequestHandle) -> None:
        """Remember when the request was first in a step: this turn's start, or its submission if later."""
        if handle.scheduled is None:
            handle.scheduled = max(self.turn_began, handle.submitted)

    def flush(self) -> None:
        """Deliver this turn's events: one wake-up of each event loop per turn, not one per token (provided)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, event in self.outbox:
            by_loop.setdefault(handle.loop, []).append((handle.events, event))
        self.outbox = []
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed: the server is gone, nobody is waiting
                pass

    def publish_stats(self) -> None:
        """After a turn: the engine's `EngineStats` for /metrics, and when the requests it scheduled were first in
        a step (provided)."""
        self.stats = self.engine.stats()
        for request_id in self.stats.scheduled:
            handle = self.handles.get(request_id)
            if handle is not None:
                self.mark_scheduled(handle)

    def run_once(self) -> bool:
        """One turn of the engine thread: apply the commands in `inbox`, then run one engine step.

        Take the turn's commands from `commands(block)`, which waits for the first one only when asked
        (with no work in the engine, wait for a command instead of spinning). "add": call
        `engine.add_request(handle.prompt, handle.sampling, request_id=..., priority=...)`, remember the
        handle, and send it `Accepted()`, or `Rejected(error)` if add_request raised ValueError/TypeError.
        "abort": `engine.abort(request_id)` and forget the handle (its client is gone). "stop": return
        False. After a step, send each `StepOutput` to its request's handle (forget the handle when the
        output is finished), then `publish_stats()`. Returns True to keep running.
        """
        # BEGIN TASK Week 3 Day 5 Task 4: the engine thread's turn
        # TODO: take `self.commands(block=...)`, blocking only when the engine is idle; apply add/abort/stop;
        # TODO: one step; send each output to its handle
        for command, argument in self.commands(block=not self.engine.has_work()):
            if command == "stop":
                return False
            if command == "add":
                try:
                    self.engine.add_request(argument.prompt, argument.sampling, request_id=argument.request_id,
                                            priority=argument.priority)
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
        """The thread: turns until "stop"; a failed turn fails its requests, only a broken thread ends it (provided)."""
        try:
            while True:
                try:
                    keep_running = self.run_once()
                except NotImplementedError:
                    raise  # an unfinished skeleton: nothing to recover
                except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
                    self.fail_dropped(error)
                    keep_running = True
                finally:
                    self.flush()
                if not keep_running:
                    return
        except BaseException as error:  # noqa: BLE001 - a dead engine thread must fail every waiting request
            logger.exception("the engine thread died; every request fails until a restart")
            self.error = error
            self.fail(list(self.handles), error)
            self.fail_unanswered(error)
            while not self.inbox.empty():  # requests still in the inbox would wait forever: refuse them too
                command, argument = self.inbox.get()
                if command == "add":
                    self.send(argument, Rejected(error))
            self.flush()
        finally:
            self.running = False

    def fail_dropped(self, error: Exception) -> None:
        """After a failed turn: fail the requests it concerned, log it, keep serving (provided).

        The engine frees the blocks of the sequences of a step that failed: those requests fail. A
        request whose `add_request` raised something unexpected fails too. If neither explains the
        failure and the engine kept its work, the next step would likely fail the same way: every
        running request is aborted and failed.
        """
        logger.exception("an engine turn failed; failing the requests it concerned and serving on")
        held = self.engine.stats().held
        dropped = [request_id for request_id in self.handles if request_id not in held]
        lost = self.fail_unanswered(error)
        if not dropped and not lost and self.engine.has_work():
            dropped = list(self.handles)
            for request_id in dropped:
                self.engine.abort(request_id)
        self.fail(dropped, error)
        self.publish_stats()

    def fail_unanswered(self, error: BaseException) -> list[RequestHandle]:
        """Fail the requests this turn took from the inbox and never answered (their `add_request` raised
        something unexpected, or the turn ended before it got to them); returns them (provided)."""
        lost = [handle for handle in self.taken if not handle.answered]
        for handle in lost:
            self.send(handle, Rejected(error))
        return lost

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self.send(self.handles.pop(request_id), Rejected(error))


def _deliver(events: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: put each event on its request's queue."""
    for events_queue, event in events:
        events_queue.put_nowait(event)


# ---------------------------------------------------------------- a request's life


async def wait_for_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """Tell the handler (through its requests' queues) when the client goes away; run as a task beside it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.events.put_nowait(ClientLeft())


class Server:
    """What every handler shares: the engine thread, the tokenizer, the metrics and the requests in flight.

    A request's life, in order: `admit` (checks, then one `RequestHandle` per choice handed to the
    engine thread), a `Completion` (waits until the engine took them, then streams or collects), and
    `close` (once per handle, however it ended: aborted unless the engine finished it, counted).
    """

    def __init__(self, engine, tokenizer, model_name: str, clock: Callable[[], float], max_model_len: int | None,
                 keepalive: float, max_pending: int):
        self.engine_thread = EngineThread(engine, clock)
        self.tokenizer, self.model_name, self.clock = tokenizer, model_name, clock
        stats = self.engine_thread.stats
        self.context = stats.max_request_tokens if max_model_len is None else max_model_len
        if not 1 <= self.context <= stats.max_request_tokens:
            raise ValueError(f"max_model_len={max_model_len} must be in 1 .. {stats.max_request_tokens}: "
                             f"the tokens this engine's KV pool and model positions hold")
        self.vocab_size = stats.vocab_size
        self.metrics = ServerMetrics(model_name, lambda: self.engine_thread.stats, self.context)
        self.keepalive, self.max_pending = keepalive, max_pending
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.active: dict[str, RequestHandle] = {}  # engine requests from `admit` to `close`, by id
        self.draining = False

    async def tokenize(self, size: int, function, *args):
        """Tokenize a prompt of `size` characters: a short one right here (it takes microseconds), a long one
        on the tokenizing thread, so it stalls neither the event loop nor the short prompts behind it."""
        if size <= LONG_PROMPT_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, function, *args)

    def check_open(self, num_choices: int) -> None:
        """A 503 while shutting down or without an engine thread; a 429 with Retry-After when `num_choices` more
        engine requests would pass `max_pending` (beyond it a client would wait with nothing to show)."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if not self.engine_thread.running:
            raise APIError(503, f"the engine is not running: {self.engine_thread.error!r}")
        if len(self.active) + num_choices > self.max_pending:
            raise APIError(429, f"the server is busy ({len(self.active)} requests in flight, at most "
                           f"{self.max_pending}): retry shortly", code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def admit(self, body, prompts: list[list[int]], chat: bool, arrival: float) -> Completion:
        """Every prompt `n` times, one engine request per choice, all handed to the engine thread at once (so
        they start in the same step); every check first, so a refused request leaves nothing behind."""
        check_choices(len(prompts), body.n)
        check_token_ids(body, self.vocab_size)
        tools = tool_calls_for(body, self.tokenizer, self.vocab_size)  # day 4.5: tools, a call forced or read back
        constraint = tools.constraint if tools and tools.forced else output_constraint(body, self.tokenizer,
                                                                                       self.vocab_size)
        choices = [(prompt, body.sampling(max_tokens_for(body, len(prompt), self.context), i, constraint))
                   for prompt in prompts for i in range(body.n)]
        self.check_open(len(choices))
        self.metrics.n.observe(body.n)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        handles = []
        for index, (prompt, sampling) in enumerate(choices):
            handle = RequestHandle(f"{response_id}-{index}", prompt, sampling, loop, asyncio.Queue(), body.priority,
                                   submitted=self.clock())
            self.active[handle.request_id] = handle
            self.engine_thread.submit(handle)
            handles.append(handle)
        return Completion(self, body, prompts, chat, arrival, response_id, handles, tools)

    def close(self, handle: RequestHandle, arrival: float, finished: bool = False, count: bool = True) -> None:
        """A request's end, handled once however it came: abort it unless the engine `finished` it; `count` it
        in the metrics (not a request the engine refused)."""
        if handle.closed:
            return
        handle.closed = True
        self.active.pop(handle.request_id, None)
        if not finished:
            self.engine_thread.abort(handle.request_id)
        if not count:
            return
        self.metrics.request_ended(handle.finish_reason or "abort", self.clock() - arrival, len(handle.prompt),
                                   handle.completion_tokens, handle.sampling.max_tokens)
        if handle.scheduled is not None:  # never scheduled: it left (or failed) while it waited
            self.metrics.phases(handle.submitted, handle.scheduled, handle.first_token, handle.last_token,
                                handle.completion_tokens)

    async def drain(self, timeout: float) -> None:
        """Shutting down: refuse new requests, let running ones finish for `timeout` seconds, end the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(self.active.values()):
            handle.events.put_nowait(ServerStopping())


class Completion:
    """One HTTP request's choices (a `RequestHandle` each) on their way to one JSON answer or one stream."""

    def __init__(self, server: Server, body, prompts: list[list[int]], chat: bool, arrival: float,
                 response_id: str, handles: list[RequestHandle], tools: ToolCalls | None = None):
        self.server, self.body, self.prompts, self.chat, self.arrival = server, body, prompts, chat, arrival
        self.handles = handles
        self.head = {"id": response_id, "created": int(time.time()), "model": server.model_name}
        # Day 4.5: with tools, each choice's text is read as a call while it may be one.
        self.readers = [CallReader(tools, f"call_{uuid.uuid4().hex[:24]}") for _ in handles] if tools else None

    async def accepted(self) -> None:
        """Wait for the engine thread to take every choice; if it refuses one (or the wait ends), none runs on."""
        try:
            for handle in self.handles:
                first = await handle.events.get()
                if isinstance(first, Rejected) and isinstance(first.error, (ValueError, TypeError)):
                    raise APIError(400, str(first.error), code="invalid_request")
                if isinstance(first, Rejected):
                    raise APIError(500, f"the engine failed: {type(first.error).__name__}")
                if not isinstance(first, Accepted):
                    raise APIError(503, "the server is shutting down")
        except BaseException:
            for handle in self.handles:
                self.server.close(handle, self.arrival, count=False)
            raise

    def count_token(self, handle: RequestHandle, output) -> None:
        """What one StepOutput tells the usage and the metrics: its token's time, log-probabilities, cached tokens."""
        if output.finished:
            handle.cached_tokens = output.num_cached_tokens or 0
        if output.token is None:  # EOS or a stop token id ends a request with token None (unless it ignores EOS)
            return
        now = self.server.clock()
        handle.completion_tokens += 1
        if output.logprobs is not None:
            handle.logprobs.append(output.logprobs)
        if handle.last_token is None:
            handle.first_token = now
            self.server.metrics.ttft.observe(now - self.arrival)
        else:
            self.server.metrics.itl.observe(now - handle.last_token)
        handle.last_token = now

    async def tokens(self, handle: RequestHandle):
        """One choice's text pieces, one per token; aborts the request if it ends before the engine says so."""
        text = TextStream(self.server.tokenizer, self.body.stop_strings())
        engine_done = False  # the engine finished the request itself (EOS, a stop token id or max_tokens)
        try:
            while True:
                output = await handle.events.get()
                if isinstance(output, ClientLeft):
                    return
                if isinstance(output, ServerStopping):
                    handle.finish_reason = "abort"
                    yield text.add(None, finished=True)
                    return
                if isinstance(output, Rejected):
                    raise APIError(500, f"the engine failed: {type(output.error).__name__}")
                self.count_token(handle, output)
                engine_done = output.finished
                piece = text.add(output.token, output.finished)
                if text.stopped:
                    handle.finish_reason = "stop"
                elif output.finished:
                    handle.finish_reason = "length" if output.finish_reason == "length" else "stop"
                yield piece
                if handle.finish_reason is not None:
                    return
        finally:
            # The client left, the engine failed, a stop string or a shutdown ended it: free its blocks now.
            self.server.close(handle, self.arrival, finished=engine_done and not text.stopped)

    def usage(self) -> dict:
        """The response's `usage`: each prompt counted once however many choices it has, its cached tokens too
        (the most any of its choices found: one stopped by a stop string never learns its count)."""
        n = self.body.n
        per_prompt = [self.handles[i:i + n] for i in range(0, len(self.handles), n)]
        cached = sum(max(handle.cached_tokens for handle in choices) for choices in per_prompt)
        completion = sum(handle.completion_tokens for handle in self.handles)
        return usage(sum(len(prompt) for prompt in self.prompts), completion, cached)

    def logprobs_of(self, handle: RequestHandle, entries: list | None) -> dict | None:
        """A choice's `logprobs` for `entries`, in the response's shape; offsets go on from the last chunk's."""
        shaped = logprobs_field(self.chat, entries, lambda token: self.server.tokenizer.decode([token]),
                                handle.text_offset)
        if shaped is not None and not self.chat:
            handle.text_offset += sum(len(token) for token in shaped["tokens"])
        return shaped

    async def answer(self, request: Request) -> Response:
        """Serve the submitted choices as one response or one stream."""
        await self.accepted()
        watcher = asyncio.create_task(wait_for_disconnect(request, self.handles))
        # A stream's own `finally` closes its request, but only if the stream ever started: a response cancelled
        # before its body was read (the client left at once) never starts it. The watcher ends with the
        # response, however it ends (callbacks run even for a task cancelled before it ran): it closes the rest.
        watcher.add_done_callback(lambda _: [self.server.close(handle, self.arrival) for handle in self.handles])
        streams = [self.tokens(handle) for handle in self.handles]
        if not self.body.stream:
            return await self.whole(streams, watcher)
        return StreamingResponse(self.events(streams, watcher), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def whole(self, streams: list, watcher: asyncio.Task) -> JSONResponse:
        """Every choice's whole text in one JSON answer."""
        texts = await collect_all(streams, watcher)
        if any(handle.finish_reason is None for handle in self.handles):
            raise APIError(499, "the client disconnected")  # nobody reads this: it is for the access log
        choices = [self.whole_choice(i, text, handle) for i, (text, handle) in enumerate(zip(texts, self.handles))]
        return JSONResponse({**self.head, "object": object_kind(self.chat, False), "choices": choices,
                             "usage": self.usage()})

    def whole_choice(self, index: int, text: str, handle: RequestHandle) -> dict:
        """Choice `index` of a whole answer: its text, or (day 4.5) the tool call the text is."""
        logprobs = self.logprobs_of(handle, handle.take_logprobs())
        if self.readers is None:
            return choice(self.chat, index, text, handle.finish_reason, streaming=False, logprobs=logprobs)
        message, finish_reason = self.readers[index].answer(text, handle.finish_reason)
        return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}

    async def events(self, streams: list, watcher: asyncio.Task):
        """The stream's server-sent events: a chunk per piece, keep-alive comments while nothing comes, then
        `usage` (if asked) and `[DONE]`."""
        kind = object_kind(self.chat, True)
        # Cancelled here (the client left) or not, each stream's finally aborts its unfinished request.
        try:
            async for chunk in merge(streams, self.handles, self.server.keepalive):
                if chunk is KEEP_ALIVE:
                    yield SSE_KEEP_ALIVE
                    continue
                index, piece, finish_reason, first, entries = chunk
                logprobs = self.logprobs_of(self.handles[index], entries)
                part = choice(self.chat, index, piece, finish_reason, True, first, logprobs) if self.readers is None \
                    else self.readers[index].chunk_choice(index, piece, finish_reason, first, logprobs)
                yield sse_event({**self.head, "object": kind, "choices": [part]})
            if any(handle.finish_reason is None for handle in self.handles):
                return  # the client left or the engine failed: nothing more to say
            if self.body.include_usage:
                yield sse_event({**self.head, "object": kind, "choices": [], "usage": self.usage()})
            yield sse_event("[DONE]")
        finally:
            watcher.cancel()
            for stream in streams:
                await stream.aclose()


# ---------------------------------------------------------------- the app


def add_completion_routes(app: FastAPI, server: Server) -> None:
    """POST /v1/chat/completions and /v1/completions."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = server.clock()
        server.check_open(1)  # before reading the body: a busy server spends nothing on a refused request
        with server.engine_thread.arriving():
            body = parse_body(ChatCompletionRequest, await request.body(), server.model_name)
            size = sum(len(message.text()) for message in body.messages)
            prompts = [await server.tokenize(size, chat_prompt_ids, server.tokenizer, body.messages, True, False,
                                             body.prompt_tools())]
            completion = server.admit(body, prompts, True, arrival)
        return await completion.answer(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = server.clock()
        server.check_open(1)
        with server.engine_thread.arriving():
            body = parse_body(CompletionRequest, await request.body(), server.model_name)
            prompts = await server.tokenize(prompt_size(body.prompt), completion_prompt_ids, server.tokenizer,
                                            body.prompt, server.vocab_size)
            completion = server.admit(body, prompts, False, arrival)
        return await completion.answer(request)


def add_tokenizer_routes(app: FastAPI, server: Server) -> None:
    """vLLM's POST /tokenize (a prompt, or messages through the chat template) and POST /detokenize."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = parse_body(TOKENIZE_BODY, await request.body(), server.model_name)
        if isinstance(body, TokenizeChat):
            size = sum(len(message.text()) for message in body.messages)
            tokens = await server.tokenize(size, chat_prompt_ids, server.tokenizer, body.messages,
                                           body.add_generation_prompt, body.add_special_tokens, body.tools)
        else:
            tokens = await server.tokenize(len(body.prompt), text_ids, server.tokenizer, body.prompt,
                                           body.add_special_tokens)
        token_strs = server.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": server.context, "tokens": tokens, "token_strs": token_strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = parse_body(Detokenize, await request.body(), server.model_name)
        if body.tokens and max(body.tokens) >= server.vocab_size:
            raise APIError(400, f"'tokens' holds a token id outside the vocabulary (0 .. {server.vocab_size - 1})",
                           param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}


def add_info_routes(app: FastAPI, server: Server) -> None:
    """GET /v1/models, /v1/models/{id}, /version, /health and /metrics."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server.model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != server.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card(server.model_name)

    @app.get("/version")
    async def version():
        return {"version": server_version()}

    @app.get("/health")
    async def health():
        if not server.engine_thread.running:
            return JSONResponse({"status": "error", "error": repr(server.engine_thread.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        content, content_type = server.metrics.render()
        return Response(content, media_type=content_type)


def create_app(engine, tokenizer, model_name: str, clock: Callable[[], float] = time.perf_counter,
               max_model_len: int | None = None, api_key: str | None = None, cors_origins: tuple[str, ...] = (),
               max_body_bytes: int = MAX_BODY_BYTES, max_pending_requests: int = MAX_PENDING_REQUESTS,
               keepalive: float = KEEPALIVE_SECONDS) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving `engine` (started and stopped with the app's lifespan).

    `model_name` is the id clients send as "model" and that /v1/models lists. The engine thread is
    `app.state.engine_thread`. `clock` times the latency histograms. `max_model_len` (optional, at
    most what the engine can hold) bounds prompt plus output. `api_key`: requests to /v1 must send
    it as `Authorization: Bearer KEY`. `cors_origins`: origins a browser may call from ("*": any).
    `max_body_bytes`: a larger body is a 413. `max_pending_requests`: engine requests (choices) in
    flight before new ones get a 429. `keepalive`: seconds of silence before a stream gets an SSE comment.
    """
    server = Server(engine, tokenizer, model_name, clock, max_model_len, keepalive, max_pending_requests)

    async def lifespan(app):
        server.engine_thread.start()
        yield
        server.engine_thread.stop()
        server.tokenize_pool.shutdown(wait=False)

    app = FastAPI(title="tiny-llm", lifespan=lifespan)
    app.state.server = server
    app.state.engine_thread = server.engine_thread
    app.state.metrics = server.metrics
    app.state.drain = server.drain
    install_http_extras(app, api_key, list(cors_origins), max_body_bytes, errors=APIError)
    add_completion_routes(app, server)
    add_tokenizer_routes(app, server)
    add_info_routes(app, server)
    return app
