"""Serving the engine over HTTP: an OpenAI-compatible API with streaming, stop strings and aborts.

A request's path, from socket to token and back:

    client ─HTTP─> uvicorn ─> FastAPI handler (event loop) ──inbox (queue.Queue)──> engine thread
                                     ^                                                  │ engine.step()
                                     └── asyncio.Queue <── loop.call_soon_threadsafe ───┘

- The event loop does the cheap, many things: parse and validate requests (`openai_api`), detokenize,
  cut at stop strings, write server-sent events, notice disconnects. Tokenizing a long prompt, which
  can take seconds, runs on a worker thread so the loop (and the short prompts) keep being served.
- The engine thread does the one expensive thing, `engine.step()`, in a loop, and is the only caller
  of the engine (it is single-threaded by contract). Requests reach it through a thread-safe queue;
  tokens leave it through each request's `asyncio.Queue`, all of one step's in one
  `loop.call_soon_threadsafe` (an asyncio queue may only be touched from its own loop's thread).
- A client that goes away is noticed by the handler, which asks the engine thread to `abort` the
  request: its KV blocks return to the pool before the next step.
- A step that fails fails the requests the engine dropped; the thread logs it and keeps serving.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics (Prometheus, vLLM's names). The OpenAI plumbing
(request models, errors, responses, metrics, API key, CORS, access log) is `openai_api.py`.
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

from .openai_api import (APIError, ChatCompletionRequest, CompletionRequest, ServerMetrics, chat_prompt_ids,
                         check_choices, check_logit_bias, choice, collect_all, completion_prompt_ids,
                         install_http_extras, logprobs_field, max_tokens_for, merge, model_card, object_kind,
                         output_constraint, parse_body, prompt_size, usage)
from .sequence import SamplingParams

logger = logging.getLogger("tiny_llm.server")

LONG_PROMPT_CHARS = 16_384  # longer prompts are tokenized on a worker thread (milliseconds and up)
ARRIVAL_WAIT = 0.01  # seconds a step may wait for requests still arriving (a step on a CPU: 0.1 s and up)


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


def find_stop(text: str, stops: list[str]) -> tuple[int, bool]:
    """How much of `text` may be sent to the client now, and whether a stop string was found.

    Returns `(end, stopped)`. If a stop string occurs in `text`, `end` is where the earliest one starts
    and `stopped` is True: the client gets `text[:end]`, never the stop string itself. Otherwise `end`
    holds back the longest tail of `text` that is the beginning of some stop string (the next tokens
    may complete it), and `stopped` is False.
    """
    # BEGIN TASK Week 3 Day 5 Task 2: stop strings
    # TODO: the earliest occurrence of any stop; else hold back the longest tail that begins a stop
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


class IncrementalDetokenizer:
    """Text from tokens one token at a time, decoding a short window instead of the whole output.

    Decoding all the tokens again after each one costs O(n) per token, O(n^2) per stream. Instead,
    keep two offsets into `tokens`: `read_offset`, the end of what was already turned into text, and
    `prefix_offset`, a little before it, so the window decoded has the context some tokenizers need
    (a SentencePiece token's leading space depends on the token before it). The new text is the
    window's decoding minus the decoding of its already-read part. A token that ends inside a
    multi-byte character decodes to a trailing U+FFFD: nothing is returned until the next tokens
    complete the character.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # where the decoded window starts
        self.read_offset = 0  # tokens before this have been returned as text

    def add(self, token: int) -> str:
        """The text `token` completes (often one word piece; empty while a character is incomplete)."""
        # BEGIN TASK Week 3 Day 5 Task 3: incremental detokenization
        # TODO: append; decode tokens[prefix_offset:read_offset] and tokens[prefix_offset:]; if the window
        # TODO: grew and does not end in U+FFFD, move both offsets forward and return the new text
        self.tokens.append(token)
        already = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        if len(window) <= len(already) or window.endswith("\ufffd"):
            return ""  # the token ended inside a character (or added no text yet): wait for the next ones
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return window[len(already):]
        # END TASK

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, as `tokenizer.decode` renders it (provided)."""
        already = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return window[len(already):]


class TextStream:
    """Turns one request's tokens into the text pieces its client receives: detokenized, cut at stop strings.

    The pieces add up to what `tokenizer.decode` gives for all the tokens, cut before the first stop
    string. Only the text not yet sent is searched for stop strings: `find_stop` never lets a piece
    end with the beginning of a stop string, so a stop cannot straddle what was sent (provided).
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.stops = stops
        self.pending = ""  # text decoded but not sent: it may be the beginning of a stop string
        self.stopped = False  # a stop string was found: the request is over

    def add(self, token: int | None, finished: bool) -> str:
        """The new piece of text after `token` (may be empty); at `finished`, everything still held back."""
        if token is not None and token not in self.eos_token_ids:
            self.pending += self.detokenizer.add(token)
        if finished:
            self.pending += self.detokenizer.flush()
        end, self.stopped = find_stop(self.pending, self.stops)
        if finished and not self.stopped:
            end = len(self.pending)  # nothing more can complete a stop string
        piece, self.pending = self.pending[:end], self.pending[end:]
        return piece


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
    priority: int = 0
    submitted: float = 0.0  # when the handler submitted it (the app's clock)
    scheduled: float | None = None  # when it was first in a step (set by the engine thread), for /metrics


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


def engine_stats(engine) -> dict[str, float]:
    """The engine's gauges and counters for /metrics (the one place that reads them) (provided)."""
    manager = engine.block_manager
    return {
        "num_running": engine.num_running,
        "num_waiting": engine.num_waiting,
        "kv_cache_usage": engine.kv_cache_usage,
        "prefix_cache_queries": getattr(manager, "queried_tokens", 0),
        "prefix_cache_hits": getattr(manager, "hit_tokens", 0),
        "num_preemptions": engine.num_preemptions,
        "prompt_tokens": engine.prompt_tokens_total,
        "generation_tokens": engine.generation_tokens_total,
    }


def engine_holds(engine, request_id) -> bool:
    """Whether the engine still has this request, waiting or running (provided)."""
    return request_id in engine.sequences


def engine_admitted(engine, request_id) -> bool:
    """Whether the engine has admitted this request into a step at least once (provided)."""
    seq = engine.sequences.get(request_id)
    return seq is not None and seq.num_cached_tokens is not None  # set at the first admission


def engine_context(engine) -> int:
    """The most tokens one request can hold: the KV pool's size or the model's positions (provided)."""
    manager = engine.block_manager
    return min(manager.num_blocks * manager.block_size, engine.model.max_position)


class EngineThread:
    """Runs the engine in its own thread; the only code that calls `engine.add_request/step/abort`.

    Handlers call `submit(handle)` and `abort(request_id)` from the event loop: both only put a command
    on `inbox`, a thread-safe queue. The thread turns commands into engine calls between steps, and
    after each step also publishes `stats`, a snapshot of the engine's gauges for /metrics (read
    from the event loop while the engine keeps changing).
    """

    def __init__(self, engine, clock: Callable[[], float] = time.perf_counter):
        """A thread for `engine` (an `LLMEngine`, or anything with its interface); `start()` starts it.
        `clock` times when requests are first scheduled (the app's clock)."""
        self.engine = engine
        self.clock = clock
        self.turn_began = clock()  # when this turn's commands were taken: its step follows at once
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[str, RequestHandle] = {}
        self.stats: dict[str, float] = {}
        self.error: BaseException | None = None  # what killed the thread, if anything did
        self.running = False
        self.outbox: list[tuple[RequestHandle, object]] = []  # this turn's events, delivered together
        self.unanswered: dict[str, RequestHandle] = {}  # submitted, neither Accepted nor Rejected yet
        self.submit_lock = threading.Lock()  # submit's two steps, seen together by fail_dropped
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
        with self.submit_lock:
            self.unanswered[handle.request_id] = handle
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
        if block:
            yield self.inbox.get()
            deadline = time.monotonic() + ARRIVAL_WAIT
            while (left := deadline - time.monotonic()) > 0:
                try:
                    yield self.inbox.get(timeout=left)
                except queue.Empty:
                    break
        with self.prepared:
            self.prepared.wait_for(lambda: self.preparing == 0, timeout=ARRIVAL_WAIT)
        self.turn_began = self.clock()
        while True:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                return

    def send(self, handle: RequestHandle, event) -> None:
        """Queue `event` for the handle; the turn's events reach the event loop together at its end."""
        if isinstance(event, (Accepted, Rejected)):
            self.unanswered.pop(handle.request_id, None)
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
        """After a turn: the engine's gauges for /metrics, and when the requests it admitted were scheduled."""
        self.stats = engine_stats(self.engine)
        for request_id, handle in self.handles.items():
            if handle.scheduled is None and engine_admitted(self.engine, request_id):
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
        lost = self.lost_submissions()
        dropped = [request_id for request_id in self.handles if not engine_holds(self.engine, request_id)]
        if not dropped and not lost and self.engine.has_work():
            dropped = list(self.handles)
            for request_id in dropped:
                self.engine.abort(request_id)
        self.fail(dropped, error)
        for handle in lost:
            self.send(handle, Rejected(error))
        self.publish_stats()

    def lost_submissions(self) -> list[RequestHandle]:
        """Requests taken from the inbox but never answered: their `add_request` raised something unexpected."""
        with self.submit_lock:
            waiting = {argument.request_id for command, argument in list(self.inbox.queue) if command == "add"}
            return [handle for request_id, handle in self.unanswered.items()
                    if request_id not in waiting and request_id not in self.handles]

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self.send(self.handles.pop(request_id), Rejected(error))


def _deliver(events: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: put each event on its request's queue."""
    for events_queue, event in events:
        events_queue.put_nowait(event)


# ---------------------------------------------------------------- the app


@dataclass
class Generation:
    """What a handler learned about one request while it ran."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served (known when the engine finishes it)
    logprobs: list | None = None  # the tokens' TokenLogprobs not yet sent; None: the request asked for none
    text_offset: int = 0  # where the next token's text starts in the choice's text (completions' logprobs)
    closed: bool = False  # its end was handled (`close_request`): aborted if unfinished, counted in the metrics

    def take_logprobs(self) -> list | None:
        """The log-probabilities gathered since the last call (None when the request asked for none)."""
        if self.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken


async def wait_for_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """Tell the handler (through its requests' queues) when the client goes away; run as a task beside it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.events.put_nowait(ClientLeft())


def create_app(engine, tokenizer, model_name: str, clock: Callable[[], float] = time.perf_counter,
               max_model_len: int | None = None, api_key: str | None = None,
               cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving `engine` (started and stopped with the app's lifespan).

    `model_name` is the id clients send as "model" and that /v1/models lists. The engine thread is
    `app.state.engine_thread`. `clock` times the latency histograms. `max_model_len` (optional, at
    most what the engine can hold) bounds prompt plus output. `api_key`: requests to /v1 must send
    it as `Authorization: Bearer KEY`. `cors_origins`: origins a browser may call from ("*": any).
    """
    engine_thread = EngineThread(engine, clock)
    metrics = ServerMetrics(model_name, lambda: engine_thread.stats)
    context = engine_context(engine) if max_model_len is None else max_model_len
    if not 1 <= context <= engine_context(engine):
        raise ValueError(f"max_model_len={max_model_len} must be in 1 .. {engine_context(engine)}: "
                         f"the tokens this engine's KV pool and model positions hold")
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def lifespan(app):
        engine_thread.start()
        yield
        engine_thread.stop()
        tokenize_pool.shutdown(wait=False)

    app = FastAPI(title="tiny-llm", lifespan=lifespan)
    app.state.engine_thread = engine_thread
    app.state.metrics = metrics
    app.state.draining = False
    active: dict[str, RequestHandle] = {}  # requests being served, by id

    async def drain(timeout: float) -> None:
        """Shutting down: refuse new requests, let running ones finish for `timeout` seconds, end the rest."""
        app.state.draining = True
        deadline = time.monotonic() + timeout
        while active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(active.values()):
            handle.events.put_nowait(ServerStopping())

    app.state.drain = drain
    install_http_extras(app, api_key, list(cors_origins))

    def decode_token(token: int) -> str:
        """One token's text, as a response's log-probabilities name it."""
        return tokenizer.decode([token])

    async def tokenize(size: int, function, *args):
        """Tokenize a prompt of `size` characters: a short one right here (it takes microseconds), a long one
        on the tokenizing thread, so it stalls neither the event loop nor the short prompts behind it."""
        if size <= LONG_PROMPT_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, function, *args)

    def submit(body, prompts: list[list[int]], chat: bool) -> tuple[str, list[RequestHandle]]:
        """Every prompt `n` times, one engine request per choice, all handed to the engine thread at once (so
        they start in the same step); their answers (Accepted or Rejected) come on the handles' queues."""
        check_choices(len(prompts), body.n)
        check_logit_bias(body, engine.model.args.vocab_size)
        if app.state.draining:
            raise APIError(503, "the server is shutting down")
        if not engine_thread.running:
            raise APIError(503, f"the engine is not running: {engine_thread.error!r}")
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        handles = []
        constraint = output_constraint(body, tokenizer, engine.model.args.vocab_size)  # day 4.5: response_format
        for index, (prompt, i) in enumerate((prompt, i) for prompt in prompts for i in range(body.n)):
            sampling = body.sampling(max_tokens_for(body, len(prompt), context), i, constraint)
            handle = RequestHandle(f"{response_id}-{index}", prompt, sampling, loop, asyncio.Queue(), body.priority,
                                   submitted=clock())
            engine_thread.submit(handle)
            handles.append(handle)
        return response_id, handles

    async def accepted(handles: list[RequestHandle]) -> None:
        """Wait for the engine thread to take every choice; if it refuses one (or the wait ends), none runs on."""
        try:
            for handle in handles:
                first = await handle.events.get()
                if isinstance(first, Rejected) and isinstance(first.error, (ValueError, TypeError)):
                    raise APIError(400, str(first.error), code="invalid_request")
                if isinstance(first, Rejected):
                    raise APIError(500, f"the engine failed: {type(first.error).__name__}")
        except BaseException:
            for handle in handles:
                engine_thread.abort(handle.request_id)
            raise

    def observe_phases(handle: RequestHandle, first_token: float | None, last_token: float | None) -> None:
        """vLLM's phases of a request that ended: queued (until its first step), prefill (to its first token),
        decode (to its last token), inference (prefill and decode)."""
        if handle.scheduled is None:
            return  # never scheduled: it left (or failed) while it waited
        metrics.queue.observe(handle.scheduled - handle.submitted)
        if first_token is not None:
            metrics.prefill.observe(max(0.0, first_token - handle.scheduled))
            metrics.decode.observe(last_token - first_token)
            metrics.inference.observe(max(0.0, last_token - handle.scheduled))

    async def tokens(handle: RequestHandle, stops: list[str], generation: Generation, arrival: float):
        """The request's text pieces, one per token; aborts the request if it ends before the engine says so."""
        text = TextStream(tokenizer, stops)
        first_token = last_token = None
        engine_done = False  # the engine finished the request itself (EOS or max_tokens)
        active[handle.request_id] = handle
        try:
            while True:
                output = await handle.events.get()
                if isinstance(output, ClientLeft):
                    return
                if isinstance(output, ServerStopping):
                    generation.finish_reason = "abort"
                    yield text.add(None, finished=True)
                    return
                if isinstance(output, Rejected):
                    raise APIError(500, f"the engine failed: {type(output.error).__name__}")
                now = clock()
                if output.token is not None:  # EOS ends a request with token None (unless it ignores EOS)
                    generation.completion_tokens += 1
                    if output.logprobs is not None:
                        generation.logprobs.append(output.logprobs)
                    if last_token is None:
                        first_token = now
                        metrics.ttft.observe(now - arrival)
                    else:
                        metrics.itl.observe(now - last_token)
                    last_token = now
                engine_done = output.finished
                if output.finished:
                    generation.cached_tokens = output.num_cached_tokens or 0
                piece = text.add(output.token, output.finished)
                if text.stopped:
                    generation.finish_reason = "stop"
                elif output.finished:
                    generation.finish_reason = "length" if output.finish_reason == "length" else "stop"
                yield piece
                if generation.finish_reason is not None:
                    return
        finally:
            # The client left, the engine failed, a stop string or a shutdown ended it: free its blocks now.
            close_request(handle, generation, arrival, first_token, last_token,
                          finished=engine_done and not text.stopped)

    def close_request(handle: RequestHandle, generation: Generation, arrival: float, first_token: float | None = None,
                      last_token: float | None = None, finished: bool = False) -> None:
        """A request's end, handled once however it came: abort it unless the engine `finished` it; count it."""
        if generation.closed:
            return
        generation.closed = True
        active.pop(handle.request_id, None)
        if not finished:
            engine_thread.abort(handle.request_id)
        metrics.finished(generation.finish_reason or "abort")
        metrics.e2e.observe(clock() - arrival)
        observe_phases(handle, first_token, last_token)

    async def respond(request: Request, body, prompts: list[list[int]], chat: bool, arrival: float,
                      response_id: str, handles: list[RequestHandle]):
        """Serve the submitted choices as one response or one stream."""
        await accepted(handles)
        watcher = asyncio.create_task(wait_for_disconnect(request, handles))
        generations = [Generation(h.request_id, prompt_tokens=len(h.prompt),
                                  logprobs=None if h.sampling.logprobs is None else []) for h in handles]
        streams = [tokens(h, body.stop_strings(), g, arrival) for h, g in zip(handles, generations)]

        def close_the_rest(_watcher: asyncio.Task) -> None:
            for handle, generation in zip(handles, generations):
                close_request(handle, generation, arrival)

        # A stream's own `finally` closes its request, but only if the stream ever started: a response cancelled
        # before its body was read (the client left at once) never starts it. The watcher ends with the
        # response, however it ends (callbacks run even for a task cancelled before it ran): it closes the rest.
        watcher.add_done_callback(close_the_rest)
        head = {"id": response_id, "created": int(time.time()), "model": model_name}

        def total_usage() -> dict:
            completion = sum(g.completion_tokens for g in generations)
            cached = sum(g.cached_tokens for g in generations)
            return usage(sum(len(prompt) for prompt in prompts), completion, cached)

        def logprobs_of(generation: Generation, entries: list | None) -> dict | None:
            """A choice's `logprobs` for `entries`, in the response's shape; offsets go on from the last chunk's."""
            shaped = logprobs_field(chat, entries, decode_token, generation.text_offset)
            if shaped is not None and not chat:
                generation.text_offset += sum(len(token) for token in shaped["tokens"])
            return shaped

        if not body.stream:
            texts = await collect_all(streams, watcher)
            if any(g.finish_reason is None for g in generations):
                raise APIError(499, "the client disconnected")  # nobody reads this: it is for the access log
            choices = [choice(chat, i, text, g.finish_reason, streaming=False,
                              logprobs=logprobs_of(g, g.take_logprobs()))
                       for i, (text, g) in enumerate(zip(texts, generations))]
            return JSONResponse({**head, "object": object_kind(chat, False), "choices": choices,
                                 "usage": total_usage()})

        kind = object_kind(chat, True)

        async def events():
            # Cancelled here (the client left) or not, each stream's finally aborts its unfinished request.
            try:
                async for index, piece, finish_reason, first, entries in merge(streams, generations):
                    logprobs = logprobs_of(generations[index], entries)
                    yield sse_event({**head, "object": kind,
                                     "choices": [choice(chat, index, piece, finish_reason, True, first, logprobs)]})
                if any(g.finish_reason is None for g in generations):
                    return  # the client left or the engine failed: nothing more to say
                if body.include_usage:
                    yield sse_event({**head, "object": kind, "choices": [], "usage": total_usage()})
                yield sse_event("[DONE]")
            finally:
                watcher.cancel()
                for stream in streams:
                    await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = clock()
        with engine_thread.arriving():
            body = parse_body(ChatCompletionRequest, await request.body(), model_name)
            size = sum(len(message.text()) for message in body.messages)
            prompts = [await tokenize(size, chat_prompt_ids, tokenizer, body.messages)]
            response_id, handles = submit(body, prompts, chat=True)
        return await respond(request, body, prompts, True, arrival, response_id, handles)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = clock()
        with engine_thread.arriving():
            body = parse_body(CompletionRequest, await request.body(), model_name)
            prompts = await tokenize(prompt_size(body.prompt), completion_prompt_ids, tokenizer, body.prompt,
                                     engine.model.args.vocab_size)
            response_id, handles = submit(body, prompts, chat=False)
        return await respond(request, body, prompts, False, arrival, response_id, handles)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card(model_name)

    @app.get("/health")
    async def health():
        if not engine_thread.running:
            return JSONResponse({"status": "error", "error": repr(engine_thread.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return app
