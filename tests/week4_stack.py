"""Your stack so far, week 4: the student's own week-3 engine with their day 4.1 or 4.2 on top, as a server runs it.

Days 4.1 and 4.2 end like the week-3 days, with a "Your stack so far" task whose test calls
`check_speculative_stack(stack(week=4, day=1))` or `check_quantized_stack(stack(week=4, day=2))`: the
student's code for every week-3 engine day they have written and for the day (course/selector.py's
`Choice(4, D, "stack")`, `STACK_STARTS`), driven through the public engine API only
(`SpeculativeEngine` or `LLMEngine` with `EngineConfig(kv_bits=..., kv_cache_bytes=...)`, `add_request`,
`step`, `abort`, `summary()`, the block manager's free blocks). The machinery is week 3's
(tests/week3_stack.py): the same tiny random Qwen2 behind a probe that counts tokens, keeps a fake
clock and fails on a chosen call, the same requests, and mlx-lm's model on each request alone as the
oracle, token for token:

- day 4.1: greedy output identical to mlx-lm's under a small pool with preemptions, EOS and aborts,
  with the student's prompt lookup and with guesses right for a known number of tokens (so every step
  must yield exactly the right guesses plus one, and rejected positions must go back across block
  boundaries); a model failure then a clean rerun; top-k/top-p, penalty, logit_bias and logprobs
  requests beside speculating ones, served as week 3 serves them; sampled speculation keeping the
  target's distribution at the second and third tokens (chi-square tests on the tiny model's exact
  probabilities); seeds that reproduce, run twice and beside another request; an EOS inside accepted
  guesses; no guess past max_tokens - 1; back-off step by step as a fed `AcceptanceTracker` asks; the
  student's prompt lookup checked at every proposal; a follow-up turn served from the prefix cache;
- day 4.2: the same server workloads on 8-bit and 4-bit pools sized by memory: the blocks a memory
  budget buys, preemptions, and every token equal to mlx-lm's model over a cache that stores MLX's own
  quantize-then-dequantize of each key and value (`RoundTripCache`); float16 and bfloat16 models
  (every call in the model's dtype), heads of 128 features in groups of 64, a float16 pool on a
  float32 model.

Every workload ends with every block back in the pool; every loop has a step limit. Day 4.1's proposers are
built where the engine runs (tests/actor_fakes/speculative.py); what they record comes back as data and is checked
here against the test's own oracles (the truth proposer's calls replayed through its own copy, each prompt-lookup
proposal against the rule, each guess against the guess limit).
"""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import qwen2 as mlx_qwen2
from mlx_lm.models.cache import KVCache

from tests import week3_stack as w3
from tests.chi_square import assert_distribution
from tests.harness import actor_fakes, fetch, solution_name
from tests.actor_fakes import speculative
from tests.week3_stack import (EOS, VOCAB, ModelProbe, Request, RoundTripCache, Run, expected,
                               tokens)

K = 3  # guesses per verify chunk in the speculative workloads


# ---------------------------------------------------------------- day 4.1: speculative decoding


def speculative_fakes(package):
    """tests/actor_fakes/speculative.py where `package` runs: the proposers the engine calls, built there."""
    return actor_fakes(package, "speculative")


def truths(requests: list[Request]) -> dict:
    """Each request's prompt, its output alone (mlx-lm's) and the EOS that ended it, if one did: what a
    `TruthProposer` guesses from."""
    truth = {}
    for request in requests:
        output, reason = expected(request)
        truth[request.request_id] = request.prompt + output + ([EOS] if reason == "stop" else [])
    return truth


def truth_proposer(package, requests: list[Request], seed: int):
    """A `TruthProposer` where `package` runs, and the test's own copy to replay its calls: (there, here)."""
    truth = truths(requests)
    return speculative_fakes(package).TruthProposer(truth, seed), speculative.TruthProposer(truth, seed)


