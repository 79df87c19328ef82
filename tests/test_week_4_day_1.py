"""Week 4 Day 1: speculative decoding, verified as a prefill chunk (book/src/week4-01-speculative-decoding.md).

Oracles: a fake runner whose "model" is a fixed function of the history, so generation one request
at a time, without speculation, is computed directly. The runner and the fake proposers run beside
the engine under test (tests/actor_fakes/speculative.py) and record what they were fed and asked; the
test reads those records as data after every step and checks them itself: it replays the paged pool
(every slot remembers which token of which sequence was written there, and every sampled row's block
table must read back exactly its own context), requires every greedy output token to be one a row
the model computed gives, and asks its own copy of each proposer the recorded questions. Exact probabilities of that
function for the statistical tests (a chi-square test with a stated false-alarm rate); mlx-lm's own
Qwen2, one request at a time, for greedy outputs on the embedded model; hand-built cases for the
acceptance rules and the counters.

Every other day's code (week 3's engine, scheduler, runner, model) comes from the reference: the
selector. Each task's tests take the student's code for that task alone and the reference's for the
day's other tasks (`solution(week=4, day=1, task=N)`): Task 2's engine test runs the student's greedy
acceptance with the reference's planning and roll-back, so a bug in one task never costs another
task's points. Task 6 runs the student's whole day 4.1 on their week 3.
"""

import functools
import math
import random

import mlx.core as mx
import pytest

from tests.chi_square import assert_distribution, chi_square_p_value
from tests.actor_fakes import EOS, VOCAB
from tests.actor_fakes import speculative
from tests.actor_fakes.speculative import MARKOV, MODELS, PERIOD, copying_logits, fake_logits, markov_logits
from tests.harness import actor_fakes, class_of, fetch, reference, solution, stack
from tests.week3_fakes import PLAIN_ENGINE, mlx_lm_greedy
from tests.week4_stack import check_speculative_stack

TASKS = {n: solution(week=4, day=1, task=n) for n in range(1, 6)}  # Task N's tests: the student's Task N alone
STACK = stack(week=4, day=1)  # "your stack so far": started now, beside the collection
ref = reference()
STEP_LIMIT = 2000  # no engine run in this file needs more steps; more means a sequence stopped moving


# ---------------------------------------------------------------- the fake model and runner


def fake_greedy(prompt: list[int], max_tokens: int, logits_of=fake_logits) -> tuple[list[int], str]:
    """One request alone, greedy, no speculation: (output, finish reason)."""
    history, output = list(prompt), []
    while len(output) < max_tokens:
        row = logits_of(history)
        token = row.index(max(row))
        if token == EOS:
            return output, "stop"
        output.append(token)
        history.append(token)
    return output, "length"


def accepted_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The test's own greedy acceptance: the guesses the target agrees with, then its own token."""
    out = []
    for guess, target in zip(draft, targets):
        out.append(target)
        if guess != target:
            return out
    return out + targets[len(draft):][:1]


class PoolReplay:
    """The test's check of what the fake runner was fed (its `trace`, read back as data after every step).

    The pool is simulated slot by slot, each slot holding the (position, token) last written there (a block shared
    through the prefix cache holds the same for every sharer): every sampled row's context must read back from its
    block table exactly. Each greedy row's context and the tokens its rows give (the fake model's, accepted as greedy
    verification accepts them) are kept, and `check_outputs` requires them to be the engine's output tokens, every
    one of them. So a trace the submission's process rewrote passes only if it is a step-by-step record of a paged
    engine that produced those very tokens, consistent slot for slot: dropping a step, a chunk or a read, or naming
    other blocks, fails.
    """

    def __init__(self, block_size: int, logits_of):
        self.block_size, self.logits_of = block_size, logits_of
        self.slots: dict[int, tuple[int, int]] = {}
        self.implied: dict[object, list[tuple[list[int], list[int]]]] = {}  # request id -> (context, tokens it gives)
        self.last: list[dict] = []  # the last step's chunks
        self.verified: list[tuple] = []  # every verify chunk: (request id, tokens before its guesses, its guesses)

    def slot(self, request_id, table, position):
        assert position // self.block_size < len(table), \
            f"{request_id!r} position {position} has no block (table {table})"
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def step(self, chunks: list[dict]):
        """One model call's chunks: the model writes every row's key before any row reads."""
        for chunk in chunks:
            for position, token in enumerate(chunk["tokens"], chunk["start"]):
                self.slots[self.slot(chunk["request_id"], chunk["table"], position)] = (position, token)
        for chunk in chunks:
            if "context" not in chunk:
                continue
            request_id, context = chunk["request_id"], chunk["context"]
            if chunk["verify"]:
                self.verified.append((request_id, context[: chunk["start"] + 1], context[chunk["start"] + 1 :]))
            for position, token in enumerate(context):
                held = self.slots.get(self.slot(request_id, chunk["table"], position))
                assert held == (position, token), \
                    f"{request_id!r} position {position}: its block holds {held}, not token {token}"
            if chunk["greedy"]:
                first = len(context) - (chunk["length"] if chunk["verify"] else 1)
                rows = [self.logits_of(context[: end + 1]) for end in range(first, len(context))]
                targets = [row.index(max(row)) for row in rows]
                self.implied.setdefault(request_id, []).append(
                    (context[: first + 1], accepted_greedy(context[first + 1 :], targets)))
        self.last = chunks

    def check_outputs(self, seqs_fields):
        """Each greedy sequence's (request id, tokens, prompt): every output token is one its rows gave."""
        for request_id, tokens, prompt in seqs_fields:
            covered = set()
            for context, implied in self.implied.get(request_id, []):
                assert tokens[: len(context)] == context, \
                    f"{request_id!r}: the runner was fed {context}, not a prefix of its tokens {tokens}"
                for position, token in enumerate(implied, len(context)):
                    if position >= len(tokens):
                        break  # max_tokens or EOS ended it there
                    assert tokens[position] == token, \
                        f"{request_id!r}: token {position} is {tokens[position]}; the model's rows gave {token}"
                    covered.add(position)
            missing = [p for p in range(len(prompt), len(tokens)) if p not in covered]
            assert not missing, f"{request_id!r}: output positions {missing} came from no row the model computed"


