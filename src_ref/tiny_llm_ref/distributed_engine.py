"""Week 3's engine across ranks: rank 0 plans and samples, every rank runs the plan on its shard.

Day 4.3's `Qwen2TensorParallel` already runs one batch across N ranks, provided every rank calls it
with the same batch at the same time. This module makes that true every step:

    rank 0                                       every other rank
    plan = scheduler.schedule()
    message = encode_plan(plan)                  message = zeros
    received = all_sum(message)  ------------->  received = all_sum(message)  (the same array everywhere)
    run decode_plan(received) on its shard       run decode_plan(received) on its shard
    sample, update the scheduler                 (nothing: the logits on rank 0 are the ones that count)

The plan crosses as one int32 array of a fixed length (`plan_capacity`), so the collective always has
the same shape on every rank; the ranks other than 0 add zeros, which makes the sum a broadcast.
A message whose first number is `STOP` ends the other ranks' loop.

The message, all int32:

    [num_decodes, num_prefills,
     then per chunk, decodes first:  start, length, samples (0/1), table length, token ids..., block ids...,
     then zeros up to the capacity]
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .engine import EngineConfig, LLMEngine
from .model_runner import ModelRunner
from .scheduler import StepPlan

STOP = -1  # the first number of the message that ends the other ranks' loop
HEADER = 2  # num_decodes, num_prefills
CHUNK_HEADER = 4  # start, length, samples, table length


class RankLost(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


@dataclass
class BlockTable:
    """What the model runner reads of a sequence on a rank that holds no sequences: its block table."""

    block_table: list[int]


@dataclass
class PlannedChunk:
    """A chunk as the other ranks see it: everything `ModelRunner.prepare` reads of a `ScheduledChunk`."""

    seq: BlockTable
    start: int
    length: int
    token_ids: list[int]
    samples: bool


def plan_capacity(config: EngineConfig, num_blocks: int) -> int:
    """The message's fixed length for an engine: room for the biggest plan it can make (provided).

    At most `max_num_seqs` chunks, each a header and a block table of at most `num_blocks` blocks,
    and at most `token_budget` token ids in all.
    """
    return HEADER + config.max_num_seqs * (CHUNK_HEADER + num_blocks) + config.token_budget


def encode_plan(plan: StepPlan, capacity: int) -> mx.array:
    """The plan as one int32 array of `capacity` numbers, in the layout of this module's docstring."""
    # BEGIN TASK Week 4 Day 4 Task 1: lay a step's plan out as one int32 array
    # TODO: counts of decodes and prefills; per chunk (decodes first) start, length, samples, table length,
    # TODO: its token ids and its whole block table; pad with zeros to `capacity` (refuse a plan that overflows)
    message = [len(plan.decodes), len(plan.prefills)]
    for chunk in plan.chunks:
        table = chunk.seq.block_table
        message += [chunk.start, chunk.length, int(chunk.samples), len(table)]
        message += chunk.token_ids
        message += table
    if len(message) > capacity:
        raise ValueError(f"the plan needs {len(message)} numbers, more than the message's {capacity}")
    return mx.array(message + [0] * (capacity - len(message)), dtype=mx.int32)
    # END TASK


def stop_message(capacity: int) -> mx.array:
    """The message that ends the other ranks' loop (provided)."""
    return mx.concatenate([mx.array([STOP], dtype=mx.int32), mx.zeros(capacity - 1, dtype=mx.int32)])


def decode_plan(message: mx.array) -> StepPlan | None:
    """The plan an `encode_plan` message carries, as `PlannedChunk`s; None for the stop message."""
    # BEGIN TASK Week 4 Day 4 Task 2: read a plan back from the array
    # TODO: None if the first number is STOP; else read the counts, then each chunk's header, its token ids
    # TODO: and its block table, in order; the first num_decodes chunks are the decodes
    numbers = message.tolist()
    if numbers[0] == STOP:
        return None
    num_decodes, num_prefills = numbers[0], numbers[1]
    chunks, at = [], HEADER
    for _ in range(num_decodes + num_prefills):
        start, length, samples, table_length = numbers[at : at + CHUNK_HEADER]
        at += CHUNK_HEADER
        token_ids = numbers[at : at + length]
        at += length
        table = numbers[at : at + table_length]
        at += table_length
        chunks.append(PlannedChunk(BlockTable(table), start, length, token_ids, bool(samples)))
    return StepPlan(decodes=chunks[:num_decodes], prefills=chunks[num_decodes:])
    # END TASK


