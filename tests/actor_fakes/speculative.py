"""Days 4.1 and 4.2's fakes, built where the engine under test runs (`actor_fakes(sol, "speculative")`): the fake
models, the fake runner and the proposers of tests/test_week_4_day_1.py and tests/week4_stack.py, and day 4.2's
tokenizer.

Each one decides nothing the test trusts on its word: the runner computes rows of a fixed function of the history and
records what each step fed it (`trace`), the proposers guess from data the test gave them and record what they were
asked (`calls`). The tests read those records back as data and check them in their own process against their own
copy of these functions and classes: the runner's record by replaying the pool slot by slot and requiring that the
rows it implies give the engine's output tokens, a proposer's by asking a copy of it the same questions (see the
tests). Plain Python, MLX and mlx-lm only (the worker imports this package alone).
"""

import random

import mlx.core as mx

from tests.actor_fakes import EOS, STACK_VOCAB, VOCAB


# ---------------------------------------------------------------- fake models: logits as a function of the history


def fake_logits(history: list[int]) -> list[float]:
    """The fake model's logits after `history`: a fixed pseudo-random function of the whole history."""
    h = 17
    for token in history:
        h = (h * 1_000_003 + token + 7) % 2_147_483_647
    rng = random.Random(h)
    return [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]


PERIOD = 12  # the copying model repeats the last 12 tokens


def copying_logits(history: list[int]) -> list[float]:
    """A model that copies: its greedy token is the one PERIOD tokens back (the prompt, over and over),
    except at every 9th position, where it says the next token instead (so some guesses are rejected)."""
    row = [0.1 * x for x in fake_logits(history)]
    copied = history[len(history) - PERIOD]
    row[copied if len(history) % 9 else (copied + 1) % EOS] += 10.0
    return row


# A Markov chain over tokens 1..3 (everything else, EOS included, impossible): rows of logits by last token.
MARKOV = {1: [0.0, 1.0, -0.5], 2: [0.8, -0.3, 0.2], 3: [-1.0, 0.5, 1.2]}


def markov_logits(history: list[int]) -> list[float]:
    row = [-1e4] * VOCAB
    row[1:4] = MARKOV.get(history[-1], [0.0, 0.0, 0.0])
    return row


MODELS = {"fake": fake_logits, "copying": copying_logits, "markov": markov_logits}  # a runner names its model


def greedy_token(history: list[int], model: str = "fake") -> int:
    row = MODELS[model](history)
    return row.index(max(row))


# ---------------------------------------------------------------- the runner


class FakeSpeculativeRunner:
    """`run` and `sample`, what SpeculativeEngine calls of its runner, without a model or a pool.

    `run` returns, for every sampled row of the plan (one per sampling chunk, 1 + k per verify chunk), the named fake
    model's logits after that row's context, and appends to `trace` what the step fed: per chunk, its request id,
    block table, start, length, tokens, whether it is a verify chunk, whether it samples, whether its request is
    greedy, and for a sampled chunk its whole context (the sequence's tokens before the chunk, then the chunk's).
    The test replays that trace through its own pool (tests/test_week_4_day_1.py).
    """

    def __init__(self, model: str, verify_classes: tuple):
        self.logits_of = MODELS[model]
        self.verify_classes = verify_classes  # VerifyChunk as the package under test knows it
        self.logprobs = {}  # what the engine reads after sampling: none asked here
        self.trace: list[list[dict]] = []  # one entry per `run`; `take()` hands the new ones over

    def run(self, plan):
        record, rows = [], []
        for chunk in plan.chunks:
            seq, verify = chunk.seq, isinstance(chunk, self.verify_classes)
            entry = dict(request_id=seq.request_id, table=list(seq.block_table), start=chunk.start,
                         length=chunk.length, tokens=list(chunk.token_ids), verify=verify, samples=bool(chunk.samples),
                         greedy=bool(seq.sampling.greedy))
            if verify or entry["samples"]:
                context = entry["context"] = list(seq.token_ids[: chunk.start]) + entry["tokens"]
                first = len(context) - (chunk.length if verify else 1)
                rows += [self.logits_of(context[: end + 1]) for end in range(first, len(context))]
            record.append(entry)
        self.trace.append(record)
        return mx.array(rows) if rows else mx.zeros((0, VOCAB))

    def sample(self, logits, seqs):
        tokens = []
        for row, seq in enumerate(seqs):
            if seq.sampling.greedy:
                tokens.append(mx.argmax(logits[row]).item())
            else:
                tokens.append(mx.random.categorical(logits[row] / seq.sampling.temperature).item())
        return tokens

    def take(self) -> list[list[dict]]:
        """The steps recorded since the last `take` (the test reads them as data)."""
        new, self.trace = self.trace, []
        return new


