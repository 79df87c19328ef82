"""Fakes that need no trust for days 1.5-1.6 and 2.1-2.5, built where the code under test runs
(`actor_fakes(sol, "week2_models")`).

Each records what the student's code did with it as plain data the test reads back; the tests check those records
against outputs the judge computes itself with its own copy of the same class (this module, imported in the judge),
so a record the submission rewrote must still agree with what its code returned.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen2 as mlx_qwen2
from mlx_lm.models.cache import make_prompt_cache


class Week2Model:
    """mlx-lm's Qwen2 behind the week-2 model's interface (`model(inputs, offset, cache)`, `make_cache()`).

    Day 2.1's loops (Tasks 3 and 4) run on it: a correct model that is none of the student's tasks. mlx-lm's cache
    knows its own offset, so a loop that passes another one gets an error instead of silently wrong positions.
    """

    def __init__(self, mlx_model):
        self.model = mlx_model
        self.num_hidden_layers = mlx_model.args.num_hidden_layers
        self.vocab_size = mlx_model.args.vocab_size

    def make_cache(self):
        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, offset: int, cache) -> mx.array:
        if offset != cache[0].offset:
            raise ValueError(f"offset {offset}, but the cache holds {cache[0].offset} tokens: the offset is the "
                             f"number of tokens already cached")
        return self.model(inputs, cache=cache)


class Spy:
    """Wraps a week-2 model: records each call's tokens and offset; optionally makes EOS win from a position on."""

    def __init__(self, model, eos: int | None = None, eos_from: int | None = None):
        self.model, self.eos, self.eos_from = model, eos, eos_from
        self.num_hidden_layers = model.num_hidden_layers
        self.vocab_size = model.vocab_size
        self.inputs: list[tuple[mx.array, int]] = []  # kept lazy: reading them here would undo a pipelined loop

    @property
    def calls(self) -> list[tuple[int, int]]:
        """(tokens fed, offset) per call."""
        return [(inputs.shape[1], int(offset)) for inputs, offset in self.inputs]

    @property
    def trace(self) -> list[tuple[list[int], int]]:
        """(token ids fed, offset) per call, as plain data: what the judge replays."""
        return [(inputs[0].tolist(), int(offset)) for inputs, offset in self.inputs]

    def make_cache(self):
        return self.model.make_cache()

    def __call__(self, inputs: mx.array, offset: int, cache) -> mx.array:
        self.inputs.append((inputs, offset))
        logits = self.model(inputs, offset, cache)
        if self.eos is not None and offset + inputs.shape[1] >= self.eos_from:
            logits = logits + mx.zeros((logits.shape[-1],)).at[self.eos].add(1e4)
        return logits


class Recorder:
    """A greedy sampler that writes down each token it picks."""

    def __init__(self):
        self.tokens: list[int] = []

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = mx.argmax(logprobs, axis=-1)
        self.tokens.append(int(token.item()))
        return token


class Pieces:
    """An `on_text` callback that keeps every piece of text it is handed."""

    def __init__(self):
        self.pieces: list[str] = []

    def __call__(self, text: str) -> None:
        self.pieces.append(text)