class TensorParallelRunner:
    """Wraps a week-3 `ModelRunner` whose model is day 4.3's `Qwen2TensorParallel` on `group` (provided but `run`, `follow`).

    Its pool holds this rank's KV heads; its `prepare`, model and `sample` are used as they are.
    """

    def __init__(self, runner, group, capacity: int):
        self.runner = runner
        self.group = group
        self.capacity = capacity

    @property
    def pool(self):
        return self.runner.pool

    def evaluate(self, *arrays) -> None:
        """`mx.eval` of arrays that hold collectives: a failure there is a lost rank, `RankLost` (provided).

        MLX reports a peer that died mid-collective as a RuntimeError when the graph is evaluated.
        """
        try:
            mx.eval(*arrays)
        except RuntimeError as error:
            raise RankLost(f"rank {self.group.rank()} of {self.group.size()}: another rank stopped answering "
                           f"({error})") from None

    def exchange(self, message: mx.array) -> mx.array:
        """The all_sum of every rank's message: rank 0's plan, everywhere (provided)."""
        received = mx.distributed.all_sum(message, group=self.group)
        self.evaluate(received)
        return received

    def forward(self, plan: StepPlan) -> mx.array:
        """Run a plan on this rank's shard, the KV pool's writes evaluated with the logits (provided)."""
        batch = self.runner.prepare(plan)
        logits = self.runner.model(batch, self.runner.pool)
        self.evaluate(logits, *self.runner.pool.arrays())
        return logits

    def run(self, plan: StepPlan) -> list[int]:
        """Rank 0: send the plan, run what every rank received, sample; the next token of each sampling chunk."""
        # BEGIN TASK Week 4 Day 4 Task 3: rank 0's step: broadcast the plan, run it, sample
        # TODO: exchange the encoded plan; run the decoded plan (what the others run too); sample the rows
        # TODO: of the original plan's sampling chunks (their sequences hold the sampling parameters)
        received = decode_plan(self.exchange(encode_plan(plan, self.capacity)))
        logits = self.forward(received)
        return self.runner.sample(logits, [chunk.seq for chunk in plan.chunks if chunk.samples])
        # END TASK

    def follow(self) -> int:
        """Every other rank: run each plan rank 0 sends until the stop message; the number of steps run."""
        # BEGIN TASK Week 4 Day 4 Task 3: the other ranks' loop: receive, run, never sample
        # TODO: exchange zeros; stop on the stop message; otherwise run the plan on this shard (no sampling)
        steps = 0
        while (plan := decode_plan(self.exchange(mx.zeros(self.capacity, dtype=mx.int32)))) is not None:
            self.forward(plan)
            steps += 1
        return steps
        # END TASK

    def stop(self) -> None:
        """Rank 0: end the other ranks' loop (provided)."""
        self.exchange(stop_message(self.capacity))


class TensorParallelEngine(LLMEngine):
    """Week 3's engine on rank 0 of a tensor-parallel group; every other rank runs `follow_engine` (provided).

    `model` is this rank's `Qwen2TensorParallel`. Call `shutdown()` when done: the others wait for it.
    """

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, **kwargs):
        super().__init__(model, tokenizer, config, **kwargs)
        capacity = plan_capacity(self.config, self.block_manager.num_blocks)
        self.runner = TensorParallelRunner(self.runner, model.group, capacity)

    def shutdown(self) -> None:
        """Send the stop message: every other rank's `follow_engine` returns."""
        self.runner.stop()


def follow_engine(model, config: EngineConfig | None = None) -> TensorParallelRunner:
    """A rank other than 0: the runner the engine on rank 0 drives, with a pool the engine's size (provided).

    Call its `follow()`; it returns when rank 0's engine shuts down.
    """
    config = config or EngineConfig()
    num_blocks = config.pool_blocks_for(model)
    runner = ModelRunner(model, num_blocks, config.block_size, config.kv_bits)
    return TensorParallelRunner(runner, model.group, plan_capacity(config, num_blocks))
