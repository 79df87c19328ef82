"""Days 2.6 and 2.7's fakes, built where the scheduler under test runs (`actor_fakes(sol, "schedulers")`).

`FakeModel` has the interface of `Qwen2ModelWeek2` (`__call__(inputs, offset, cache, mask="causal")`, `make_cache()`,
`make_batch_cache(batch_size, max_seq_len)`, `num_hidden_layers`, `vocab_size`). Its caches hold token ids
instead of keys and values, and the token it predicts is a hash of the whole history in the cache
(`next_token_of`), so a scheduler that mixes up slots, caches or offsets gets different tokens (and a wrong offset
fails an assertion at once). A prefill chunk's row computed under a mask that is not the chunk's causal one (each
row sees the cached tokens and the chunk's up to itself) goes into the cache marked (`WRONG_MASK`), as a real
model's keys and values would be wrong there: every later token differs, so the mask shows in the outputs.

Everything the fake does goes through a `Tape`: plain data (the token ids each cache holds, which cache each
decode slot holds) and the list of operations (`events`) that made it. The tape is what the test reads back, in
one round trip; it is written where the submission runs, so the judge never trusts it as it comes: it runs the
same events through a `Tape` of its own (tests/scheduler_fakes.py) and requires that they are a valid run of
the fake which produces exactly the tokens the scheduler returned.

`drive` runs a scheduler to the end here and returns what the test checks as data: the finished requests and,
after every step, a view of the slots (the submission's own state, read as a test would read it).
Plain Python and MLX only: the worker imports this package alone.
"""

from dataclasses import dataclass

import mlx.core as mx

from . import EOS, VOCAB, FakeTokenizer, Lines, next_token_of  # noqa: F401  (the fake model's tokenizer, a log sink)


WRONG_MASK = 1000  # added to a token the cache took from a row computed under a wrong mask


def rows_masked_right(mask, offset: int, length: int) -> list[bool]:
    """Per row of a prefill chunk at `offset`: whether `mask` lets it see exactly the cached tokens and the chunk's
    up to itself, as day 2.7's `chunk_causal_mask` and the model's default "causal" do (None: no mask, every row
    sees the whole chunk). An array mask is additive, `L x S` (S = offset + L): 0 where a row sees a key; a key
    it must not see may hold any value up to -1e4 (-inf included)."""
    if isinstance(mask, str):
        assert mask == "causal", f"a mask is an array, None or \"causal\", not {mask!r}"
        return [True] * length
    if mask is None:
        return [row == length - 1 for row in range(length)]
    keys = offset + length
    assert tuple(mask.shape[-2:]) == (length, keys) and mask.size == length * keys, (
        f"a chunk of {length} tokens at offset {offset} takes an {length} x {keys} mask, not {tuple(mask.shape)}")
    values = mx.array(mask).reshape(length, keys)
    sees = mx.arange(keys)[None, :] <= offset + mx.arange(length)[:, None]
    return mx.all(mx.where(sees, values == 0, values <= -1e4), axis=1).tolist()


class ModelFailure(Exception):
    """What FakeModel(fail_on_call=n) raises (not a RuntimeError, so NotImplementedError never passes for it)."""


@dataclass
class Call:
    kind: str  # "prefill", "decode" or "failed"
    tokens: list  # prefill: the chunk's tokens; decode: one token per row
    offset: object  # prefill: an int; decode: one offset per row
    active: list  # decode: the slots that held a request
    mask: object = None  # prefill: the mask the caller passed ("causal": none, the model's default)


