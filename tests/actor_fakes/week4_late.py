"""Fakes of days 4.3-4.5 that need no trust, built where the code under test runs (`actor_fakes(sol, "week4_late")`).

Day 4.3's in-process tests shard a layer for rank r of a group that does not exist: `StandInGroup` answers rank()
and size(), and `AllSumOfOthers` stands in for `mx.distributed.all_sum` (its argument plus the other ranks'
partials). Day 4.4's tests wrap the engine's own collaborators where it runs: a counter of the runner's samples, a
recorder of the messages rank 0 sends, a follower's exchange fed those messages back, a rank told to die. Day 4.5's
`SchemaBreaker` proposes guesses the schema refuses. Each keeps its record as plain data the test reads back in one
round trip; the verdicts stay with the tests, which check each record against what the engine returned, with
oracles of their own.
"""

import os
import random

import mlx.core as mx


class StandInGroup:
    """The part of an `mx.distributed.Group` that sharding reads: which rank, out of how many."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class AllSumOfOthers:
    """`mx.distributed.all_sum` as rank r of a `StandInGroup` sees it: its own argument plus the other ranks'
    partials (`partials[r]`: what rank r's local part computes). A rank that all_sums its partial gets the full
    output; one that skips the all_sum keeps its partial; one that sums anything else gets garbage."""

    def __init__(self, partials: list):
        self.partials = partials

    def __call__(self, x, *args, group=None, **kwargs):
        rank = (group if group is not None else args[0]).rank()
        return x + sum(p for r, p in enumerate(self.partials) if r != rank)


# ---------------------------------------------------------------- day 4.4: serving across ranks


def build_plan(sequence, scheduler, decodes: list, prefills: list):
    """A `scheduler.StepPlan` over new `sequence.Sequence`s, from plain data: each chunk is (request id, prompt
    ids, output ids, block table, start, length). The modules are the code under test's, so the plan is made of
    the classes its engine makes (a test's plan, or a copy of one a trusted engine made)."""

    def chunk(request_id, prompt, outputs, table, start, length):
        seq = sequence.Sequence(request_id, list(prompt))
        seq.output_token_ids.extend(outputs)
        seq.block_table = list(table)
        return scheduler.ScheduledChunk(seq, start, length)

    return scheduler.StepPlan(decodes=[chunk(*c) for c in decodes], prefills=[chunk(*c) for c in prefills])


class SampleCounter:
    """Counts the calls of a week-3 runner's `sample` (`runner.runner.sample` of a `TensorParallelRunner`) in
    `calls`, passing each on."""

    def __init__(self, runner):
        self.sample, self.calls = runner.runner.sample, 0
        runner.runner.sample = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.sample(*args, **kwargs)


class ToldToDie(Exception):
    """What `DieOnStep` raises: the rank program catches it and exits at once, as a crashed rank would."""


class DieOnStep:
    """Makes a `TensorParallelRunner`'s `forward` raise `ToldToDie` as it starts step `step` (after step - 1 plans
    run with the other ranks). The rank program then exits without a word: its peers must notice."""

    def __init__(self, runner, step: int):
        self.forward, self.step, self.steps = runner.forward, step, 0
        runner.forward = self

    def __call__(self, plan):
        self.steps += 1
        if self.steps == self.step:
            raise ToldToDie(f"told to die at step {self.step} (pid {os.getpid()})")
        return self.forward(plan)


class ExchangeRecorder:
    """Records every message a `TensorParallelRunner` receives from its exchange (rank 0's plans, as the others get
    them), passing each on: `received`, a list of int lists."""

    def __init__(self, runner):
        self.exchange, self.received = runner.exchange, []
        runner.exchange = self

    def __call__(self, message):
        received = self.exchange(message)
        self.received.append(received.tolist())
        return received


class ScriptedExchange:
    """A follower's exchange on a group of its own: each call returns the next of `messages` (what rank 0 sent) as
    an int32 array; `nonzero_sent` counts the calls whose argument was not all zeros (a follower adds zeros)."""

    def __init__(self, runner, messages: list):
        self.messages = [mx.array(m, dtype=mx.int32) for m in messages]
        self.calls, self.nonzero_sent = 0, 0
        runner.exchange = self

    def __call__(self, message):
        self.nonzero_sent += bool(mx.any(message).item())
        self.calls += 1
        if self.calls > len(self.messages):
            raise AssertionError(f"the follower asked for message {self.calls} after the stop message")
        return self.messages[self.calls - 1]


# ---------------------------------------------------------------- day 4.5: structured output


class SchemaBreaker:
    """A proposer whose guesses for a constrained request are its true constrained continuation for a random number
    of tokens, then a token the schema refuses there, then anything; for a free request, anything.

    `truths[request id]`: the request's constrained greedy output (the test's oracle's); `refused[request id][n]`: a
    few tokens the schema refuses after the first n tokens of it (the test's oracle picked them). `calls` records each
    proposal as (request id, tokens output so far, draft): the test counts, with its own oracle, the guesses the
    engine must verify."""

    def __init__(self, truths: dict, refused: dict, vocab_size: int, seed: int):
        self.truths, self.refused, self.vocab_size = truths, refused, vocab_size
        self.rng = random.Random(seed)
        self.calls: list[tuple] = []

    def propose(self, seq, k):
        truth, done = self.truths.get(seq.request_id), list(seq.output_token_ids)
        if truth is None:
            draft = [self.rng.randrange(self.vocab_size) for _ in range(k)]
        else:
            assert truth[:len(done)] == done, f"{seq.request_id}: guesses asked after an output off the oracle's"
            right = self.rng.randint(0, max(min(k - 1, len(truth) - len(done) - 1), 0))
            refused = self.refused[seq.request_id][len(done) + right]
            draft = truth[len(done):len(done) + right] + [self.rng.choice(refused)]
            draft += [self.rng.randrange(self.vocab_size) for _ in range(k - len(draft))]
        self.calls.append((seq.request_id, len(done), draft))
        return draft

    def forget(self, request_id):
        pass
