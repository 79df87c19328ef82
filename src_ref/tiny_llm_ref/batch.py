"""Continuous batching with chunked prefill: the scheduler of a tiny inference server.

A request moves through three places:

    queue ──> prefill (one request at a time, one chunk per iteration) ──> a decode slot ──> finished

Each iteration of the scheduler (`SlotScheduler.step`) does two pieces of work:

1. one prefill chunk (at most `prefill_step` prompt tokens) of the request being prefilled;
2. one decode step: one new token for every request in a decode slot, in one batched model call.

A request takes a decode slot as soon as its prefill is done and a slot is free, and leaves it at
EOS or when its prompt plus output tokens reach `max_seq_len`; the slot then serves the next one.
Cutting a long prompt's prefill into chunks is what keeps the decoding requests' tokens flowing:
they wait one chunk per iteration instead of the whole prompt (head-of-line blocking).

Caches come only from the model: `model.make_cache()` for one request's prefill, and
`model.make_batch_cache(batch_size, max_seq_len)` for the decode slots.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .chunk_policy import FixedChunkPolicy
from .metrics import MetricsRecorder
from .validation import (check_batch_size, check_chunk_size, check_int, check_max_seq_len, check_number,
                         check_prompt, check_prompts, clear_failure, refuse_after_failure)

logger = logging.getLogger("tiny_llm.batch")


def greedy(logits: mx.array) -> list[int]:
    """The most likely next token of every row of `B x L x vocab` logits, read at the last position (provided)."""
    return mx.argmax(logits[:, -1, :], axis=-1).tolist()


# ---------------------------------------------------------------- one request


class Request:
    """One prompt on its way through the server: its prefill progress, its KV cache and its output."""

    def __init__(
        self,
        model,
        tokenizer,
        prompt: str | list[int],
        prefill_max_step: int = 128,
        prompt_idx: int = 0,
        max_seq_len: int | None = None,
    ):
        """Encode the prompt and make the request's KV cache (provided).

        `prompt` is a string, encoded as it is (the caller applies any chat template), or token ids.
        `try_prefill` runs chunks of at most `prefill_max_step` tokens. With `max_seq_len`, the request
        ends once prompt plus output tokens reach it. Raises ValueError or TypeError, before any model
        call, for a chunk size below 1 (or not an integer), an empty prompt, a token id outside the
        vocabulary, a `max_seq_len` beyond the model's context, or a prompt that leaves no room for one
        output token.
        """
        check_int("prefill_max_step", prefill_max_step, 1)
        check_int("prompt_idx", prompt_idx, 0)
        if max_seq_len is not None:
            check_max_seq_len(model, max_seq_len)
        tokens = check_prompt(model, tokenizer, prompt, f"prompt {prompt_idx}")
        if max_seq_len is not None and len(tokens) >= max_seq_len:
            raise ValueError(f"prompt {prompt_idx} has {len(tokens)} tokens, which leaves no room to generate "
                             f"within max_seq_len={max_seq_len}")
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_idx = prompt_idx
        self.prompt_tokens: list[int] = tokens
        self.prefill_max_step = prefill_max_step
        self.max_seq_len = max_seq_len
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.kv_cache = model.make_cache()  # one cache per layer, filled chunk by chunk
        self.offset = 0  # how many tokens the KV cache holds = the absolute position of the next one
        self.is_prefill_done = False
        self.next_token: int | None = None  # the newest output token: the next decode step feeds it
        self.output_tokens: list[int] = []  # generated tokens, EOS excluded
        self.is_done = False
        self.finish_reason: str | None = None  # "stop" (EOS), "length" or "abort" (the engine's and OpenAI's words)

    def try_prefill(self) -> int:
        """Prefill the next chunk of at most `prefill_max_step` prompt tokens; return how many tokens it ran.

        The chunk's tokens sit at absolute positions `offset ..`; the model reads the earlier ones from
        the KV cache under the chunk's mask (`chunk_causal_mask(offset, chunk length)`), and `offset`
        moves past the chunk. A chunk that is not the last materializes the KV cache (MLX is lazy).
        The last chunk also picks the first output token (greedy), records it with `record_token`, and
        sets `is_prefill_done`. Called once the prefill is done, it raises ValueError (no model call).
        """
        # BEGIN TASK Week 2 Day 7 Task 3: prefill one chunk at its absolute offset
        # TODO: done already -> ValueError; chunk = prompt_tokens[offset : offset + prefill_max_step];
        # TODO: model(1 x L, offset, kv_cache, mask=chunk_causal_mask(...)); materialize, or the first token
        if self.is_prefill_done:
            raise ValueError(f"request {self.prompt_idx}: prefill already complete")
        start = self.offset
        chunk = self.prompt_tokens[start : start + self.prefill_max_step]
        mask = chunk_causal_mask(start, len(chunk))
        logits = self.model(mx.array([chunk]), start, self.kv_cache, mask=mask)
        self.offset = start + len(chunk)
        if self.offset < len(self.prompt_tokens):
            # Nobody reads this chunk's logits. Compute its keys and values now: left lazy, every
            # chunk's work would pile up and run at the last one, blocking decodes all the same.
            materialize_cache(self.kv_cache)
            return len(chunk)
        self.is_prefill_done = True
        self.record_token(greedy(logits)[0])
        return len(chunk)
        # END TASK

    def record_token(self, token: int) -> None:
        """Take `token` as the request's newest output (`next_token`); finish at EOS or at `max_seq_len`.

        An EOS token (any id in `tokenizer.eos_token_ids`) ends the request with finish_reason "stop"
        and is not part of the output. Any other token is appended to `output_tokens`, and the request
        ends with finish_reason "length" once prompt plus output tokens reach `max_seq_len`.
        """
        # BEGIN TASK Week 2 Day 6 Task 1: record an output token; finish at EOS or max_seq_len
        # TODO: set next_token; EOS: done ("stop"), not kept; else append, and done ("length") at max_seq_len
        self.next_token = token
        if token in self.eos_token_ids:
            self.is_done, self.finish_reason = True, "stop"
            return
        self.output_tokens.append(token)
        if self.max_seq_len is not None and len(self.prompt_tokens) + len(self.output_tokens) >= self.max_seq_len:
            self.is_done, self.finish_reason = True, "length"
        # END TASK

    def decode_done(self, token: int) -> None:
        """A decode step ran `next_token` at position `offset` (now in the cache) and produced `token`."""
        # BEGIN TASK Week 2 Day 6 Task 1: the fed token is cached now; record the new one
        # TODO: the fed token is in the cache now: offset + 1; then record_token(token)
        self.offset += 1
        self.record_token(token)
        # END TASK

    def text(self) -> str:
        """The generated text so far (EOS excluded)."""
        # BEGIN TASK Week 2 Day 6 Task 1: the generated text
        # TODO: decode output_tokens with the tokenizer
        return self.tokenizer.decode(self.output_tokens)
        # END TASK


def materialize_cache(kv_cache: list) -> None:
    """Evaluate every array a request's KV cache holds (one cache object per layer), so no lazy work is left."""
    # BEGIN TASK Week 2 Day 7 Task 2: evaluate the KV cache between chunks
    # TODO: mx.eval over the arrays each layer's cache object holds (vars(...) reaches them)
    # mx.eval walks lists, tuples and dicts and skips what is not an array (offsets, None).
    mx.eval([vars(layer_cache) for layer_cache in kv_cache])
    # END TASK