class Tape:
    """The fake model's caches as plain data, and every operation on them, checked as it is applied.

    `histories[c]` is the token ids layer cache `c` holds; `batches[b][layer][slot]` the layer cache that decode
    slot holds in batch cache `b` (None: free). `apply(event)` checks one operation, performs it, appends it to
    `events` (and a model call to `calls`) and returns the call's greedy predictions. Run on the judge's side over
    the events the actor recorded, it is the replay that checks them.
    """

    def __init__(self, num_layers: int = 2, eos: bool = True):
        self.num_layers, self.eos = num_layers, eos
        self.histories: list[list[int]] = []
        self.prefilled: list[int] = []  # per layer cache: how many of its tokens came from prefill chunks
        self.requests: list[list[int]] = []  # per make_cache(): its layer caches
        self.batches: list[list[list[int | None]]] = []
        self.adds: list[int] = []  # per batch cache: requests added (counted on layer 0)
        self.events: list[list] = []
        self.calls: list[Call] = []

    def apply(self, event: list):
        kind, *args = event
        operation = {"cache": self._cache, "batch": self._batch, "add": self._add, "remove": self._remove,
                     "prefill": self._prefill, "decode": self._decode, "failed": self._failed}.get(kind)
        assert operation is not None, f"an operation the fake model never records: {kind!r}"
        self.events.append(list(event))
        return operation(*args)

    def held(self, batch: int, layer: int) -> list[int]:
        """The slots of one layer of a batch cache that hold a request."""
        return [slot for slot, cache in enumerate(self.batches[batch][layer]) if cache is not None]

    def generations(self) -> list[tuple[tuple, tuple]]:
        """Per request cache that was prefilled: (its prompt, every token the model predicted for it in order).

        The prediction after the prompt, then one per decode step: the greedy tokens of the whole history."""
        found = []
        for layers in self.requests:
            history, prompt_length = self.histories[layers[0]], self.prefilled[layers[0]]
            if prompt_length:
                predicted = [next_token_of(history[:n], self.eos) for n in range(prompt_length, len(history) + 1)]
                found.append((tuple(history[:prompt_length]), tuple(predicted)))
        return found

    def _cache(self) -> list[int]:
        ids = list(range(len(self.histories), len(self.histories) + self.num_layers))
        self.histories += [[] for _ in ids]
        self.prefilled += [0 for _ in ids]
        self.requests.append(ids)
        return ids

    def _batch(self, batch_size: int, max_seq_len: int) -> int:
        self.batches.append([[None] * batch_size for _ in range(self.num_layers)])
        self.adds.append(0)
        return len(self.batches) - 1

    def _add(self, batch: int, layer: int, slot: int, cache: int) -> None:
        assert 0 <= cache < len(self.histories), f"slot {slot}: expected a request's own cache"
        rows = self.batches[batch][layer]
        assert rows[slot] is None, (
            f"add_request into slot {slot}, which is still taken (a retired request not removed?)")
        rows[slot] = cache
        self.adds[batch] += layer == 0

    def _remove(self, batch: int, layer: int, slot: int) -> None:
        rows = self.batches[batch][layer]
        assert rows[slot] is not None, f"remove_request of slot {slot}, which is already free"
        rows[slot] = None

    def _prefill(self, caches: list[int], tokens: list[int], offset, mask) -> list[int]:
        assert isinstance(offset, int) and len(caches) == self.num_layers, \
            "a prefill chunk is one request: 1 x L, an int offset, one cache per layer"
        self.calls.append(Call("prefill", tokens, offset, [], mask))
        # A row computed under a wrong mask leaves wrong keys and values behind it: a marked token.
        held = [t if right else t + WRONG_MASK for t, right in zip(tokens, rows_masked_right(mask, offset, len(tokens)))]
        for cache in caches:
            assert len(self.histories[cache]) == offset, (
                f"prefill chunk at offset {offset}, but this cache holds {len(self.histories[cache])} tokens")
            self.histories[cache] += held
            self.prefilled[cache] += len(tokens)
        history = self.histories[caches[0]]
        return [next_token_of(history[: offset + i + 1], self.eos) for i in range(len(tokens))]

    def _decode(self, layers: list, tokens: list[int], offsets) -> list[int]:
        assert len(layers) == self.num_layers, "one cache per layer"
        rows = [self.batches[batch][layer] for batch, layer in layers]
        slots = len(rows[0])
        active = [slot for slot in range(slots) if rows[0][slot] is not None]
        # One row per slot (idle rows included), or one row per held slot in slot order (idle slots left out).
        row_slots = list(range(slots)) if len(tokens) == slots else active
        assert len(tokens) == len(row_slots), (
            f"a decode step is {slots} x 1 (one row per slot) or {len(active)} x 1 (one row per held slot)")
        assert isinstance(offsets, list) and len(offsets) == len(tokens), "a decode step has one offset per row"
        self.calls.append(Call("decode", tokens, offsets, active))
        predictions = []
        for row, slot in enumerate(row_slots):
            if rows[0][slot] is None:
                assert all(layer[slot] is None for layer in rows), f"slot {slot} is held in some layers only"
                predictions.append(0)  # an idle row: garbage nobody should read
                continue
            for layer in rows:
                assert layer[slot] is not None, f"slot {slot} is held in some layers only"
                history = self.histories[layer[slot]]
                assert len(history) == offsets[row], (
                    f"slot {slot}: decode at offset {offsets[row]}, but its cache holds {len(history)} tokens")
                history.append(tokens[row])
            predictions.append(next_token_of(self.histories[rows[0][slot]], self.eos))
        return predictions

    def _failed(self, tokens, offset) -> None:
        self.calls.append(Call("failed", tokens, offset, []))