class CallCountingTokenizer:
    """Wraps a tokenizer: for each token handed to its detokenizer, notes the token and how many calls `spy` had seen.

    A plain loop reads token n, hands it over, then calls the model for step n + 1: n + 1 calls by then.
    A pipelined loop has already queued step n + 1 when it reads token n: n + 2 calls.
    """

    def __init__(self, tokenizer, spy: Spy):
        self.tokenizer, self.spy = tokenizer, spy
        self.calls_at_token: list[int] = []
        self.tokens: list[int] = []
        self.eos_token_ids = tokenizer.eos_token_ids

    def encode(self, text, add_special_tokens=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def detokenizer(self):
        detokenizer = self.tokenizer.detokenizer
        add_token = detokenizer.add_token

        def counted_add_token(token):
            self.calls_at_token.append(len(self.spy.inputs))
            self.tokens.append(int(token))
            add_token(token)

        detokenizer.add_token = counted_add_token
        return detokenizer


# ---------------------------------------------------------------- day 2.3

def quantized_copy(mlx_model, group_size: int = 64, bits: int = 4):
    """A copy of an mlx-lm Qwen2 quantized in-process, embedding included; layers whose input size is not a
    multiple of `group_size` stay float, as in real mixed-precision checkpoints. The judge makes its own (the
    oracle) and the actor its own from its copy of the same weights: MLX's quantization is deterministic."""
    copy = mlx_qwen2.Model(mlx_model.args)
    copy.update(mlx_model.parameters())
    nn.quantize(copy, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(copy.parameters())
    return copy


# ---------------------------------------------------------------- day 2.4

class MarkedFlash:
    """Stands in for the module `flash_attention` as the week-2 model reaches it: counts each call's query length
    and returns day 2.4's tiled attention scaled by `MARK`.

    The mark makes the route visible in the logits: the judge runs its own model through its own `MarkedFlash`,
    so a layer that skipped flash attention (or a decode step that took it) gives other logits, whatever the
    counts say.
    """

    MARK = 0.5

    def __init__(self, module, tile_q: int = 32, tile_kv: int = 48):
        self.module, self.tile_q, self.tile_kv = module, tile_q, tile_kv
        self.calls: list[int] = []

    def flash_attention(self, q, k, v, scale=None, mask=None):
        self.calls.append(q.shape[-2])
        out = self.module.flash_attention(q, k, v, scale=scale, mask=mask, tile_q=self.tile_q, tile_kv=self.tile_kv)
        return out * self.MARK


# ---------------------------------------------------------------- day 1.6: week 1's loop, which day 2.1's extends

class EosAfter:
    """Wraps a week-1 model (`model(inputs)`): counts its calls; from the n-th generated token on, EOS is the most
    likely token."""

    def __init__(self, model, prompt_len: int, n: int, eos: int):
        self.model, self.prompt_len, self.n, self.eos = model, prompt_len, n, eos
        self.calls = 0

    def __call__(self, inputs: mx.array) -> mx.array:
        self.calls += 1
        logits = self.model(inputs)
        if inputs.shape[1] >= self.prompt_len + self.n:
            logits = logits + mx.zeros((logits.shape[-1],)).at[self.eos].add(1e4)
        return logits


class Events:
    """A week-1 model and an `on_text` callback (`events.on_text`) that log, in one list, each model call ("model")
    and each piece of text ("text"): the order in which a loop computes and streams."""

    def __init__(self, model):
        self.model = model
        self.events: list[str] = []
        self.pieces: list[str] = []

    def __call__(self, inputs: mx.array) -> mx.array:
        self.events.append("model")
        return self.model(inputs)

    def on_text(self, piece: str) -> None:
        self.events.append("text")
        self.pieces.append(piece)


class RankedSampler:
    """A sampler that answers, at its n-th call, the token of rank `ranks[n]` (0: the most likely) in the
    log-probabilities it is handed, and `then` once they run out.

    Its picks spell a text that only a loop handing it the last position's log-probabilities, once per token, in
    order, produces: the judge computes that text with the reference's loop and its own copy of this sampler. It
    takes one sequence's log-probabilities (1 x vocab) and refuses any other shape."""

    def __init__(self, ranks: list[int], then: int):
        self.ranks, self.then = ranks, then
        self.calls = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        if logprobs.ndim != 2 or logprobs.shape[0] != 1:
            raise ValueError(f"a sampler takes one sequence's log-probabilities, 1 x vocab, not {tuple(logprobs.shape)}")
        call, self.calls = self.calls, self.calls + 1
        if call >= len(self.ranks):
            return mx.array([self.then])
        return mx.argsort(-logprobs, axis=-1)[:, self.ranks[call]]
