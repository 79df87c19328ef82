"""Your stack so far: the workloads a server meets, run on the week-3 engine a student will serve with.

Each week-3 day ends with a "Your stack so far" task whose test calls `check_stack(stack(week=3, day=D), D)`:
the student's own code for day D and every earlier week-3 day, together (course/selector.py's
`Choice(3, D, "stack")`), driven only through the public engine API: `LLMEngine`, `add_request`, `step`, `abort`,
the `StepOutput`s, `summary()` and the block manager's free-block count.

The model is a tiny random Qwen2 (mlx-lm's own class, 64 tokens of vocabulary), so a step takes
milliseconds; the oracle for every output is mlx-lm's model run on one request alone (greedy, or with
the course's seed rule). A probe around the student's model counts each call's tokens, advances a fake
clock by a fixed cost model (the adaptive budget's measurements), and raises at a chosen call.

Every workload ends with every block back in the pool and nothing waiting or running; every loop is
bounded by a step limit that fails with a message. `check_stack` runs them all and fails once, listing
every workload that broke, so a student sees the whole picture.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import traceback
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import qwen2 as mlx_qwen2
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tests.actor_fakes import STACK_EOS as EOS  # five of the nine pressure requests meet it: "stop" endings
from tests.actor_fakes import STACK_VOCAB as VOCAB
from tests.actor_fakes import ModelFailure, ModelProbe  # noqa: F401  (built where the engine runs: new_probe)
from tests.actor_fakes import StackTokenizer as Tokenizer
from tests.harness import actor_fakes, fetch, reference
from tests.serve_fakes import running_server, wait_until
from tests.week3_fakes import PLAIN_ENGINE, run_until_done

STEP_LIMIT = 400  # no workload here needs more than about 100 steps; more means the engine stopped progressing
BASE_SECONDS, SECONDS_PER_TOKEN = 0.002, 0.00025  # the probe's cost model (its defaults): a step, a prefill token
ref = reference()


@functools.cache
def tiny_mlx_model():
    """mlx-lm's Qwen2 with random weights: 2 layers, 64 hidden, 4 heads over 2 KV heads, 64 tokens.

    Every weight matrix is scaled up 5x: at mlx-lm's initial scale a random model repeats one token
    forever, and a lost or repeated token would go unseen. Scaled, each token depends on the whole history.
    """
    args = mlx_qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                               max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(20260)
    model = mlx_qwen2.Model(args)
    model.update(tree_map(lambda p: p * 5 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@functools.cache
def wide_mlx_model():
    """Day 4.2's model: `tiny_mlx_model` twice as wide, so head_dim is 32, a group size MLX's `mx.quantize` (the
    oracle) supports, over 2 KV heads (a token's heads quantized apart); weights scaled up 5x likewise."""
    args = mlx_qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                               max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(20272)  # a seed under which four of the nine pressure requests meet EOS
    model = mlx_qwen2.Model(args)
    model.update(tree_map(lambda p: p * 5 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


class RoundTripCache(KVCache):
    """mlx-lm's KV cache storing what MLX's own quantize then dequantize give (scales and biases rounded to
    float16): what a quantized paged pool must hand attention back, written once per token."""

    def __init__(self, bits: int):
        super().__init__()
        self.num_bits = bits  # not `bits`: mlx-lm would take the cache for its own quantized one

    def round_trip(self, x: mx.array) -> mx.array:
        head_dim = x.shape[-1]
        packed, scales, biases = mx.quantize(x.reshape(-1, head_dim), head_dim, self.num_bits)
        scales, biases = (a.astype(mx.float16).astype(x.dtype) for a in (scales, biases))
        return mx.dequantize(packed, scales, biases, head_dim, self.num_bits).reshape(x.shape)

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(self.round_trip(keys), self.round_trip(values))


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrive: int = 0  # the step before which it is added
    abort: int | None = None  # the step before which it is aborted
    priority: int = 0
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, seed
    kv_bits: int | None = None  # day 4.2: served from a pool of this format, on `wide_mlx_model` (oracle: `RoundTripCache`)

    def params(self):
        return ref.sequence.SamplingParams(max_tokens=self.max_tokens, **self.sampling)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, VOCAB) for _ in range(n)]


# ---------------------------------------------------------------- the oracle: mlx-lm, one request alone


@functools.cache
def _alone(prompt: tuple, max_tokens: int, sampling: tuple, kv_bits: int | None) -> tuple[tuple, str]:
    options = dict(sampling)
    if kv_bits is None:
        model = tiny_mlx_model()
        cache = make_prompt_cache(model)
    else:
        model = wide_mlx_model()
        cache = [RoundTripCache(kv_bits) for _ in model.layers]
    history, output = list(prompt), []
    sampler = None
    if options.get("temperature", 0) > 0:  # what the runner passes to make_sampler: None for a filter that is off
        sampler = ref.sampler.make_sampler(options["temperature"], options.get("top_p", 1.0) if
                                           options.get("top_p", 1.0) < 1 else None, options.get("top_k", 0) or None)
    while len(output) < max_tokens:
        logits = model(mx.array([history]), cache=cache)[0, -1:].astype(mx.float32)
        if sampler is None:
            token = mx.argmax(logits, axis=-1).item()
        else:
            if "seed" in options:
                mx.random.seed(options["seed"] + len(output))  # the seed rule: seed plus tokens generated so far
            token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()
        if token == EOS:
            return tuple(output), "stop"
        output.append(token)
        history = [token]
    return tuple(output), "length"


def expected(request: Request) -> tuple[list[int], str]:
    """(tokens, finish reason) of `request` generated alone by mlx-lm's model."""
    output, reason = _alone(tuple(request.prompt), request.max_tokens, tuple(sorted(request.sampling.items())),
                            request.kv_bits)
    return list(output), reason


# ---------------------------------------------------------------- driving an engine


class Output(NamedTuple):
    """What a test keeps of a StepOutput."""

    request_id: object
    token: int | None
    finished: bool
    finish_reason: str | None


class Run:
    """One workload on one engine: every StepOutput, by request, and the steps they came in."""

    def __init__(self, engine, probe: ModelProbe, requests: list[Request], max_num_seqs: int,
                 step_limit: int = STEP_LIMIT, rule: str = "every request ends", fakes=None):
        self.engine, self.probe, self.requests, self.max_num_seqs = engine, probe, requests, max_num_seqs
        self.fakes = fakes  # `actor_fakes(package, "week3")`, where the engine runs: a step in one round trip
        self.step_limit, self.rule = step_limit, rule  # a bug that stops progress fails naming `rule`
        self.streams: dict[str, list] = {r.request_id: [] for r in requests}  # (step, StepOutput)
        self.aborted: set[str] = set()
        self.step_index = 0
        self.refusals = 0  # steps ending with a sequence waiting although a sequence slot was free
        self.pending = sorted(requests, key=lambda r: r.arrive)
        self.first_call = len(probe.calls)  # the probe's calls before this run (a probe may serve several runs)

    def drive(self, until_done=True, after_step=None):
        """Step to the end (or once): requests join and abort at their steps; `after_step(self)` after each."""
        pending = self.pending
        has_work = self.engine.has_work()
        while pending or has_work or any(r.abort is not None and r.abort >= self.step_index for r in self.requests):
            if self.step_index >= self.step_limit:
                raise AssertionError(f"the engine made no progress in {self.step_limit} steps ({self.rule}): "
                                     f"{self.engine.num_running} running, {self.engine.num_waiting} waiting")
            while pending and pending[0].arrive <= self.step_index:
                request = pending.pop(0)
                self.engine.add_request(request.prompt, request.params(), request_id=request.request_id,
                                        priority=request.priority)
            for request in self.requests:
                if request.abort == self.step_index:
                    self.engine.abort(request.request_id)
                    self.aborted.add(request.request_id)
            outputs, has_work, waiting, running = self.step()
            self.record(outputs)
            if waiting and running < self.max_num_seqs:
                self.refusals += 1
            self.step_index += 1
            if after_step:
                after_step(self)
            if not until_done:
                return

    def step(self) -> tuple[list, bool, int, int]:
        """One engine step: (its StepOutputs' `Output` fields, whether work is left, sequences waiting, running)."""
        if self.fakes is not None:
            return self.fakes.step(self.engine, Output._fields)
        outputs = fetch(self.engine.step(), *Output._fields)  # while grading: a round trip for all the outputs
        [(waiting, running)] = fetch([self.engine], "num_waiting", "num_running")
        return outputs, self.engine.has_work(), waiting, running

    def record(self, outputs: list):
        for output in map(Output._make, outputs):
            stream = self.streams.get(output.request_id)
            assert stream is not None, f"step {self.step_index}: a StepOutput for unknown request {output.request_id!r}"
            assert not (stream and stream[-1][1].finished), \
                f"step {self.step_index}: request {output.request_id!r} got a StepOutput after it finished"
            assert output.request_id not in self.aborted, \
                f"step {self.step_index}: request {output.request_id!r} got a StepOutput after it was aborted"
            stream.append((self.step_index, output))

    def tokens_of(self, request_id) -> list[int]:
        return [o.token for _, o in self.streams[request_id] if o.token is not None]

    def first_output_step(self, request_id) -> int:
        """The step of the request's first StepOutput (its first token, or its EOS); STEP_LIMIT if none."""
        return next((step for step, _ in self.streams[request_id]), STEP_LIMIT)

    def check_outputs(self):
        """Every stream equals one-at-a-time generation: no token twice, none lost, the right ending."""
        for request in self.requests:
            want, reason = expected(request)
            got, stream = self.tokens_of(request.request_id), self.streams[request.request_id]
            if request.request_id in self.aborted:
                assert got == want[: len(got)], f"request {request.request_id!r} (aborted) streamed {got}, " \
                                                f"alone it generates {want}"
                continue
            assert got == want, f"request {request.request_id!r} streamed {got}; alone it generates {want} " \
                                f"(a token twice, a token lost, or the wrong token)"
            assert stream and stream[-1][1].finished, f"request {request.request_id!r} never finished"
            assert stream[-1][1].finish_reason == reason, \
                f"request {request.request_id!r} finished by {stream[-1][1].finish_reason!r}, expected {reason!r}"
            if reason == "stop":
                assert stream[-1][1].token is None, f"request {request.request_id!r}: EOS is not an output token"

    def check_clean(self):
        """After the run: every block back in the pool, nothing waiting or running."""
        engine = self.engine
        manager = engine.block_manager
        assert not engine.has_work() and engine.num_running == 0 and engine.num_waiting == 0, \
            f"after the run: {engine.num_running} running, {engine.num_waiting} waiting"
        assert manager.num_free_blocks == manager.num_blocks, \
            f"after the run {manager.num_blocks - manager.num_free_blocks} of {manager.num_blocks} blocks are not free"

    def samples(self, request_id) -> int:
        """Tokens the model sampled for the request: its output tokens, and the EOS that ended it."""
        stream = self.streams[request_id]
        return len(self.tokens_of(request_id)) + (stream[-1][1].finish_reason == "stop" if stream else 0)

    def calls(self) -> list[tuple[int, int, float]]:
        """The probe's record of this run's model calls, (tokens, decode tokens, seconds) each, checked first.

        The probe runs where the submission does, so its record is the submission's to write: before any check
        reads it, it must agree with the run. At most one model call a step; each call's seconds are the cost
        model's for its tokens (what the fake clock the engine read moved by); and the calls' tokens add up to at
        least the rows the streams prove the model computed: a row for every token it sampled and, with prefix
        caching off, every position before it (prompt and fed-back outputs alike). So a record that hides tokens
        from the budget checks would have to spread at least that much work over no more calls than the run had
        steps, each call priced right: a schedule of its own, consistent with every stream.
        """
        calls = self.probe.calls[self.first_call:]
        assert len(calls) <= self.step_index, f"the probe recorded {len(calls)} model calls in {self.step_index} steps"
        for index, (num_tokens, decodes, seconds) in enumerate(calls):
            if (num_tokens, decodes, seconds) == (0, 0, 0.0):
                continue  # the call the probe failed on purpose
            cost = BASE_SECONDS + SECONDS_PER_TOKEN * (num_tokens - decodes)
            assert 0 <= decodes <= num_tokens and seconds == pytest.approx(cost, abs=1e-12), \
                f"the probe's record of model call {index + 1}: {(num_tokens, decodes, seconds)}"
        [caching] = fetch([self.engine], "config.enable_prefix_caching")[0]
        rows = 0
        for request in self.requests:
            sampled = self.samples(request.request_id)
            rows += sampled + (len(request.prompt) - 1 if sampled and not caching else 0)
        computed = sum(num_tokens for num_tokens, _, _ in calls)
        assert computed >= rows, f"the probe recorded {computed} tokens in this run's model calls, but its streams " \
                                 f"need at least {rows} computed"
        return calls

    def decode_calls(self) -> list[tuple[int, int, float]]:
        """`calls()` of a plain engine (no speculation), whose decode counts the checks read too: every token sampled
        after a request's first comes from a decode, but after a preemption (recomputed), so the record must hold
        at least that many decode tokens (a record claiming none would make every step look like a prefill)."""
        calls = self.calls()
        preemptions = self.engine.summary()["num_preemptions"]
        needed = sum(max(self.samples(r.request_id) - 1, 0) for r in self.requests) - preemptions
        recorded = sum(decodes for _, decodes, _ in calls)
        assert recorded >= needed, f"the probe recorded {recorded} decode tokens, but the streams need {needed}"
        return calls

    def check_budget(self, budget):
        for index, (num_tokens, _, _) in enumerate(self.calls()):
            assert num_tokens <= budget, f"model call {index + 1} ran {num_tokens} tokens, over the budget of {budget}"


def engine_options(day: int) -> dict:
    """The engine a student serves with on day D: prefix caching from 3.3, priorities from 3.4; a fixed budget
    (plans that do not depend on step times; `workload_adaptive_budget` and `workload_goodput_budget` time them)."""
    return dict(PLAIN_ENGINE, enable_prefix_caching=day >= 3, scheduling_policy="priority" if day >= 4 else "fcfs")


def make_engine(package, probe: ModelProbe, **options):
    """The one place an engine is built here: `options` are `EngineConfig`'s fields."""
    return package.engine.LLMEngine(probe, actor_fakes(package).StackTokenizer(), package.engine.EngineConfig(**options),
                                    clock=probe.clock)


def new_probe(package, model=None, **kwargs) -> ModelProbe:
    """A probe around `package`'s week-3 model of `model` (the tiny one by default), built where the engine runs:
    the engine calls it and reads its clock at every step, and the test reads its `calls` back as data."""
    week3_model = package.qwen2_week3.Qwen2ModelWeek3(tiny_mlx_model() if model is None else model)
    return actor_fakes(package).ModelProbe(week3_model, **kwargs)


def run(package, day, requests, probe=None, step_limit=STEP_LIMIT, rule="every request ends", **options) -> Run:
    probe = probe or new_probe(package)
    merged = dict(token_budget=16, max_num_seqs=4, block_size=4, num_blocks=64, **engine_options(day))
    merged.update(options)
    result = Run(make_engine(package, probe, **merged), probe, requests, merged["max_num_seqs"], step_limit, rule,
                 actor_fakes(package, "week3"))
    result.drive()
    return result


# ---------------------------------------------------------------- the workloads


def pressure_requests(day: int) -> list[Request]:
    """Nine requests arriving over time, more than the pool holds: ends by EOS, by length and by abort."""
    shared = tokens(8, 1)  # two full blocks some prompts share (prefix caching, from day 3.3)
    requests = [Request(f"r{i}", (shared if i % 3 == 0 else []) + tokens(3 + 4 * i % 17, 10 + i),
                        max_tokens=6 + (i * 5) % 9, arrive=(i * 3) % 7) for i in range(9)]
    requests[2].abort = requests[2].arrive + 1  # aborted while waiting or prefilling
    requests[5].abort = 9  # aborted while decoding
    requests[1].abort = 40  # long finished: aborting it does nothing
    if day >= 4:
        for request, priority in zip(requests, [0, 1, 0, 2, 0, 1, 0, 0, 3]):
            request.priority = priority
    return requests


def workload_pressure(package, day):
    """A pool too small for the load: admission refusals and preemptions; streams equal one-at-a-time."""
    result = run(package, day, pressure_requests(day), token_budget=16, num_blocks=14)
    result.check_outputs()
    result.check_budget(16)
    result.check_clean()
    reasons = {o.finish_reason for s in result.streams.values() for _, o in s if o.finished}
    assert {"stop", "length"} <= reasons, f"the workload should end by EOS and by length, ended by {reasons}"
    assert result.engine.summary()["num_preemptions"] > 0, "a pool of 14 blocks must force preemptions"
    assert result.refusals > 0, "a pool of 14 blocks must refuse some admissions"


def workload_model_failure(package, day):
    """A model that raises mid-run: the error reaches the caller, nothing leaks, and a clean run is identical."""
    requests = pressure_requests(day)[:6]
    probe = new_probe(package, fail_on_call=6)
    engine = make_engine(package, probe, token_budget=16, max_num_seqs=4, block_size=4, num_blocks=14,
                         **engine_options(day))
    fakes = actor_fakes(package, "week3")
    failing = Run(engine, probe, [Request(r.request_id, r.prompt, r.max_tokens) for r in requests], 4, fakes=fakes)
    with pytest.raises(actor_fakes(package).ModelFailure):
        failing.drive()
    failing.check_clean()
    again = [Request(f"again-{r.request_id}", r.prompt, r.max_tokens, arrive=r.arrive, priority=r.priority)
             for r in requests]
    clean = Run(engine, probe, again, 4, fakes=fakes)
    clean.step_index = failing.step_index
    for request in again:
        request.arrive += clean.step_index
    clean.drive()
    clean.check_outputs()
    clean.check_clean()


def workload_adaptive_budget(package, day):
    """The adaptive budget through the engine: a long prompt spread over decode steps held to the target."""
    # The probe charges 2 ms a step and 0.25 ms a prefill token: 32 prefill tokens fit beside a decode in 10.1 ms.
    target = 0.0101
    requests = [Request("chat", tokens(4, 30), max_tokens=30), Request("long", tokens(160, 31), max_tokens=3, arrive=2)]
    result = run(package, day, requests, budget_policy="adaptive", target_itl=target, token_budget=64, num_blocks=64)
    result.check_outputs()
    result.check_clean()
    mixed = [(index, call) for index, call in enumerate(result.decode_calls()) if 0 < call[1] < call[0]]
    assert mixed, "the long prompt never shared a step with the chat's decode"
    for index, (num_tokens, decodes, seconds) in mixed[1:]:  # the first one measures the cost of a prefill token
        assert seconds <= target + 1e-9, f"model call {index + 1}: {decodes} decode(s) and " \
            f"{num_tokens - decodes} prefill tokens took {seconds * 1000:.2f} ms, over the {target * 1000:.1f} ms target"
    first = result.first_output_step("long")
    assert first <= 2 + 10, \
        f"the 160-token prompt arriving at step 2 got its first output at step {first}: with the budget adapted " \
        f"to the measured costs (32 prefill tokens a step beside the decode) it needs 5 steps"


def workload_goodput_budget(package, day):
    """Day 3.4: the goodput budget through the engine: every step sized for the oldest wait, never past the ITL target."""
    # The probe charges 2 ms a step and 0.25 ms a prefill token: the ITL target leaves 8 ms of room above a decode
    # step (32 prefill tokens), half of it (16) while nobody waits, all of it once a request has waited 30 ms.
    itl, ttft, base, per_token = 0.010, 0.030, BASE_SECONDS, SECONDS_PER_TOKEN
    requests = [Request("chat", tokens(4, 30), max_tokens=40), Request("long", tokens(150, 31), max_tokens=3, arrive=2),
                Request("late", tokens(60, 32), max_tokens=3, arrive=16)]
    result = run(package, day, requests, budget_policy="goodput", target_itl=itl, target_ttft=ttft, token_budget=64,
                 num_blocks=64)
    result.check_outputs()
    result.check_clean()
    calls = result.decode_calls()
    assert len(calls) == result.step_index, "every step of this workload runs the model once"
    starts = [sum(seconds for _, _, seconds in calls[:index]) for index in range(len(calls))]
    first_mixed = next(index for index, (num_tokens, decodes, _) in enumerate(calls) if 0 < decodes < num_tokens)
    checked = 0
    for step, (num_tokens, decodes, seconds) in enumerate(calls):
        if step <= first_mixed or not 0 < decodes < num_tokens:
            continue  # the first mixed step measures a prefill token's cost; without decodes nobody waits on a step
        waiting = [starts[r.arrive] for r in requests if r.arrive <= step <= result.first_output_step(r.request_id)]
        urgency = min(1.0, (starts[step] - min(waiting)) / ttft) if waiting else 0.0
        allowed = base + (itl - base) * (1 + urgency) / 2
        assert seconds <= allowed + 1e-9, \
            f"step {step}: {decodes} decode(s) and {num_tokens - decodes} prefill tokens took {seconds * 1000:.2f} ms; " \
            f"the oldest request without a first token had waited {(urgency * ttft) * 1000:.1f} ms, so the step may " \
            f"take {allowed * 1000:.2f} ms (half the room below the {itl * 1000:.0f} ms ITL target, rising to all of it " \
            f"at the {ttft * 1000:.0f} ms TTFT target)"
        ends_a_prompt = any(result.first_output_step(r.request_id) == step for r in requests)
        if not ends_a_prompt:  # a prompt's last chunk may be shorter than the budget
            assert seconds >= allowed - 2 * per_token - 1e-9, \
                f"step {step}: {num_tokens - decodes} prefill tokens took {seconds * 1000:.2f} ms, more than a token " \
                f"under the {allowed * 1000:.2f} ms this step may take"
            checked += 1
    assert checked >= 4, f"only {checked} steps shared a decode with a prefill chunk; the workload needs more"


def seeded_requests() -> list[Request]:
    """Four seeded requests (top-k or top-p) arriving one a step, and a greedy one."""
    requests = [Request(f"s{i}", tokens(5 + 3 * i, 40 + i), max_tokens=10, arrive=i,
                        sampling=dict(temperature=1.0, seed=100 + i, **({"top_k": 20} if i % 2 else {"top_p": 0.9})))
                for i in range(4)]
    return requests + [Request("greedy", tokens(9, 49), max_tokens=10)]


def workload_seeded_sampling(package, day):
    """Seeded sampling under preemption: every draw as the seed rule says, whatever shares the batch."""
    result = run(package, day, seeded_requests(), token_budget=16, num_blocks=10)
    result.check_outputs()
    result.check_clean()
    assert result.engine.summary()["num_preemptions"] > 0, "a pool of 10 blocks must force preemptions"


def workload_prefix_cache(package, day):
    """Day 3.3: prompts sharing a long prefix, under pressure: the reference's hit rate, the right tokens."""
    shared = tokens(12, 50)
    requests = [Request(f"p{i}", shared + tokens(1 + i, 51 + i), max_tokens=5, arrive=0 if i < 2 else 6 + i)
                for i in range(6)]
    requests.append(Request("other", tokens(10, 59), max_tokens=5, arrive=7))
    options = dict(token_budget=16, num_blocks=16)
    result = run(package, day, requests, **options)
    result.check_outputs()
    result.check_clean()
    reference_run = run(ref, day, [Request(**vars(r)) for r in requests], **options)
    got, want = result.engine.summary()["prefix_cache_hit_rate"], reference_run.engine.summary()["prefix_cache_hit_rate"]
    assert want > 0.3, f"the workload must share prefixes (the reference's hit rate is {want:.3f})"
    assert got == pytest.approx(want, abs=1e-9), f"prefix cache hit rate {got:.3f}, the reference's {want:.3f}"


def workload_prefix_chain(package, day):
    """Day 3.3: equal token blocks after different prefixes, and a block repeated in one prompt, are different blocks:
    a block's name stands for its whole prefix, so only a request that starts the same way shares it."""
    a, b, x, y = (tokens(4, seed) for seed in (100, 101, 102, 103))
    requests = [Request("after-a", a + x + y + [5], max_tokens=4),
                Request("x-first", x + y + [5], max_tokens=4, arrive=3),  # x's tokens at positions 0-3, not 4-7
                Request("after-b", b + x + y + [5], max_tokens=4, arrive=3),
                Request("x-thrice", x + x + x + [7], max_tokens=4, arrive=6),
                Request("x-thrice-again", x + x + x + [9], max_tokens=4, arrive=9)]
    result = run(package, day, requests, token_budget=16, num_blocks=32)
    result.check_outputs()
    result.check_clean()
    reference_run = run(ref, day, [Request(**vars(r)) for r in requests], token_budget=16, num_blocks=32)
    got, want = result.engine.summary()["prefix_cache_hit_rate"], reference_run.engine.summary()["prefix_cache_hit_rate"]
    assert got == pytest.approx(want, abs=1e-9), \
        f"prefix cache hit rate {got:.3f}, the reference's {want:.3f}: only a request whose prompt starts with the " \
        "same blocks shares them (a block's name hashes its parent's name and its tokens)"


def workload_whole_block_prompts(package, day):
    """Day 3.3: prompts that are a whole number of blocks, each arriving twice: the second is served from the cache
    but for its last token, which is always computed (its logits give the first output token)."""
    eight, twelve = tokens(8, 110), tokens(12, 111)
    requests = [Request("eight", eight, max_tokens=4), Request("twelve", twelve, max_tokens=4),
                Request("twelve-twin", twelve, max_tokens=3),  # computes the same blocks at the same time
                Request("eight-again", eight, max_tokens=4, arrive=3),
                Request("twelve-again", twelve, max_tokens=5, arrive=4),
                Request("after", tokens(6, 112), max_tokens=3, arrive=5)]
    # Then fresh prompts that need most of the pool: cached blocks are evicted, least recently used first.
    requests += [Request(f"fresh{i}", tokens(13, 113 + i), max_tokens=3, arrive=8 + 4 * i) for i in range(2)]
    requests.append(Request("after-last", requests[5].prompt, max_tokens=3, arrive=16))
    requests.append(Request("fresh-long", tokens(40, 116), max_tokens=3, arrive=20))  # evicts nearly every block
    options = dict(token_budget=16, num_blocks=16)
    result = run(package, day, requests, step_limit=60,
                 rule="a prompt found whole in the cache still computes its last token", **options)
    result.check_outputs()
    result.check_clean()
    reference_run = run(ref, day, [Request(**vars(r)) for r in requests], **options)
    got, want = result.engine.summary()["prefix_cache_hit_rate"], reference_run.engine.summary()["prefix_cache_hit_rate"]
    assert got == pytest.approx(want, abs=1e-9), \
        f"prefix cache hit rate {got:.3f}, the reference's {want:.3f}: a prompt of n whole blocks found in the " \
        "cache is served n - 1 blocks from it (its last block holds the token still to compute), and new tokens " \
        "take unnamed free blocks first, then the least recently used cached ones"


def workload_priorities(package, day):
    """Day 3.4: priorities reorder service; an urgent request is served at once however busy the engine."""
    queued = [Request(f"q{p}", tokens(6, 60 + p), max_tokens=3, priority=p) for p in (0, 2, 1, 3)]
    result = run(package, day, queued, max_num_seqs=1)
    result.check_outputs()
    result.check_clean()
    served = sorted(queued, key=lambda r: result.first_output_step(r.request_id))
    assert [r.priority for r in served] == [3, 2, 1, 0], \
        f"one sequence slot: the most important first; served priorities {[r.priority for r in served]}"
    preemptions = result.engine.summary()["num_preemptions"]
    assert preemptions == 0, f"one sequence slot, the most important request running: {preemptions} preemption(s), " \
                             "but nobody may be preempted for a less important request"
    busy = [Request(f"low{i}", tokens(20, 70 + i), max_tokens=12) for i in range(4)]
    busy.append(Request("urgent", tokens(6, 79), max_tokens=4, arrive=3, priority=5))
    result = run(package, day, busy, max_num_seqs=2, num_blocks=14)
    result.check_outputs()
    result.check_clean()
    assert result.first_output_step("urgent") == 3, \
        f"the urgent request arrived at step 3 and got its first output at step {result.first_output_step('urgent')}: " \
        "less important sequences must make room for it (slots and blocks)"


def workload_shortest_prefill_first(package, day):
    """Day 3.4: shortest prefill first; a short prompt passes a long one's chunks, but never takes its blocks."""
    options = dict(scheduling_policy="shortest_prefill_first", token_budget=16)
    behind = [Request("long", tokens(64, 80), max_tokens=3), Request("short", tokens(6, 81), max_tokens=3, arrive=1)]
    result = run(package, day, behind, **options)
    result.check_outputs()
    result.check_clean()
    assert result.first_output_step("short") == 1, \
        f"a 6-token prompt arrived at step 1 behind a 64-token one and got its first output at step " \
        f"{result.first_output_step('short')}: the fewest tokens left to prefill go first"
    # Left to prefill, not prompt length: the long prompt has 8 tokens left at step 2, fewer than the new 12.
    late = [Request("long", tokens(40, 82), max_tokens=3), Request("later", tokens(12, 83), max_tokens=3, arrive=2)]
    result = run(package, day, late, **options)
    result.check_outputs()
    assert result.first_output_step("long") == 2, \
        f"with 8 prompt tokens left at step 2 the long prompt goes before a new 12-token one; its first output " \
        f"came at step {result.first_output_step('long')}"
    ranked = [Request("short", tokens(6, 86), max_tokens=3, arrive=1),
              Request("urgent", tokens(30, 87), max_tokens=3, arrive=1, priority=1)]
    result = run(package, day, ranked, **options)
    result.check_outputs()
    assert result.first_output_step("urgent") < result.first_output_step("short"), \
        "a 30-token prompt of priority 1 and a 6-token one of priority 0: priority comes before length"
    one_slot = [Request("long", tokens(40, 84), max_tokens=3), Request("short", tokens(4, 85), max_tokens=3, arrive=1)]
    result = run(package, day, one_slot, max_num_seqs=1, **options)
    result.check_outputs()
    result.check_clean()
    preemptions = result.engine.summary()["num_preemptions"]
    assert preemptions == 0, f"one sequence slot, a long prompt prefilling: {preemptions} preemption(s); being " \
                             "shorter never takes a running sequence's blocks (it would recompute from the start)"


def workload_starvation(package, day):
    """Day 3.4: an urgent request every other step for one sequence slot; aging bounds the low one's wait."""
    stream = [Request(f"u{step}", tokens(4, 120 + step), max_tokens=3, arrive=step, priority=1)
              for step in range(0, 24, 2)]
    low = Request("low", tokens(4, 119), max_tokens=3, arrive=1)
    result = run(package, day, stream + [low], max_num_seqs=1, aging_steps=4)
    result.check_outputs()
    result.check_clean()
    finished = result.streams["low"][-1][0]
    # Arriving at step 1, after 4 steps of waiting it outranks every fresh arrival (priority 1, but younger): its wait
    # is bounded by (1 - 0) * aging_steps plus what first come, first served would take (the reference: step 9).
    assert finished <= 16, f"priority 0 behind a steady stream of priority 1 (one slot, aging_steps=4, 12 urgent " \
                           f"requests) finished at step {finished}: its priority must grow by one every 4 steps " \
                           "counted from its own arrival, so it soon outranks every fresh arrival"


def workload_urgent_room(package, day):
    """Day 3.4: an urgent request whose first chunk needs the blocks of several less urgent sequences, while their
    decodes need new blocks in the same step: room is made for both before the step is planned."""
    # Four 7-token prompts (none meets EOS): 2 blocks each after step 0; at step 2 each decode starts a third block.
    lows = [Request(f"low{i}", tokens(7, seed), max_tokens=12) for i, seed in enumerate((133, 135, 137, 138))]
    urgent = Request("urgent", tokens(12, 139), max_tokens=3, arrive=2, priority=3)
    result = run(package, day, lows + [urgent], max_num_seqs=5, num_blocks=11, token_budget=32)
    result.check_outputs()
    result.check_clean()
    first = result.first_output_step("urgent")
    assert first == 2, f"the urgent request arrived at step 2 and got its first output at step {first}: less urgent " \
                       "sequences are preempted, as many as it takes, until its whole first chunk and every " \
                       "remaining decode's new block fit in the free blocks"


def workload_queue_order(package, day):
    """Day 3.4: among equal priorities the plan keeps arrival order; a part-way prompt goes before a waiting one."""
    queued = [Request(f"a{step}", tokens(5, 140 + step), max_tokens=3, arrive=step) for step in range(4)]
    result = run(package, day, queued, max_num_seqs=1)
    result.check_outputs()
    result.check_clean()
    served = sorted(queued, key=lambda r: result.first_output_step(r.request_id))
    assert [r.request_id for r in served] == [r.request_id for r in queued], \
        f"four requests of equal priority arriving one a step, one sequence slot: served in the order " \
        f"{[r.request_id for r in served]}; a later request never passes an earlier one of the same priority"
    pair = [Request("first", tokens(20, 150), max_tokens=3), Request("second", tokens(20, 151), max_tokens=3)]
    result = run(package, day, pair, max_num_seqs=2)
    result.check_outputs()
    result.check_clean()
    assert result.first_output_step("first") == 1, \
        f"two 20-token prompts of equal priority arriving together, a budget of 16: the first one's last 4 tokens " \
        f"come before the second's chunk in step 1 (a part-way prompt goes before a waiting one), but its first " \
        f"output came at step {result.first_output_step('first')}"


def text_of(tokens: list[int]) -> str:
    """What the server streams for these tokens: the test tokenizer's decode."""
    return Tokenizer().decode(tokens)


def warm_up(package, probe: ModelProbe) -> None:
    """One token through a throwaway engine on this thread: MLX streams are per thread, so whatever the
    student's model left lazy must be evaluated here before the server's engine thread runs it."""
    engine = make_engine(package, probe, token_budget=16, max_num_seqs=1, block_size=4, num_blocks=8)
    engine.add_request([1], ref.sequence.SamplingParams(max_tokens=1))
    run_until_done(engine, max_steps=STEP_LIMIT, rule="a one-token request ends")


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None = None):
    """Stream one completion: (text, finish reason); with `leave_after`, close the connection after that many
    chunks (the client leaves) and return (text so far, "left")."""
    pieces, reason = [], None
    body = {"model": "tiny", "stream": True, "temperature": 0, **body}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, f"POST /v1/completions answered {response.status_code}"
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "".join(pieces), reason
            if not line.startswith("data: "):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            pieces.append(choice["text"])
            reason = choice["finish_reason"] or reason
            if leave_after is not None and len(pieces) >= leave_after:
                return "".join(pieces), "left"
    raise AssertionError("a stream ended without data: [DONE]")