class FakeEngine:
    """`sol`'s SpeculativeEngine over the fake runner (both in the process that runs the code under test), with the
    test's `PoolReplay` of what the runner was fed. Reads and calls go to the engine; `step` also replays the step
    and keeps the engine's `state` after it (read in the same round trip while grading)."""

    def __init__(self, sol, engine, runner, replay: PoolReplay, proposer=None, replica=None):
        self.fakes, self.engine, self.runner, self.replay = speculative_fakes(sol), engine, runner, replay
        self.proposer, self.replica = proposer, replica  # a fake proposer, and how to build the test's own copy
        self.seqs = []
        self.state = None  # the engine's state after the last step (None once a request was added since)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, params, request_id):
        seq = self.engine.add_request(prompt, params, request_id=request_id)
        self.seqs.append(seq)
        self.state = None
        return seq

    def add_requests(self, requests: list[tuple]) -> list:
        """`add_request` of each (prompt, params, request id), in one round trip while grading: the sequences."""
        seqs = self.fakes.add_requests(self.engine, requests)
        self.seqs += seqs
        self.state = None
        return seqs

    def has_work(self) -> bool:
        return self.engine.has_work() if self.state is None else self.state["has_work"]

    def step(self):
        outputs, steps, self.state = self.fakes.step(self.engine, self.runner)
        for chunks in steps:
            self.replay.step(chunks)
        return outputs

    def catch_up(self):
        """Replay the steps the runner recorded since the last call (one round trip)."""
        for chunks in self.runner.take():
            self.replay.step(chunks)

    def proposals(self) -> list[tuple]:
        """The fake proposer's record, (request id, tokens so far, k, guesses) per call, checked.

        It comes from the process that runs the code under test, so the test's own copy answers every recorded
        call again and must give the recorded guesses, and every verify chunk the model was fed (the replayed trace)
        must hold the guesses of a recorded call made on those very tokens (cut to what the step had room for): a
        record rewritten to show other calls fails one or the other.
        """
        self.catch_up()
        calls, made, replica = self.proposer.calls, {}, self.replica()  # a fresh copy: the calls from the first
        for request_id, tokens, k, draft in calls:
            assert draft == replica.guess(request_id, tokens, k), \
                f"{request_id!r}: the proposer's record does not replay (guesses {draft} after {tokens})"
            made.setdefault((request_id, tuple(tokens)), []).append(draft)
        for request_id, tokens, draft in self.replay.verified:
            assert any(guesses[: len(draft)] == draft for guesses in made.get((request_id, tuple(tokens)), [])), \
                f"{request_id!r}: the model verified guesses {draft} after {tokens}, which no recorded call proposed"
        return calls

    def check_outputs(self):
        if self.replica is not None:
            self.proposals()
        self.catch_up()
        fields = fetch(self.seqs, "request_id", "token_ids", "prompt_token_ids", "sampling.greedy")
        self.replay.check_outputs([(request_id, tokens, prompt) for request_id, tokens, prompt, greedy in fields
                                   if greedy])


def speculative_fakes(sol):
    """tests/actor_fakes/speculative.py where `sol`'s code runs: the runner and proposers the engine calls."""
    return actor_fakes(sol, "speculative")


def for_task(number: int):
    """(the code under test for Task `number`, its SamplingParams): params are made where the engine reads them
    (while grading, in the submission's process that runs the task)."""
    sol = TASKS[number]
    return sol, sol.sequence.SamplingParams


