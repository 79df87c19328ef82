"""Week 4 Day 4: serving across ranks (book/src/week4-04-serving-across-ranks.md).

Oracles: week 3's model runner (`prepare` of the scheduler's own plan is what every rank must run),
the reference's single-process engine on the whole model, and mlx-lm's own Qwen2 recomputing every
token; invariants (every block back in the pool, every rank ran every step, only rank 0 sampled: the one record
taken on trust, as no output shows a follower's pick; see `count_samples` in tests/ranks_distributed_engine.py).
Two kinds of test:

- in this process: the message's layout on a hand-made plan; encoding and decoding every plan of a
  real engine run (with chunked prefills and preemptions); the engine on a group of one rank (the
  all_sum is then the message itself) against the single-process engine; a follower fed rank 0's
  messages, whose pool must end up the leader's;
- across two real ranks, `mlx.launch -n 2 --backend ring` on loopback (course/ranks.py): each rank runs
  tests/ranks_distributed_engine.py, which builds the code its launch names as these tests do; one launch
  with Task 3's code, one with your stack so far (your week-3 engine, day-4.3 shards and day-4.4 code
  together, on week 3's workloads), and one that kills rank 1 after its first step.

Each task's tests, in this process and on the ranks, take your code for that task alone
(`solution(week=4, day=4, task=N)`: the reference's for the day's other tasks), so a bug in one task
never costs another its points; your stack so far runs all of your code together.
"""

import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from course import ranks
from tests.harness import RankLaunches, actor_fakes, fetch, reference, solution
from tests.ranks_distributed_engine import DIED, MAX_TOKENS, PROMPTS, engine_config, run_engine
from tests.week4_stack import two_rank_stack_records

TASKS = {n: solution(week=4, day=4, task=n) for n in range(1, 4)}  # Task N's tests: the student's Task N alone
ref = reference()

WORLD = 2
# Seconds for both ranks to start, load the embedded model and serve every prompt: about 15 on two
# busy cores; a machine shared with more work may need more.
LAUNCH_TIMEOUT = float(os.environ.get("TINY_LLM_RANKS_TIMEOUT", "55"))
RANKS_PROGRAM = [sys.executable, "-m", "tests.ranks_distributed_engine"]
STEP_LIMIT = 200
# Each launch: whose code its ranks run (tests/harness.py's RankLaunches), and the checks they make with it.
LAUNCHES = {"task3": ["engine"], "stack": ["stack"]}


@pytest.fixture(scope="module")
def one_rank():
    """The group of this process alone: the all_sum of a message is the message."""
    group = mx.distributed.init()
    assert group.size() == 1, "the tests' own process must not be a rank of a launch"
    return group


@pytest.fixture(scope="module")
def models(model32, one_rank):
    """(sharded model on one rank, whole week-3 model, tokenizer): the reference's, here, on the same weights, float32."""
    mlx_model, tokenizer = model32
    return (ref.tensor_parallel.Qwen2TensorParallel(mlx_model, one_rank), ref.qwen2_week3.Qwen2ModelWeek3(mlx_model),
            tokenizer)


@pytest.fixture(scope="module")
def task3_model(model32, one_rank):
    """The sharded model on one rank, built where Task 3's code runs (its day-4.3 code is the reference's)."""
    return TASKS[3].tensor_parallel.Qwen2TensorParallel(model32[0], one_rank)


@pytest.fixture(scope="module")
def two_ranks():
    """The module's two-rank launches (tests/ranks_distributed_engine.py), each made when a test first needs it."""
    return RankLaunches(RANKS_PROGRAM, 4, 4, LAUNCHES, WORLD, LAUNCH_TIMEOUT)


def rank_results(run: ranks.RankRun) -> list[dict]:
    """Every rank's result; an unwritten task surfaces as the skeleton's NotImplementedError."""
    for result in run.results:
        if result and "not_implemented" in result:
            raise NotImplementedError(result["not_implemented"])
    failure = run.failure()
    assert failure is None, f"the two-rank run did not finish: {failure}"
    for rank, result in enumerate(run.results):
        assert "error" not in result and "lost" not in result, f"rank {rank}: {result}"
    return run.results


