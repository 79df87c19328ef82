"""Your stack so far, week 4: the student's own week-3 engine with their day 4.1 or 4.2 on top, as a server runs it.

Days 4.1 and 4.2 end like the week-3 days, with a "Your stack so far" task whose test calls
`check_speculative_stack(stack(week=4, day=1))` or `check_quantized_stack(stack(week=4, day=2))`: the
student's code for every week-3 engine day they have written and for the day (course/selector.py's
`for_stack`, `course_map.stack_days`), driven through the public engine API only
(`SpeculativeEngine` or `LLMEngine` with `EngineConfig(kv_bits=..., kv_cache_bytes=...)`, `add_request`,
`step`, `abort`, `summary()`, the block manager's free blocks). The machinery is week 3's
(tests/week3_stack.py): the same tiny random Qwen2 behind a probe that counts tokens, keeps a fake
clock and fails on a chosen call, the same requests, and mlx-lm's model on each request alone as the
oracle, token for token:

- day 4.1: greedy output identical to mlx-lm's under a small pool with preemptions, EOS and aborts,
  with the student's prompt lookup and with guesses right for a known number of tokens (so every step
  must yield exactly the right guesses plus one, and rejected positions must go back across block
  boundaries); a model failure then a clean rerun; top-k/top-p, penalty, logit_bias and logprobs
  requests beside speculating ones, served as week 3 serves them; and sampled speculation keeping the
  target's distribution (a chi-square test on the tiny model's exact probabilities);
- day 4.2: the same server workloads on 8-bit and 4-bit pools sized by memory: the blocks a memory
  budget buys, preemptions, and every token equal to mlx-lm's model over a cache that stores MLX's own
  quantize-then-dequantize of each key and value (`RoundTripCache`).

Every workload ends with every block back in the pool; every loop has a step limit.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tests import week3_stack as w3
from tests.chi_square import assert_distribution
from tests.harness import solution_name
from tests.week3_stack import EOS, VOCAB, ModelFailure, ModelProbe, Request, Run, Tokenizer, expected, tokens

K = 3  # guesses per verify chunk in the speculative workloads


# ---------------------------------------------------------------- day 4.1: speculative decoding


class TruthProposer:
    """Guesses each request's true greedy continuation (mlx-lm's, alone) right for a random number of tokens,
    then wrong: the test knows exactly how many guesses of each proposal the target must accept."""

    def __init__(self, requests: list[Request], seed: int):
        self.truth = {}
        for request in requests:
            output, reason = expected(request)
            self.truth[request.request_id] = request.prompt + output + ([EOS] if reason == "stop" else [])
        self.rng = random.Random(seed)
        self.calls: dict[object, tuple[int, int]] = {}  # request id -> (guesses, right ones), this step

    def propose(self, seq, k):
        truth, n = self.truth[seq.request_id], len(seq.token_ids)
        assert truth[:n] == seq.token_ids, f"{seq.request_id!r} asked for guesses after tokens it should not have"
        # Right guesses stop before the last true token, so the first wrong one is always checked against the truth.
        right = min(self.rng.randint(0, k), len(truth) - n - 1)
        draft = truth[n : n + right] + [(truth[n + right] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB]
        while len(draft) < k:
            draft.append(self.rng.randrange(VOCAB))
        self.calls[seq.request_id] = (k, right)
        return draft

    def forget(self, request_id):
        pass


def speculative_engine(package, probe: ModelProbe, proposer, **options):
    """The one place a day-4.1 engine is built here: the student's SpeculativeEngine on their week-3 engine.

    No back-off (min_acceptance_rate 0): every decode guesses as many tokens as it may, so every
    workload exercises verification and roll-back at every step.
    """
    merged = dict(token_budget=16, max_num_seqs=4, block_size=4, num_blocks=64, **w3.engine_options(4))
    merged.update(options)
    speculation = package.speculative.SpeculativeConfig(K, min_acceptance_rate=0.0)
    return package.speculative.SpeculativeEngine(probe, Tokenizer(), package.engine.EngineConfig(**merged),
                                                 speculation=speculation, proposer=proposer, clock=probe.clock)


def check_blocks_after_every_step(engine):
    """No running sequence holds a block past its tokens (rejected guesses give theirs back); none leaked."""
    manager = engine.block_manager
    held = {block for seq in engine.scheduler.running for block in seq.block_table}
    assert len(held) + manager.num_free_blocks == manager.num_blocks, \
        f"{manager.num_blocks - manager.num_free_blocks - len(held)} blocks are neither held nor free"
    for seq in engine.scheduler.running:
        most = -(-seq.num_tokens // manager.block_size)
        assert len(seq.block_table) <= most, \
            f"{seq.request_id!r} holds {len(seq.block_table)} blocks for {seq.num_tokens} tokens: rejected positions kept"


def drive_speculative(package, requests, proposer, probe=None, after_step=None, **options) -> Run:
    """Run `requests` on a speculative engine, checking the blocks (and `after_step(run)`) after every step."""
    probe = probe or w3.new_probe(package)
    engine = speculative_engine(package, probe, proposer, **options)
    result = Run(engine, probe, requests, engine.config.max_num_seqs)

    def check(run):
        check_blocks_after_every_step(run.engine)
        if after_step:
            after_step(run)

    result.drive(after_step=check)
    return result


def workload_speculative_pressure(package):
    """A pool too small for the load, the student's prompt lookup guessing at every step: preemptions,
    EOS, aborts, every token mlx-lm's, every rejected position given back, every block home."""
    for proposer in (package.speculative.NgramProposer(max_ngram=2, min_ngram=1),
                     TruthProposer(w3.pressure_requests(4), seed=3)):
        result = drive_speculative(package, w3.pressure_requests(4), proposer, num_blocks=14)
        result.check_outputs()
        result.check_budget(16)
        result.check_clean()
        summary = result.engine.summary()
        assert summary["num_preemptions"] > 0, "a pool of 14 blocks must force preemptions"
        assert summary["speculative_proposed"] > 0, f"{type(proposer).__name__} never guessed"
    assert summary["speculative_proposed"] > summary["speculative_accepted"] > 0, \
        f"{summary['speculative_accepted']} of {summary['speculative_proposed']} right guesses accepted: " \
        "some must be accepted and some rejected"