def right_guesses(calls, requests: list[Request], replica) -> dict:
    """Each recorded call of a `TruthProposer` checked and counted: request id -> (guesses, right ones).

    The record comes from the process that runs the code under test, so `replica` (the test's own proposer, same
    truth and seed) answers every recorded question again and must give the recorded guesses: a record rewritten to
    hide proposals or change guesses parts from the replay's random draws. Each proposal must be asked after true
    tokens only, within the guess limit."""
    limits = {r.request_id: (len(r.prompt), r.max_tokens) for r in requests}
    counted = {}
    for request_id, tokens, k, draft in calls:
        truth = replica.truth[request_id]
        assert truth[: len(tokens)] == tokens, f"{request_id!r} asked for guesses after tokens it should not have"
        check_guess_limit(request_id, k, len(tokens), *limits[request_id])
        assert draft == replica.guess(request_id, tokens, k), \
            f"{request_id!r}: the proposer's record does not replay (it guessed {draft})"
        right = next((i for i, guess in enumerate(draft) if guess != truth[len(tokens) + i]), len(draft))
        counted[request_id] = (k, right)
    return counted


def check_guess_limit(request_id, k: int, num_tokens: int, prompt_length: int, max_tokens: int) -> None:
    """The rule of Task 4: the last token a sequence emits is always the target's own, so it guesses at most
    max_tokens - emitted - 1 tokens (a guess past that is a row computed for nothing)."""
    left = max_tokens - (num_tokens - prompt_length)
    assert k <= left - 1, f"{request_id!r} was asked for {k} guesses with {left} tokens left to emit: at most " \
                          f"max_tokens - emitted - 1 = {left - 1} (the last token is always the target's own)"


def speculative_engine(package, probe: ModelProbe, proposer, min_acceptance_rate: float = 0.0, **options):
    """The one place a day-4.1 engine is built here: the student's SpeculativeEngine on their week-3 engine.

    No back-off by default (min_acceptance_rate 0): every decode guesses as many tokens as it may, so
    every workload exercises verification and roll-back at every step.
    """
    merged = dict(token_budget=16, max_num_seqs=4, block_size=4, num_blocks=64, **w3.engine_options(4))
    merged.update(options)
    speculation = package.speculative.SpeculativeConfig(K, min_acceptance_rate=min_acceptance_rate)
    return package.speculative.SpeculativeEngine(probe, actor_fakes(package).StackTokenizer(), package.engine.EngineConfig(**merged),
                                                 speculation=speculation, proposer=proposer, clock=probe.clock)


