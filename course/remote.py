"""Objects in another process, reached through a pipe: how the grader's tests call a sandboxed submission.

The grader runs each day's tests in a trusted pytest process that never imports the student's code.
`solution(week, day)` there returns a `RemoteSelection`: `sol.basics.softmax(x)` sends the call to a
worker process in an OS sandbox (course/sandbox.py), which runs the student's package and sends the
result back. Both processes run this module; each is an `Endpoint` on one end of a pair of pipes.

What crosses, and how (never pickle: nothing that arrives is ever unpickled or executed):
- a message is a JSON header plus raw byte buffers, each with its length first;
- values travel by value: None, bool, int, float, str, bytes, tuples, lists, dicts, sets, slices,
  MLX arrays and numpy arrays (raw bytes, dtype and shape; numpy object arrays are refused), MLX dtypes;
- every other object stays where it lives and travels as a handle: the other side gets a `Remote`
  proxy, and attribute access, calls, item access, iteration, comparisons and arithmetic on the proxy
  are requests to its owner. The same object always comes back as the same proxy (so `is` works), and
  a proxy sent back is the original object again;
- a list or dict that is an attribute of an object of the sandbox (a scheduler's slots, a ref count
  table), and a trusted list of plain values that the trusted side passes or that is an attribute of
  one of the reference's objects (a sequence's block table), arrive as mirrors: a copy to read, and
  every change made to the original too; a call's result, and a test's fake's list, go as copies; enum members of shared modules travel by value, and so does an
  `mx.distributed` group of one rank;
- an exception travels as the nearest built-in exception type with its message and the remote
  traceback as a note (one of a class of the sandbox's, as a stand-in subclass of that type, one per
  class, so `except sol.module.SomeError` works): `pytest.raises(ValueError)` and "not implemented
  yet" work unchanged; an
  exception that comes back to the side that raised it first is the original object again;
- calls nest both ways and come from several threads: a trusted object handed to the student's code
  (a model, a tokenizer, a fake) is called back through its handle while the outer call waits, on the
  thread that waits (see "chains" below); awaiting a proxy (an ASGI app's coroutine) works too.

A trusted endpoint serves the sandbox only a narrow surface of the objects it handed over (`Policy`):
public attributes, calls and item access, no module, class, code, frame, traceback or built-in function,
nothing that writes files or replaces weights; attributes set only to plain data and only on the
reference's objects (never on a test's fake); no seed of its random numbers; messages of at most
MAX_MESSAGE bytes. `fetch` reads many attributes of many objects in one round trip.
"""

from __future__ import annotations

import builtins
import enum
import functools
import inspect
import itertools
import json
import operator
import os
import queue
import re
import struct
import threading
import traceback
import types
import weakref

import numpy as np

MAX_HEADER = 64 << 20
MAX_MESSAGE = 2 << 30  # bytes of one message's buffers together (the largest weight of a test's model is ~0.1 GB)
MAX_BUFFERS = 100_000
MAX_DEPTH = 200
MAX_CHAINS = 512  # threads of calls the other side may start here


class RemoteGone(RuntimeError):
    """The other process ended (it crashed, was killed at a time limit, or closed the pipe)."""


class _RaisedThere(Exception):
    """Carries an exception the other side raised past the handling of broken calls."""

    def __init__(self, error: BaseException):
        self.error = error


class ProtocolError(RuntimeError):
    """The other side sent something this protocol does not allow."""


# Special methods a proxy forwards to its owner: the name and how the owner performs it.
OPERATIONS = {
    "__getitem__": operator.getitem, "__setitem__": operator.setitem, "__delitem__": operator.delitem,
    "__len__": len, "__iter__": iter, "__next__": next, "__contains__": operator.contains,
    "__bool__": bool, "__hash__": hash, "__repr__": repr, "__str__": str, "__int__": int, "__float__": float,
    "__index__": operator.index, "__reversed__": reversed,
    "__eq__": operator.eq, "__ne__": operator.ne, "__lt__": operator.lt, "__le__": operator.le,
    "__gt__": operator.gt, "__ge__": operator.ge,
    "__add__": operator.add, "__sub__": operator.sub, "__mul__": operator.mul, "__truediv__": operator.truediv,
    "__floordiv__": operator.floordiv, "__mod__": operator.mod, "__matmul__": operator.matmul,
    "__pow__": operator.pow, "__neg__": operator.neg, "__abs__": abs,
    "__radd__": lambda a, b: b + a, "__rsub__": lambda a, b: b - a, "__rmul__": lambda a, b: b * a,
    "__rtruediv__": lambda a, b: b / a, "__rmatmul__": lambda a, b: b @ a,
    "__enter__": lambda a: a.__enter__(), "__exit__": lambda a, *rest: a.__exit__(*rest),
    "__instancecheck__": lambda cls, obj: isinstance(obj, cls),
    "__subclasscheck__": lambda cls, sub: issubclass(sub, cls),
}