def add_requests(engine, requests: list[tuple]) -> list:
    """`engine.add_request(prompt, params, request_id=request_id)` for each (prompt, params, request id), in one call:
    the sequences."""
    return [engine.add_request(prompt, params, request_id=request_id) for prompt, params, request_id in requests]


def state(engine) -> dict:
    """What the tests check of an engine after a step, read in one call: block size, free blocks, blocks, whether work
    is left, each running sequence's (request id, block table, tokens, computed tokens)."""
    manager = engine.block_manager
    running = [(seq.request_id, list(seq.block_table), seq.num_tokens, seq.num_computed_tokens)
               for seq in engine.scheduler.running]
    return dict(block_size=manager.block_size, num_free=manager.num_free_blocks, num_blocks=manager.num_blocks,
                has_work=engine.has_work(), running=running)


def step(engine, runner):
    """One step of `engine` (whose runner is `runner`) in one call: (the step's outputs, the runner's new records,
    the engine's `state` after it)."""
    outputs = engine.step()
    return outputs, runner.take(), state(engine)


# ---------------------------------------------------------------- proposers of the day's tests


class Recorder:
    """A proposer that records each call as (request id, the sequence's tokens, k, the guesses it returned)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def propose(self, seq, k):
        tokens = list(seq.token_ids)
        draft = self.guess(seq.request_id, tokens, k)
        self.calls.append((seq.request_id, tokens, k, draft))
        return draft

    def guess(self, request_id, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def forget(self, request_id):
        pass

    def take(self) -> list[tuple]:
        """The calls since the last `take`."""
        new, self.calls = self.calls, []
        return new


class OracleProposer(Recorder):
    """Guesses the fake model's greedy continuation right for a random number of tokens, then wrong ones."""

    def __init__(self, seed: int, model: str = "fake"):
        super().__init__()
        self.rng, self.model = random.Random(seed), model

    def guess(self, request_id, tokens, k):
        right = self.rng.randint(0, k)
        history, draft = list(tokens), []
        for i in range(k):
            token = greedy_token(history, self.model)
            if i >= right:
                token = (token + 1 + self.rng.randrange(VOCAB - 2)) % VOCAB  # anything but the right one
            draft.append(token)
            history.append(token)
        return draft


class Listed(Recorder):
    """Always the first k of the same guesses."""

    def __init__(self, guesses: list[int]):
        super().__init__()
        self.guesses = guesses

    def guess(self, request_id, tokens, k):
        return self.guesses[:k]


class NeverRight(Recorder):
    """Guesses wrong every time: k times the token after the fake model's greedy one."""

    def guess(self, request_id, tokens, k):
        return [(greedy_token(tokens) + 1) % EOS] * k


class FirstRight(Recorder):
    """Its first guess is the fake model's greedy token and the rest wrong, until its `right_after`-th call; from
    then on every guess is right."""

    def __init__(self, right_after: int):
        super().__init__()
        self.right_after, self.num_calls = right_after, 0

    def guess(self, request_id, tokens, k):
        self.num_calls += 1
        history, draft = list(tokens), []
        for i in range(k):
            token = greedy_token(history)
            draft.append(token if i == 0 or self.num_calls > self.right_after else (token + 1) % EOS)
            history.append(draft[-1])
        return draft