def workload_speculative_exact(package):
    """A roomy pool, a tight budget, guesses right for a known count: each verification yields exactly the right
    guesses plus the target's own token (fewer only where the request ends), the counters add up, and guesses
    never take the step past its budget."""
    # Three run to max_tokens; the last meets EOS after two tokens, inside a verification.
    requests = [Request(f"x{i}", tokens(length, seed), max_tokens=max_tokens, arrive=i)
                for i, (length, seed, max_tokens) in enumerate([(8, 80, 16), (11, 81, 16), (5, 84, 16), (7, 81, 12)])]
    proposer = TruthProposer(requests, seed=5)
    totals = {"proposed": 0, "accepted": 0}
    before: dict[str, int] = {}

    def exact(result):
        for request_id, (guesses, right) in proposer.calls.items():
            want = expected(next(r for r in result.requests if r.request_id == request_id))[0]
            had, now = before.get(request_id, 0), len(result.tokens_of(request_id))
            assert now == min(had + right + 1, len(want)), \
                f"{request_id!r}: {right} of {guesses} guesses right, so {right + 1} new tokens; got {now - had}"
            totals["proposed"] += guesses
            totals["accepted"] += right
        proposer.calls.clear()
        before.update({r.request_id: len(result.tokens_of(r.request_id)) for r in result.requests})

    # A budget of 7: beside three or four decodes only a few guesses fit, so the budget cuts proposals short.
    result = drive_speculative(package, requests, proposer, after_step=exact, token_budget=7)
    result.check_outputs()
    result.check_budget(7)
    result.check_clean()
    summary = result.engine.summary()
    got = (summary["speculative_proposed"], summary["speculative_accepted"])
    assert totals["accepted"] > 10 and totals["proposed"] > 20, f"too few guesses to check: {totals}"
    assert got == (totals["proposed"], totals["accepted"]), \
        f"summary counts {got[0]} guesses proposed and {got[1]} accepted; the proposals were " \
        f"{totals['proposed']} and {totals['accepted']}"