def plan_of(sol, decodes: list, prefills: list):
    """A plan made of `sol`'s own classes, where its code runs, from plain data: each chunk (request id, prompt ids,
    output ids, block table, start, length) (tests/actor_fakes/week4_late.py)."""
    return actor_fakes(sol, "week4_late").build_plan(sol.sequence, sol.scheduler, decodes, prefills)


def as_data(plan) -> tuple[list, list]:
    """A plan of this process's engine as `plan_of`'s data: its decodes' and its prefills'."""
    def chunks(of):
        return [(c.seq.request_id, c.seq.prompt_token_ids, c.seq.output_token_ids, c.seq.block_table, c.start, c.length)
                for c in of]
    return chunks(plan.decodes), chunks(plan.prefills)


def hand_made_plan(sol):
    """A decode of sequence A (6 tokens, blocks 3 and 7) and the first 3 tokens of B's prompt (block 5)."""
    return plan_of(sol, [("a", [11, 12, 13, 14, 15], [16], [3, 7], 5, 1)], [("b", [21, 22, 23, 24], [], [5], 0, 3)])


def batch_arrays(batch) -> list:
    """A RaggedBatch as plain lists, to compare two of them."""
    views = [(c.length, c.key_slots.tolist(), c.mask.tolist()) for c in batch.chunks]
    decode = None if batch.decode_key_slots is None else (batch.decode_key_slots.tolist(), batch.decode_mask.tolist())
    return [batch.token_ids.tolist(), batch.positions.tolist(), batch.write_slots.tolist(), batch.num_decodes,
            decode, views, batch.sample_rows.tolist()]


def for_every_plan(model, tokenizer, check) -> None:
    """A real engine run of PROMPTS (chunked prefills, decodes, preemptions): `check(step, plan, engine)`
    on every plan before it runs, while its block tables are current."""
    engine = ref.engine.LLMEngine(model, tokenizer, engine_config(ref))
    for prompt in PROMPTS:
        engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=MAX_TOKENS))
    mixed = False
    for step in range(STEP_LIMIT):
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            break
        mixed |= bool(plan.decodes and plan.prefills)
        check(step, plan, engine)
        engine.scheduler.update_from_output(plan, engine.runner.run(plan))
    assert engine.num_preemptions > 0 and mixed, "the run was meant to mix decodes and prefills, and to preempt"


def capacity_of(engine) -> int:
    return ref.distributed_engine.plan_capacity(engine.config, engine.block_manager.num_blocks)


# ---------------------------------------------------------------- Task 1: the plan as one array


def test_task_1_layout_of_a_hand_made_plan():
    message = TASKS[1].distributed_engine.encode_plan(hand_made_plan(TASKS[1]), 30)
    assert message.dtype == mx.int32 and message.shape == (30,), f"{message.dtype}, {message.shape}"
    expected = [1, 1,  5, 1, 1, 2, 16, 3, 7,  0, 3, 0, 1, 21, 22, 23, 5]
    assert message.tolist() == expected + [0] * (30 - len(expected)), (
        "layout: [decodes, prefills, then per chunk start, length, samples, table length, token ids, block ids]")


def test_task_1_a_plan_that_overflows_is_refused():
    with pytest.raises(ValueError):
        TASKS[1].distributed_engine.encode_plan(hand_made_plan(TASKS[1]), 16)
    assert TASKS[1].distributed_engine.encode_plan(hand_made_plan(TASKS[1]), 17).shape == (17,)


def test_task_1_every_plan_of_a_run_fits_and_reads_back(models):
    """Read back by the reference, every message of a real run is its plan: the same batch. The run is the
    reference's, here; Task 1 encodes a copy of each plan made of its own classes, where it runs."""
    _, model, tokenizer = models

    def check(step, plan, engine):
        capacity = capacity_of(engine)
        message = TASKS[1].distributed_engine.encode_plan(plan_of(TASKS[1], *as_data(plan)), capacity)
        assert message.shape == (capacity,) and message.dtype == mx.int32, f"step {step}: {message.shape}, {message.dtype}"
        decoded = ref.distributed_engine.decode_plan(message)
        assert batch_arrays(engine.runner.prepare(decoded)) == batch_arrays(engine.runner.prepare(plan)), f"step {step}"

    for_every_plan(model, tokenizer, check)


