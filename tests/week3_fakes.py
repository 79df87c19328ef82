"""Fakes and oracles for week 3's engine tests (days 3.1 and 3.2).

`FakeRunner` replaces the engine's model runner: instead of running a model it keeps, for every pool
slot, which (sequence, position, token) was written there, and when a chunk samples it first checks
that the sequence's block table reads back exactly its own tokens 0 .. n-1 (a block freed while in
use, shared by two sequences, or a wrong slot fails at once). Its next token is a hash of the whole
sequence (`next_token_of`), so `expected_tokens` gives one-request-at-a-time generation with no
scheduler at all. Runs in microseconds, so property tests can run many workloads.

`mlx_lm_greedy` is the model-level oracle: mlx-lm's own model, one request at a time, greedy.
`run_until_done` steps any engine to the end within a step limit: every week-3 test loop goes through it (or
checks a limit of its own), so a bug that stops progress fails its test at once, naming the rule, instead of
using up the test's time.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from course.engines import PLAIN_ENGINE  # noqa: F401  (the plain engine the tests ask for; one dict with the labs)
from tests.actor_fakes import FakeWeek3Model  # noqa: F401  (built where the engine runs: actor_fakes(sol))
from tests.harness import fetch
from tests.scheduler_fakes import EOS, VOCAB, FakeTokenizer, next_token_of  # noqa: F401



class FakeRunner:
    """Runs plans without a model; checks every plan against the pool it simulates."""

    def __init__(self, engine, eos: bool = True, fail_on_step: int | None = None):
        self.engine = engine
        self.eos = eos
        self.fail_on_step = fail_on_step
        self.slots: dict[int, tuple] = {}
        self.plans = []
        self.block_size = None

    def run(self, plan):
        self.plans.append(plan)
        if self.fail_on_step is not None and len(self.plans) == self.fail_on_step:
            raise RuntimeError("the model failed")
        if self.block_size is None:  # read once (while grading, the engine is the submission's: round trips)
            self.block_size = self.engine.block_manager.block_size
        block_size = self.block_size
        tokens = []
        # Every chunk's fields at once (while grading, the plan lives in the submission's process: one round trip).
        chunks = fetch(plan.chunks, "seq.request_id", "seq.block_table", "seq.token_ids", "start", "length", "samples")
        for request_id, table, token_ids, start, length, samples in chunks:
            for position in range(start, start + length):
                slot = table[position // block_size] * block_size + position % block_size
                self.slots[slot] = (request_id, position, token_ids[position])
            if samples:
                for position, token in enumerate(token_ids):
                    slot = table[position // block_size] * block_size + position % block_size
                    assert self.slots.get(slot) == (request_id, position, token), \
                        f"{request_id!r} position {position}: its block holds {self.slots.get(slot)}"
                tokens.append(next_token_of(token_ids, self.eos))
        return tokens


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