def workload_speculative_model_failure(package):
    """The model raises mid-run with verify chunks in flight: the error reaches the caller, nothing leaks, a rerun
    on the same engine is exact."""
    requests = w3.pressure_requests(4)[:6]
    probe = w3.new_probe(package, fail_on_call=6)
    engine = speculative_engine(package, probe, package.speculative.NgramProposer(2, 1), num_blocks=14)
    failing = Run(engine, probe, [Request(r.request_id, r.prompt, r.max_tokens) for r in requests], 4)
    with pytest.raises(ModelFailure):
        failing.drive()
    failing.check_clean()
    again = [Request(f"again-{r.request_id}", r.prompt, r.max_tokens, arrive=failing.step_index + r.arrive)
             for r in requests]
    clean = Run(engine, probe, again, 4)
    clean.step_index = failing.step_index
    clean.drive()
    clean.check_outputs()
    clean.check_clean()
    assert engine.summary()["speculative_proposed"] > 0, "the rerun never speculated"


def biased_greedy(prompt: list[int], max_tokens: int, bias: dict[int, float]) -> list[int]:
    """mlx-lm's model alone, greedy, with `bias` added to the logits (the oracle of a logit_bias request)."""
    model, history, output = w3.tiny_mlx_model(), list(prompt), []
    while len(output) < max_tokens:
        row = model(mx.array([history]))[0, -1].astype(mx.float32)
        row = row.at[mx.array(list(bias))].add(mx.array(list(bias.values())))
        token = mx.argmax(row).item()
        if token == EOS:
            break
        output.append(token)
        history.append(token)
    return output