def prefill_peak_memory(model, tokenizer, prompt: str | list[int], prefill_step: int) -> int:
    """The peak memory, in bytes above what was allocated before, of prefilling `prompt` in chunks of `prefill_step` tokens."""
    # BEGIN TASK Week 2 Day 7 Task 3: measure the peak memory of a prefill
    # TODO: active memory before, reset the peak, prefill chunk by chunk, peak minus before
    request = Request(model, tokenizer, prompt, prefill_step)
    mx.synchronize()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    while not request.is_prefill_done:
        request.try_prefill()
    return mx.get_peak_memory() - baseline
    # END TASK


# ---------------------------------------------------------------- the chunk's view of attention


def chunk_positions(offset: int, chunk_len: int) -> mx.array:
    """The absolute positions of a chunk of `chunk_len` tokens after `offset` cached ones: what RoPE rotates by."""
    # BEGIN TASK Week 2 Day 7 Task 1: absolute positions of a chunk
    # TODO: offset, offset + 1, ..., offset + chunk_len - 1
    return mx.arange(offset, offset + chunk_len)
    # END TASK


def chunk_causal_mask(offset: int, chunk_len: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The additive mask of a prefill chunk: `chunk_len x (offset + chunk_len)`, 0 where allowed, -inf elsewhere.

    Query i of the chunk sits at absolute position offset + i and sees keys 0 .. offset + i: all the
    cached ones, and the chunk's own up to itself. It is `causal_mask(L, S)` with L = chunk_len and
    S = offset + chunk_len.
    """
    # BEGIN TASK Week 2 Day 7 Task 1: the causal mask of a chunk after cached tokens
    # TODO: key position <= query position (offset + i): 0, else -inf
    query_positions = chunk_positions(offset, chunk_len)[:, None]
    key_positions = mx.arange(offset + chunk_len)[None, :]
    allowed = key_positions <= query_positions
    return mx.where(allowed, mx.array(0.0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))
    # END TASK


# ---------------------------------------------------------------- the scheduler


@dataclass
class SchedulerStats:
    """What a scheduler did: prefill chunks and their time, decode steps served, and how the two interleaved."""

    chunks: int = 0  # prefill chunks run
    prefill_tokens: int = 0  # prompt tokens prefilled
    chunk_seconds: float = 0.0  # time spent in prefill chunks
    decode_steps: int = 0  # batched decode steps run
    decode_tokens: int = 0  # tokens those steps produced (one per running request)
    decode_seconds: float = 0.0  # time spent in decode steps
    interleaved_steps: int = 0  # decode steps that shared their iteration with a prefill chunk

    def record_chunk(self, tokens: int, seconds: float) -> None:
        """Count one prefill chunk of `tokens` prompt tokens that took `seconds`."""
        # BEGIN TASK Week 2 Day 7 Task 4: count a prefill chunk
        # TODO: one more chunk, its tokens and seconds
        self.chunks += 1
        self.prefill_tokens += tokens
        self.chunk_seconds += seconds
        # END TASK

    def record_decode_step(self, batch: int, seconds: float, interleaved: bool) -> None:
        """Count one decode step of `batch` requests that took `seconds`; `interleaved`: a chunk ran in the same iteration."""
        # BEGIN TASK Week 2 Day 7 Task 4: count a decode step
        # TODO: one more step, batch tokens, seconds; interleaved counts
        self.decode_steps += 1
        self.decode_tokens += batch
        self.decode_seconds += seconds
        self.interleaved_steps += int(interleaved)
        # END TASK

    @property
    def avg_chunk_time(self) -> float | None:
        """Mean seconds per prefill chunk (None before the first chunk)."""
        # BEGIN TASK Week 2 Day 7 Task 4: mean seconds per chunk
        # TODO: chunk_seconds / chunks, None before any chunk
        return self.chunk_seconds / self.chunks if self.chunks else None
        # END TASK

    @property
    def interleave_ratio(self) -> float | None:
        """Prefill chunks per decode step (None before the first decode step)."""
        # BEGIN TASK Week 2 Day 7 Task 4: prefill chunks per decode step
        # TODO: chunks / decode_steps, None before any decode step
        return self.chunks / self.decode_steps if self.decode_steps else None
        # END TASK

    def to_dict(self) -> dict:
        """The counters and the two derived figures, JSON-ready."""
        return {**vars(self), "avg_chunk_time": self.avg_chunk_time, "interleave_ratio": self.interleave_ratio}


class SlotScheduler:
    """Continuous batching with chunked prefill, driven one iteration at a time; requests may arrive at any time.

    `add_request` queues a prompt; `step` runs one iteration; `has_work` says whether anything is
    left. Finished requests collect in `finished`. `slots[b]` is the request decoding in row b of the
    batch (None: idle), `prefilling` the request being prefilled (or prefilled and waiting for a
    slot), `queue` the requests not started. Token times go to `metrics` (a MetricsRecorder).

    Named for its decode slots: week 3's `Scheduler` (scheduler.py) plans token-budget steps instead.
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_seq_len: int = 512,
        batch_size: int = 5,
        prefill_step: int = 128,
        policy=None,
        metrics: MetricsRecorder | None = None,
        clock: Callable[[], float] = time.perf_counter,
        log: Callable[[str], None] | None = None,
        log_interval: float = 5.0,
    ):
        """Check the settings and make the decode slots' batch KV cache (provided).

        `policy` picks each chunk's size (default: `FixedChunkPolicy(prefill_step)`); `clock` times
        chunks, decode steps and log lines; `log` receives log lines (default: the "tiny_llm.batch"
        logger). Raises ValueError or TypeError, before any model call, for sizes that are not integers,
        `batch_size < 1`, `prefill_step < 1`, `max_seq_len < 2` or beyond the model's context, or more
        slots than the machine's memory can hold full.
        """
        check_max_seq_len(model, max_seq_len)
        check_batch_size(model, batch_size, max_seq_len)
        check_int("prefill_step", prefill_step, 1)
        check_number("log_interval", log_interval, 0.0)
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.prefill_step = prefill_step
        self.policy = policy if policy is not None else FixedChunkPolicy(prefill_step)
        self.clock = clock
        self.metrics = metrics if metrics is not None else MetricsRecorder(clock=clock)
        self.log = log if log is not None else logger.info
        self.log_interval = log_interval
        self.stats = SchedulerStats()
        self.batch_cache = model.make_batch_cache(batch_size, max_seq_len)
        self.slots: list[Request | None] = [None] * batch_size
        self.prefilling: Request | None = None
        self.queue: deque[Request] = deque()
        self.finished: list[Request] = []
        self.next_prompt_idx = 0
        self.last_log_time: float | None = None  # when log_stats last wrote a line (None: never)
        self.last_log_tokens = (0, 0)  # (prompt, generated) token counts at that line
        self.failure: BaseException | None = None  # what the last step raised, until release_all()

    # -- provided helpers

    def add_request(self, prompt: str | list[int], prompt_idx: int | None = None, max_tokens: int | None = None) -> Request:
        """Queue a prompt (a string encoded as it is, or token ids) and return its Request (provided).

        `prompt_idx` defaults to the next unused index; `max_tokens` caps the output below what
        `max_seq_len` allows. Bad input (an index already used, too) raises ValueError or TypeError
        here, before any model call, and leaves the scheduler as it was.
        """
        idx = self.next_prompt_idx if prompt_idx is None else check_int("prompt_idx", prompt_idx, 0)
        if idx in self.metrics.requests:
            raise ValueError(f"prompt_idx {idx} is already in use: every request needs its own index")
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, 1)
        request = Request(self.model, self.tokenizer, prompt, self.prefill_step, idx, self.max_seq_len)
        if max_tokens is not None:
            request.max_seq_len = min(self.max_seq_len, len(request.prompt_tokens) + max_tokens)
        self.next_prompt_idx = max(self.next_prompt_idx, idx + 1)
        self.queue.append(request)
        self.metrics.arrive(idx, len(request.prompt_tokens))
        return request

    def has_work(self) -> bool:
        """Whether any request is queued, prefilling or decoding (provided)."""
        return bool(self.queue) or self.prefilling is not None or self.num_running > 0

    @property
    def num_running(self) -> int:
        """How many requests hold a decode slot (provided)."""
        return sum(request is not None for request in self.slots)

    @property
    def num_waiting(self) -> int:
        """How many requests have no decode slot yet: queued or prefilling (provided)."""
        return len(self.queue) + (self.prefilling is not None)

    def free_slot(self) -> int | None:
        """The first idle decode slot, or None when all are busy (provided)."""
        for slot, request in enumerate(self.slots):
            if request is None:
                return slot
        return None

    def finish(self, request: Request) -> None:
        """A request is done: drop its KV cache, stamp its finish time, keep it in `finished` (provided)."""
        request.kv_cache = None
        self.metrics.finish(request.prompt_idx)
        self.finished.append(request)

    # -- continuous batching (day 2.6)

    def admit(self) -> None:
        """Move the request whose prefill is done into a free decode slot; one already done finishes at once.

        Its per-layer caches join the batch cache in that slot. With every slot busy it stays in
        `prefilling`, prefilled, until a slot frees up.
        """
        # BEGIN TASK Week 2 Day 6 Task 2: move a prefilled request into a free decode slot
        # TODO: prefilling done? already done -> finish; else a free slot: add_request on every layer, slots[slot] = it
        request = self.prefilling
        if request is None or not request.is_prefill_done:
            return
        if request.is_done:
            # Its first token was EOS or reached max_seq_len: it never needs a decode step.
            self.prefilling = None
            self.finish(request)
            return
        slot = self.free_slot()
        if slot is None:
            return
        for layer_cache, prefilled in zip(self.batch_cache, request.kv_cache, strict=True):
            layer_cache.add_request(prefilled, slot)
        self.slots[slot] = request
        self.prefilling = None
        # END TASK

    def decode_step(self) -> None:
        """One batched decode step: each running request feeds its `next_token` at its `offset` and gets one token.

        The batch has one row per busy slot, in slot order: idle slots are left out, so they cost
        nothing (the batch cache lines its held slots up the same way). Each produced token goes to its
        request (`decode_done`) and to `metrics` (EOS excluded); requests that are now done leave their
        slot (`retire`).
        """
        # BEGIN TASK Week 2 Day 6 Task 2: one batched decode step over the slots
        # TODO: the busy slots; their tokens (n x 1) and offsets; model(...); greedy; decode_done, metrics.token, retire
        busy = [slot for slot, request in enumerate(self.slots) if request is not None]
        tokens = [self.slots[slot].next_token for slot in busy]
        offsets = [self.slots[slot].offset for slot in busy]
        logits = self.model(mx.array(tokens)[:, None], offsets, self.batch_cache)
        for slot, token in zip(busy, greedy(logits), strict=True):
            request = self.slots[slot]
            request.decode_done(token)
            if request.finish_reason != "stop":
                self.metrics.token(request.prompt_idx)
            if request.is_done:
                self.retire(slot)
        # END TASK

    def retire(self, slot: int) -> None:
        """Free decode slot `slot`: remove its request from every layer's batch cache and finish it."""
        # BEGIN TASK Week 2 Day 6 Task 2: free a decode slot
        # TODO: remove_request(slot) on every layer, empty the slot, finish(request)
        request = self.slots[slot]
        for layer_cache in self.batch_cache:
            layer_cache.remove_request(slot)
        self.slots[slot] = None
        self.finish(request)
        # END TASK

    @clear_failure
    def release_all(self) -> None:
        """Give back every slot and cache after an error: running, prefilling and queued requests are cancelled."""
        # BEGIN TASK Week 2 Day 6 Task 3: release every slot and cache after an error
        # TODO: remove every held slot from the batch cache; cancel running, prefilling, queued (kv_cache = None)
        cancelled = [r for r in self.slots if r is not None] + list(self.queue)
        if self.prefilling is not None:
            cancelled.append(self.prefilling)
        for slot, request in enumerate(self.slots):
            if request is not None:
                for layer_cache in self.batch_cache:
                    layer_cache.remove_request(slot)
                self.slots[slot] = None
        for request in cancelled:
            request.kv_cache = None
            request.is_done, request.finish_reason = True, "abort"
        self.prefilling = None
        self.queue.clear()
        # END TASK

    # -- chunked prefill (day 2.7)

    def prefill_chunk(self) -> int:
        """Run one prefill chunk of the request being prefilled (taking the next queued one if none is); return its tokens.

        Returns 0 when no chunk ran (nothing to prefill, or a prefilled request waits for a slot). The
        chunk size comes from the policy, given how many requests are decoding; the chunk is timed with
        `clock`, counted in `stats` and reported to the policy. When the prefill is done, its first
        output token is recorded in `metrics` (unless it is EOS).
        """
        # BEGIN TASK Week 2 Day 7 Task 5: run one prefill chunk of the pending request
        # TODO: take from the queue if nobody prefills; chunk size from the policy (check_chunk_size it);
        # TODO: time try_prefill; stats, policy
        if self.prefilling is None:
            if not self.queue:
                return 0
            self.prefilling = self.queue.popleft()
        request = self.prefilling
        if request.is_prefill_done:
            return 0
        # A policy is outside code: an answer below 1 token would never finish the prefill.
        request.prefill_max_step = check_chunk_size(self.policy, self.policy.next_chunk_size(self.num_running))
        start = self.clock()
        tokens = request.try_prefill()
        seconds = self.clock() - start
        self.stats.record_chunk(tokens, seconds)
        self.policy.observe_chunk(tokens, seconds)
        if request.is_prefill_done and request.finish_reason != "stop":
            self.metrics.token(request.prompt_idx)  # the first token: time to first token ends here
        return tokens
        # END TASK

    @refuse_after_failure
    def step(self) -> None:
        """One iteration: log if due, one prefill chunk, admission into a free slot, one decode step of every running request.

        The decode step is timed with `clock`, counted in `stats` (interleaved when a chunk ran in the
        same iteration) and reported to the policy. A slot freed by the decode step is handed at once
        to a request that waits, prefilled, for one. After a step that raised, `step` refuses to run
        (RuntimeError) until `release_all()`.
        """
        # BEGIN TASK Week 2 Day 7 Task 5: one iteration: a prefill chunk, admission, a decode step
        # TODO: log_stats, prefill_chunk, admit, then (timed) decode_step with stats and policy, and admit again
        self.log_stats()
        chunk_tokens = self.prefill_chunk()
        self.admit()  # the request whose last chunk just ran takes a free slot
        batch = self.num_running
        if batch == 0:
            return
        start = self.clock()
        self.decode_step()
        seconds = self.clock() - start
        self.stats.record_decode_step(batch, seconds, interleaved=chunk_tokens > 0)
        self.policy.observe_decode(batch, seconds)
        self.admit()  # a slot this decode step freed goes at once to a request waiting, prefilled
        # END TASK

    def log_stats(self) -> None:
        """Log the set-up on the first call, then a stats line whenever `log_interval` seconds have passed.

        The first line says "chunked prefill enabled" with the policy's `describe()`, or "chunked
        prefill disabled" when `prefill_step >= max_seq_len` (a chunk then holds any prompt that fits),
        and the token budget of one iteration. Later lines give prompt and generation tokens/s since
        the previous line (not since the start), running and waiting requests, and KV cache use: the
        tokens the decode slots hold (the sum of their requests' `offset`) / `batch_size * max_seq_len`.
        """
        # BEGIN TASK Week 2 Day 7 Task 4: the start-up line and the periodic stats line
        # TODO: first call: the set-up line; then every log_interval: rates since the last line, counts, KV use
        now = self.clock()
        if self.last_log_time is None:
            if self.prefill_step >= self.max_seq_len:
                mode = f"chunked prefill disabled (prefill_step {self.prefill_step} >= max_seq_len: one chunk per prompt)"
            else:
                mode = f"chunked prefill enabled: {self.policy.describe()}"
            self.log(f"{mode}; token budget per iteration: one chunk + {self.batch_size} decode tokens; "
                     f"{self.batch_size} decode slots of {self.max_seq_len} tokens")
            self.last_log_time = now
            return
        elapsed = now - self.last_log_time
        if elapsed < self.log_interval:
            return
        prompt_tokens, generated_tokens = self.stats.prefill_tokens, self.stats.decode_tokens
        prompt_rate = (prompt_tokens - self.last_log_tokens[0]) / elapsed
        generation_rate = (generated_tokens - self.last_log_tokens[1]) / elapsed
        held = sum(request.offset for request in self.slots if request is not None)
        capacity = self.batch_size * self.max_seq_len
        self.log(f"prompt {prompt_rate:.1f} tokens/s, generation {generation_rate:.1f} tokens/s, "
                 f"running {self.num_running}, waiting {self.num_waiting}, "
                 f"KV cache {100 * held / capacity:.1f}% ({held}/{capacity} tokens)")
        self.last_log_time = now
        self.last_log_tokens = (prompt_tokens, generated_tokens)
        # END TASK


