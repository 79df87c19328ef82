"""The pipe between the grader's trusted test process (the judge) and the sandboxed worker (the actor).

Only data crosses (a JSON header and raw buffers, never pickle), rebuilt by the receiver as its own exact types; any
other object of the actor is an opaque `Handle`; calls go one way. See book/src/grading.md, "Where your code runs".
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import enum
import functools
import importlib
import json
import operator
import os
import re
import select
import struct
import sys
import threading
import traceback
import unicodedata

from course import models

MAX_HEADER = 64 << 20
MAX_MESSAGE = 2 << 30  # bytes of one message's buffers together (the largest weight of a test's model is ~0.1 GB)
MAX_BUFFERS = 100_000
MAX_DEPTH = 200


class RemoteGone(RuntimeError):
    """The other process ended (it crashed, was killed at a time limit, or closed the pipe)."""


class ProtocolError(RuntimeError):
    """The other side sent something this protocol does not allow."""


class _NotData(Exception):
    """Raised while a data class is encoded field by field, at a field that is not data (it goes as a handle)."""


BUILTIN_EXCEPTIONS = {name: value for name, value in vars(builtins).items() if isinstance(value, type)
                      and issubclass(value, Exception) and not issubclass(value, BaseExceptionGroup)}
# Modules both processes load from the same files: their data classes and enum members travel by value.
SHARED_MODULES = ("mlx.", "mlx_lm.", "numpy", "tiny_llm_ref.")


def _shared_class(path: str, load: bool = False):
    """The class `module:qualname` of a shared module, or None; `load`: import the module if it is not yet."""
    module, _, qualname = path.partition(":")
    if not module.startswith(SHARED_MODULES):
        return None
    if load and module not in sys.modules:
        with contextlib.suppress(ImportError):  # no such module: no such class
            importlib.import_module(module)
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


# ---------------------------------------------------------------- the wire: JSON header, raw buffers

def send_message(fd: int, header: dict, buffers: list) -> None:
    text = json.dumps({**header, "sizes": [memoryview(b).nbytes for b in buffers]}, allow_nan=True).encode()
    for part in (struct.pack("<Q", len(text)) + text, *buffers):  # an array's bytes from its own memory: no copy
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view):]


def _read(fd: int, count: int) -> bytearray:
    """Exactly `count` bytes, never more: what the other side wrote past a message stays in the pipe, where
    `Endpoint.broken` sees it."""
    data = bytearray(count)
    view, filled = memoryview(data), 0
    while filled < count:
        got = os.readv(fd, [view[filled:]])
        if not got:
            raise RemoteGone("the other process closed the pipe")
        filled += got
    return data


def receive_message(fd: int) -> tuple[dict, list[bytearray]]:
    (size,) = struct.unpack("<Q", _read(fd, 8))
    if size > MAX_HEADER:
        raise ProtocolError(f"a message header of {size} bytes")
    header = json.loads(_read(fd, size))
    sizes = header.get("sizes") if isinstance(header, dict) else None
    if not isinstance(sizes, list) or len(sizes) > MAX_BUFFERS or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError("a malformed message header")
    if sum(sizes) > MAX_MESSAGE:
        raise ProtocolError(f"a message of more than {MAX_MESSAGE} bytes")
    return header, [_read(fd, n) for n in sizes]


# ---------------------------------------------------------------- values

def _mlx():
    """mlx.core, imported at first use: in the worker, course/fast_mlx.py picks MLX's BLAS before it is loaded."""
    import mlx.core as mx

    return mx


def _numpy():
    """numpy, imported at first use: the grader's own process (scripts/grade.py) needs `printable` alone."""
    import numpy

    return numpy