# ---------------------------------------------------------------- Task 2: the array back as a plan


def test_task_2_hand_made_message_reads_back():
    capacity = 30
    message = mx.array([1, 1, 5, 1, 1, 2, 16, 3, 7, 0, 3, 0, 1, 21, 22, 23, 5] + [0] * 13, dtype=mx.int32)
    plan = TASKS[2].distributed_engine.decode_plan(message)
    [decode], [prefill] = plan.decodes, plan.prefills
    assert (decode.start, decode.length, decode.token_ids, decode.samples, decode.seq.block_table) == (5, 1, [16], True, [3, 7])
    assert (prefill.start, prefill.length, prefill.token_ids, prefill.samples, prefill.seq.block_table) == (0, 3, [21, 22, 23], False, [5])
    assert TASKS[2].distributed_engine.decode_plan(ref.distributed_engine.stop_message(capacity)) is None, "the stop message"
    empty = TASKS[2].distributed_engine.decode_plan(mx.zeros(capacity, dtype=mx.int32))
    assert empty.is_empty, "all zeros is a plan of nothing"


def test_task_2_every_plan_of_a_run_runs_the_same_batch(models):
    """What a rank builds from the message is exactly the batch rank 0's runner builds from the plan."""
    _, model, tokenizer = models

    def check(step, plan, engine):
        decoded = TASKS[2].distributed_engine.decode_plan(ref.distributed_engine.encode_plan(plan, capacity_of(engine)))
        assert [c.length for c in decoded.decodes] == [c.length for c in plan.decodes], f"step {step}: decodes"
        assert batch_arrays(engine.runner.prepare(decoded)) == batch_arrays(engine.runner.prepare(plan)), (
            f"step {step}: the batch built from the message differs from the plan's")

    for_every_plan(model, tokenizer, check)


# ---------------------------------------------------------------- Task 3: rank 0's step, the others' loop


def test_task_3_one_rank_engine_equals_the_single_process_engine(models, task3_model):
    _, model, tokenizer = models
    engine = TASKS[3].distributed_engine.TensorParallelEngine(task3_model, tokenizer, engine_config(TASKS[3]))
    got = run_engine(engine, ref)
    expected = run_engine(ref.engine.LLMEngine(model, tokenizer, engine_config(ref)), ref)
    assert not got["unfinished"], "the engine did not finish within its step limit"
    assert got["outputs"] == expected["outputs"]
    assert got["free_blocks"] == got["num_blocks"], "every block back in the pool"


def test_task_3_a_follower_runs_rank_0s_messages_into_the_same_pool(models, task3_model):
    """Fed the messages rank 0 sent, a follower runs every plan, never samples, and its pool is rank 0's.

    Both run where Task 3's code runs; what rank 0 sent is read back from a recorder there. The evidence is
    checked against this process's own replay: the reference's follower, here, run on those messages, must write
    the very pool rank 0 and the follower report (a lying record of the messages would have to replay into the
    pool the engine wrote). The sample count alone is taken on trust: no output shows a follower's pick."""
    tp, _, tokenizer = models
    fakes = actor_fakes(TASKS[3], "week4_late")
    engine = TASKS[3].distributed_engine.TensorParallelEngine(task3_model, tokenizer, engine_config(TASKS[3]))
    recorder = fakes.ExchangeRecorder(engine.runner)
    result = run_engine(engine, ref)
    engine.shutdown()
    [[sent]] = fetch([recorder], "received")
    assert len(sent) == result["steps"] + 1, f"rank 0 sent {len(sent)} messages for {result['steps']} steps and the stop"
    follower = TASKS[3].distributed_engine.follow_engine(task3_model, engine_config(TASKS[3]))
    script, sampled = fakes.ScriptedExchange(follower, sent), fakes.SampleCounter(follower)
    steps = TASKS[3].distributed_engine.TensorParallelRunner.follow(follower)
    [[nonzero_sent]], [[sample_calls]] = fetch([script], "nonzero_sent"), fetch([sampled], "calls")
    assert nonzero_sent == 0, "a follower adds zeros to the all_sum: anything else corrupts rank 0's plan"
    assert sample_calls == 0, f"a follower sampled {sample_calls} times: only rank 0 samples"
    assert steps == result["steps"], f"the follower ran {steps} steps, rank 0 {result['steps']}"

    replay, messages = ref.distributed_engine.follow_engine(tp, engine_config(ref)), iter(sent)
    replay.exchange = lambda message: mx.array(next(messages), dtype=mx.int32)
    assert replay.follow() == result["steps"]
    for leader_array, follower_array, replayed in zip(engine.runner.pool.arrays(), follower.pool.arrays(),
                                                      replay.pool.arrays()):
        assert mx.array_equal(leader_array, follower_array), "the follower's pool differs from rank 0's"
        assert mx.allclose(leader_array, replayed, atol=1e-5), "rank 0's pool is not what its messages write"