def batch_generate(
    model,
    tokenizer,
    prompts: list[str],
    max_seq_len: int = 512,
    batch_size: int = 5,
    prefill_step: int = 128,
    policy=None,
    metrics: MetricsRecorder | None = None,
    log: Callable[[str], None] | None = None,
) -> list[tuple[int, str]]:
    """Generate greedily for every prompt with continuous batching and chunked prefill; `(prompt_idx, text)` in prompt order.

    A request stops at EOS or when prompt plus output tokens reach `max_seq_len`; `prefill_step`
    tokens per chunk (a chunk at least as long as every prompt means no chunking). Bad input (an
    empty prompt, a prompt too long for `max_seq_len`, `batch_size` or `prefill_step` below 1)
    raises ValueError before any model call, and so do a `prompts` that is not a list and sizes that are
    not integers (TypeError). If the model raises, every slot and cache is released before the error
    propagates. No prompts: an empty list.
    """
    prompts = check_prompts(prompts)
    # BEGIN TASK Week 2 Day 6 Task 3: the continuous batching loop
    # TODO: a SlotScheduler; add_request every prompt; step while has_work (release_all on error); sorted results
    scheduler = SlotScheduler(model, tokenizer, max_seq_len, batch_size, prefill_step, policy=policy, metrics=metrics, log=log)
    for prompt_idx, prompt in enumerate(prompts):
        scheduler.add_request(prompt, prompt_idx)  # validates every prompt before the model runs
    try:
        while scheduler.has_work():
            scheduler.step()
    except BaseException:
        scheduler.release_all()
        raise
    return sorted((request.prompt_idx, request.text()) for request in scheduler.finished)
    # END TASK