class Scripted(Recorder):
    """Given the true continuation of one request: call 1 guesses 2 right of 3, call 2 0 right of 2, call 3 3 right
    of 3, later calls nothing."""

    def __init__(self, prompt_length: int, truth: list[int]):
        super().__init__()
        self.prompt_length, self.truth, self.num_calls = prompt_length, truth, 0

    def guess(self, request_id, tokens, k):
        self.num_calls += 1
        done = len(tokens) - self.prompt_length
        right = self.truth[done : done + 3]
        wrong = [(t + 1) % EOS for t in right]
        return {1: right[:2] + wrong[2:3], 2: wrong[:2], 3: right[:3]}.get(self.num_calls, [])


# ---------------------------------------------------------------- proposers of your stack so far (tests/week4_stack.py)


class TruthProposer(Recorder):
    """Guesses each request's true continuation (`truth`: request id -> prompt, output and its EOS, as the test's
    oracle gives them) right for a random number of tokens, then wrong: the test knows exactly how many guesses of
    each proposal the target must accept."""

    def __init__(self, truth: dict, seed: int):
        super().__init__()
        self.truth, self.rng = truth, random.Random(seed)

    def guess(self, request_id, tokens, k):
        truth, n = self.truth[request_id], len(tokens)
        if truth[:n] != tokens:
            return [0] * k  # asked after tokens it should not have: the test sees that in the record
        # Right guesses stop before the last true token, so the first wrong one is always checked against the truth.
        right = min(self.rng.randint(0, k), len(truth) - n - 1)
        draft = truth[n : n + right] + [(truth[n + right] + 1 + self.rng.randrange(STACK_VOCAB - 1)) % STACK_VOCAB]
        while len(draft) < k:
            draft.append(self.rng.randrange(STACK_VOCAB))
        return draft


class PastEosProposer(Recorder):
    """Guesses each request's greedy continuation right, EOS included and the target's tokens after it (`truth`:
    request id -> the prompt and that continuation)."""

    def __init__(self, truth: dict):
        super().__init__()
        self.truth = truth

    def guess(self, request_id, tokens, k):
        n = len(tokens)
        return self.truth[request_id][n : n + k]


class WrongProposer(Recorder):
    """Guesses wrong every time (`truth`: request id -> prompt, output and EOS): the first guess is never the
    target's token."""

    def __init__(self, truth: dict):
        super().__init__()
        self.truth = truth

    def guess(self, request_id, tokens, k):
        return [(self.truth[request_id][len(tokens)] + 1) % STACK_VOCAB] * k


class ArgmaxProposer(Recorder):
    """Guesses the target's own greedy continuation of whatever the sequence holds (`model`: mlx-lm's)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def guess(self, request_id, tokens, k):
        return greedy_past_eos(self.model, tokens, k)


class Watched(Recorder):
    """The student's proposer, each call recorded (the test checks the guesses against the rule)."""

    def __init__(self, proposer):
        super().__init__()
        self.proposer = proposer

    def propose(self, seq, k):
        draft = list(self.proposer.propose(seq, k))
        self.calls.append((seq.request_id, list(seq.token_ids), k, draft))
        return draft

    def forget(self, request_id):
        self.proposer.forget(request_id)


def greedy_past_eos(model, prompt: list[int], length: int) -> list[int]:
    """mlx-lm's `model` alone, greedy, for `length` tokens, going on past EOS as if it were any token."""
    history = list(prompt)
    for _ in range(length):
        history.append(mx.argmax(model(mx.array([history]))[0, -1]).item())
    return history[len(prompt):]


# ---------------------------------------------------------------- day 4.2 (tests/test_week_4_day_2.py)


class EndToken:
    """What the engine needs of a tokenizer when prompts are token ids: the one EOS id."""

    def __init__(self, eos: int):
        self.eos_token_ids = {eos}