def test_task_3_two_ranks_equal_single_process_and_mlx_lm(two_ranks):
    leader, _ = rank_results(two_ranks.run("task3"))
    assert not leader["unfinished"], "rank 0's engine did not finish within its step limit"
    assert leader["preemptions"] > 0, "the run was meant to preempt"
    assert leader["outputs"] == leader["single_process"]["outputs"], "two ranks vs the single-process engine"
    assert leader["outputs"] == leader["mlx_lm"], "two ranks vs mlx-lm"


def test_task_3_every_rank_ran_every_step_and_the_pool_is_full(two_ranks):
    leader, follower = rank_results(two_ranks.run("task3"))
    assert follower["steps"] == leader["steps"], f"rank 1 ran {follower['steps']} steps, rank 0 {leader['steps']}"
    assert leader["free_blocks"] == leader["num_blocks"], "rank 0's block manager: every block back"
    # Each rank's pool: the engine's blocks, this rank's one KV head of the model's two.
    assert leader["pool_shape"] == follower["pool_shape"] == [leader["num_blocks"] * 4, 1, 16]


def test_task_3_only_rank_0_samples(two_ranks):
    # The counts are the ranks' own records, taken on trust (no output shows a follower's pick: `count_samples`).
    leader, follower = rank_results(two_ranks.run("task3"))
    assert follower["sample_calls"] == 0, f"rank 1 sampled {follower['sample_calls']} times: only rank 0 samples"
    assert leader["sample_calls"] == leader["steps"], "rank 0 samples once a step"


def test_task_3_a_dead_rank_fails_rank_0(two_ranks):
    with tempfile.TemporaryDirectory() as out_dir:
        run = two_ranks.launch("task3", ["engine"], Path(out_dir), "--die-rank", "1")
    if run.results[0] and "not_implemented" in run.results[0]:
        raise NotImplementedError(run.results[0]["not_implemented"])
    assert not run.timed_out, "rank 0 waited for the dead rank until the time limit"
    assert run.results[1] is None and f"exited with code {DIED}" in run.output, run.output[-2000:]
    assert run.results[0] is not None, f"rank 0 left no result: {run.failure()}"
    assert "another rank stopped answering" in run.results[0].get("lost", ""), f"rank 0: {run.results[0]}"


# ---------------------------------------------------------------- Task 4: your stack so far


def test_task_4_your_stack_so_far_on_two_ranks(two_ranks):
    """Your week-3 engine, day-4.3 shards and day-4.4 code together on two ranks: week 3's pressure workload
    (refusals, preemptions, aborts, EOS, priorities, prefix caching) and seeded sampling, every stream
    mlx-lm's for the request alone, every block back in rank 0's pool, rank 1 in step and never sampling."""
    leader, follower = two_rank_stack_records(TASKS[3], "distributed_engine", two_ranks.run("stack"))
    if leader["failures"]:
        pytest.fail("your stack so far on two ranks:\n  " + "\n  ".join(leader["failures"]), pytrace=False)
    assert follower["steps"] == leader["steps"], f"rank 1 ran {follower['steps']} steps per engine, rank 0 {leader['steps']}"
    assert follower["sample_calls"] == 0, f"rank 1 sampled {follower['sample_calls']} times: only rank 0 samples"
    assert leader["pool_kv_heads"] == follower["pool_kv_heads"] == 1, (
        f"each rank's KV pool must hold its one KV head of the model's two: rank 0's holds {leader['pool_kv_heads']}, "
        f"rank 1's {follower['pool_kv_heads']}")