def is_verify_class(cls, sol) -> bool:
    """Whether chunks of class `cls` (`class_of(chunk)`) are VerifyChunks: while grading a class of the submission's
    process is a handle, known by identity."""
    return cls is sol.speculative.VerifyChunk or cls is sol.scheduler.VerifyChunk


def fake_engine(sol, model="fake", proposer=None, num_speculative_tokens=4, min_acceptance_rate=0.3,
                probe_interval=8, **config) -> FakeEngine:
    """`sol`'s SpeculativeEngine over the fake runner of the fake model named `model` (tests/actor_fakes/
    speculative.py's MODELS); `config` holds EngineConfig's fields. Engine, runner and proposer live where the code
    under test runs; the test keeps the replay.

    `proposer`: a proposer of the package under test, or (class name, keyword arguments) of one of tests/actor_fakes/
    speculative.py's, built there and here (the copy that checks its record: `FakeEngine.proposals`).
    """
    replica = None
    if type(proposer) is tuple:
        name, arguments = proposer
        proposer = getattr(speculative_fakes(sol), name)(**arguments)
        replica = functools.partial(getattr(speculative, name), **arguments)
    speculation = sol.speculative.SpeculativeConfig(num_speculative_tokens, min_acceptance_rate, probe_interval)
    fakes = actor_fakes(sol)  # read at every step: built where the engine runs
    config = {**PLAIN_ENGINE, **config}
    engine = sol.speculative.SpeculativeEngine(fakes.FakeWeek3Model(), fakes.FakeTokenizer(),
                                               sol.engine.EngineConfig(**config), speculation=speculation,
                                               proposer=proposer)
    runner = speculative_fakes(sol).FakeSpeculativeRunner(model, (sol.speculative.VerifyChunk,
                                                                  sol.scheduler.VerifyChunk))
    engine.runner = runner
    return FakeEngine(sol, engine, runner, PoolReplay(engine.block_manager.block_size, MODELS[model]), proposer, replica)


def run_to_end(engine, arrivals=(), check=None) -> dict:
    """Step until done (requests in `arrivals` join one per step); `check(engine)` after every step; then every
    greedy output token must be one the model's rows gave (`PoolReplay.check_outputs`).

    Returns the arrivals' sequences by request id.
    """
    pending, seqs = list(arrivals), {}
    for _ in range(STEP_LIMIT):
        if pending:
            prompt, params, request_id = pending.pop(0)
            seqs[request_id] = engine.add_request(prompt, params, request_id=request_id)
        if not pending and not engine.has_work():
            if type(engine) is FakeEngine:
                engine.check_outputs()
            return seqs
        engine.step()
        if check:
            check(engine)
    raise AssertionError(f"not done after {STEP_LIMIT} steps: {engine.num_running} running, {engine.num_waiting} "
                         "waiting; every step must move a running sequence forward (a prefill chunk, at least one "
                         "token, or a preemption), so the engine stopped making progress")