def check_blocks_after_every_step(package, engine):
    """No running sequence holds a block past its tokens (rejected guesses give theirs back); none leaked."""
    # Read at once, where the engine runs (while grading, one round trip, not one per attribute).
    state = speculative_fakes(package).state(engine)
    num_free, num_blocks, block_size = state["num_free"], state["num_blocks"], state["block_size"]
    held = {block for _, table, _, _ in state["running"] for block in table}
    assert len(held) + num_free == num_blocks, f"{num_blocks - num_free - len(held)} blocks are neither held nor free"
    for request_id, table, num_tokens, _ in state["running"]:
        most = -(-num_tokens // block_size)
        assert len(table) <= most, \
            f"{request_id!r} holds {len(table)} blocks for {num_tokens} tokens: rejected positions kept"


def drive_speculative(package, requests, proposer, probe=None, after_step=None, min_acceptance_rate=0.0,
                      **options) -> Run:
    """Run `requests` on a speculative engine, checking the blocks (and `after_step(run)`) after every step."""
    probe = probe or w3.new_probe(package)
    engine = speculative_engine(package, probe, proposer, min_acceptance_rate, **options)
    result = Run(engine, probe, requests, engine.config.max_num_seqs)

    def check(run):
        check_blocks_after_every_step(package, run.engine)
        if after_step:
            after_step(run)

    result.drive(after_step=check)
    return result


def workload_speculative_pressure(package):
    """A pool too small for the load, the student's prompt lookup guessing at every step: preemptions,
    EOS, aborts, every token mlx-lm's, every rejected position given back, every block home."""
    truth, replica = truth_proposer(package, w3.pressure_requests(4), seed=3)
    for proposer in (package.speculative.NgramProposer(max_ngram=2, min_ngram=1), truth):
        result = drive_speculative(package, w3.pressure_requests(4), proposer, num_blocks=14)
        result.check_outputs()
        result.check_budget(16)
        result.check_clean()
        summary = result.engine.summary()
        assert summary["num_preemptions"] > 0, "a pool of 14 blocks must force preemptions"
        assert summary["speculative_proposed"] > 0, f"{'prompt lookup' if proposer is not truth else 'the truth'} " \
                                                    "never guessed"
    right_guesses(truth.calls, result.requests, replica)
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
    proposer, replica = truth_proposer(package, requests, seed=5)
    totals = {"proposed": 0, "accepted": 0}
    before: dict[str, int] = {}

    def exact(result):
        for request_id, (guesses, right) in right_guesses(proposer.take(), requests, replica).items():
            want = expected(next(r for r in result.requests if r.request_id == request_id))[0]
            had, now = before.get(request_id, 0), len(result.tokens_of(request_id))
            assert now == min(had + right + 1, len(want)), \
                f"{request_id!r}: {right} of {guesses} guesses right, so {right + 1} new tokens; got {now - had}"
            totals["proposed"] += guesses
            totals["accepted"] += right
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
    with pytest.raises(actor_fakes(package).ModelFailure):
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
        raise AssertionError(f"no end after {w3.STEP_LIMIT} steps: every step must move a request forward (a prefill "
                             "chunk, at least one token, or a preemption), so the engine stopped making progress")
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


class ExactCache(KVCache):
    """mlx-lm's KV cache without its room to grow: keys and values exactly as long as what was fed, so a batch of
    thousands of one-token continuations attends to a few keys each."""

    def update_and_fetch(self, keys, values):
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.values = values if self.values is None else mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


@functools.cache
def token_laws() -> tuple[dict[int, float], dict[int, float]]:
    """The exact laws of the second and third output tokens at TEMPERATURE, given the tokens before are not EOS:
    mlx-lm's model on every possible first token, then on every possible pair, at once."""
    model = w3.tiny_mlx_model()

    def law(logits: mx.array) -> mx.array:
        return mx.softmax(logits[:, -1].astype(mx.float32) / TEMPERATURE, axis=-1)

    first = law(model(mx.array([SAMPLED_PROMPT])))[0]
    cache = [ExactCache() for _ in model.layers]
    second = law(model(mx.array([SAMPLED_PROMPT + [t] for t in range(VOCAB)]), cache=cache))  # row t1: after t1
    for layer in cache:  # each context P + [t1] once per t2, in order: row t1 * VOCAB + t2
        layer.keys, layer.values = (mx.repeat(part, VOCAB, axis=0) for part in (layer.keys, layer.values))
    following = mx.array([[t2] for _ in range(VOCAB) for t2 in range(VOCAB)])
    third = law(model(following, cache=cache)).reshape(VOCAB, VOCAB, VOCAB)
    alive = mx.ones(VOCAB).at[EOS].add(-1.0)  # the paths that go on: neither token before is EOS
    pairs = first[:, None] * alive[:, None] * second * alive[None, :]  # P(t1, t2), both alive
    law2 = (first * alive) @ second / (first * alive).sum()
    law3 = (pairs[:, :, None] * third).sum(axis=(0, 1)) / pairs.sum()
    return dict(enumerate(law2.tolist())), dict(enumerate(law3.tolist()))


def output_at(result: Run, request: Request, index: int) -> int | None:
    """The request's output token number `index` (EOS when it stopped right there), None if it ended before."""
    got = result.tokens_of(request.request_id)
    if len(got) > index:
        return got[index]
    if len(got) == index and result.streams[request.request_id][-1][1].finish_reason == "stop":
        return EOS
    return None


def workload_speculative_sampling(package):
    """Temperature sampling through verification: the second token (the first one guessed) and the third (after a
    rejection, the token after the replacement must come from the next verify chunk, not from a row of guesses the
    target rejected) follow the target's own law, whatever the guesses (chi-square tests at the stated false-alarm
    rate, fixed seed)."""
    law2, law3 = token_laws()
    guess = max(law2, key=law2.get)
    requests = [Request(f"t{i}", SAMPLED_PROMPT, max_tokens=4, sampling=dict(temperature=TEMPERATURE))
                for i in range(NUM_SAMPLED)]
    mx.random.seed(2024)
    result = drive_speculative(package, requests, actor_fakes(package).FixedGuess(guess), token_budget=512, max_num_seqs=128,
                               num_blocks=512)
    result.check_clean()
    for index, law, name in ((1, law2, "second"), (2, law3, "third")):
        counts: dict[int, int] = {}
        for request in requests:
            token = output_at(result, request, index)
            if token is not None:
                counts[token] = counts.get(token, 0) + 1
        assert sum(counts.values()) >= NUM_SAMPLED // 2, f"too few requests reached a {name} token to test its law"
        assert_distribution(counts, law, f"{name} tokens (the guess {guess} has probability {law[guess]:.2f}; after "
                                         "a rejected guess nothing more comes from that verify chunk)")
        # The guess against every other token (one degree of freedom: far more power than the whole law's test for
        # the rule most often broken, a replacement drawn from p itself, which can draw the rejected guess again).
        guessed = counts.get(guess, 0)
        assert_distribution({"guess": guessed, "other": sum(counts.values()) - guessed},
                            {"guess": law[guess], "other": 1 - law[guess]},
                            f"how often the {name} token is the guess {guess} (probability {law[guess]:.2f}; after a "
                            "rejection the replacement comes from max(p - q, 0), never the rejected guess)")
    assert result.engine.summary()["speculative_proposed"] >= NUM_SAMPLED // 2, "the second tokens were not verified"


def seeded_run(package, requests: list[Request]) -> dict[str, list[int]]:
    """`requests` on a fresh speculative engine guessing the target's argmax: each request's tokens."""
    # Guesses the target's own greedy continuation of whatever the sequence holds: at temperature 1 such a guess is
    # often, not always, accepted, so the outcome of each verification turns on rejection sampling's draws.
    proposer = speculative_fakes(package).ArgmaxProposer(w3.tiny_mlx_model())
    result = drive_speculative(package, requests, proposer, token_budget=32)
    result.check_clean()
    summary = result.engine.summary()
    assert summary["speculative_proposed"] > summary["speculative_accepted"] > 0, \
        "the guesses must be accepted sometimes and rejected sometimes"
    return {r.request_id: result.tokens_of(r.request_id) for r in requests}


def workload_speculative_seeded(package):
    """A seed reproduces a temperature request through speculation: run twice, and beside another request, the
    same tokens (every draw of rejection sampling comes from MLX's random state, which the engine seeds with the
    request's seed plus the tokens it has so far; with a roomy budget each request guesses alike)."""
    seeded = [Request(f"seeded{i}", tokens(6, 70 + i), max_tokens=14, sampling=dict(temperature=1.0, seed=500 + i))
              for i in range(2)]
    neighbour = Request("neighbour", tokens(7, 79), max_tokens=14)
    first = seeded_run(package, seeded)
    mx.random.seed(7)  # whatever the global random state was: the seed alone decides
    again = seeded_run(package, seeded)
    for request in seeded:
        assert again[request.request_id] == first[request.request_id], \
            f"{request.request_id!r} with seed {request.sampling['seed']} gave {first[request.request_id]}, then " \
            f"{again[request.request_id]}: rejection sampling must draw from MLX's random state (mx.random), " \
            "which the engine seeds, never from Python's random or an unseeded source"
    beside = seeded_run(package, seeded[:1] + [neighbour])
    assert beside["seeded0"] == first["seeded0"], \
        f"seeded0 gave {first['seeded0']} beside seeded1 and {beside['seeded0']} beside a greedy request: a seed " \
        "reproduces a request whatever shares its batch"


def check_guess_limits(calls, requests: list[Request]) -> None:
    """`check_guess_limit` for every recorded call of a proposer."""
    limits = {r.request_id: (len(r.prompt), r.max_tokens) for r in requests}
    for request_id, tokens_so_far, k, _ in calls:
        check_guess_limit(request_id, k, len(tokens_so_far), *limits[request_id])


def stopping_requests(count: int, max_tokens: int) -> list[Request]:
    """`count` requests whose greedy output meets EOS within `max_tokens` tokens (found by seed, in order)."""
    found = []
    for seed in range(200, 400):
        request = Request(f"eos{seed}", tokens(6, seed), max_tokens=max_tokens, arrive=len(found))
        if expected(request)[1] == "stop" and len(expected(request)[0]) >= 2:
            found.append(request)
            if len(found) == count:
                return found
    raise AssertionError("the tiny model never stops: pick other seeds")


def workload_speculative_eos_guessed(package):
    """A proposer guesses EOS followed by more tokens, and the target agrees with all of them: the request ends at
    the EOS (finish reason "stop", no token after it streamed, its blocks home), whatever guesses were accepted."""
    requests = stopping_requests(3, max_tokens=14)
    # Guesses each request's greedy continuation right, EOS included and the target's tokens after it: the target
    # accepts every guess, so an EOS inside the accepted guesses must end the request there.
    truth = {r.request_id: r.prompt + speculative.greedy_past_eos(w3.tiny_mlx_model(), r.prompt, r.max_tokens + K)
             for r in requests}
    proposer = speculative_fakes(package).PastEosProposer(truth)
    result = drive_speculative(package, requests, proposer)
    result.check_outputs()
    result.check_clean()
    calls = proposer.calls
    check_guess_limits(calls, requests)
    # The record comes from the code under test's process: each guess must be what the truth says there.
    assert all(draft == truth[request_id][len(so_far) : len(so_far) + k] for request_id, so_far, k, draft in calls), \
        "the proposer's record does not replay"
    eos_guessed = sum(EOS in draft[:-1] for _, _, _, draft in calls)  # proposals with EOS before their last guess
    assert eos_guessed > 0, "no proposal had an EOS followed by more guesses: the workload checks nothing"


def tracker_schedule(request: Request, min_rate: float, probe_interval: int) -> list[tuple[int, int]]:
    """(tokens emitted, guesses) of each proposal for `request` when every guess fails and the request decodes
    one token a step: a fresh `AcceptanceTracker` told each verification's outcome (k proposed, 0 accepted)."""
    tracker = w3.ref.speculative.AcceptanceTracker(min_rate, probe_interval)
    output, reason = expected(request)
    last = len(output) if reason == "stop" else request.max_tokens - 1  # the last step that decodes
    schedule = []
    for emitted in range(1, last + 1):
        most = min(K, request.max_tokens - emitted - 1)
        if most <= 0:
            continue
        k = tracker.num_guesses(request.request_id, most)
        if k:
            schedule.append((emitted, k))
            tracker.observe(request.request_id, k, 0)
    return schedule


def workload_speculative_back_off(package):
    """Guesses that always fail, with back-off on (the defaults): each verification's outcome reaches the
    acceptance tracker, so a request guesses k, then fewer, then stops and probes with one guess after 2, 4, 8 ...
    plain steps: the guesses asked for, step by step, are an AcceptanceTracker's told every outcome."""
    requests = [Request(f"b{i}", tokens(6, 300 + i), max_tokens=24) for i in range(2)]
    # Guesses wrong every time (the first guess is never the target's token); its record says, per request, how
    # many tokens it had emitted and how many guesses it was asked for.
    proposer = speculative_fakes(package).WrongProposer(truths(requests))
    result = drive_speculative(package, requests, proposer, min_acceptance_rate=0.3, token_budget=16)
    result.check_outputs()
    result.check_clean()
    calls = proposer.calls
    for request in requests:
        want = tracker_schedule(request, 0.3, 16)
        # A record rewritten to show this schedule must be the schedule a tracker gives: the back-off itself.
        got = [(len(so_far) - len(request.prompt), k) for request_id, so_far, k, _ in calls
               if request_id == request.request_id]
        assert got == want, \
            f"{request.request_id!r} (every guess wrong) was asked for guesses at (tokens emitted, guesses) {got}; " \
            f"a tracker told each verification's outcome (tracker.observe(request id, proposed, accepted guesses)) " \
            f"asks {want}"


def workload_speculative_follow_up(package):
    """A follow-up request whose prompt is an earlier request's prompt and answer (a chat's next turn), on the same
    engine with prefix caching: every full block of the earlier request's accepted tokens was named for the cache
    with the tokens it holds, so the follow-up computes only what its cached blocks do not cover."""
    first = Request("turn1", tokens(9, 162), max_tokens=16)
    answer, reason = expected(first)
    assert reason == "length" and len(answer) == 16, "pick a seed whose first turn runs to max_tokens"
    follow_up = Request("turn2", first.prompt + answer[:10], max_tokens=4)
    probe = w3.new_probe(package)
    engine = speculative_engine(package, probe, truth_proposer(package, [first, follow_up], seed=9)[0])
    earlier = Run(engine, probe, [first], 4)
    earlier.drive(after_step=lambda run: check_blocks_after_every_step(package, run.engine))
    earlier.check_outputs()
    calls = len(probe.calls)
    later = Run(engine, probe, [follow_up], 4)
    later.step_index = earlier.step_index
    later.drive()
    later.check_outputs()
    later.check_clean()
    cached = (len(follow_up.prompt) - 1) // 4 * 4  # every full block but the one holding the last prompt token
    computed = probe.calls[calls][0]
    assert computed == len(follow_up.prompt) - cached, \
        f"the follow-up's first step computed {computed} of its {len(follow_up.prompt)} prompt tokens; the first " \
        f"turn's blocks cover {cached}, so {len(follow_up.prompt) - cached}: roll back after appending the accepted " \
        "tokens, so that the blocks the scheduler names for the prefix cache hold their tokens"


def latest_lookup(tokens_so_far: list[int], k: int, max_ngram: int, min_ngram: int, latest: bool = True,
                  longest_first: bool = True) -> list[int]:
    """The rule of Task 1, written again as the oracle: longest suffix first, its latest earlier occurrence, the up
    to k tokens after it (`latest` and `longest_first` False: the wrong rules, to check the workload sees them)."""
    sizes = range(max_ngram, min_ngram - 1, -1)
    for n in sizes if longest_first else reversed(sizes):
        if len(tokens_so_far) <= n:
            continue
        suffix = tokens_so_far[-n:]
        starts = [s for s in range(len(tokens_so_far) - n) if tokens_so_far[s : s + n] == suffix]
        if starts:
            start = starts[-1] if latest else starts[0]
            return tokens_so_far[start + n : start + n + k]
    return []


def workload_speculative_prompt_lookup(package):
    """The student's prompt lookup in the engine, on prompts where an n-gram recurs with different continuations:
    every proposal is the latest match of the longest suffix, and every token mlx-lm's."""
    # Prompts over 6 tokens: the model's outputs recur in them and in each other (seeds with such proposals).
    requests = [Request(f"p{i}", [rng.randrange(6) for _ in range(20)], max_tokens=20, arrive=i)
                for i, rng in enumerate(random.Random(51 + i) for i in range(3))]
    proposer = speculative_fakes(package).Watched(package.speculative.NgramProposer(max_ngram=3, min_ngram=1))
    result = drive_speculative(package, requests, proposer)
    result.check_outputs()
    result.check_clean()
    earliest_differs = shortest_differs = 0  # proposals where the earliest match, or the shortest suffix first, differ
    truth = truths(requests)
    for request_id, context, k, draft in proposer.calls:
        # Recorded where the code under test runs: each context must be the request's true tokens so far (so a record
        # rewritten to hold easier contexts fails), and to show a right guess where the lookup made a wrong one a
        # rewritten record would have to apply the rule itself.
        assert truth[request_id][: len(context)] == context, f"{request_id!r} proposed from tokens it never had"
        want = latest_lookup(context, k, 3, 1)
        assert draft == want, \
            f"prompt lookup on {context} (k={k}, n-grams 3 down to 1) proposed {draft}; the rule gives {want}: the " \
            "longest suffix that occurs earlier, its latest occurrence, the tokens that followed it"
        earliest_differs += want != latest_lookup(context, k, 3, 1, latest=False)
        shortest_differs += want != latest_lookup(context, k, 3, 1, longest_first=False)
    assert earliest_differs > 0 and shortest_differs > 0, \
        "no proposal where the earliest match or the shortest suffix differs: the workload checks nothing"


SPECULATIVE_WORKLOADS = [workload_speculative_pressure, workload_speculative_exact, workload_speculative_model_failure,
                         workload_speculative_mixed_requests, workload_speculative_sampling,
                         workload_speculative_seeded, workload_speculative_eos_guessed, workload_speculative_back_off,
                         workload_speculative_prompt_lookup, workload_speculative_follow_up]


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
    return w3.new_probe(package, w3.wide_mlx_model(), **kwargs)


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
    with pytest.raises(actor_fakes(package).ModelFailure):
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


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bits: int, group_size: int = 64,
                    float_bytes: int = 2) -> int:
    """The oracle of Task 3: keys and values of every layer and head; quantized: `head_dim * bits / 8` bytes plus a
    float16 scale and bias per group of min(group_size, head_dim) features; 16 bits: float16, whatever the model."""
    if bits == 16:
        return 2 * num_layers * num_kv_heads * head_dim * float_bytes
    groups = head_dim // min(group_size, head_dim)
    return 2 * num_layers * num_kv_heads * (head_dim * bits // 8 + 2 * 2 * groups)


@functools.cache
def head128_mlx_model():
    """A model whose heads have 128 features: with the default group size of 64, two groups per head vector
    (scaled up 5x like the others)."""
    args = mlx_qwen2.ModelArgs(model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                                  num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                                  max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(20281)
    model = mlx_qwen2.Model(args)
    model.update(tree_map(lambda p: p * 5 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@functools.cache
def wide_model_in(dtype: mx.Dtype):
    """`wide_mlx_model` with every weight cast to `dtype`: a float16 or bfloat16 checkpoint."""
    model = mlx_qwen2.Model(w3.wide_mlx_model().args)
    model.update(tree_map(lambda p: p.astype(dtype), w3.wide_mlx_model().parameters()))
    mx.eval(model.parameters())
    return model


class GroupRoundTripCache(RoundTripCache):
    """`RoundTripCache` in groups of `group_size` features (the whole head when it is smaller)."""

    def __init__(self, bits: int, group_size: int):
        super().__init__(bits)
        self.group_size = group_size

    def round_trip(self, x: mx.array) -> mx.array:
        group = min(self.group_size, x.shape[-1])
        packed, scales, biases = mx.quantize(x.reshape(-1, group), group, self.num_bits)
        scales, biases = (a.astype(mx.float16).astype(x.dtype) for a in (scales, biases))
        return mx.dequantize(packed, scales, biases, group, self.num_bits).reshape(x.shape)


class Float16Cache(KVCache):
    """mlx-lm's KV cache storing float16 keys and values, read back in the model's dtype: a kv_bits=16 pool."""

    def update_and_fetch(self, keys, values):
        keys, values = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        return keys, values


def greedy_alone(model, make_cache, request: Request) -> tuple[list[int], str]:
    """(tokens, finish reason) of `request` alone on mlx-lm's `model` over the caches `make_cache()` gives."""
    cache = [make_cache() for _ in model.layers]
    history, output = list(request.prompt), []
    while len(output) < request.max_tokens:
        token = mx.argmax(model(mx.array([history]), cache=cache)[0, -1]).item()
        if token == EOS:
            return output, "stop"
        output.append(token)
        history = [token]
    return output, "length"


def sized_pool_run(package, probe: ModelProbe, requests: list[Request], bits: int, num_blocks: int, per_token: int,
                   why: str) -> Run:
    """`requests` to the end on the student's engine over a `bits` pool that `kv_cache_bytes` sizes to `num_blocks`
    blocks of 4 tokens at `per_token` bytes a token; the pool's own arrays fit the budget."""
    memory = (num_blocks + 1) * 4 * per_token - 1
    engine = w3.make_engine(package, probe, token_budget=16, max_num_seqs=4, block_size=4, kv_bits=bits,
                            kv_cache_bytes=memory, **w3.engine_options(4))
    assert engine.block_manager.num_blocks == num_blocks, \
        f"{memory} bytes of {bits}-bit KV cache hold {num_blocks} blocks of 4 tokens at {per_token} bytes a token " \
        f"({why}); the engine made {engine.block_manager.num_blocks}"
    used = package.quantized_kv.pool_nbytes(engine.runner.pool)
    assert used <= memory, f"the {bits}-bit pool's arrays take {used} bytes, over kv_cache_bytes={memory}"
    result = Run(engine, probe, requests, 4)
    result.drive()
    result.check_clean()
    return result


def check_tokens(result: Run, oracle, what: str) -> None:
    """Every request's tokens and ending as `oracle(request)` gives."""
    for request in result.requests:
        want, reason = oracle(request)
        got, stream = result.tokens_of(request.request_id), result.streams[request.request_id]
        assert got == want, f"{what}: request {request.request_id!r} streamed {got}; mlx-lm over the same " \
                            f"round trip gives {want}"
        assert stream[-1][1].finish_reason == reason, \
            f"{what}: request {request.request_id!r} finished by {stream[-1][1].finish_reason!r}, expected {reason!r}"


# Logits a half-precision model may miss the argmax by (measured at 4 bits: 0.8 in float16, 1.1 in bfloat16).
HALF_TOLERANCE = {mx.float16: 2.0, mx.bfloat16: 4.0}


def check_near_greedy(result: Run, model, make_cache, tolerance: float, what: str) -> float:
    """In half precision the order of the sums moves the logits by float rounding, so the tokens may part from
    mlx-lm's: given the tokens before it, each streamed token (and the EOS that ended a request) must be within
    `tolerance` of mlx-lm's best logit over the same round trip. The largest miss."""
    worst = 0.0
    for request in result.requests:
        got, stream = result.tokens_of(request.request_id), result.streams[request.request_id]
        chosen = got + ([EOS] if stream[-1][1].finish_reason == "stop" else [])
        cache = [make_cache() for _ in model.layers]
        rows = model(mx.array([request.prompt + got]), cache=cache)[0, len(request.prompt) - 1:].astype(mx.float32)
        for i, token in enumerate(chosen):
            miss = (rows[i].max() - rows[i, token]).item()
            worst = max(worst, miss)
            assert miss <= tolerance, \
                f"{what}: request {request.request_id!r}'s token {i} ({token}) is {miss:.2f} below mlx-lm's best " \
                f"logit over the same round trip (float rounding moves it by less than {tolerance})"
        assert stream[-1][1].finished, f"{what}: request {request.request_id!r} never finished"
    return worst


def small_requests(count: int, seed: int, max_tokens: int = 8) -> list[Request]:
    return [Request(f"r{i}", tokens(5 + 2 * i, seed + i), max_tokens=max_tokens, arrive=i) for i in range(count)]


def workload_quantized_half_precision(package):
    """A float16 and a bfloat16 model over 8-bit and 4-bit pools: every call computes in the model's dtype (gather
    returns it), every token one mlx-lm's model in that dtype over MLX's round trip ranks first, to float rounding."""
    for dtype in (mx.float16, mx.bfloat16):
        model = wide_model_in(dtype)
        for bits in (8, 4):
            probe = w3.new_probe(package, model, logits_dtype=dtype)
            requests = small_requests(3, 610)
            result = sized_pool_run(package, probe, requests, bits, 24, bytes_per_token(2, 2, 32, bits, 32),
                                    "head_dim 32: one group of 32 per head")
            check_near_greedy(result, model, lambda: GroupRoundTripCache(bits, 32), HALF_TOLERANCE[dtype],
                              f"{dtype} model, {bits}-bit pool")


def workload_quantized_wide_heads(package):
    """head_dim 128 with the default group size of 64: two groups per head vector, in the bytes a token costs
    (kv_group_size(head_dim, group_size)) and in the quantization (every token mlx-lm's over MLX's round trip in
    groups of 64); a pool small enough to preempt."""
    model = head128_mlx_model()
    for bits in (8, 4):
        probe = w3.new_probe(package, model)
        requests = small_requests(5, 620, max_tokens=10)
        result = sized_pool_run(package, probe, requests, bits, 12, bytes_per_token(2, 2, 128, bits, 64),
                                "head_dim 128 in groups of kv_group_size(128, 64) = 64: two scales and biases a head")
        check_tokens(result, lambda r: greedy_alone(model, lambda: GroupRoundTripCache(bits, 64), r),
                     f"head_dim 128, {bits}-bit pool")


def workload_float16_pool(package):
    """kv_bits=16 on a float32 model: two bytes a number whatever the model's dtype (the pool stores float16), so a
    memory budget buys twice the float32 blocks; every token mlx-lm's over float16 keys and values."""
    model = w3.wide_mlx_model()
    probe = wide_probe(package)
    requests = small_requests(3, 630)
    result = sized_pool_run(package, probe, requests, 16, 20, bytes_per_token(2, 2, 32, 16),
                            "kv_bits 16: float16, two bytes a number, on a float32 model")
    check_tokens(result, lambda r: greedy_alone(model, Float16Cache, r), "float16 pool")


QUANTIZED_WORKLOADS = [workload_quantized_pressure, workload_quantized_model_failure,
                       workload_quantized_seeded_sampling, workload_quantized_half_precision,
                       workload_quantized_wide_heads, workload_float16_pool]


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
