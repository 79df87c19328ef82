"""Fakes and oracles for week 3's engine tests (days 3.1 and 3.2).

The engine's model runner is replaced by a `TraceRunner` (tests/actor_fakes/week3.py), built where the engine runs:
instead of running a model it simulates the pool slot by slot, checks that every sampling chunk's block table reads
back exactly its sequence's own tokens 0 .. n-1 (a block freed while in use, shared by two sequences, or a wrong
slot fails at once), and predicts a hash of the whole sequence (`next_token_of`), so `fake_expected` gives
one-request-at-a-time generation with no scheduler at all. Runs in microseconds, so property tests can run many
workloads. It records every plan as data; `replay` checks that record here, in the judge, against the outputs.

`mlx_lm_greedy` is the model-level oracle: mlx-lm's own model, one request at a time, greedy.
`run_until_done` steps any engine to the end within a step limit: every week-3 test loop goes through it (or
checks a limit of its own), so a bug that stops progress fails its test at once, naming the rule, instead of
using up the test's time.
"""

from typing import NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from course.engines import PLAIN_ENGINE  # noqa: F401  (the plain engine the tests ask for; one dict with the labs)
from tests.actor_fakes import EOS, VOCAB, FakeTokenizer, FakeWeek3Model  # noqa: F401  (built where the engine runs)
from tests.actor_fakes.week3 import PoolSimulation, TraceRunner, next_token_of  # noqa: F401  (the judge's own copies)
from tests.harness import actor_fakes, fetch, reference



def trace_runner(package, engine, **kwargs):
    """A `TraceRunner` (tests/actor_fakes/week3.py) for `engine`, built where the engine runs (no round trip a step)."""
    return actor_fakes(package, "week3").TraceRunner(engine, **kwargs)


def block_size_of(**config) -> int:
    """The block size an engine built with these `EngineConfig` fields has (the reference's default when not given):
    the judge's own figure for the replay, never read from the engine under test."""
    return reference().engine.EngineConfig(**{**PLAIN_ENGINE, **config}).block_size


def sampled_for(output_token_ids: list[int], finish_reason: str | None) -> list[int]:
    """What the runner sampled for a request that ended with these outputs: its tokens, and the EOS that ended it."""
    return list(output_token_ids) + ([EOS] if finish_reason == "stop" else [])


class Replay(NamedTuple):
    """A runner's trace, replayed by the judge: every plan's chunks (tuples of `CHUNK_FIELDS`) and, per request, the
    tokens the replay sampled for it, in order."""

    trace: list
    generations: dict


def replay(engine, block_size: int, outputs: dict, eos: bool = True) -> Replay:
    """Read the engine's `TraceRunner` record back (one round trip) and check it here, where the submission cannot.

    The record was written in the submission's process, so it proves nothing by itself. The judge runs every plan's
    chunks through its own `PoolSimulation` (each sampling chunk's history must read back, slot by slot, through the
    block table it names, with nothing else written over it), requires the tokens that predicts to be the tokens the
    runner returned, and requires each request's predicted tokens, in order, to be exactly the outputs the engine
    reported for it (`outputs`: request id -> (output token ids, finish reason)), EOS included where it ended one.
    As the test also checks those outputs against one-at-a-time generation, a lying record would have to be a whole
    valid paged schedule of its own: every history of every request written into blocks no other live sequence
    overwrote, reproducing every token. (Block ids it made up, private to each request, would pass here; what a
    scheduler really did with its blocks is also checked from its state (day 3.2's `check_pool`) and, in the stack
    tests, by a real model whose tokens a shared block would change.)
    """
    [(trace, sampled)] = fetch([engine], "runner.trace", "runner.sampled")
    assert len(trace) - 1 <= len(sampled) <= len(trace), "the runner's record: a plan without its tokens"
    pool = PoolSimulation(block_size, eos)
    generations: dict = {}
    for chunks, tokens in zip(trace, sampled):
        for request_id, _, token_ids, start, length, samples in chunks:
            assert samples == (start + length == len(token_ids)), \
                f"the runner's record: {request_id!r}'s chunk {start}..{start + length} marked samples={samples}"
        assert pool.run(chunks) == list(tokens), "the runner's record: tokens its plans do not predict"
        for (request_id, *_), token in zip([c for c in chunks if c[5]], tokens):
            generations.setdefault(request_id, []).append(token)
    for request_id, (output_token_ids, finish_reason) in outputs.items():
        assert generations.get(request_id, []) == sampled_for(output_token_ids, finish_reason), \
            f"request {request_id!r}: the engine reported {list(output_token_ids)} ({finish_reason}), but the " \
            f"model sampled {generations.get(request_id, [])} for it"
    return Replay(trace, generations)


def outputs_of(seqs) -> dict:
    """request id -> (output token ids, finish reason) of the engine's sequences, read in one round trip."""
    return {request_id: (output, reason)
            for request_id, output, reason in fetch(seqs, "request_id", "output_token_ids", "finish_reason")}


def fake_expected(prompt: list[int], max_tokens: int, eos: bool = True) -> tuple[list[int], str]:
    """One-request-at-a-time generation under the fake runner: (output tokens, finish reason)."""
    history, output = list(prompt), []
    while len(output) < max_tokens:
        token = next_token_of(history, eos)
        if token == EOS:
            return output, "stop"
        output.append(token)
        history.append(token)
    return output, "length"


def mlx_lm_greedy(mlx_model, prompt: list[int], max_tokens: int, eos_ids) -> list[int]:
    """mlx-lm's own model, one request alone, greedy: the oracle for the engine's outputs."""
    cache = make_prompt_cache(mlx_model)
    tokens, output = list(prompt), []
    for _ in range(max_tokens):
        logits = mlx_model(mx.array([tokens]), cache=cache)
        token = mx.argmax(logits[0, -1]).item()
        if token in eos_ids:
            break
        output.append(token)
        tokens = [token]
    return output


def run_until_done(engine, max_steps: int = 500, rule: str = "every request ends") -> list:
    """Step `engine` until it has no work; return every StepOutput. After `max_steps` steps with work left it
    fails, naming `rule` (the promise a stopped engine breaks), instead of looping until the test times out."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        outputs += engine.step()
    if engine.has_work():
        raise AssertionError(f"the engine made no progress in {max_steps} steps ({rule}): "
                             f"{engine.num_running} running, {engine.num_waiting} waiting")
    return outputs