def random_prompts(n, seed, longest=30):
    rng = random.Random(seed)
    return [[rng.randrange(0, EOS) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def running_fields(engine):
    """(block size, free blocks, blocks, running sequences' (request id, block table, tokens, computed tokens))."""
    if type(engine) is FakeEngine and engine.state is not None:
        state = engine.state  # read with the step
        return state["block_size"], state["num_free"], state["num_blocks"], state["running"]
    engine = engine.engine if type(engine) is FakeEngine else engine
    [(block_size, num_free, num_blocks, running)] = fetch([engine], "block_manager.block_size",
                                                          "block_manager.num_free_blocks", "block_manager.num_blocks",
                                                          "scheduler.running")
    return block_size, num_free, num_blocks, fetch(running, "request_id", "block_table", "num_tokens",
                                                   "num_computed_tokens")


def blocks_are_sound(engine, shared: bool = False, fields=None):
    """No block in two tables (unless `shared`: the prefix cache) or both held and free; none past a sequence's
    tokens."""
    block_size, num_free, num_blocks, running = fields or running_fields(engine)
    held = [b for _, table, _, _ in running for b in table]
    if not shared:
        assert len(held) == len(set(held)), "a block is in two block tables"
    assert len(set(held)) + num_free == num_blocks, \
        f"{num_blocks - num_free - len(set(held))} blocks are neither held nor free: leaked"
    for request_id, table, num_tokens, _ in running:
        most = ref.block_manager.blocks_for(num_tokens, block_size)
        assert len(table) <= most, \
            f"{request_id!r} holds {len(table)} blocks for {num_tokens} tokens: rejected positions kept"


def verifications_are_exact(engine: FakeEngine, fields=None):
    """After a step: each greedy verify chunk gave its sequence exactly its right guesses plus one token.

    Right guesses are counted from the fake model itself, on the chunk as the replay saw it (so as the model was
    fed it); the cache then holds all but the newest token. A sequence no longer running finished.
    """
    _, _, _, running = fields or running_fields(engine)
    now = {request_id: (num_tokens, computed) for request_id, _, num_tokens, computed in running}
    for chunk in engine.replay.last:
        if not (chunk["verify"] and chunk["greedy"]) or chunk["request_id"] not in now:
            continue
        request_id, start, context = chunk["request_id"], chunk["start"], chunk["context"]
        draft, history, right = context[start + 1 :], context[: start + 1], 0
        for guess in draft:
            row = engine.replay.logits_of(history)
            if guess != row.index(max(row)):
                break
            right += 1
            history.append(guess)
        num_tokens, num_computed = now[request_id]
        if num_computed == 0:
            continue  # preempted since: nothing to check
        assert num_tokens == start + 2 + right, (
            f"{request_id!r}: {right} of {len(draft)} guesses right, so {right + 1} new tokens; "
            f"got {num_tokens - start - 1}")
        assert num_computed == num_tokens - 1, \
            f"{request_id!r}: {num_computed} positions computed for {num_tokens} tokens"


def engine_is_sound(engine: FakeEngine, shared: bool = False):
    """Every check after a step: blocks, and what each verify chunk gave (one read of the engine for both)."""
    fields = running_fields(engine)
    blocks_are_sound(engine, shared, fields)
    verifications_are_exact(engine, fields)


# ---------------------------------------------------------------- Task 1: n-gram prompt lookup


def seq_of(sol, tokens, params=None, request_id="s"):
    """A sequence of `sol`'s package: while grading it lives in the sandbox with the proposer that reads it."""
    return sol.sequence.Sequence(request_id, tokens, params)


def test_task_1_ngram_proposes_what_followed():
    sol = TASKS[1]
    proposer = sol.speculative.NgramProposer(max_ngram=3, min_ngram=1)
    # "5 6 7" occurred before, followed by 8 9 1: the longest suffix match wins.
    assert proposer.propose(seq_of(sol, [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]), 3) == [8, 9, 1]
    assert proposer.propose(seq_of(sol, [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]), 10) == [8, 9, 1, 2, 5, 6, 7]
    # The latest earlier occurrence: "1 2" is followed by 3 early on and by 4 later.
    assert proposer.propose(seq_of(sol, [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]), 2) == [4, 0]
    # Longer suffixes first: "0 1 2" matches only at the start (-> 3), "1 2" later (-> 4).
    assert proposer.propose(seq_of(sol, [0, 1, 2, 3, 9, 1, 2, 4, 0, 1, 2]), 1) == [3]
    assert proposer.propose(seq_of(sol, [4, 5, 6]), 3) == [], "no earlier occurrence: no guess"
    assert proposer.propose(seq_of(sol, [7]), 3) == []
    # The output counts as context too.
    seq = seq_of(sol, [3, 1, 4])
    seq.output_token_ids = [1, 5, 3, 1]
    assert proposer.propose(seq, 2) == [4, 1]


def test_task_1_ngram_respects_min_ngram_and_k():
    sol = TASKS[1]
    strict = sol.speculative.NgramProposer(max_ngram=3, min_ngram=2)
    assert strict.propose(seq_of(sol, [1, 9, 8, 1]), 2) == [], "a single-token match is below min_ngram"
    assert strict.propose(seq_of(sol, [1, 9, 8, 7, 1, 9]), 2) == [8, 7]
    assert strict.propose(seq_of(sol, [1, 9, 8, 7, 1, 9]), 1) == [8]
    loose = sol.speculative.NgramProposer(max_ngram=1, min_ngram=1)
    assert loose.propose(seq_of(sol, [1, 9, 8, 1]), 2) == [9, 8]
    # A match right before the suffix proposes only what exists: repeated tokens.
    assert loose.propose(seq_of(sol, [2, 2]), 4) == [2]
    with pytest.raises(ValueError):
        sol.speculative.NgramProposer(max_ngram=1, min_ngram=2)


STEPS_BOUND = {2: 27, 4: 23}  # steps for 40 tokens with prompt lookup at k (the reference: 23, 18; plain: 40)


@pytest.mark.parametrize("k", [2, 4])
def test_task_1_prompt_lookup_speeds_up_copying(k):
    """On output that copies its prompt, the engine with prompt lookup gains about k + 1 tokens a step, same text."""
    sol, Params = for_task(1)
    rng = random.Random(k)
    engine = fake_engine(sol, "copying", proposer=sol.speculative.NgramProposer(), num_speculative_tokens=k,
                         token_budget=64, max_num_seqs=2, block_size=4)
    prompts = [rng.sample(range(EOS), PERIOD) for _ in range(2)]  # distinct tokens: a suffix occurs once
    max_tokens = 40
    seqs = [engine.add_request(p, Params(max_tokens=max_tokens), request_id=i) for i, p in enumerate(prompts)]
    run_to_end(engine, check=engine_is_sound)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == fake_greedy(prompt, max_tokens, copying_logits)[0]
    stats = engine.speculation
    assert stats.acceptance_rate >= 0.5, f"prompt lookup on copied text: {100 * stats.acceptance_rate:.0f}% accepted"
    # A plain engine needs 1 prefill step + 39 decode steps.
    assert engine.num_steps <= STEPS_BOUND[k], f"{engine.num_steps} steps for {max_tokens} tokens"


# ---------------------------------------------------------------- Task 2: greedy acceptance


@pytest.mark.parametrize("draft,target,expected", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # every guess right: all of them and the bonus token
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # the first wrong guess is replaced by the target's token
    ([4, 5, 6], [1, 5, 6, 7], [1]),  # wrong at once: the target's own token, as a plain decode
    ([4, 5, 6], [4, 5, 2, 7], [4, 5, 2]),
    ([8], [8, 3], [8, 3]),
    ([], [3], [3]),  # nothing guessed: exactly a decode step
])
def test_task_2_accept_greedy(draft, target, expected):
    sol = TASKS[2]
    assert sol.speculative.accept_greedy(list(draft), list(target)) == expected


@pytest.mark.parametrize("k", [1, 3, 6])
def test_task_2_engine_gains_exactly_the_agreeing_guesses(k):
    """In the engine, each verify chunk gains its agreeing guesses plus one token; outputs as without speculation."""
    sol, Params = for_task(2)
    engine = fake_engine(sol, proposer=("OracleProposer", dict(seed=k)), num_speculative_tokens=k, token_budget=32,
                         max_num_seqs=4, block_size=4, min_acceptance_rate=0.0)
    prompts = random_prompts(6, seed=40 + k)
    arrivals = [(p, Params(max_tokens=16), i) for i, p in enumerate(prompts)]
    seqs = run_to_end(engine, arrivals, engine_is_sound)
    for prompt, params, i in arrivals:
        assert (seqs[i].output_token_ids, seqs[i].finish_reason) == fake_greedy(prompt, 16), f"request {i}"
    assert engine.speculation.accepted > 0


# ---------------------------------------------------------------- Task 3: rejection sampling


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_task_3_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    """Vocabulary of 4, two guesses, 3,000 draws; each chi-square test at false-alarm rate FALSE_ALARM.

    Row i of p is the target's distribution at the i-th new token (here the same whatever came before).
    Whatever the guesses, token i of the output, whenever the output reaches it, must follow p[i].
    With `draft_probs` the guesses are drawn from the draft's rows q; without, they are fixed (q one-hot).
    """
    sol = TASKS[3]
    # The test's own chi-square against known quantiles (dof 2 has a closed form; dof 10's 0.999 quantile is 29.588).
    assert chi_square_p_value(2 * math.log(1000), 2) == pytest.approx(1e-3, rel=1e-9)
    assert chi_square_p_value(29.588, 10) == pytest.approx(1e-3, rel=1e-3)
    p = [[0.1, 0.4, 0.2, 0.3], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]]
    q = [[0.05, 0.6, 0.05, 0.3], [0.1, 0.1, 0.7, 0.1]] if with_draft_probs else None
    rng = random.Random(5)
    mx.random.seed(11)
    target, draft_rows = mx.array(p), None if q is None else mx.array(q)
    counts = [{}, {}, {}]  # position -> token -> count
    accept_sampled = sol.speculative.accept_sampled  # read once (while grading, a round trip)
    for _ in range(3000):
        draft = [1, 2] if q is None else [rng.choices(range(4), weights=row)[0] for row in q]
        out = accept_sampled(draft, target, draft_rows)
        assert 1 <= len(out) <= 3 and out[:-1] == draft[: len(out) - 1], \
            f"{out} for guesses {draft}: every token but the last must be an accepted guess"
        for position, token in enumerate(out):
            counts[position][token] = counts[position].get(token, 0) + 1
    for position in range(3):
        assert sum(counts[position].values()) >= 200, f"too few outputs reach token {position} to test it"
        assert_distribution(counts[position], dict(enumerate(p[position])), f"output token {position}")