def workload_serving(package, day):
    """Day 3.5: the engine behind the server, over HTTP: twelve streams at once equal one-at-a-time generation
    (EOS, length and a stop string), two clients leave and are aborted, every block comes back."""
    # Each step sleeps 20 ms, as a real model's step takes that long: a leaver's 400 tokens then take 8 s, and the
    # leaving reaches an honest engine long before, however busy the machine (a step of the tiny model alone is a
    # millisecond or two, and at load 20 a client's leaving once took 242 of them to arrive).
    probe = new_probe(package, pause_seconds=0.02)
    warm_up(package, probe)
    engine = make_engine(package, probe, token_budget=16, max_num_seqs=4, block_size=4, num_blocks=128,
                         **engine_options(day))
    app = package.server.create_app(engine, actor_fakes(package).StackTokenizer(), "tiny")
    finishing = [Request(r.request_id, r.prompt, r.max_tokens) for r in pressure_requests(day)]
    wants = {r.request_id: expected(r) for r in finishing}
    assert {"stop", "length"} <= {reason for _, reason in wants.values()}, "the workload must end by EOS and length"
    # A stop string: the text of a token in the middle of a long answer, with the spaces around it.
    cut = next(r for r in finishing if len(wants[r.request_id][0]) >= 6)
    full = text_of(wants[cut.request_id][0])
    stop = f" {wants[cut.request_id][0][2]} "
    # The leavers' max_tokens: an engine that never aborts them generates all of it; an honest one, the steps that run
    # before a client's leaving reaches it (a few at 20 ms a step). The model holds 512 positions.
    leave_budget = 400

    async def clients(url):
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
            calls = [stream_completion(client, url, {"prompt": r.prompt, "max_tokens": r.max_tokens})
                     for r in finishing]
            calls.append(stream_completion(client, url, {"prompt": cut.prompt, "max_tokens": cut.max_tokens,
                                                         "stop": stop}))
            calls += [stream_completion(client, url, {"prompt": tokens(5, 90 + i), "max_tokens": leave_budget,
                                                      "ignore_eos": True}, leave_after=2) for i in range(2)]
            return await asyncio.gather(*calls)

    with running_server(app) as url:
        answers = asyncio.run(clients(url))
        assert wait_until(lambda: not engine.has_work(), timeout=120), \
            f"after every client ended: {engine.num_running} running, {engine.num_waiting} waiting"
        health = httpx.get(f"{url}/health", timeout=60)
        assert health.status_code == 200 and health.json() == {"status": "ok"}, f"/health: {health.text}"
        for request, (got, reason) in zip(finishing, answers):
            want, want_reason = wants[request.request_id]
            assert got == text_of(want), f"request {request.request_id!r} streamed {got!r}; alone it generates " \
                                         f"{text_of(want)!r} (a token twice, a token lost, or the wrong token)"
            assert reason == want_reason, f"request {request.request_id!r} finished by {reason!r}, expected {want_reason!r}"
        assert answers[len(finishing)] == (full[:full.find(stop)], "stop"), \
            f"with stop {stop!r} the text must end before it, finish reason 'stop': got {answers[len(finishing)]!r}"
        generated = engine.generation_tokens_total - sum(len(wants[r.request_id][0]) + 1 for r in finishing)
        assert generated < leave_budget, \
            f"the two clients that left and the stopped request generated {generated} tokens: a request whose " \
            f"client left (or whose stop string was found) must be aborted, not run to max_tokens ({leave_budget})"
        assert not app.state.engine_thread.handles, "the engine thread must forget every request that ended"
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, \
        f"after the run {manager.num_blocks - manager.num_free_blocks} of {manager.num_blocks} blocks are not free"


