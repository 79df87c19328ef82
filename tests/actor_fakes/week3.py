"""Days 3.1-3.4's fakes, built where the engine under test runs (`actor_fakes(sol, "week3")`).

`TraceRunner` replaces the engine's model runner: instead of running a model it keeps, in a `PoolSimulation`, which
(sequence, position, token) each pool slot holds, and when a chunk samples it checks that the sequence's block
table reads back exactly its own tokens 0 .. n-1 (a block freed while in use, shared by two sequences, or a wrong
slot fails at once, naming the step). Its next token is a hash of the history it read back (`next_token_of`).

It keeps every plan it ran as plain data (`trace`) and the tokens it returned (`sampled`). Both are written where
the submission runs, so the judge never takes them on trust: it runs the same chunks through a `PoolSimulation` of
its own and ties what that predicts to the outputs the engine returned (tests/week3_fakes.py, `replay`).

`step` is one engine step with what a test reads after it, in one call (tests/week3_stack.py's `Run`).
`Lines` (a log sink) and `TickingClock` stand in for the lambdas a test would pass; their record is read back as data.
Plain Python only: the worker imports this package alone.
"""

from . import Lines, next_token_of  # noqa: F401  (Lines: the engine's log sink, as `fakes.Lines()`)

CHUNK_FIELDS = ("request_id", "block_table", "token_ids", "start", "length", "samples")


class PoolSimulation:
    """The pool slot by slot: `run(chunks)` writes one step's chunks (each a tuple of `CHUNK_FIELDS`) and returns
    the next token of every chunk that samples, after checking its block table reads back its whole history."""

    def __init__(self, block_size: int, eos: bool = True):
        self.block_size, self.eos = block_size, eos
        self.slots: dict[int, tuple] = {}

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, chunks: list) -> list[int]:
        tokens = []
        for request_id, table, token_ids, start, length, samples in chunks:
            for position in range(start, start + length):
                self.slots[self.slot(table, position)] = (request_id, position, token_ids[position])
            if samples:
                for position, token in enumerate(token_ids):
                    held = self.slots.get(self.slot(table, position))
                    assert held == (request_id, position, token), \
                        f"{request_id!r} position {position}: its block holds {held}"
                tokens.append(next_token_of(token_ids, self.eos))
        return tokens


class TraceRunner:
    """Runs plans without a model (a `PoolSimulation`), recording each one; raises on step `fail_on_step`."""

    def __init__(self, engine, eos: bool = True, fail_on_step: int | None = None):
        self.engine, self.eos, self.fail_on_step = engine, eos, fail_on_step
        self.pool = None  # made at the first step: the engine's block manager may be replaced after the runner
        self.trace: list[list[tuple]] = []  # per plan run: its chunks, decodes first, as tuples of CHUNK_FIELDS
        self.sampled: list[list[int]] = []  # per plan that ran to the end: the tokens returned

    def run(self, plan) -> list[int]:
        chunks = [(c.seq.request_id, list(c.seq.block_table), list(c.seq.token_ids), c.start, c.length, c.samples)
                  for c in plan.chunks]
        self.trace.append(chunks)
        if self.fail_on_step is not None and len(self.trace) == self.fail_on_step:
            raise RuntimeError("the model failed")
        if self.pool is None:
            self.pool = PoolSimulation(self.engine.block_manager.block_size, self.eos)
        tokens = self.pool.run(chunks)
        self.sampled.append(tokens)
        return tokens

    @property
    def num_plans(self) -> int:
        return len(self.trace)

    def num_tokens(self, index: int) -> int:
        """Tokens plan `index` ran."""
        return sum(length for _, _, _, _, length, _ in self.trace[index])


class TickingClock:
    """A clock that moves `tick` seconds forward at every reading."""

    def __init__(self, tick: float = 1.0):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def step(engine, fields: tuple[str, ...]) -> tuple[list[tuple], bool, int, int]:
    """One `engine.step()`: each StepOutput's `fields`, then whether the engine has work left and how many sequences
    wait and run (while grading, the test reads all of it in one round trip a step)."""
    outputs = [tuple(getattr(output, name) for name in fields) for output in engine.step()]
    return outputs, engine.has_work(), engine.num_waiting, engine.num_running