def workload_speculative_mixed_requests(package):
    """Requests verification cannot serve decode as in week 3 beside speculating ones: top-k/top-p (seeded, under
    preemption), logit_bias, logprobs; every token as mlx-lm's alone, every logprob mlx-lm's."""
    requests = [Request(f"s{i}", tokens(5 + 3 * i, 40 + i), max_tokens=10, arrive=i,
                        sampling=dict(temperature=1.0, seed=100 + i, **({"top_k": 20} if i % 2 else {"top_p": 0.9})))
                for i in range(4)]
    requests.append(Request("greedy", tokens(9, 49), max_tokens=10))
    result = drive_speculative(package, requests, package.speculative.NgramProposer(2, 1), num_blocks=10)
    result.check_outputs()
    result.check_clean()
    assert result.engine.summary()["num_preemptions"] > 0, "a pool of 10 blocks must force preemptions"

    prompt = tokens(8, 90) * 2  # repeated: prompt lookup has guesses to make
    plain, _ = expected(Request("plain", prompt, 12))
    bias = {token: -100.0 for token in set(plain[:6])}  # bans the tokens the request would pick first
    want = biased_greedy(prompt, 12, bias)
    engine = speculative_engine(package, w3.new_probe(package), package.speculative.NgramProposer(2, 1))
    Params = package.sequence.SamplingParams
    engine.add_request(prompt, Params(max_tokens=12), request_id="plain")
    engine.add_request(prompt, Params(max_tokens=12, logit_bias=bias), request_id="biased")
    engine.add_request(prompt, Params(max_tokens=12, logprobs=2), request_id="logprobs")
    streams = {"plain": [], "biased": [], "logprobs": []}
    for _ in range(w3.STEP_LIMIT):
        if not engine.has_work():
            break
        for output in engine.step():
            streams[output.request_id].append(output)
    else:
        raise AssertionError(f"no end after {w3.STEP_LIMIT} steps")
    got = {name: [o.token for o in outputs if o.token is not None] for name, outputs in streams.items()}
    assert got["plain"] == plain, f"greedy request: {got['plain']}, alone {plain}"
    assert got["biased"] == want, f"a logit_bias request streamed {got['biased']}; with its bias mlx-lm gives {want}"
    assert got["logprobs"] == plain, f"a logprobs request streamed {got['logprobs']}, alone {plain}"
    logits = w3.tiny_mlx_model()(mx.array([prompt + plain]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, output in enumerate(o for o in streams["logprobs"] if o.token is not None):
        assert output.logprobs is not None, f"token {i} of a logprobs request came without its logprobs"
        want_logprob = logprobs[len(prompt) - 1 + i, output.token].item()
        assert abs(output.logprobs.logprob - want_logprob) < 1e-3, \
            f"token {i}: logprob {output.logprobs.logprob:.4f}, mlx-lm's {want_logprob:.4f}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


SAMPLED_PROMPT = tokens(5, 95)
TEMPERATURE = 2.0
NUM_SAMPLED = 600


class FixedGuess:
    """Always guesses one token: the target's most likely second token (so most guesses are accepted, and a
    wrong acceptance or residual rule shows in how often it comes out)."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, seq, k):
        return [self.token] * k

    def forget(self, request_id):
        pass


def second_token_distribution() -> dict[int, float]:
    """The exact law of the second output token at TEMPERATURE, given the first is not EOS: mlx-lm's model on
    every possible first token at once."""
    model = w3.tiny_mlx_model()
    first = mx.softmax(model(mx.array([SAMPLED_PROMPT]))[0, -1].astype(mx.float32) / TEMPERATURE).tolist()
    batch = mx.array([SAMPLED_PROMPT + [t] for t in range(VOCAB)])
    second = mx.softmax(model(batch)[:, -1].astype(mx.float32) / TEMPERATURE, axis=-1).tolist()
    alive = 1 - first[EOS]
    return {t2: sum(first[t1] * second[t1][t2] for t1 in range(VOCAB) if t1 != EOS) / alive for t2 in range(VOCAB)}


def workload_speculative_sampling(package):
    """Temperature sampling through verification: the second token (the first one guessed) follows the target's
    own law, whatever the guesses (a chi-square test at the stated false-alarm rate, fixed seed)."""
    law = second_token_distribution()
    guess = max(law, key=law.get)
    requests = [Request(f"t{i}", SAMPLED_PROMPT, max_tokens=3, sampling=dict(temperature=TEMPERATURE))
                for i in range(NUM_SAMPLED)]
    mx.random.seed(2024)
    result = drive_speculative(package, requests, FixedGuess(guess), token_budget=512, max_num_seqs=128,
                               num_blocks=512)
    result.check_clean()
    counts: dict[int, int] = {}
    for request in requests:
        stream = result.streams[request.request_id]
        got = result.tokens_of(request.request_id)
        if len(got) >= 2:
            second = got[1]
        elif len(got) == 1 and stream[-1][1].finish_reason == "stop":
            second = EOS
        else:
            continue  # EOS first: no second token
        counts[second] = counts.get(second, 0) + 1
    assert sum(counts.values()) >= NUM_SAMPLED // 2, "too few requests reached a second token to test its law"
    assert_distribution(counts, law, f"second tokens (the guess {guess} has probability {law[guess]:.2f})")
    assert result.engine.summary()["speculative_proposed"] >= NUM_SAMPLED // 2, "the second tokens were not verified"


SPECULATIVE_WORKLOADS = [workload_speculative_pressure, workload_speculative_exact, workload_speculative_model_failure,
                         workload_speculative_mixed_requests, workload_speculative_sampling]


# ---------------------------------------------------------------- day 4.2: the quantized pool


def quantized_bytes_per_token(bits: int) -> int:
    """`wide_mlx_model`'s keys and values for one token: 2 layers x (K and V) x 2 heads x (32 features at `bits`
    bits plus a float16 scale and bias for its one group of 32)."""
    return 2 * 2 * 2 * (32 * bits // 8 + 2 * 2)


def quantized_engine(package, probe: ModelProbe, bits: int, num_blocks: int, **options):
    """The student's engine over a `bits`-bit pool that `kv_cache_bytes` sizes to `num_blocks` blocks of 4 tokens."""
    memory = num_blocks * 4 * quantized_bytes_per_token(bits) + 4 * quantized_bytes_per_token(bits) - 1
    merged = dict(token_budget=16, max_num_seqs=4, block_size=4, kv_bits=bits, kv_cache_bytes=memory,
                  **w3.engine_options(4))
    merged.update(options)
    engine = w3.make_engine(package, probe, **merged)
    assert engine.block_manager.num_blocks == num_blocks, \
        f"{memory} bytes of {bits}-bit KV cache hold {num_blocks} blocks of 4 tokens " \
        f"({quantized_bytes_per_token(bits)} bytes a token); the engine made {engine.block_manager.num_blocks}"
    return engine


def wide_probe(package, **kwargs) -> ModelProbe:
    return ModelProbe(package.qwen2_week3.Qwen2ModelWeek3(w3.wide_mlx_model()), **kwargs)


def quantized_run(package, requests, bits: int, num_blocks: int, **options) -> Run:
    """`requests` run to the end on `quantized_engine`."""
    probe = wide_probe(package)
    result = Run(quantized_engine(package, probe, bits, num_blocks, **options), probe, requests, 4)
    result.drive()
    return result


def with_bits(requests: list[Request], bits: int) -> list[Request]:
    for request in requests:
        request.kv_bits = bits
    return requests


def workload_quantized_pressure(package):
    """8-bit and 4-bit pools too small for the load: refusals, preemptions, EOS, aborts; every token mlx-lm's over
    MLX's own round trip; every block home."""
    for bits in (8, 4):
        result = quantized_run(package, with_bits(w3.pressure_requests(4), bits), bits, num_blocks=14)
        result.check_outputs()
        result.check_budget(16)
        result.check_clean()
        reasons = {o.finish_reason for s in result.streams.values() for _, o in s if o.finished}
        assert {"stop", "length"} <= reasons, f"the workload should end by EOS and by length, ended by {reasons}"
        assert result.engine.summary()["num_preemptions"] > 0, f"{bits}-bit: a pool of 14 blocks must preempt"
        assert result.refusals > 0, f"{bits}-bit: a pool of 14 blocks must refuse some admissions"


def workload_quantized_model_failure(package):
    """A model that fails mid-run over an 8-bit pool, then a clean rerun on the same engine: exact, nothing leaked."""
    requests = w3.pressure_requests(4)[:6]
    probe = wide_probe(package, fail_on_call=6)
    engine = quantized_engine(package, probe, 8, num_blocks=14)
    failing = Run(engine, probe, [Request(r.request_id, r.prompt, r.max_tokens, kv_bits=8) for r in requests], 4)
    with pytest.raises(ModelFailure):
        failing.drive()
    failing.check_clean()
    again = [Request(f"again-{r.request_id}", r.prompt, r.max_tokens, arrive=failing.step_index + r.arrive, kv_bits=8)
             for r in requests]
    clean = Run(engine, probe, again, 4)
    clean.step_index = failing.step_index
    clean.drive()
    clean.check_outputs()
    clean.check_clean()


def workload_quantized_seeded_sampling(package):
    """Seeded sampling over a 4-bit pool under preemption: every draw as the seed rule says."""
    requests = [Request(f"s{i}", tokens(5 + 3 * i, 40 + i), max_tokens=10, arrive=i, kv_bits=4,
                        sampling=dict(temperature=1.0, seed=100 + i, **({"top_k": 20} if i % 2 else {"top_p": 0.9})))
                for i in range(4)]
    requests.append(Request("greedy", tokens(9, 49), max_tokens=10, kv_bits=4))
    result = quantized_run(package, requests, 4, num_blocks=10)
    result.check_outputs()
    result.check_clean()
    assert result.engine.summary()["num_preemptions"] > 0, "a pool of 10 blocks must force preemptions"


QUANTIZED_WORKLOADS = [workload_quantized_pressure, workload_quantized_model_failure,
                       workload_quantized_seeded_sampling]


def check_speculative_stack(package) -> None:
    """Day 4.1's workloads on `package`; fail once, naming each workload that broke."""
    w3.check_workloads(package, SPECULATIVE_WORKLOADS, lambda workload: workload(package))


def check_quantized_stack(package) -> None:
    """Day 4.2's workloads on `package`; fail once, naming each workload that broke."""
    w3.check_workloads(package, QUANTIZED_WORKLOADS, lambda workload: workload(package))


def two_rank_stack_records(sol, module: str, run) -> list[dict]:
    """Each rank's "your stack so far" record from a two-rank run of day 4.3 or 4.4 (their rank programs run the
    stack after the day's own checks); fails the test cleanly when the day is unwritten, the run ended before the
    records, or a rank raised."""
    if solution_name() == "student":
        # The stack fills unwritten tasks with the reference's: it grades today only once today is written.
        for name, task in sol.unwritten(module).items():
            raise NotImplementedError(f"{task} ({name}): your stack so far runs today's code")
    records = [result and result.get("stack") for result in run.results]
    if None in records:
        pytest.fail(f"the two-rank run ended before your stack so far reported: {run.failure() or ''}\n"
                    f"{run.output[-2000:]}", pytrace=False)
    for rank, record in enumerate(records):
        if "not_implemented" in record:
            raise NotImplementedError(record["not_implemented"])
        assert "error" not in record, f"rank {rank} raised: {record['error']}"
    return records