BUILTIN_EXCEPTIONS = {name: value for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, Exception)
                      and not issubclass(value, BaseExceptionGroup)}
# Modules both processes load from the same files: a proxy of one of their classes answers isinstance() with
# this process's class of the same name, and their enum members travel by value.
SHARED_MODULES = ("mlx.", "mlx_lm.", "numpy", "tiny_llm_ref.")


def _shared_class(path: str):
    """The class `module:qualname` of a shared module, if this process has loaded that module (never imports)."""
    import sys

    module, _, qualname = path.partition(":")
    if not (module.startswith(SHARED_MODULES) or module in SHARED_MODULES):
        return None
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


# ---------------------------------------------------------------- the wire: JSON header, raw buffers

class PipeReader:
    """The read end of a pipe, buffered (a message in one system call or few), read by one thread at a time."""

    def __init__(self, fd: int):
        self.fd, self.pending = fd, bytearray()

    def read(self, count: int) -> bytes | bytearray:
        if count > 1 << 16:
            return self._read_large(count)
        while len(self.pending) < count:
            chunk = os.read(self.fd, max(count - len(self.pending), 1 << 16))
            if not chunk:
                raise RemoteGone("the other process closed the pipe")
            self.pending += chunk
        data = bytes(self.pending[:count])
        del self.pending[:count]
        return data

    def _read_large(self, count: int) -> bytearray:
        """An array's bytes, read from the pipe straight into their own buffer (no copy through `pending`)."""
        data = bytearray(count)
        view = memoryview(data)
        filled = min(count, len(self.pending))
        view[:filled] = self.pending[:filled]
        del self.pending[:filled]
        while filled < count:
            got = os.readv(self.fd, [view[filled:]])
            if not got:
                raise RemoteGone("the other process closed the pipe")
            filled += got
        return data


def _read_exactly(reader: PipeReader, count: int) -> bytes | bytearray:
    return reader.read(count)