WORKLOADS = [  # (first day it runs on, workload)
    (1, workload_pressure), (1, workload_model_failure), (1, workload_adaptive_budget), (1, workload_seeded_sampling),
    (3, workload_prefix_cache), (3, workload_prefix_chain), (3, workload_whole_block_prompts),
    (4, workload_priorities), (4, workload_shortest_prefill_first), (4, workload_starvation), (4, workload_urgent_room),
    (4, workload_queue_order), (4, workload_goodput_budget),
    (5, workload_serving),
]


def check_stack(package, day: int) -> None:
    """Run every workload of days 3.1 .. 3.D on `package`; fail once, naming each workload that broke."""
    check_workloads(package, [w for first, w in WORKLOADS if first <= day], lambda workload: workload(package, day))


def check_workloads(package, workloads: list, call) -> None:
    """`call(workload)` for each workload; fail once, naming each that broke (a student sees the whole picture)."""
    failures = []
    for workload in workloads:
        try:
            call(workload)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001: a student's engine may fail in any way; report them all
            failures.append(f"{workload.__name__.removeprefix('workload_')}: {type(error).__name__}: {error}"
                            f"{where_in_student_code(error)}")
    if failures:
        borrowed = getattr(package, "describe", lambda: "")()
        pytest.fail(f"your stack so far fails {len(failures)} of {len(workloads)} workloads"
                    + (f" ({borrowed})" if borrowed else "") + ":\n  " + "\n  ".join(failures), pytrace=False)


def where_in_student_code(error: BaseException) -> str:
    """' (at src/tiny_llm/x.py:N in f)' for the innermost frame of the student's package, if any."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/src/tiny_llm/" in f.filename.replace("\\", "/")]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at src/tiny_llm/{frame.filename.replace(chr(92), '/').rsplit('/src/tiny_llm/', 1)[1]}:{frame.lineno} " \
           f"in {frame.name})"
