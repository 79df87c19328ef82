"""Servers and the fakes around them, where the app under test runs (`actor_fakes(sol, "serving")`).

While grading, the student's ASGI app lives in the sandboxed worker, which has no network of its own: the judge
makes listening TCP sockets on 127.0.0.1 before the worker starts and hands them over
(TINY_LLM_SERVER_SOCKETS="fd:port,fd:port,..."). `serve(app)` runs uvicorn on one of them in a thread here and
returns its port; the tests talk plain HTTP to http://127.0.0.1:PORT, so only bytes cross between the two
processes (never an ASGI call). Outside the sandbox `serve` binds a socket of its own on 127.0.0.1.

The rest stands where a test used to put a function of its own into the server: a tokenizer that records or
waits, an app that holds its responses back, a method that sleeps, fails once or records its calls. Each keeps
its record here and the test reads it back as data. Two drivers feed the day's pure functions their inputs one
piece at a time here (`find_stops`, `stream_text`): one round trip for a whole stream, not one per piece. Nothing
here decides a verdict: the tests check what comes back.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

SOCKETS_VARIABLE = "TINY_LLM_SERVER_SOCKETS"

_lock = threading.Lock()
_servers: dict[int, tuple[object, threading.Thread, int | None]] = {}  # port: (uvicorn server, its thread, fd)


def _listening_socket() -> tuple[socket.socket, int | None]:
    """A listening socket for one server, and the handed-over fd it is a copy of (None: bound here)."""
    handed = os.environ.get(SOCKETS_VARIABLE)
    if handed is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        return sock, None
    in_use = {fd for _, _, fd in _servers.values()}
    for entry in handed.split(","):
        fd = int(entry.split(":")[0])
        if fd not in in_use:
            # A copy: uvicorn closes its socket when it stops, and the next server listens on the fd again.
            sock = socket.socket(fileno=os.dup(fd))
            sock.listen(128)
            return sock, fd
    raise RuntimeError(f"every one of the {len(handed.split(','))} sockets the grader handed over has a server")


def serve(app, drain: float | None = None, timeout: float = 30.0) -> int:
    """Run `app` under uvicorn in a thread and return the port it listens on, once it is ready (lifespan done).

    With `drain`, stopping it is what `pdm run serve` does on Ctrl-C or SIGTERM (scripts/serve.py's
    DrainingServer): `app.state.drain(drain)` first, then uvicorn's own shutdown."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            if drain is not None:
                await self.config.app.state.drain(drain)
            await super().shutdown(sockets)

    with _lock:
        sock, fd = _listening_socket()
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", interface="asgi3")
        server = Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        _servers[port] = (server, thread, fd)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            stop(port, timeout=0)
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return port


def stop(port: int, timeout: float = 30.0) -> bool:
    """Ask the server on `port` to stop (as uvicorn's signal handler does), wait up to `timeout` seconds for it to
    end, and say whether it did. With `timeout` 0 it only asks; call again to wait."""
    server, thread, _ = _servers[port]
    server.should_exit = True
    thread.join(timeout)
    if thread.is_alive():
        return False
    with _lock:
        _servers.pop(port, None)
    return True


def raise_engine_error(app) -> None:
    """Raise what ended the app's engine thread, if it died: raised here, it reaches the test as an exception (while
    grading, an exception object the test read as a value would be an opaque handle, and raising that fails)."""
    error = app.state.engine_thread.error
    if error is not None:
        raise error


class HeldStart:
    """An app whose responses' first message is held back `hold` seconds: time for a client to leave before
    the response body is ever read (as a slow machine or a busy event loop can make it)."""

    def __init__(self, app, hold: float):
        self.app, self.state, self.hold = app, app.state, hold

    async def __call__(self, scope, receive, send):
        async def held_send(message):
            if message["type"] == "http.response.start":
                await asyncio.sleep(self.hold)
            await send(message)

        await self.app(scope, receive, held_send)


class CountingTokenizer:
    """A tokenizer that records the tokens of every `decode` call (`windows`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.windows: list[list[int]] = []

    def decode(self, tokens):
        self.windows.append([int(t) for t in tokens])
        return self.tokenizer.decode(tokens)


class SlowTokenizer:
    """A tokenizer that, encoding a long text, says so (`started`) and waits until the test says go (`release`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text, *args, **kwargs):
        if len(text) > 100_000:
            self.started.set()
            self.release.wait(timeout=60)  # a step limit: never hangs the server for good
        return self.tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def find_stops(find_stop, text: str, stops: list[str]) -> list:
    """`find_stop` on each prefix of `text`, a character more each time, up to the first that finds a stop."""
    answers = []
    for n in range(1, len(text) + 1):
        answers.append(find_stop(text[:n], stops))
        if answers[-1][1]:
            break
    return answers


def stream_text(detokenizer_class, tokenizer, tokens: list[int]) -> list[str]:
    """Every piece an incremental detokenizer gives for `tokens`, one token at a time, and its final flush."""
    detokenizer = detokenizer_class(tokenizer)
    return [detokenizer.add(token) for token in tokens] + [detokenizer.flush()]


class Patched:
    """`owner.name`, replaced by a wrapper that can sleep before each call, fail the first call, and record the
    keyword arguments `keys` of every call (`calls`, read back by the test)."""

    def __init__(self, owner, name: str, pause: float = 0.0, fail_first: str | None = None, keys: tuple = ()):
        self.original, self.pause, self.fail_first, self.keys = getattr(owner, name), pause, fail_first, keys
        self.calls: list[dict] = []
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls.append({key: kwargs.get(key) for key in self.keys})
        if self.fail_first is not None and len(self.calls) == 1:
            raise RuntimeError(self.fail_first)
        time.sleep(self.pause)
        return self.original(*args, **kwargs)
