"""Fakes for testing a scheduler (days 2.6 and 2.7) without a real model, and the one-at-a-time oracle.

`FakeModel` has the interface of `Qwen2ModelWeek2` (`__call__(inputs, offset, cache)`, `make_cache()`,
`make_batch_cache(batch_size, max_seq_len)`, `num_hidden_layers`) and records every call. Its caches
hold token ids instead of keys and values, and the token it predicts depends on the whole history in
the cache, so a scheduler that mixes up slots, caches or offsets gets different tokens (and a wrong
offset fails an assertion at once). `expected_tokens` computes what one-request-at-a-time greedy
generation gives, straight from the same rule, with no scheduler at all.

"""

from dataclasses import dataclass

import mlx.core as mx

from tests.actor_fakes import EOS, VOCAB, FakeTokenizer  # noqa: F401  (one tokenizer for every fake model)


class ModelFailure(Exception):
    """What FakeModel(fail_on_call=n) raises (not a RuntimeError, so NotImplementedError never passes for it)."""


def next_token_of(history: list[int], eos: bool = True) -> int:
    """The fake model's greedy next token after `history`: a hash of the whole sequence."""
    h = 17
    for token in history:
        h = (h * 1_000_003 + token + 7) % 2_147_483_647
    return h % VOCAB if eos else h % (VOCAB - 1)


def expected_tokens(prompt: list[int], max_seq_len: int, eos: bool = True) -> tuple[list[int], str]:
    """One-request-at-a-time greedy generation under the fake model: (output tokens, "stop" or "length")."""
    history, output = list(prompt), []
    while True:
        token = next_token_of(history, eos)
        if token == EOS:
            return output, "stop"
        output.append(token)
        history.append(token)
        if len(history) >= max_seq_len:
            return output, "length"


class FakeLayerCache:
    """One layer of one request's cache: the token ids it holds, in order."""

    def __init__(self):
        self.tokens: list[int] = []


class FakeBatchCache:
    """One layer of the decode slots: slot b holds a request's FakeLayerCache, or None."""

    def __init__(self, batch_size: int, max_seq_len: int):
        self.rows: list[FakeLayerCache | None] = [None] * batch_size
        self.max_seq_len = max_seq_len
        self.adds = 0

    def add_request(self, prefilled: FakeLayerCache, id: int) -> None:
        assert isinstance(prefilled, FakeLayerCache), f"slot {id}: expected a request's own cache, got {prefilled!r}"
        assert self.rows[id] is None, f"add_request into slot {id}, which is still taken (a retired request not removed?)"
        self.rows[id] = prefilled
        self.adds += 1

    def remove_request(self, id: int) -> None:
        assert self.rows[id] is not None, f"remove_request of slot {id}, which is already free"
        self.rows[id] = None

    def held(self) -> list[int]:
        return [slot for slot, row in enumerate(self.rows) if row is not None]


@dataclass
class Call:
    kind: str  # "prefill" or "decode"
    tokens: list  # prefill: the chunk's tokens; decode: one token per row
    offset: object  # prefill: an int; decode: one offset per row
    active: list  # decode: the rows that held a request
    mask: object = None  # prefill: the mask the caller passed (None: none)


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
        self.eos = eos
        self.fail_on_call = fail_on_call  # raise ModelFailure on this call (1-based)
        self.clock = clock
        self.prefill_cost = prefill_cost  # (seconds per chunk, seconds per token), added to the clock
        self.decode_cost = decode_cost  # seconds per decode step
        self.calls: list[Call] = []
        self.request_caches: list[list[FakeLayerCache]] = []
        self.batch_caches: list[list[FakeBatchCache]] = []

    def make_cache(self) -> list[FakeLayerCache]:
        cache = [FakeLayerCache() for _ in range(self.num_hidden_layers)]
        self.request_caches.append(cache)
        return cache

    def make_batch_cache(self, batch_size: int, max_seq_len: int) -> list[FakeBatchCache]:
        cache = [FakeBatchCache(batch_size, max_seq_len) for _ in range(self.num_hidden_layers)]
        self.batch_caches.append(cache)
        return cache

    @property
    def prefill_calls(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "prefill"]

    @property
    def decode_calls(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "decode"]

    def __call__(self, inputs: mx.array, offset, cache, mask=None) -> mx.array:
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            self.calls.append(Call("failed", inputs.tolist(), offset, []))
            raise ModelFailure("the fake model failed on purpose")
        rows = inputs.tolist()
        assert len(cache) == self.num_hidden_layers, "one cache per layer"
        if isinstance(cache[0], FakeLayerCache):
            predictions = [self._prefill(rows, offset, cache, mask)]
        else:
            predictions = [[p] for p in self._decode(rows, offset, cache)]
        logits = mx.full((len(predictions), len(predictions[0]), VOCAB), -10.0)
        hot = mx.array(predictions)[..., None] == mx.arange(VOCAB)
        return mx.where(hot, 10.0, logits)

    def _prefill(self, rows, offset, cache, mask=None) -> list[int]:
        assert len(rows) == 1 and isinstance(offset, int), "a prefill chunk is one request: 1 x L, an int offset"
        chunk = rows[0]
        self.calls.append(Call("prefill", chunk, offset, [], mask))
        for layer in cache:
            assert len(layer.tokens) == offset, (
                f"prefill chunk at offset {offset}, but this cache holds {len(layer.tokens)} tokens")
            layer.tokens.extend(chunk)
        if self.clock is not None:
            self.clock.advance(self.prefill_cost[0] + self.prefill_cost[1] * len(chunk))
        history = cache[0].tokens
        return [next_token_of(history[: offset + i + 1], self.eos) for i in range(len(chunk))]

    def _decode(self, rows, offsets, cache) -> list[int]:
        slots = len(cache[0].rows)
        active = [b for b in range(slots) if cache[0].rows[b] is not None]
        # One row per slot (idle rows included), or one row per held slot in slot order (idle slots left out).
        row_slots = list(range(slots)) if len(rows) == slots else active
        assert len(rows) == len(row_slots) and all(len(r) == 1 for r in rows), (
            f"a decode step is {slots} x 1 (one row per slot) or {len(active)} x 1 (one row per held slot)")
        assert isinstance(offsets, list) and len(offsets) == len(rows), "a decode step has one offset per row"
        self.calls.append(Call("decode", [r[0] for r in rows], list(offsets), active))
        predictions = []
        for row, b in enumerate(row_slots):
            if cache[0].rows[b] is None:
                assert all(layer.rows[b] is None for layer in cache), f"slot {b} is held in some layers only"
                predictions.append(0)  # an idle row: garbage nobody should read
                continue
            for layer in cache:
                held = layer.rows[b]
                assert held is not None, f"slot {b} is held in some layers only"
                assert len(held.tokens) == offsets[row], (
                    f"slot {b}: decode at offset {offsets[row]}, but its cache holds {len(held.tokens)} tokens")
                held.tokens.append(rows[row][0])
            predictions.append(next_token_of(cache[0].rows[b].tokens, self.eos))
        if self.clock is not None:
            self.clock.advance(self.decode_cost)
        return predictions


def prompt_of(length: int, seed: int) -> str:
    """A fake-tokenizer prompt of exactly `length` tokens."""
    return "".join(chr(ord("a") + (seed * 7 + i * 3) % 26) for i in range(length))