def plain(value):
    """`value` as the exact built-in type it stands for, read with that type's own methods, or None: a deque, a list
    subclass, a numpy scalar crosses as data, and an overridden `__eq__`, `__iter__` or `__class__` stays behind."""
    kind = type(value)
    if kind in (bool, int, float, str, list, tuple, set, frozenset, dict) or value is None:
        return value
    if issubclass(kind, enum.Enum):
        return None  # an enum member travels as its name (see `encode`)
    if issubclass(kind, _numpy().generic) and value.dtype.kind in "biuf":
        return value.item()
    for base, read in ((int, int.__index__), (float, float.__float__), (str, str.__str__), (list, list.copy),
                       (set, set.copy), (frozenset, frozenset.copy),  # each an exact set, never the subclass's
                       (tuple, lambda t: tuple.__getitem__(t, slice(None))),
                       (collections.deque, lambda d: list(collections.deque.__iter__(d)))):
        if issubclass(kind, base):  # the class itself, never what its `__class__` claims
            return read(value)
    if issubclass(kind, dict) and kind.__module__ in ("collections", "builtins"):  # OrderedDict, defaultdict, Counter
        return dict(dict.items(value))
    return None


class Endpoint:
    """One end of the pipes: the judge's (`side` "trusted") asks; the actor's answers, from `root` (handle 0)."""

    def __init__(self, read_fd: int, write_fd: int, side: str, root=None):
        self.read_fd, self.write_fd, self.judge = read_fd, write_fd, side == "trusted"
        self.exported: dict[int, object] = {}  # handle -> object of ours the other side holds (in the judge: models)
        self.handle_of: dict[int, int] = {}  # id(object) -> handle (an exported object lives on: its id stays its own)
        self.proxies: dict[int, object] = {}  # their handle -> our one object for it: a Handle, stand-in, model copy
        self.lock = threading.Lock()  # the judge's threads take turns: one call on the pipe at a time
        self._broken: str | None = None
        self.pending_seed: int | None = None
        self.explain_loss = lambda: ""  # what the owner of the other process can add when it is gone
        self.strict = False  # in the actor, while a data class's fields are encoded: anything but data raises
        if root is not None:
            self._export(root)  # handle 0

    @property
    def broken(self) -> str | None:
        """Why the pipe is of no more use, or None. While the judge asks nothing, the actor has nothing to say:
        whatever it wrote meanwhile (its end, or a request of its own: it never calls the judge) breaks the pipe."""
        if self._broken is None and self.judge and self.lock.acquire(blocking=False):
            try:
                poller = select.poll()  # (select.select refuses a descriptor past 1023)
                poller.register(self.read_fd, select.POLLIN)
                if poller.poll(0):  # bytes, the end of the pipe (POLLHUP), or a descriptor closed here (POLLNVAL)
                    self._broken = f"the submission's process ended or wrote unasked{self.explain_loss()}"
            finally:
                self.lock.release()
        return self._broken

    # ---- the judge's side: requests

    def request(self, op: str, handle: int, *args):
        """Ask the actor to do `op` on its object `handle`: its answer, or what it raised, here."""
        if self.broken:
            raise RemoteGone(self.broken)
        with self.lock:
            buffers: list = []
            header = {"op": op, "h": handle, "a": self.encode(list(args), buffers)}  # what is refused is never sent
            if self.pending_seed is not None:
                header["seed"], self.pending_seed = self.pending_seed, None
            try:
                send_message(self.write_fd, header, buffers)
                reply, buffers = receive_message(self.read_fd)
                if reply.get("k") not in ("ok", "err"):
                    raise ProtocolError("a message the judge does not take (the actor never calls the judge)")
                value = self.decode(reply.get("v"), buffers)
                if reply["k"] == "ok":
                    return value
                error = rebuild_exception(value, reply)
            except Exception as gone:  # the process ended, or what it sent breaks the protocol
                self._broken = self._broken or f"{gone}{self.explain_loss()}"
                raise RemoteGone(self._broken) from None
            except BaseException:
                # Interrupted mid-call (a time limit): the other side's state is unknown from now on.
                self._broken = "a call was interrupted (a time limit): the submission's process was stopped"
                raise
        raise error  # the call raised in the actor: the process is fine

    # ---- the actor's side: serving

    def read_forever(self) -> None:
        """Serve the judge's requests in turn, in this thread, until the judge closes the pipe (the worker ends)."""
        with contextlib.suppress(RemoteGone, ProtocolError, OSError, ValueError, struct.error):
            while True:
                header, buffers = receive_message(self.read_fd)
                out: list = []
                try:
                    if "seed" in header:  # the judge's `mx.random.seed(n)`
                        _mlx().random.seed(int(header["seed"]))
                    result = OPERATIONS[header["op"]](self.exported[header["h"]], *self.decode(header["a"], buffers))
                    reply = {"k": "ok", "v": self.encode(result, out)}
                except BaseException as error:  # whatever the student's code raised (SystemExit too)
                    out = []
                    reply = {"k": "err", "v": self.encode(type(error), out), **describe_exception(error)}
                send_message(self.write_fd, reply, out)

    # ---- encoding

    def _export(self, obj) -> int:
        handle = self.handle_of.setdefault(id(obj), len(self.exported))
        self.exported[handle] = obj
        return handle

    def encode(self, value, buffers: list, depth: int = 0):
        """`value` as JSON and buffers: data by value; anything else as the sender's side allows."""
        if depth > MAX_DEPTH:
            raise ValueError("a value nested too deeply to send")
        data = plain(value)
        if value is None or type(data) in (bool, int, float, str):
            return data
        if type(data) in (list, tuple) and all(type(v) is int for v in data):
            return {"$": type(data).__name__, "ints": list(data)}  # token ids, block tables: in one piece
        if type(data) in (tuple, list, set, frozenset):
            return {"$": type(data).__name__, "v": [self.encode(v, buffers, depth + 1) for v in data]}
        if type(data) is dict:
            return {"$": "dict", "v": [[self.encode(k, buffers, depth + 1), self.encode(v, buffers, depth + 1)]
                                       for k, v in data.items()]}
        kind = type(value)
        if kind is Handle and value._endpoint is self:  # (in the judge) the actor's own object, back
            return {"$": "ref", "h": value._handle}
        if kind is bytes:
            buffers.append(value)
            return {"$": "bytes", "b": len(buffers) - 1}
        if kind is slice:
            parts = (value.start, value.stop, value.step)
            return {"$": "slice", "v": [self.encode(v, buffers, depth + 1) for v in parts]}
        if value is Ellipsis:
            return {"$": "ellipsis"}
        mx = _mlx() if "mlx" in kind.__module__ else None
        if (kind is _numpy().ndarray and value.dtype.kind in "biufc") or (mx is not None and kind is mx.array):
            return self._encode_array(value, buffers)
        if mx is not None and kind is mx.distributed.Group and value.size() == 1:
            return {"$": "group1"}  # a group of this process alone holds no connection: the same on either side
        if mx is not None and kind is mx.Dtype:
            return {"$": "dtype", "v": str(value).removeprefix("mlx.core.")}
        path = f"{kind.__module__}:{kind.__qualname__}"[:300]
        if dataclasses.is_dataclass(kind) and _shared_class(path) is kind:
            return self._encode_data(value, path, buffers, depth)
        if issubclass(kind, enum.Enum) and _shared_class(path) is kind:
            return {"$": "enum", "cls": path, "name": value.name, "h": None if self.judge else self._export(value)}
        if self.judge:  # besides data and the actor's objects: what the actor rebuilds from files both read
            if kind.__module__.startswith("mlx_lm.models.") and kind.__name__ == "Model" \
                    and dataclasses.is_dataclass(getattr(value, "args", None)):
                return self._encode_model(value, path, buffers, depth)
            shared = models.shared_tokenizer_dir(value)
            if shared is not None:
                return {"$": "tokenizer", "path": shared, "eos": sorted(value.eos_token_ids)}
            raise TypeError(f"a test handed the submission's code an object of the grader's ({path}): only data, the "
                            f"tests' mlx-lm models and tokenizer cross (build fakes in the worker: tests/actor_fakes)")
        if self.strict:
            raise _NotData
        if issubclass(kind, type) and issubclass(value, BaseException):  # `except sol.module.SomeError:` in the judge
            base = next((c for c in value.__mro__ if BUILTIN_EXCEPTIONS.get(c.__name__) is c), RuntimeError)
            return {"$": "exc", "base": base.__name__, "name": value.__name__,
                    "h": None if base is value else self._export(value)}
        return {"$": "h", "h": self._export(value), "cls": path}

    def _encode_data(self, value, path: str, buffers: list, depth: int) -> dict:
        """A data class of a shared module (the reference's `SamplingParams`, mlx-lm's `ModelArgs`; never the
        submission's: its methods are graded) by value; in the actor, one holding anything but data as a handle."""
        strict, first = self.strict, len(buffers)
        self.strict = not self.judge
        try:
            fields = {f.name: self.encode(getattr(value, f.name), buffers, depth + 1)
                      for f in dataclasses.fields(value)}
        except _NotData:
            if strict:
                raise
            del buffers[first:]
            return {"$": "h", "h": self._export(value), "cls": path}
        finally:
            self.strict = strict
        return {"$": "data", "cls": path, "h": None if self.judge else self._export(value), "v": fields}

    def _encode_model(self, model, path: str, buffers: list, depth: int) -> dict:
        """An mlx-lm model as what the actor builds its own copy from: class, arguments, quantized layers, weights."""
        if id(model) in self.handle_of:
            return {"$": "model", "h": self._export(model)}
        from mlx.utils import tree_flatten

        weights = [[name, self._encode_array(array, buffers)] for name, array in tree_flatten(model.parameters())]
        quantized = {name: {"group_size": int(m.group_size), "bits": int(m.bits), "mode": str(m.mode)}
                     for name, m in model.named_modules() if hasattr(m, "group_size") and hasattr(m, "bits")}
        return {"$": "model", "h": self._export(model), "cls": path, "w": weights, "q": quantized,
                "args": self.encode(model.args, buffers, depth + 1)}

    @staticmethod
    def _encode_array(value, buffers: list) -> dict:
        """A numpy or MLX array as raw bytes, dtype and shape, sent from the array's own memory where it can (no copy);
        an MLX bfloat16 array's bits go as uint16 (numpy has no bfloat16)."""
        mx, np = _mlx(), _numpy()
        bf16 = type(value) is mx.array and value.dtype == mx.bfloat16
        raw = np.ascontiguousarray(np.asarray(value.view(mx.uint16) if bf16 else value)).reshape(-1)
        buffers.append(raw.view(np.uint8).data if raw.size else b"")
        tag = "np" if type(value) is np.ndarray else "bf16" if bf16 else "mx"
        return {"$": tag, "b": len(buffers) - 1, "dtype": raw.dtype.str, "shape": list(value.shape)}

    # ---- decoding

    def decode(self, value, buffers: list, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ProtocolError("a value nested too deeply")
        if value is None or type(value) in (bool, int, float, str):
            return value
        if not isinstance(value, dict) or not isinstance(value.get("$"), str):
            raise ProtocolError("a malformed value")
        tag = value["$"]
        if tag == "dict":
            return {self.decode(k, buffers, depth + 1): self.decode(v, buffers, depth + 1) for k, v in value["v"]}
        if tag in ("tuple", "list", "set", "frozenset"):
            if "ints" not in value:
                return getattr(builtins, tag)([self.decode(v, buffers, depth + 1) for v in value["v"]])
            if not isinstance(value["ints"], list) or not all(type(v) is int for v in value["ints"]):
                raise ProtocolError("a list of integers holds something else")
            return getattr(builtins, tag)(value["ints"])
        if tag == "bytes":
            return bytes(buffers[value["b"]])
        if tag == "slice":
            return slice(*(self.decode(v, buffers, depth + 1) for v in value["v"]))
        if tag == "ellipsis":
            return Ellipsis
        if tag in ("np", "mx", "bf16"):
            return self._decode_array(value, buffers)
        if tag == "dtype" and isinstance(found := getattr(_mlx(), str(value["v"]), None), _mlx().Dtype):
            return found
        if tag == "group1":
            group = _mlx().distributed.init()
            if group.size() != 1:
                raise ProtocolError("a group of one rank sent to a process that is a rank of a larger one")
            return group
        if tag in ("data", "enum"):
            return self._decode_shared(tag, value, buffers, depth)
        # One side's alone: handles, exception classes (the judge); its own objects, models, tokenizers (the actor).
        if self.judge and tag in ("h", "exc"):
            return self._proxy(value)
        if not self.judge and tag == "ref":
            return self.exported[value["h"]]
        if not self.judge and tag == "model":
            return self._decode_model(value, buffers)
        if not self.judge and tag == "tokenizer":
            return models.shared_tokenizer(str(value["path"]), tuple(int(e) for e in value["eos"]))
        raise ProtocolError(f"a value tag {tag!r} this side does not take")

    def _decode_shared(self, tag: str, value: dict, buffers: list, depth: int):
        """A data class or enum member of a shared module, as the receiver's own (a handle where the judge lacks it)."""
        path = str(value["cls"])
        # The judge imports, at the actor's word, a module of the reference's alone (its data classes and enums).
        cls = _shared_class(path, load=not self.judge or re.match(r"tiny_llm_ref\.[a-z][a-z_0-9]*:", path) is not None)
        if tag == "enum" and isinstance(cls, enum.EnumMeta) and value["name"] in cls.__members__:
            return cls[value["name"]]
        fields = value.get("v")
        if tag == "data" and dataclasses.is_dataclass(cls) and isinstance(fields, dict) \
                and set(fields) == {f.name for f in dataclasses.fields(cls)}:
            rebuilt = object.__new__(cls)  # the receiver's own class, holding the values sent
            for name, field in fields.items():
                object.__setattr__(rebuilt, name, self.decode(field, buffers, depth + 1))
            return rebuilt
        if self.judge and isinstance(value.get("h"), int):
            return self._proxy(value)
        raise ProtocolError(f"{tag} of an unknown class {path!r}")

    @staticmethod
    def _decode_array(value: dict, buffers: list):
        np = _numpy()
        dtype = np.dtype(str(value["dtype"]))
        if dtype.kind not in "biufc":
            raise ProtocolError(f"an array of dtype {dtype} is not accepted")
        raw = np.frombuffer(buffers[value["b"]], dtype=dtype).reshape([int(n) for n in value["shape"]])
        if value["$"] == "np":
            return raw.copy()  # writable, as the sender's was
        mx = _mlx()
        return mx.array(raw).view(mx.bfloat16) if value["$"] == "bf16" else mx.array(raw)

    def _decode_model(self, value: dict, buffers: list):
        if "w" in value:  # the first time the judge sends it (`_encode_model`)
            model = _shared_class(str(value["cls"]), load=True)(self.decode(value["args"], buffers))
            import mlx.nn as nn

            # The judge's quantized layers (`q`), quantized alike before their weights arrive.
            nn.quantize(model, class_predicate=lambda name, _: value["q"].get(name, False))
            model.load_weights([(str(name), self._decode_array(array, buffers)) for name, array in value["w"]])
            _mlx().eval(model.parameters())
            self.proxies[value["h"]] = model
        return self.proxies[value["h"]]

    def _proxy(self, value: dict):
        """The judge's one object for an object of the actor's: a `Handle`; for an exception class, the built-in
        one itself, or a subclass of its nearest built-in one (one per class: `pytest.raises(sol.module.Error)`)."""
        base = BUILTIN_EXCEPTIONS.get(str(value.get("base")), RuntimeError) if value["$"] == "exc" else None
        if base is not None and value.get("h") is None:
            return base
        handle = int(value["h"])
        if handle not in self.proxies:
            if base is not None:
                name = re.sub(r"\W", "_", str(value.get("name")))[:200] or "Error"
                self.proxies[handle] = type(name, (base,), {"__module__": "submission"})
            else:
                self.proxies[handle] = proxy = Handle.__new__(Handle)
                for slot, slot_value in (("_endpoint", self), ("_handle", handle), ("_cls", str(value["cls"]))):
                    object.__setattr__(proxy, slot, slot_value)
        return self.proxies[handle]


def _import_fakes(_, name: str):
    """The package tests/actor_fakes or a module of it (the fakes that need no trust: tests/harness.py), no other."""
    if not re.fullmatch(r"tests\.actor_fakes(\.[a-z_0-9]+)?", name):
        raise ProtocolError(f"the judge may not import {name!r} in the actor")
    return importlib.import_module(name)


# What the actor does for the judge: anything it asks of the actor's own objects.
OPERATIONS = {"getattr": getattr, "setattr": setattr, "getitem": operator.getitem, "import": _import_fakes,
              "call": lambda target, args, kwargs: target(*args, **kwargs),
              "fetch": lambda _, objects, paths: fetch(objects, *paths)}


def fetch(objects, *paths: str) -> list[list]:
    """For each object, the value of each attribute path ("seq.block_table"): objects of the actor in one round trip
    for all of them (a test reads a whole plan at once), objects of this process here."""
    objects = list(objects)
    handle = next((o for o in objects if type(o) is Handle), None)
    if handle is not None:  # (in the judge) anything but that actor's handles is refused
        return handle._endpoint.request("fetch", 0, objects, list(paths))
    return [[functools.reduce(getattr, path.split("."), obj) for path in paths] for obj in objects]


# ---------------------------------------------------------------- exceptions

def describe_exception(error: BaseException) -> dict:
    """An exception of the actor's, besides its class (sent as a value): its text, and the student's frames of its
    traceback (outside this module and the worker's), innermost first, as `pdm run test` shows them."""
    try:
        message = str(error)
    except BaseException:  # noqa: BLE001 - a text of the submission's that raises in turn
        message = "(the exception's text could not be read)"
    # Paths from the repository's root ("src/tiny_llm/batch.py"), as the student's tree and `pdm run test` name them.
    frames = [f'  File "{re.sub(r"^.*?/(?=src(_ref)?/)", "", f.filename)}", line {f.lineno}, in {f.name}: '
              f'{(f.line or "").strip()}' for f in traceback.extract_tb(error.__traceback__)[::-1]
              if not f.filename.endswith((os.path.join("course", "remote.py"), os.path.join("course", "sandbox.py")))]
    return {"msg": message[:20_000], "tb": "\n".join(frames[:12])[:6000]}


def rebuild_exception(cls, reply: dict) -> Exception:
    """The judge's exception of class `cls` for the actor's: its text, and the student's frames as a note, escaped."""
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        raise ProtocolError("an error reply without an exception class")
    message = printable(str(reply.get("msg", "")))
    try:
        error = cls(message)
    except Exception:  # a built-in exception that takes other arguments (UnicodeDecodeError)
        error = RuntimeError(message)
    trace = printable(str(reply.get("tb", "")))
    if trace:
        error.add_note(f"Raised in the submission's code (sandboxed), innermost first:\n{trace.rstrip()}")
    return error


def printable(text: str) -> str:
    """`text` with every control and format character but newline and tab escaped (\\x1b, \\r, \\u202e), so that
    no text of the submission's can recolour or clear a terminal, or move the cursor back over a table."""
    return "".join(c if c in "\n\t" or unicodedata.category(c)[0] != "C" else c.encode("unicode_escape").decode()
                   for c in text)


# ---------------------------------------------------------------- the judge's handles

class Handle:
    """An object of the actor, as the judge holds it: the judge may read an attribute or item, call it, set an
    attribute and send it back; nothing the submission's code would answer is asked (see `_refuse`)."""

    __slots__ = ("_endpoint", "_handle", "_cls")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # Python's and pytest's probes of special methods: none here
        return self._endpoint.request("getattr", self._handle, name)

    def __setattr__(self, name, value):
        self._endpoint.request("setattr", self._handle, name, value)

    def __call__(self, *args, **kwargs):
        return self._endpoint.request("call", self._handle, args, kwargs)

    def __getitem__(self, key):
        return self._endpoint.request("getitem", self._handle, key)

    def __repr__(self):
        return f"<object of the submission: {printable(self._cls)}>"  # `str()` too: object's `__str__` calls it


def _refuse(handle: Handle, name: str):
    raise TypeError(f"a test expected a value and got an object of the submission ({handle!r}): the grader does not "
                    f"let the submission's code answer __{name}__ (return data: numbers, strings, lists, arrays)")


# Comparing, hashing, `bool`, `len`, iterating, converting, formatting, arithmetic: each raises `TypeError`.
_REFUSED = ("eq ne lt le gt ge hash bool len iter next reversed contains int float complex index bytes round trunc "
            "floor ceil format neg pos abs invert await enter exit instancecheck subclasscheck array").split()
_ARITHMETIC = "add sub mul truediv floordiv mod pow matmul divmod lshift rshift and or xor".split()
for _name in [*_REFUSED, *_ARITHMETIC, *(f"r{op}" for op in _ARITHMETIC)]:
    setattr(Handle, f"__{_name}__", lambda self, *args, _name=_name: _refuse(self, _name))