class FakeLayerCache:
    """One layer of one request's cache: layer cache `id` of the model's tape (its tokens: `tape.histories[id]`)."""

    def __init__(self, id: int):
        self.id = id


class FakeBatchCache:
    """One layer of the decode slots: slot b holds a request's FakeLayerCache, or nothing."""

    def __init__(self, tape: Tape, batch: int, layer: int):
        self.tape, self.batch, self.layer = tape, batch, layer

    def add_request(self, prefilled: FakeLayerCache, id: int) -> None:
        assert isinstance(prefilled, FakeLayerCache), f"slot {id}: expected a request's own cache, got {prefilled!r}"
        self.tape.apply(["add", self.batch, self.layer, id, prefilled.id])

    def remove_request(self, id: int) -> None:
        self.tape.apply(["remove", self.batch, self.layer, id])

    def held(self) -> list[int]:
        return self.tape.held(self.batch, self.layer)


class FakeClock:
    """A clock the test moves by hand (or the fake model moves as it 'computes')."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeModel:
    """A recording model whose next token depends on the whole history held in the cache it is given."""

    def __init__(self, num_layers: int = 2, eos: bool = True, fail_on_call: int | None = None,
                 clock: FakeClock | None = None, prefill_cost=(0.0, 0.0), decode_cost: float = 0.0):
        self.num_hidden_layers = num_layers
        self.vocab_size = VOCAB
        self.tape = Tape(num_layers, eos)
        self.fail_on_call = fail_on_call  # raise ModelFailure on this call (1-based)
        self.clock = clock
        self.prefill_cost = prefill_cost  # (seconds per chunk, seconds per token), added to the clock
        self.decode_cost = decode_cost  # seconds per decode step
        self.batch_caches: list[list[FakeBatchCache]] = []

    def record(self) -> list[list]:
        """Every operation so far, as plain data (what the judge replays)."""
        return self.tape.events

    @property
    def num_calls(self) -> int:
        return len(self.tape.calls)

    @property
    def calls(self) -> list[Call]:
        return self.tape.calls

    @property
    def decode_calls(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "decode"]

    def make_cache(self) -> list[FakeLayerCache]:
        return [FakeLayerCache(id) for id in self.tape.apply(["cache"])]

    def make_batch_cache(self, batch_size: int, max_seq_len: int) -> list[FakeBatchCache]:
        batch = self.tape.apply(["batch", batch_size, max_seq_len])
        cache = [FakeBatchCache(self.tape, batch, layer) for layer in range(self.num_hidden_layers)]
        self.batch_caches.append(cache)
        return cache

    def __call__(self, inputs: mx.array, offset, cache, mask="causal") -> mx.array:
        rows = inputs.tolist()
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            self.tape.apply(["failed", rows, offset])
            raise ModelFailure("the fake model failed on purpose")
        assert len(cache) == self.num_hidden_layers, "one cache per layer"
        if isinstance(cache[0], FakeLayerCache):
            assert len(rows) == 1, "a prefill chunk is one request: 1 x L, an int offset"
            assert all(isinstance(layer, FakeLayerCache) for layer in cache), "a request's cache, every layer"
            predictions = [self.tape.apply(["prefill", [layer.id for layer in cache], rows[0], offset, mask])]
            cost = self.prefill_cost[0] + self.prefill_cost[1] * len(rows[0])
        else:
            assert all(isinstance(layer, FakeBatchCache) for layer in cache), "the decode slots' cache, every layer"
            assert all(len(row) == 1 for row in rows), "a decode step feeds one token per row"
            layers = [[layer.batch, layer.layer] for layer in cache]
            predictions = [[p] for p in self.tape.apply(["decode", layers, [r[0] for r in rows], offset])]
            cost = self.decode_cost
        if self.clock is not None:
            self.clock.advance(cost)
        logits = mx.full((len(predictions), len(predictions[0]), VOCAB), -10.0)
        hot = mx.array(predictions)[..., None] == mx.arange(VOCAB)
        return mx.where(hot, 10.0, logits)


# ---------------------------------------------------------------- driving a scheduler, read back as data


def drive(scheduler, prompts, model=None, watch: bool = False, texts: bool = False) -> dict:
    """Queue every prompt (its index its position) and step `scheduler` to the end, as batch_generate does.

    Returns {"finished": one dict per finished request, in finishing order; "views": with `watch`, the slots after
    every step (`view`); "events": the record of `model`, a FakeModel, or None}."""
    for idx, prompt in enumerate(prompts):
        scheduler.add_request(prompt, idx)
    views = []
    while scheduler.has_work():
        scheduler.step()
        if watch:
            views.append(view(scheduler, model))
    return {"finished": [finished(request, texts) for request in scheduler.finished], "views": views,
            "events": model.record() if isinstance(model, FakeModel) else None}


def finished(request, text: bool = False) -> dict:
    """What the test checks of a finished request."""
    return {"idx": request.prompt_idx, "tokens": list(request.output_tokens), "reason": request.finish_reason,
            "done": bool(request.is_done), "dropped": request.kv_cache is None,
            "text": request.text() if text else None}


def view(scheduler, model) -> dict:
    """The scheduler's slots as the test checks them after a step: `at` is how many operations the model had
    recorded by then (where the judge's replay stands), `slots[b]` the layer caches of slot b's request (None:
    idle), `waiting` the request being prefilled (is_prefill_done, is_done), `free` the first free slot, and
    `retired` whether every finished request is done and holds no slot."""
    slots = scheduler.slots
    waiting = scheduler.prefilling
    return {
        "at": len(model.record()),
        "slots": [None if r is None else [getattr(layer, "id", None) for layer in (r.kv_cache or [])] for r in slots],
        "waiting": None if waiting is None else [bool(waiting.is_prefill_done), bool(waiting.is_done)],
        "free": scheduler.free_slot(),
        "retired": all(r.is_done and all(r is not s for s in slots) for r in scheduler.finished),
    }


# ---------------------------------------------------------------- the real model, measured where it runs


def active_memory() -> int:
    """MLX's active memory in this process once the work already queued has finished (nothing lazy is computed)."""
    mx.synchronize()
    return mx.get_active_memory()


def call_lazily(model, tokens: list[int], offset: int, cache) -> None:
    """Run `model` on one row of `tokens` and drop its logits uncomputed: `cache` is left lazy."""
    model(mx.array([tokens]), offset, cache)


class LogitsRecorder:
    """Wraps a model and keeps the logits of every call (the model's other attributes pass through)."""

    def __init__(self, model):
        self.model = model
        self.outputs = []

    def __call__(self, inputs, offset, cache, **kwargs):
        logits = self.model(inputs, offset, cache, **kwargs)
        self.outputs.append(logits)
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)