def _write_all(fd: int, parts: list) -> None:
    """Write every part (bytes, or an array's memoryview, sent without a copy) in as few system calls as fit."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    first = 0  # the first part not yet written whole
    while first < len(views):
        try:
            written = os.writev(fd, views[first:first + 1024])  # at most IOV_MAX parts a call
        except (BrokenPipeError, OSError) as error:
            raise RemoteGone(f"the other process closed the pipe ({error})") from None
        while first < len(views) and written >= views[first].nbytes:
            written -= views[first].nbytes
            first += 1
        if written:
            views[first] = views[first][written:]


def send_message(fd: int, header: dict, buffers: list) -> None:
    text = json.dumps({**header, "nbuf": len(buffers)}, allow_nan=True).encode()
    parts = [struct.pack("<Q", len(text)), text]
    for buffer in buffers:
        parts += [struct.pack("<Q", memoryview(buffer).nbytes), buffer]
    _write_all(fd, parts)


def receive_message(reader) -> tuple[dict, list[bytes]]:
    """One message from `reader`, a buffered binary file of the pipe."""
    (size,) = struct.unpack("<Q", _read_exactly(reader, 8))
    if size > MAX_HEADER:
        raise ProtocolError(f"a message header of {size} bytes")
    header = json.loads(_read_exactly(reader, size))
    if not isinstance(header, dict) or not isinstance(header.get("nbuf"), int) or not 0 <= header["nbuf"] <= MAX_BUFFERS:
        raise ProtocolError("a malformed message header")
    buffers, left = [], MAX_MESSAGE
    for _ in range(header["nbuf"]):
        (length,) = struct.unpack("<Q", _read_exactly(reader, 8))
        if length > left:
            raise ProtocolError(f"a message of more than {MAX_MESSAGE} bytes")
        left -= length
        buffers.append(_read_exactly(reader, length))
    return header, buffers


# ---------------------------------------------------------------- values

def _mlx():
    import mlx.core as mx

    return mx


@functools.cache
def _dtype_names() -> dict:
    mx = _mlx()
    return {str(value).removeprefix("mlx.core."): value for value in vars(mx).values() if isinstance(value, mx.Dtype)}


class Policy:
    """What a trusted endpoint lets the sandbox do with the objects it handed over."""

    # Names that write files, load weights, or replace a trusted model's weights (nn.Module's own methods).
    DENIED_PREFIXES = re.compile(r"^(save|push_to_hub|from_pretrained|to_json_file|load_weights)")
    DENIED_NAMES = {"update", "update_modules", "set_dtype", "apply", "apply_to_modules", "freeze", "unfreeze"}

    def allows(self, obj, name: str) -> bool:
        try:
            self.attribute(obj, name)
        except (PermissionError, AttributeError):
            return False
        return True

    def attribute(self, obj, name: str):
        if not isinstance(name, str) or name.startswith("_") or name in self.DENIED_NAMES \
                or self.DENIED_PREFIXES.match(name):
            raise PermissionError(f"the grader does not let submitted code use {name!r} of a trusted object")
        value = getattr(obj, name)
        self.check_result(value, name)
        return value

    def check_result(self, value, name: str) -> None:
        forbidden = (types.ModuleType, type, types.CodeType, types.FrameType, types.TracebackType)
        unbound_builtin = isinstance(value, types.BuiltinFunctionType) and isinstance(
            getattr(value, "__self__", None), (types.ModuleType, type(None)))
        if isinstance(value, forbidden) or unbound_builtin:
            raise PermissionError(f"the grader does not hand modules, classes or built-in functions to submitted "
                                  f"code ({name!r})")

    @staticmethod
    def writable(obj) -> bool:
        """Whether submitted code may change `obj`: an object of the reference or MLX a test hands over (a
        sequence whose block table a scheduler fills), never a test's own fake, which may hold its evidence."""
        cls = type(obj)
        return _shared_class(f"{cls.__module__}:{cls.__qualname__}") is cls

    def set_attribute(self, obj, name: str, value) -> None:
        if not isinstance(name, str) or name.startswith("_") or callable(getattr(obj, name, None)) \
                or not self.writable(obj):
            raise PermissionError(f"the grader does not let submitted code replace {name!r} of a trusted object")
        if _holds_remote(value):
            raise PermissionError(f"submitted code may set {name!r} of a trusted object only to plain data")
        setattr(obj, name, value)

    def operation(self, name: str, target, args) -> None:
        plain_container = type(target) in (list, dict) and not _holds_remote(args)  # a mirrored list or dict
        if name in ("__setitem__", "__delitem__") and not plain_container or name in ("__enter__", "__exit__"):
            raise PermissionError(f"the grader does not let submitted code use {name} of a trusted object")


def _holds_remote(value, depth: int = 0) -> bool:
    if isinstance(value, Remote):
        return True
    if depth > MAX_DEPTH:
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_remote(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_remote(k, depth + 1) or _holds_remote(v, depth + 1) for k, v in value.items())
    return False


