"""The engine: add requests, then `step()` until done. A step is plan, run, apply.

    plan = scheduler.schedule()       # which tokens of which sequences (data)
    tokens = runner.run(plan)         # one model call, one new token per sampling sequence
    outputs = self.apply(plan, ...)   # progress, new tokens, finished sequences, freed blocks

The engine is single-threaded: a server calls `add_request`, `step` and `abort` from one thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockManager, blocks_for
from .metrics import MetricsRecorder
from .model_runner import ModelRunner
from .prefix_cache import PrefixCachingBlockManager
from .priority_scheduler import DEFAULT_AGING_STEPS, PriorityScheduler
from .scheduler import Scheduler, StepPlan
from .sequence import SamplingParams, Sequence
from .validation import check_int, check_kv_pool

DEFAULT_KV_TOKENS = 8192  # the pool's size in tokens when `num_blocks` is not given


@dataclass
class StepOutput:
    """What one step did for one sequence: its new token (None if it ended without one) and whether it finished.

    An EOS token ends the sequence and is not part of its output: its StepOutput has token None and
    finish_reason "eos".
    """

    request_id: object
    token: int | None
    finished: bool
    finish_reason: str | None  # "eos" | "length" | "abort"


class LLMEngine:
    """Continuous batching under a token budget, over a paged KV cache, one model call per step."""

    def __init__(self, model, tokenizer, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                 block_size: int = 16, num_blocks: int | None = None, policy=None,
                 metrics: MetricsRecorder | None = None, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] | None = None, log_interval: float = 5.0,
                 enable_prefix_caching: bool = False, scheduling_policy: str = "fcfs",
                 aging_steps: int = DEFAULT_AGING_STEPS):
        """Build the block manager, the scheduler and the runner (provided).

        `model` is a `Qwen2ModelWeek3`; `num_blocks` defaults to a pool of 8192 tokens; `policy` is a
        token-budget policy (default: fixed at `max_num_batched_tokens`). `metrics` records every
        request's token times, `log` gets a line every `log_interval` seconds and on preemption.
        `enable_prefix_caching` shares the KV blocks of common prompt prefixes (day 3.3);
        `scheduling_policy` "priority" serves requests by `priority`, aged every `aging_steps` steps (day 3.4).
        """
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks is None:
            num_blocks = blocks_for(DEFAULT_KV_TOKENS, block_size)
        check_kv_pool(model, num_blocks, block_size)  # a pool the machine cannot hold is one clear line, not an OOM
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.clock = clock
        self.log = log or (lambda line: None)
        self.log_interval = log_interval
        self.metrics = metrics or MetricsRecorder(clock=clock)
        manager_class = PrefixCachingBlockManager if enable_prefix_caching else BlockManager
        self.block_manager = manager_class(num_blocks, block_size)
        if scheduling_policy == "priority":
            self.scheduler = PriorityScheduler(self.block_manager, max_num_batched_tokens, max_num_seqs, policy,
                                               self.log, aging_steps)
        else:
            self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs, policy, self.log)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.sequences: dict[object, Sequence] = {}  # unfinished ones, by request id
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.last_log = None
        self.log(f"engine: {self.scheduler.policy.describe()}, up to {max_num_seqs} sequences, KV pool of "
                 f"{num_blocks} blocks x {block_size} tokens")

    # ------------------------------------------------------------ requests in

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | int | None = None, priority: int = 0) -> Sequence:
        """Queue a request; validated before any model call. Returns its `Sequence`.

        `prompt` is a string (encoded as it is) or token ids. `request_id` defaults to a counter.
        Raises TypeError/ValueError naming the argument for bad input, and ValueError when the prompt
        plus `max_tokens` could never fit in the KV pool or the model's positions.
        """
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = list(prompt)
        else:
            raise TypeError("prompt must be a string or a list of token ids")
        if not tokens:
            raise ValueError("prompt is empty: there is nothing to prefill")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt has token ids outside 0 .. {vocab - 1}")
        if request_id is None:
            request_id = self.num_requests_added()
        check_int("priority", priority)  # compared on every later step: a bad one would break them all
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # The KV cache holds every token but the last output (which is never fed back).
        longest = len(tokens) + sampling.max_tokens - 1
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if longest > min(capacity, self.model.max_position):
            raise ValueError(f"prompt ({len(tokens)} tokens) + max_tokens ({sampling.max_tokens}) can never fit: "
                             f"the KV pool holds {capacity} tokens and the model {self.model.max_position} positions")
        seq = Sequence(request_id, tokens, sampling, priority=priority, arrival_time=self.clock())
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self.metrics.arrive(request_id, len(tokens))
        return seq

    def num_requests_added(self) -> int:
        """How many requests the metrics have seen: the next automatic request id (provided)."""
        return len(self.metrics.requests)

    def abort(self, request_id) -> None:
        """End a request now and free its blocks; nothing happens if it already finished (provided)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        self.metrics.finish(request_id)

    # ------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """One step: plan, run (one model call), apply. Returns a StepOutput per sequence that got a token or finished."""
        self.maybe_log()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        start = self.clock()
        try:
            tokens = self.runner.run(plan)
        except BaseException:
            self.release_all()  # a failed step must not leak the blocks of the sequences it held
            raise
        self.scheduler.policy.observe_step(plan.num_tokens, len(plan.decodes), self.clock() - start)
        self.num_steps += 1
        return self.apply(plan, tokens)

    def apply(self, plan: StepPlan, tokens: list[int]) -> list[StepOutput]:
        """Move every chunk's sequence forward; give each sampling one its token; finish those that are done."""
        outputs = []
        new_tokens = iter(tokens)
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.length
            self.block_manager.cache_computed_blocks(seq)  # day 3.3: its new full blocks become shareable
            prompt_end = len(seq.prompt_token_ids)
            self.prompt_tokens_total += max(0, min(chunk.start + chunk.length, prompt_end) - chunk.start)
            if chunk.samples:
                outputs.append(self.append_token(seq, next(new_tokens)))
        return outputs

    def append_token(self, seq: Sequence, token: int) -> StepOutput:
        """Record a sampled token: EOS ends the sequence; otherwise append it and end at `max_tokens`."""
        if token in self.eos_token_ids:
            self.finish(seq, "eos")
            return StepOutput(seq.request_id, None, True, "eos")
        seq.output_token_ids.append(token)
        self.generation_tokens_total += 1
        self.metrics.token(seq.request_id)
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            self.finish(seq, "length")
            return StepOutput(seq.request_id, token, True, "length")
        return StepOutput(seq.request_id, token, False, None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence: free its blocks, record its finish time (provided)."""
        self.scheduler.finish(seq, reason)
        self.sequences.pop(seq.request_id, None)
        self.metrics.finish(seq.request_id)

    def release_all(self) -> None:
        """Abort every unfinished sequence, freeing all blocks (after an error) (provided)."""
        for request_id in list(self.sequences):
            self.abort(request_id)

    # ------------------------------------------------------------ state for callers and /metrics

    def has_work(self) -> bool:
        """True while a request waits or runs (provided)."""
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        """Sequences admitted (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued (new or preempted)."""
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use, 0..1."""
        return self.block_manager.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """The fraction of prompt tokens served from cached blocks (0 without prefix caching; day 3.3)."""
        return self.block_manager.hit_rate if self.enable_prefix_caching else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and zero the hit counters (a no-op without prefix caching) (provided)."""
        if self.enable_prefix_caching:
            self.block_manager.reset()

    def summary(self) -> dict:
        """The metrics summary plus the engine's counters: prefix-cache hit rate, preemptions, token totals (provided)."""
        summary = self.metrics.summary()
        summary.update(prefix_cache_hit_rate=self.prefix_cache_hit_rate, num_preemptions=self.num_preemptions,
                       prompt_tokens_total=self.prompt_tokens_total,
                       generation_tokens_total=self.generation_tokens_total)
        return summary

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far."""
        return self.scheduler.num_preemptions

    def maybe_log(self) -> None:
        """Every `log_interval` seconds, one line: throughput, queue lengths, KV cache use (provided)."""
        now = self.clock()
        if self.last_log is None:
            self.last_log = (now, self.prompt_tokens_total, self.generation_tokens_total)
            return
        then, prompt_then, generated_then = self.last_log
        elapsed = now - then
        if elapsed < self.log_interval:
            return
        self.log(f"prompt {(self.prompt_tokens_total - prompt_then) / elapsed:.1f} tokens/s, generation "
                 f"{(self.generation_tokens_total - generated_then) / elapsed:.1f} tokens/s, running "
                 f"{self.num_running}, waiting {self.num_waiting}, KV cache {100 * self.kv_cache_usage:.1f}%, "
                 f"preemptions {self.num_preemptions}"
                 + (f", prefix cache hit rate {100 * self.prefix_cache_hit_rate:.1f}%" if self.enable_prefix_caching else ""))
        self.last_log = (now, self.prompt_tokens_total, self.generation_tokens_total)


def generate(model, tokenizer, prompts: list, sampling: SamplingParams | None = None, **engine_kwargs) -> list[str]:
    """Generate for every prompt (greedy by default) with an `LLMEngine`; the texts in prompt order."""
    engine = LLMEngine(model, tokenizer, **engine_kwargs)
    seqs = [engine.add_request(prompt, sampling, request_id=i) for i, prompt in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [tokenizer.decode(seq.output_token_ids) for seq in seqs]