def test_task_3_rejection_sampling_edge_cases():
    sol = TASKS[3]
    mx.random.seed(3)
    certain = mx.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for _ in range(20):
        assert sol.speculative.accept_sampled([1], certain) == [1, 2], "p(guess) = 1: always accepted, then the bonus"
    never = mx.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for _ in range(20):
        assert sol.speculative.accept_sampled([1], never) == [2], "p(guess) = 0: rejected, the residual is p itself"
    equal = mx.array([[0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
    for _ in range(20):
        out = sol.speculative.accept_sampled([2], equal, mx.array([[0.2, 0.5, 0.3]]))
        assert len(out) == 2 and out[0] == 2, "q = p: every guess is accepted"
    assert len(sol.speculative.accept_sampled([], mx.array([[0.5, 0.5, 0.0]]))) == 1


def markov_probs(last, temperature):
    logits = [x / temperature for x in MARKOV.get(last, [0.0, 0.0, 0.0])]
    total = sum(math.exp(x) for x in logits)
    return {token: math.exp(x) / total for token, x in zip((1, 2, 3), logits)}


def test_task_3_engine_sampled_output_follows_the_target_distribution():
    """Temperature 0.8, always 2 guesses ("1, 1"): the 2nd-4th tokens' joint law must be the target's.

    The first token comes from the prefill (no guess); each later step verifies 2 guesses. 4,000
    requests, 27 outcomes of (t2, t3, t4); false-alarm rate FALSE_ALARM.
    """
    sol, Params = for_task(3)
    temperature = 0.8
    mx.random.seed(1234)
    engine = fake_engine(sol, "markov", proposer=actor_fakes(sol).FixedGuess(1), num_speculative_tokens=2,
                         token_budget=512, max_num_seqs=128, block_size=4, num_blocks=2048, min_acceptance_rate=0.0)
    n = 4000
    params = Params(temperature=temperature, max_tokens=4)
    seqs = engine.add_requests([([2], params, i) for i in range(n)])
    run_to_end(engine, check=blocks_are_sound)
    counts, probs = {}, {}
    for (output,) in fetch(seqs, "output_token_ids"):
        assert len(output) == 4
        first, *rest = output
        key = (first, *rest)
        counts[key] = counts.get(key, 0) + 1
    for t1, p1 in markov_probs(2, temperature).items():
        for t2, p2 in markov_probs(t1, temperature).items():
            for t3, p3 in markov_probs(t2, temperature).items():
                for t4, p4 in markov_probs(t3, temperature).items():
                    probs[(t1, t2, t3, t4)] = p1 * p2 * p3 * p4
    assert_distribution(counts, probs, "the engine's sampled outputs")
    assert engine.speculation.verifications >= n and 0 < engine.speculation.accepted < engine.speculation.proposed


# ---------------------------------------------------------------- Task 4: planning proposals into the step


@pytest.mark.parametrize("budget", [3, 6, 16, 64])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_task_4_greedy_output_identical_for_every_budget_mix_and_k(budget, k):
    """Speculation changes how many tokens a step yields, never which: same outputs as one request alone."""
    sol, Params = for_task(4)
    engine = fake_engine(sol, proposer=("OracleProposer", dict(seed=budget * 10 + k)), num_speculative_tokens=k,
                         token_budget=budget, max_num_seqs=3, block_size=2)
    rng = random.Random(budget + k)
    prompts = random_prompts(7, seed=budget + 100 * k)
    arrivals = [(p, Params(max_tokens=rng.randint(1, 14)), i) for i, p in enumerate(prompts)]

    def check(engine):
        num_tokens = sum(chunk["length"] for chunk in engine.replay.last)  # as the runner was fed it
        assert num_tokens <= budget, f"a step of {num_tokens} tokens: the budget is {budget}"
        engine_is_sound(engine)

    seqs = run_to_end(engine, arrivals, check)
    for prompt, params, i in arrivals:
        seq = seqs[i]
        assert (seq.output_token_ids, seq.finish_reason) == fake_greedy(prompt, params.max_tokens), f"request {i}"
    assert engine.speculation.verifications > 0, "nothing was speculated"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_task_4_proposals_fill_only_the_leftover_budget():
    sol, Params = for_task(4)
    engine = fake_engine(sol, proposer=("OracleProposer", dict(seed=1)), num_speculative_tokens=4, token_budget=8,
                         max_num_seqs=4)
    engine.add_request([1, 2, 3], Params(max_tokens=30), request_id="a")
    engine.add_request([4, 5], Params(max_tokens=30), request_id="b")
    engine.step()  # both prompts prefill (5 tokens): nobody decodes yet, nothing to guess
    assert engine.proposals() == []
    engine.add_request(list(range(1, 30)), Params(max_tokens=3), request_id="long")
    plan = engine.scheduler.schedule()
    engine.propose(plan)
    # Two decodes and a 6-token prefill chunk fill the budget of 8: no room for a single guess.
    assert plan.num_tokens == 8 and engine.proposals() == []
    assert all(not is_verify_class(class_of(c), sol) for c in plan.chunks)
    engine.record(plan, engine.update(plan, engine.runner.run(plan)))
    run_to_end(engine)


def test_task_4_proposals_within_room_blocks_and_max_tokens():
    sol, Params = for_task(4)
    engine = fake_engine(sol, proposer=("Listed", dict(guesses=[1, 2, 3, 4, 5, 6])), num_speculative_tokens=6,
                         token_budget=16, max_num_seqs=4,
                         block_size=4, num_blocks=4)
    engine.add_request([7] * 6, Params(max_tokens=4), request_id="a")  # 6 prompt tokens: 2 blocks
    engine.add_request([8] * 7, Params(max_tokens=9), request_id="b")  # 7 prompt tokens: 2 blocks, the pool is full
    engine.step()
    plan = engine.scheduler.schedule()
    engine.propose(plan)
    chunks = {c.seq.request_id: c for c in plan.chunks}
    # a: 7 tokens, may emit 3 more: at most 2 guesses (the last token is always the target's own), and
    # its 2 blocks have room for 1 position more with none free: 1 guess.
    [(_, _, asked, _), *_] = engine.proposals()
    assert asked == 2
    assert is_verify_class(class_of(chunks["a"]), sol) and chunks["a"].draft == [1]
    assert (chunks["a"].start, chunks["a"].length) == (6, 2)
    # b: 8 tokens in 2 full blocks, no free block left: speculation never preempts, so no guess.
    assert not is_verify_class(class_of(chunks["b"]), sol) and chunks["b"].length == 1
    assert plan.decodes == [chunks["b"]] and plan.prefills == [chunks["a"]], "a verify chunk runs as a prefill chunk"
    assert plan.num_tokens == 3 and engine.block_manager.num_free_blocks == 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        sol.speculative.SpeculativeConfig(num_speculative_tokens=0)


def test_task_4_backs_off_when_guesses_fail():
    sol, Params = for_task(4)
    prompt = [3] * 5
    expected, _ = fake_greedy(prompt, 60)
    max_tokens = len(expected)  # no EOS within the run
    engine = fake_engine(sol, proposer=("NeverRight", {}), num_speculative_tokens=3, min_acceptance_rate=0.5,
                         probe_interval=5)
    engine.add_request(prompt, Params(max_tokens=max_tokens), request_id="r")
    run_to_end(engine)
    decode_steps = max_tokens - 1
    # Two failed guesses turn it down (the rate starts at 1); then probes after 2 and 4 steps, then every 5.
    calls = len(engine.proposals())
    assert calls <= 2 + 2 + decode_steps // 5 + 1, f"{calls} proposals in {decode_steps} decode steps"
    assert calls >= decode_steps // 5, "a turned-down sequence must still probe now and then"
    assert engine.speculation.accepted == 0


def test_task_4_guesses_follow_what_gets_accepted():
    """A sequence whose first guess is always right and the rest wrong: after its first verification it asks for
    2 guesses (one more than it gets accepted), not k; all right again, it grows back by one a step."""
    sol, Params = for_task(4)
    prompt = next([start, 8, 7] for start in range(EOS) if fake_greedy([start, 8, 7], 40)[1] == "length")
    expected, _ = fake_greedy(prompt, 40)
    engine = fake_engine(sol, proposer=("FirstRight", dict(right_after=6)), num_speculative_tokens=4,
                         min_acceptance_rate=0.2, token_budget=64)
    engine.add_request(prompt, Params(max_tokens=len(expected)), request_id="r")
    run_to_end(engine)
    asked = [k for _, _, k, _ in engine.proposals()]
    assert asked[0] == 4, "a new sequence guesses as many as it may"
    assert asked[1:6] == [2] * 5, f"one guess accepted a time: it should ask for 2, asked {asked[:6]}"
    assert asked[6:9] == [2, 3, 4], f"every guess right from the 7th proposal: 2, 3, 4 guesses; asked {asked[6:9]}"


# ---------------------------------------------------------------- Task 5: accept, count, roll back


def test_task_5_counters_exact_on_a_constructed_case():
    sol, Params = for_task(5)
    prompt = [2, 4, 6, 8]
    truth, _ = fake_greedy(prompt, 30)
    assert EOS not in truth[:12]

    scripted = ("Scripted", dict(prompt_length=len(prompt), truth=truth))  # 2 right of 3, 0 of 2, 3 of 3
    engine = fake_engine(sol, proposer=scripted, num_speculative_tokens=3, block_size=2,
                         min_acceptance_rate=0.0)
    seq = engine.add_request(prompt, Params(max_tokens=12), request_id="r")
    engine.step()  # prefill: 1 token
    assert len(seq.output_token_ids) == 1
    gained = []
    for _ in range(3):
        before = len(seq.output_token_ids)
        outputs = engine.step()
        gained.append(len(seq.output_token_ids) - before)
        assert [o.token for o in outputs] == seq.output_token_ids[before:]
        assert seq.num_computed_tokens == seq.num_tokens - 1, "the cache holds all but the newest token"
        engine_is_sound(engine)
    assert gained == [3, 1, 4]  # accepted guesses plus the target's own token
    stats = engine.speculation
    assert (stats.proposed, stats.accepted, stats.verifications) == (8, 5, 3)
    summary = engine.summary()
    assert summary["speculative_proposed"] == 8 and summary["speculative_accepted"] == 5
    assert summary["speculative_acceptance_rate"] == pytest.approx(5 / 8)
    assert summary["speculative_mean_accepted_length"] == pytest.approx(5 / 3)
    run_to_end(engine)
    assert seq.output_token_ids == truth[:12]


@pytest.mark.parametrize("block_size", [1, 2, 3, 8])
def test_task_5_rejected_positions_never_leak_blocks(block_size):
    """Tight pool, many rejections across block boundaries, preemptions: blocks always add up."""
    sol, Params = for_task(5)
    engine = fake_engine(sol, proposer=("OracleProposer", dict(seed=block_size)), num_speculative_tokens=4,
                         token_budget=24, max_num_seqs=4, block_size=block_size,
                         num_blocks=ref.block_manager.blocks_for(60, block_size), min_acceptance_rate=0.0)
    prompts = random_prompts(8, seed=block_size, longest=12)
    arrivals = [(p, Params(max_tokens=20), i) for i, p in enumerate(prompts)]
    seqs = run_to_end(engine, arrivals, engine_is_sound)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for prompt, params, i in arrivals:
        assert (seqs[i].output_token_ids, seqs[i].finish_reason) == fake_greedy(prompt, 20)
    assert engine.speculation.proposed > engine.speculation.accepted > 0


def test_task_5_prefix_caching_and_eos_inside_accepted_tokens():
    """EOS among the accepted tokens ends the sequence there; the prefix cache only names real tokens."""
    sol, Params = for_task(5)
    for start in range(200):  # a prompt whose greedy run meets EOS after a few tokens
        prompt = [start % EOS, (start * 7) % EOS, 5]
        output, reason = fake_greedy(prompt, 12)
        if reason == "stop" and len(output) >= 3:
            break
    engine = fake_engine(sol, proposer=("OracleProposer", dict(seed=4)), num_speculative_tokens=5, block_size=2,
                         enable_prefix_caching=True, min_acceptance_rate=0.0)
    arrivals = [(prompt, Params(max_tokens=12), 0), (prompt, Params(max_tokens=12), 1),
                (prompt + output, Params(max_tokens=4), 2)]
    seqs = run_to_end(engine, arrivals, lambda e: engine_is_sound(e, shared=True))
    assert (seqs[0].output_token_ids, seqs[0].finish_reason) == (output, "stop")
    assert (seqs[1].output_token_ids, seqs[1].finish_reason) == (output, "stop")
    assert (seqs[2].output_token_ids, seqs[2].finish_reason) == fake_greedy(prompt + output, 4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------- the whole stack on a real model


@pytest.fixture(scope="module")
def real(model32):
    """(mlx-lm model, tokenizer) on the embedded weights, float32."""
    return model32


@pytest.mark.parametrize("budget,k", [(5, 2), (16, 4), (256, 3)])
def test_task_5_whole_day_on_the_embedded_model_equals_mlx_lm(real, budget, k):
    """The student's day 4.1 on week 3's engine and the embedded Qwen2, with a draft model (the same
    checkpoint through mlx-lm, so most guesses are right) and prompt lookup: mlx-lm's greedy output."""
    sol, Params = for_task(5)
    mlx_model, tokenizer = real
    model = sol.qwen2_week3.Qwen2ModelWeek3(mlx_model)  # week 3's model, built where the engine runs
    rng = random.Random(budget)
    base = [rng.randrange(100, 5000) for _ in range(6)]
    prompts = [base * 3, [rng.randrange(100, 5000) for _ in range(11)], base[:4]]
    expected = [mlx_lm_greedy(mlx_model, p, 10, tokenizer.eos_token_ids) for p in prompts]
    for name, proposer in (("draft", sol.speculative.DraftModelProposer(mlx_model)),
                           ("n-gram", sol.speculative.NgramProposer(3, 1))):
        config = sol.engine.EngineConfig(**PLAIN_ENGINE, token_budget=budget, max_num_seqs=3, block_size=4)
        engine = sol.speculative.SpeculativeEngine(model, tokenizer, config, proposer=proposer,
                                                   speculation=sol.speculative.SpeculativeConfig(k))
        seqs = [engine.add_request(p, Params(max_tokens=10), request_id=i) for i, p in enumerate(prompts)]
        run_to_end(engine, check=blocks_are_sound)
        assert [s.output_token_ids for s in seqs] == expected, name
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if name == "draft":
            assert engine.speculation.accepted > 0, "the target as its own draft: its guesses are right"


# ---------------------------------------------------------------- Task 6: your stack so far


def test_task_6_your_stack_so_far():
    """Your week-3 engine with your day 4.1 on server workloads (tests/week4_stack.py): preemptions, EOS, aborts, a
    failing model, exact acceptance, requests that cannot speculate, and the sampled distribution."""
    check_speculative_stack(STACK)