class Endpoint:
    """One end of the pipes: sends requests, serves the other side's requests while it waits for a reply."""

    def __init__(self, read_fd: int, write_fd: int, side: str, policy: Policy | None = None, root=None):
        self.read_fd, self.write_fd, self.side, self.policy = read_fd, write_fd, side, policy
        self.exported: dict[int, object] = {}  # handle -> object of ours the other side holds
        self.handle_of: dict[int, int] = {}  # id(object) -> handle
        self.proxies: weakref.WeakValueDictionary[int, Remote] = weakref.WeakValueDictionary()
        self.stand_ins: dict[int, type] = {}  # handle of an exception class of the sandbox -> its stand-in here
        self.send_lock = threading.Lock()
        self.export_lock = threading.Lock()
        self.reader = PipeReader(read_fd)
        self.chains: dict[str, queue.SimpleQueue] = {}  # chain -> the inbox of the thread serving it here
        self.local = threading.local()
        self.counter = itertools.count()
        self.loop = None  # the event loop this side last awaited the other side from
        self._pool = None
        self.broken: str | None = None
        self.pending_seed: int | None = None
        self.explain_loss = lambda: ""  # what the owner of the other process can add when it is gone
        if root is not None:
            self._export(root)  # handle 0: what the other side starts from

    # ---- encoding

    def _export(self, obj) -> int:
        with self.export_lock:
            handle = self.handle_of.get(id(obj))
            if handle is None or self.exported.get(handle) is not obj:
                handle = len(self.exported)
                self.exported[handle] = obj
                self.handle_of[id(obj)] = handle
            return handle

    def encode(self, value, buffers: list[bytes], depth: int = 0, mirror: bool = False):
        """`mirror`: a list or dict that is an attribute of an object here (of the reference's, on the trusted
        side), or on the trusted side an argument it passes (a test keeps the list it hands over, `engine.tick
        = now`, and changes it): the other side's changes come back. A call's result goes as a copy."""
        inner = mirror and self.policy is not None  # the trusted side's lists inside such a value are shared too
        if depth > MAX_DEPTH:
            raise ValueError("a value nested too deeply to send")
        kind = type(value)
        if value is None or kind in (bool, int, float, str):
            return value
        if kind in (MirrorList, MirrorDict) and object.__getattribute__(value.remote, "_endpoint") is self:
            return {"$": "ref", "h": object.__getattribute__(value.remote, "_handle")}  # the original, back home
        if kind in (tuple, list) and all(type(v) is int for v in value):
            encoded = {"$": kind.__name__, "ints": list(value)}  # token ids, block tables: in one piece
        elif kind in (tuple, list, set, frozenset):
            encoded = {"$": kind.__name__, "v": [self.encode(v, buffers, depth + 1, inner) for v in value]}
        elif kind is dict:
            encoded = {"$": "dict", "v": [[self.encode(k, buffers, depth + 1, inner),
                                           self.encode(v, buffers, depth + 1, inner)] for k, v in value.items()]}
        else:
            encoded = None
        if encoded is not None:
            # The sandbox mirrors its objects' lists and dicts; the trusted side only lists of plain values that it
            # passes or that are attributes of the reference's objects (a block table): no change made through a
            # mirror reaches a model's layers or a fake's evidence.
            if self.policy is None:
                shared = kind in (list, dict) and mirror
            else:
                shared = mirror and kind is list and all(type(v) in (int, str, type(None)) for v in value)
            if shared:
                encoded["h"] = self._export(value)  # changes the other side makes to its copy are made here too
            return encoded
        if kind is bytes:
            buffers.append(value)
            return {"$": "bytes", "b": len(buffers) - 1}
        if kind is slice:
            return {"$": "slice", "v": [self.encode(v, buffers, depth + 1) for v in (value.start, value.stop, value.step)]}
        if value is Ellipsis:
            return {"$": "ellipsis"}
        if kind is np.ndarray and not value.dtype.hasobject and value.dtype.kind in "biufc":
            flat = np.ascontiguousarray(value).reshape(-1)
            buffers.append(flat.view(np.uint8).data if flat.size else b"")
            return {"$": "np", "b": len(buffers) - 1, "dtype": value.dtype.str, "shape": list(value.shape)}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()
        if kind is Remote:
            if object.__getattribute__(value, "_endpoint") is self:
                return {"$": "ref", "h": object.__getattribute__(value, "_handle")}  # back to its owner
        mx = _mlx() if "mlx" in kind.__module__ else None
        if mx is not None and kind is mx.array:
            return self._encode_array(value, buffers)
        if mx is not None and kind is mx.distributed.Group and value.size() == 1:
            return {"$": "group1"}  # a group of this process alone holds no connection: the same on either side
        if mx is not None and kind is mx.Dtype:
            return {"$": "dtype", "v": str(value).removeprefix("mlx.core.")}
        if self.policy is None and isinstance(value, type) and issubclass(value, Exception) \
                and BUILTIN_EXCEPTIONS.get(value.__name__) is not value:
            return {"$": "exc", **self._describe_class(value)}  # `except sol.module.SomeError:` works there
        cls = type(value)
        path = f"{cls.__module__}:{cls.__qualname__}"
        if isinstance(value, enum.Enum) and _shared_class(path) is cls:
            return {"$": "enum", "cls": path, "name": value.name}
        return {"$": "h", "h": self._export(value), "cls": path}

    def _describe_class(self, cls: type) -> dict:
        """An exception class of the sandbox, for the trusted side's stand-in: handle, name, nearest built-in base."""
        return {"h": self._export(cls), "name": cls.__qualname__[:200], "base": _nearest_builtin(cls).__name__}

    def _stand_in(self, value: dict) -> type:
        """The trusted side's class for an exception class of the sandbox: a subclass of its nearest built-in
        exception, one per class, so `except sol.module.SomeError` and `pytest.raises` catch what it raises."""
        handle, base = value.get("h"), BUILTIN_EXCEPTIONS.get(str(value.get("base")), RuntimeError)
        if not isinstance(handle, int) or self.policy is None:
            raise ProtocolError("an exception class only the sandbox may send")
        if handle not in self.stand_ins:
            self.stand_ins[handle] = type(str(value.get("name", "Error"))[:200], (base,), {"__module__": "submission"})
        return self.stand_ins[handle]

    def _encode_array(self, value, buffers):
        mx = _mlx()
        dtype = str(value.dtype).removeprefix("mlx.core.")
        raw = value.view(mx.uint16) if value.dtype == mx.bfloat16 else value
        flat = np.ascontiguousarray(np.asarray(raw)).reshape(-1)  # MLX's own memory where it can (no copy)
        buffers.append(flat.view(np.uint8).data if flat.size else b"")  # sent from there, not copied to bytes
        return {"$": "mx", "b": len(buffers) - 1, "dtype": dtype, "shape": list(value.shape)}

    def decode(self, value, buffers: list[bytes], depth: int = 0):
        if depth > MAX_DEPTH:
            raise ProtocolError("a value nested too deeply")
        if value is None or type(value) in (bool, int, float, str):
            return value
        if not isinstance(value, dict) or not isinstance(value.get("$"), str):
            raise ProtocolError("a malformed value")
        tag = value["$"]
        if tag in ("tuple", "list", "set", "frozenset"):
            if "ints" in value:
                items = value["ints"]
                if not isinstance(items, list) or not all(type(v) is int for v in items):
                    raise ProtocolError("a list of integers holds something else")
            else:
                items = [self.decode(v, buffers, depth + 1) for v in value["v"]]
            if tag == "list" and isinstance(value.get("h"), int):
                return MirrorList(items, self._proxy(value["h"], "builtins:list"))
            return {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict":
            items = {self.decode(k, buffers, depth + 1): self.decode(v, buffers, depth + 1) for k, v in value["v"]}
            return MirrorDict(items, self._proxy(value["h"], "builtins:dict")) if isinstance(value.get("h"), int) \
                else items
        if tag == "bytes":
            return bytes(buffers[value["b"]])
        if tag == "slice":
            return slice(*(self.decode(v, buffers, depth + 1) for v in value["v"]))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "np":
            dtype = np.dtype(str(value["dtype"]))
            if dtype.hasobject or dtype.kind not in "biufc":
                raise ProtocolError(f"an array of dtype {dtype} is not accepted")
            return np.frombuffer(buffers[value["b"]], dtype=dtype).reshape([int(n) for n in value["shape"]]).copy()
        if tag == "mx":
            return self._decode_array(value, buffers)
        if tag == "dtype":
            return _dtype_names()[str(value["v"])]
        if tag == "ref":
            handle = value["h"]
            if not isinstance(handle, int) or handle not in self.exported:
                raise ProtocolError("a handle this side never gave out")
            return self.exported[handle]
        if tag == "h":
            return self._proxy(int(value["h"]), str(value.get("cls", "")))
        if tag == "group1":
            group = _mlx().distributed.init()
            if group.size() != 1:
                raise ProtocolError("a group of one rank sent to a process that is a rank of a larger one")
            return group
        if tag == "exc":
            return self._stand_in(value)
        if tag == "enum":
            cls = _shared_class(str(value["cls"]))
            if cls is None or not issubclass(cls, enum.Enum):
                raise ProtocolError(f"an enum of an unknown class {value['cls']!r}")
            return cls[str(value["name"])]
        raise ProtocolError(f"an unknown value tag {tag!r}")

    def _decode_array(self, value, buffers):
        mx = _mlx()
        dtype = _dtype_names()[str(value["dtype"])]
        shape = [int(n) for n in value["shape"]]
        if dtype == mx.bfloat16:
            return mx.array(np.frombuffer(buffers[value["b"]], dtype=np.uint16).reshape(shape)).view(mx.bfloat16)
        numpy_dtype = np.dtype(str(dtype).removeprefix("mlx.core."))
        return mx.array(np.frombuffer(buffers[value["b"]], dtype=numpy_dtype).reshape(shape))

    def _proxy(self, handle: int, cls: str) -> "Remote":
        proxy = self.proxies.get(handle)
        if proxy is None:
            proxy = Remote.__new__(Remote)
            object.__setattr__(proxy, "_endpoint", self)
            object.__setattr__(proxy, "_handle", handle)
            object.__setattr__(proxy, "_cls", cls)
            self.proxies[handle] = proxy
        return proxy

    # ---- requests, on chains
    #
    # Calls nest both ways and may come from several threads (a server's engine thread, uvicorn's loop).
    # A chain is one thread of calls across both processes: a request carries its chain's name, a call the
    # other side makes back while serving it carries the same name, and on each side one thread serves a
    # chain: the thread that waits for the reply, or a thread started for a chain the other side began.
    # So a call back runs on the thread that is waiting for it, and MLX sees one thread per chain.

    def pool(self):
        """Threads that wait for the other side on behalf of event loops (each is a chain of its own)."""
        from concurrent.futures import ThreadPoolExecutor

        with self.export_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=MAX_CHAINS // 4, thread_name_prefix="remote-await")
            return self._pool

    def start(self) -> "Endpoint":
        threading.Thread(target=self.read_forever, name=f"remote-{self.side}", daemon=True).start()
        return self

    def _chain(self) -> str:
        chain = getattr(self.local, "chain", None)
        if chain is None:
            chain = self.local.chain = f"{self.side}-{next(self.counter)}"
        return chain

    def _send(self, header: dict, buffers: list[bytes]) -> None:
        with self.send_lock:
            send_message(self.write_fd, header, buffers)

    def request(self, op: str, handle: int, *args):
        if self.broken:
            raise RemoteGone(self.broken)
        chain = self._chain()
        inbox = self.chains.setdefault(chain, queue.SimpleQueue())
        buffers: list[bytes] = []
        header = {"k": "req", "c": chain, "op": op, "h": handle,
                  "a": self.encode(list(args), buffers, mirror=self.policy is not None)}
        if self.pending_seed is not None:
            header["seed"], self.pending_seed = self.pending_seed, None
        try:
            self._send(header, buffers)
            return self._wait(inbox)
        except _RaisedThere as raised:
            raise raised.error from None  # the call raised on the other side: the process is fine
        except (RemoteGone, ProtocolError) as error:
            self.broken = self.broken or f"{error}{self.explain_loss()}"
            raise RemoteGone(self.broken) from None
        except BaseException:
            # Interrupted mid-call (a time limit): the other side's state is unknown from now on.
            self.broken = "a call was interrupted (a time limit): the submission's process was stopped"
            raise

    def _wait(self, inbox: queue.SimpleQueue):
        while True:
            item = inbox.get()
            if item is None:
                raise RemoteGone(self.broken or "the other process closed the pipe")
            header, buffers = item
            kind = header.get("k")
            if kind == "req":
                self._serve(header, buffers)  # a call back, on this chain: served by the thread waiting on it
            elif kind == "ok":
                return self.decode(header.get("v"), buffers)
            elif kind == "err":
                origin = header.get("origin")
                if isinstance(origin, int) and isinstance(self.exported.get(origin), BaseException):
                    raise _RaisedThere(self.exported[origin])
                error = rebuild_exception(header, self._stand_in(header["cls"]) if isinstance(header.get("cls"), dict)
                                          and self.policy is not None else None)
                if isinstance(header.get("own"), int):
                    error.remote_origin = (self, header["own"])
                raise _RaisedThere(error)
            else:
                raise ProtocolError(f"an unknown message kind {kind!r}")

    def read_forever(self) -> None:
        """Hand each message to the thread of its chain (starting one for a chain the other side began)."""
        try:
            while True:
                header, buffers = receive_message(self.reader)
                chain = header.get("c")
                if not isinstance(chain, str) or len(chain) > 64:
                    raise ProtocolError("a message without its chain")
                inbox = self.chains.get(chain)
                if inbox is None:
                    if header.get("k") != "req" or len(self.chains) >= MAX_CHAINS:
                        raise ProtocolError("a reply nobody waits for, or too many threads of calls")
                    inbox = self.chains[chain] = queue.SimpleQueue()
                    threading.Thread(target=self._serve_chain, args=(chain, inbox), daemon=True).start()
                inbox.put((header, buffers))
        except (RemoteGone, ProtocolError, OSError, ValueError, struct.error, RecursionError) as error:
            self.broken = self.broken or f"{error}{self.explain_loss()}"
        for inbox in list(self.chains.values()):
            inbox.put(None)

    def _serve_chain(self, chain: str, inbox: queue.SimpleQueue) -> None:
        self.local.chain = chain
        while True:
            item = inbox.get()
            if item is None:
                return
            header, buffers = item
            if header.get("k") != "req":
                self.broken = "a reply without a request"
                return
            try:
                self._serve(header, buffers)
            except (RemoteGone, ProtocolError) as error:
                self.broken = self.broken or str(error)
                return

    def _serve(self, header: dict, buffers: list[bytes]) -> None:
        out: list[bytes] = []
        try:
            if "seed" in header and self.policy is None:  # the trusted side's `mx.random.seed(n)`, never the reverse
                _mlx().random.seed(int(header["seed"]))
            handle = header.get("h")
            if not isinstance(handle, int) or handle not in self.exported:
                raise ProtocolError("a request for a handle this side never gave out")
            args = self.decode(header.get("a"), buffers)
            result = self._perform(str(header.get("op")), self.exported[handle], args)
            op, target = header.get("op"), self.exported[handle]
            mirror = op == "getattr" and (self.policy is None or self.policy.writable(target))
            reply = {"k": "ok", "v": self.encode(result, out, mirror=mirror)}
        except (RemoteGone, ProtocolError):
            raise
        except Exception as error:
            out = []
            reply = describe_exception(error)
            origin = getattr(error, "remote_origin", None)
            if isinstance(origin, tuple) and origin[0] is self:
                reply["origin"] = origin[1]  # an exception the other side raised first: it gets its own back
            else:
                error.__traceback__ = None  # kept for the other side to send back: without its frames
                reply["own"] = self._export(error)
                if self.policy is None and BUILTIN_EXCEPTIONS.get(type(error).__name__) is not type(error):
                    reply["cls"] = self._describe_class(type(error))
        reply["c"] = header.get("c")
        self._send(reply, out)

    def _perform(self, op: str, target, args: list):
        policy = self.policy
        if op == "getattr":
            return policy.attribute(target, args[0]) if policy else getattr(target, args[0])
        if op == "setattr":
            return policy.set_attribute(target, args[0], args[1]) if policy else setattr(target, args[0], args[1])
        if op == "delattr":
            if policy:
                raise PermissionError("the grader does not let submitted code delete attributes of trusted objects")
            return delattr(target, args[0])
        if op == "call":
            if policy and isinstance(getattr(target, "__self__", None), (list, dict)) and _holds_remote(args):
                raise PermissionError("submitted code may put only plain data into a trusted list")
            result = target(*args[0], **args[1])
            if policy:
                policy.check_result(result, getattr(target, "__name__", "a call"))
            return result
        if op == "__await__":
            if policy and not inspect.isawaitable(target):
                raise PermissionError("the grader awaits only awaitables for submitted code")
            return _run_awaitable(self, target)
        if op == "fetch":
            objects, paths = args
            if not isinstance(objects, list) or not all(isinstance(p, str) for p in paths):
                raise ProtocolError("fetch takes a list of objects and attribute paths")
            read = (lambda obj, name: policy.attribute(obj, name)) if policy else getattr
            return [[functools.reduce(read, path.split("."), obj) for path in paths] for obj in objects]
        if op == "vars":
            if policy:
                return {k: policy.attribute(target, k) for k in vars(target) if policy.allows(target, k)}
            return dict(vars(target))
        if op in OPERATIONS:
            if policy:
                policy.operation(op, target, args)
            result = OPERATIONS[op](target, *args)
            if policy:
                policy.check_result(result, op)
            return result
        raise ProtocolError(f"an unknown operation {op!r}")


def fetch(objects, *paths: str) -> list[list]:
    """For each object, the value of each attribute path ("seq.block_table"), as plain data where it can be.

    Objects of the other process are read in one round trip for all of them, not one per attribute (a test's
    fake reads a whole plan at once); objects of this process are read here, so a test works either way.
    """
    objects = list(objects)
    remote = [o for o in objects if type(o) is Remote]
    if not remote:
        return [[functools.reduce(getattr, path.split("."), obj) for path in paths] for obj in objects]
    endpoint = object.__getattribute__(remote[0], "_endpoint")
    if len(remote) < len(objects) or any(object.__getattribute__(o, "_endpoint") is not endpoint for o in remote):
        raise ValueError("fetch reads objects of one process at a time")
    return endpoint.request("fetch", object.__getattribute__(remote[0], "_handle"), objects, list(paths))


def _nearest_builtin(cls: type) -> type:
    return next((c for c in cls.__mro__ if BUILTIN_EXCEPTIONS.get(c.__name__) is c), RuntimeError)


def describe_exception(error: BaseException) -> dict:
    """An exception as the nearest built-in type, its message and a short traceback."""
    base = _nearest_builtin(type(error))
    where = "".join(traceback.format_exception(error)[-12:])
    message = str(error) if base is not KeyError or not error.args else repr(error.args[0])
    return {"k": "err", "type": base.__name__, "msg": message[:20_000], "tb": where[-6000:]}


def rebuild_exception(header: dict, stand_in: type | None = None) -> BaseException:
    cls = stand_in or BUILTIN_EXCEPTIONS.get(str(header.get("type")), RuntimeError)
    if cls is StopIteration:
        return StopIteration()
    try:
        error = cls(str(header.get("msg", "")))
    except Exception:
        error = RuntimeError(str(header.get("msg", "")))
    trace = str(header.get("tb", ""))
    if trace:
        error.add_note("In the submission's process (sandboxed):\n" + trace)
    return error


# ---------------------------------------------------------------- the proxy

def _mirrored(name: str, base: type = list):
    def method(self, *args, **kwargs):
        result = getattr(base, name)(self, *args, **kwargs)
        getattr(self.remote, name)(*args, **kwargs)
        return result

    method.__name__ = name
    return method


class MirrorList(list):
    """A list of the other process (an attribute of one of its objects, or a trusted list of plain values): a
    copy to read, and every change made to the original too (a scheduler appends to a trusted sequence's block
    table; a test puts a request into a scheduler's slots)."""

    def __init__(self, items, remote: "Remote"):
        super().__init__(items)
        self.remote = remote

    append, extend, insert, pop = _mirrored("append"), _mirrored("extend"), _mirrored("insert"), _mirrored("pop")
    remove, clear, sort, reverse = _mirrored("remove"), _mirrored("clear"), _mirrored("sort"), _mirrored("reverse")
    __setitem__, __delitem__ = _mirrored("__setitem__"), _mirrored("__delitem__")

    def __iadd__(self, other):
        self.extend(other)
        return self


class MirrorDict(dict):
    """A dict that is an attribute of an object of the other process: a copy to read, every change made there too."""

    def __init__(self, items, remote: "Remote"):
        super().__init__(items)
        self.remote = remote

    __setitem__, __delitem__, pop, popitem = (_mirrored("__setitem__", dict), _mirrored("__delitem__", dict),
                                              _mirrored("pop", dict), _mirrored("popitem", dict))
    clear, update, setdefault = _mirrored("clear", dict), _mirrored("update", dict), _mirrored("setdefault", dict)


class Remote:
    """An object that lives in the other process; every use of it is a request to that process."""

    __slots__ = ("_endpoint", "_handle", "_cls", "__weakref__")

    def _request(self, op, *args):
        return object.__getattribute__(self, "_endpoint").request(op, object.__getattribute__(self, "_handle"), *args)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in ("__name__", "__qualname__", "__doc__",
                                                                          "__module__", "__wrapped__"):
            raise AttributeError(name)
        return self._request("getattr", name)

    def __setattr__(self, name, value):
        self._request("setattr", name, value)

    def __delattr__(self, name):
        self._request("delattr", name)

    def __call__(self, *args, **kwargs):
        return self._request("call", args, kwargs)

    @property
    def __class__(self):
        """A class of a shared module (MLX, mlx-lm, the reference) answers isinstance() as the object would."""
        return _shared_class(object.__getattribute__(self, "_cls")) or Remote

    @property
    def __dict__(self):
        """`vars(obj)`: a copy of the object's public attributes."""
        return self._request("vars")

    def __repr__(self):
        try:
            return self._request("__repr__")
        except Exception as error:
            return f"<object of the submission ({type(error).__name__}: {error})>"

    def __str__(self):
        return self._request("__str__")

    def __hash__(self):
        return self._request("__hash__")

    def __iter__(self):
        return self._request("__iter__")

    def __next__(self):
        return self._request("__next__")

    def __bool__(self):
        return self._request("__bool__")

    def __await__(self):
        """Awaiting an awaitable of the other process (an ASGI app's coroutine, a server's `receive()`)."""
        return _await_there(self).__await__()

    def __instancecheck__(self, obj):
        return self._request("__instancecheck__", obj)

    def __subclasscheck__(self, cls):
        return self._request("__subclasscheck__", cls)


async def _await_there(proxy: Remote):
    """Wait on a thread of a pool, so this event loop runs on (the other side may need it meanwhile)."""
    import asyncio

    endpoint = object.__getattribute__(proxy, "_endpoint")
    loop = asyncio.get_running_loop()
    endpoint.loop = loop
    return await loop.run_in_executor(endpoint.pool(), proxy._request, "__await__")


def _run_awaitable(endpoint: Endpoint, awaitable):
    """Await `awaitable` (of this process) for the other side: in the event loop this side last awaited the
    other from, while it runs in another thread (uvicorn's), or else in a loop of this thread's own."""
    import asyncio

    async def finish():
        return await awaitable

    loop = endpoint.loop
    if loop is not None and loop.is_running() and not loop.is_closed():
        return asyncio.run_coroutine_threadsafe(finish(), loop).result()
    return asyncio.run(finish())


def _forwarded(name):
    def method(self, *args):
        return self._request(name, *args)

    method.__name__ = name
    return method


for _name in OPERATIONS:
    if _name not in vars(Remote):
        setattr(Remote, _name, _forwarded(_name))
