"""Week 3 Day 2: a paged KV cache, admission by memory, preemption (book/src/week3-02-paged-kv-cache.md).

Oracles: plain arithmetic for slots and block counts; MLX indexing for the pool; a fake runner that
simulates the pool slot by slot and checks every sampled sequence reads back its own tokens
(tests/week3_fakes.py); a hypothesis property test of the pool's accounting after every step of
random workloads; mlx-lm's own Qwen2, one request at a time, for outputs with and without paging
and with forced preemptions.

Day 3.1's parts of scheduler.py (the planner) come from the reference here, except in Task 4, which
runs days 3.1 and 3.2 of the student's code together as one engine (tests/week3_stack.py). The engines
are built from the package under test, so while grading they run whole in the sandbox; Task 3's run on
the real model takes the student's Task 3 alone (`solution(week=3, day=2, task=3)`: the reference's pool).
"""

import random

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import actor_fakes, fetch, reference, solution, stack
from tests.week3_fakes import EOS, PLAIN_ENGINE, fake_expected, mlx_lm_greedy, outputs_of, replay, trace_runner
from tests.week3_stack import check_stack

STACK = stack(week=3, day=2)  # "your stack so far": started now, beside the collection
sol = solution(week=3, day=2)
ref = reference()

def make_engine(package, model, tokenizer, **kwargs):
    """The reference engine on the block manager and scheduler under test (day 3.1's parts of the scheduler come
    from the reference: the selector). All of it is `package`'s (its engine module is the reference's): while
    grading it lives in the sandbox with the sequences the scheduler fills."""
    log = kwargs.pop("log", None)
    config = package.engine.EngineConfig(**{**PLAIN_ENGINE, "block_size": 4, "num_blocks": 64, "max_num_seqs": 3,
                                            **kwargs})
    engine = package.engine.LLMEngine(model, tokenizer, config, log=log)
    engine.block_manager = package.block_manager.BlockManager(config.pool_blocks, config.block_size)
    old = engine.scheduler
    engine.scheduler = package.scheduler.Scheduler(engine.block_manager, old.token_budget, old.max_num_seqs,
                                                  old.order, old.eos_token_ids, engine.log)
    return engine


def fake_engine(**kwargs):
    """The engine over the trace runner (check its run with `replay(engine, block_size, outputs)`)."""
    fakes = actor_fakes(sol)  # read at every step: built where the engine runs
    engine = make_engine(sol, fakes.FakeWeek3Model(), fakes.FakeTokenizer(), **kwargs)
    engine.runner = trace_runner(sol, engine)
    return engine


def run_to_end(engine, check=True, max_steps=2000):
    """Step until done, checking the pool after every step; a scheduler that stops making progress fails."""
    has_work, step = engine.has_work, engine.step  # read once (while grading, a round trip each)
    for _ in range(max_steps):
        if not has_work():
            return
        step()
        if check:
            check_pool(engine)
    raise AssertionError(f"the engine made no progress in {max_steps} steps (every request ends, preempted ones "
                         f"recomputed): {engine.num_running} running, {engine.num_waiting} waiting")


def check_pool(engine):
    """The pool's accounting: every block free or held by exactly one running sequence, and enough of them."""
    # Read at once (while grading, the engine is the submission's: a round trip per fetch, not per attribute).
    [(running, waiting, free, num_free, num_blocks, block_size)] = fetch(
        [engine], "scheduler.running", "scheduler.waiting", "block_manager.free_blocks",
        "block_manager.num_free_blocks", "block_manager.num_blocks", "block_manager.block_size")
    running = fetch(running, "block_table", "num_computed_tokens")
    held = [b for table, _ in running for b in table]
    assert len(held) == len(set(held)), "a block is held twice"
    assert not set(held) & set(free), "a held block is also free"
    assert len(held) + num_free == num_blocks, "blocks leaked"
    for table, computed in fetch(waiting, "block_table", "num_computed_tokens"):
        assert table == [] and computed == 0
    for table, computed in running:
        assert len(table) * block_size >= computed


# ---------------------------------------------------------------- Task 1: blocks


def test_task_1_block_manager_allocates_as_sequences_grow():
    manager = sol.block_manager.BlockManager(num_blocks=5, block_size=4)
    # The sequences are the package's own (sequence.py is provided code): while grading they live in the sandbox
    # with the manager that fills their block tables, and the test reads the tables back as data.
    seq = sol.sequence.Sequence("a", [1] * 6)
    assert manager.num_free_blocks == 5
    assert manager.blocks_needed(seq, 6) == 2 and manager.can_allocate(seq, 6)
    manager.allocate(seq, 6)
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 3
    manager.allocate(seq, 8)  # still within its second block
    assert len(seq.block_table) == 2
    manager.allocate(seq, 9)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 2
    other = sol.sequence.Sequence("b", [1] * 9)
    assert manager.blocks_needed(other, 9) == 3 and not manager.can_allocate(other, 9)
    with pytest.raises(RuntimeError):
        manager.allocate(other, 9)
    assert other.block_table == [] and manager.num_free_blocks == 2, "a failed allocation takes nothing"
    manager.allocate(other, 8)
    assert not set(other.block_table) & set(seq.block_table)
    manager.free(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 3
    assert manager.usage == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        sol.block_manager.BlockManager(0, 4)


# ---------------------------------------------------------------- Task 2: reading through the block table


def test_task_2_slot_mapping():
    table = [7, 2, 5]
    assert sol.block_manager.slot_mapping(table, 0, 10, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert sol.block_manager.slot_mapping(table, 5, 6, 4) == [9]
    assert sol.block_manager.slot_mapping(table, 3, 3, 4) == []


def test_task_2_pool_write_and_gather():
    pool = sol.block_manager.KvPool(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3)
    keys = mx.arange(12, dtype=mx.float32).reshape(4, 1, 3)
    pool.write(1, mx.array([6, 7, 0, 3]), keys, -keys)
    got_keys, got_values = pool.gather(1, mx.array([[0, 6], [3, 7]]))
    assert got_keys.shape == (2, 2, 1, 3)
    assert mx.array_equal(got_keys[0, 1], keys[0]).item() and mx.array_equal(got_keys[1, 0], keys[3]).item()
    assert mx.array_equal(got_values[0, 0], -keys[2]).item()
    assert mx.array_equal(pool.keys[0], mx.zeros_like(pool.keys[0])).item(), "other layers untouched"


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_task_2_outputs_identical_with_and_without_paging(model32, block_size, monkeypatch):
    """block_size 64 holds every sequence in one contiguous block: no paging at all.

    The model and its runner read and write the KV cache through your `slot_mapping` and `KvPool`.
    """
    monkeypatch.setattr(sol.model_runner, "slot_mapping", sol.block_manager.slot_mapping)
    monkeypatch.setattr(sol.qwen2_week3, "KvPool", sol.block_manager.KvPool)
    mlx_model, tokenizer = model32
    model = sol.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 5000) for _ in range(n)] for n in (11, 4, 23)]
    expected = [mlx_lm_greedy(mlx_model, p, 8, tokenizer.eos_token_ids) for p in prompts]
    engine = make_engine(sol, model, tokenizer, block_size=block_size, num_blocks=256 // block_size,
                         token_budget=8)
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=8)) for p in prompts]
    run_to_end(engine)
    assert [s.output_token_ids for s in seqs] == expected


# ---------------------------------------------------------------- Task 3: admission and preemption


def test_task_3_admission_by_free_blocks():
    engine = fake_engine(block_size=4, num_blocks=3, token_budget=64, max_num_seqs=8)
    for i in range(3):
        engine.add_request([1, 2, 3, 4, 5, 6], ref.sequence.SamplingParams(max_tokens=2), request_id=i)
    plan = engine.scheduler.schedule()
    # 3 blocks: request 0 takes 2, request 1 gets its first 4 tokens into the last one; 2 waits.
    assert [(c.seq.request_id, c.length) for c in plan.prefills] == [(0, 6), (1, 4)]
    assert engine.num_waiting == 1 and engine.block_manager.num_free_blocks == 0


def test_task_3_preemption_recomputes_to_the_same_output():
    log = actor_fakes(sol, "week3").Lines()  # the engine's log sink, beside it
    engine = fake_engine(block_size=2, num_blocks=8, token_budget=32, max_num_seqs=4, log=log)
    prompts = [[i + 1] * 5 for i in range(4)]
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=10)) for p in prompts]
    run_to_end(engine)
    assert engine.num_preemptions > 0 and any("preempt" in line for line in log.lines)
    outputs = outputs_of(seqs)
    replay(engine, 2, outputs)  # recomputed after preemption: every history read back whole, no token sampled twice
    for prompt, output in zip(prompts, outputs.values()):
        assert output == fake_expected(prompt, 10)
    assert engine.block_manager.num_free_blocks == 8


def test_task_3_forced_preemption_real_model(model32):
    # The student's Task 3 alone: the pool and slot mapping (Task 2) and the blocks (Task 1) are the reference's.
    task_3 = solution(week=3, day=2, task=3)
    mlx_model, tokenizer = model32
    model = task_3.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    rng = random.Random(9)
    prompts = [[rng.randrange(100, 5000) for _ in range(n)] for n in (7, 12, 5)]
    expected = [mlx_lm_greedy(mlx_model, p, 10, tokenizer.eos_token_ids) for p in prompts]
    engine = make_engine(task_3, model, tokenizer, block_size=2, num_blocks=12, token_budget=16)
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=10)) for p in prompts]
    run_to_end(engine)
    assert engine.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected


def test_task_3_no_leaks_on_abort_and_error():
    engine = fake_engine(block_size=2, num_blocks=16)
    for i in range(3):
        engine.add_request([1, 2, 3], ref.sequence.SamplingParams(max_tokens=6), request_id=i)
    engine.step()
    engine.abort(1)
    engine.abort(1)  # already gone: nothing happens
    check_pool(engine)
    engine.runner.fail_on_step = engine.runner.num_plans + 1
    with pytest.raises(RuntimeError, match="model failed"):
        engine.step()
    assert not engine.has_work() and engine.block_manager.num_free_blocks == 16
    replay(engine, 2, {})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    max_tokens=st.integers(1, 8),
    budget=st.integers(3, 20),
    block_size=st.integers(1, 4),
    spare_blocks=st.integers(0, 6),
    abort_at=st.integers(0, 30),
)
def test_task_3_pool_accounting_holds_after_every_step(lengths, max_tokens, budget, block_size,
                                                        spare_blocks, abort_at):
    # Just enough blocks for the longest request alone, plus a few: preemption is common.
    longest = max(lengths) + max_tokens
    num_blocks = -(-longest // block_size) + spare_blocks
    engine = fake_engine(block_size=block_size, num_blocks=num_blocks,
                         token_budget=budget, max_num_seqs=3)
    prompts = [[(7 * i + j) % EOS for j in range(n)] for i, n in enumerate(lengths)]
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=max_tokens)) for p in prompts]
    steps = 0
    runner = engine.runner
    while engine.has_work():  # at most 2000 steps: the assertion at the end of the body
        plan_count = runner.num_plans
        engine.step()
        steps += 1
        assert runner.num_plans == plan_count + 1, "a step with work ran nothing"
        check_pool(engine)
        if steps == abort_at:
            engine.abort(0)
        assert steps < 2000, f"the engine made no progress in 2000 steps (every request ends, preempted ones " \
                             f"recomputed): {engine.num_running} running, {engine.num_waiting} waiting"
    assert engine.block_manager.num_free_blocks == num_blocks
    outputs = outputs_of(seqs)
    trace = replay(engine, block_size, outputs).trace  # every plan run, checked here slot by slot
    assert all(sum(length for *_, length, _ in plan) <= budget for plan in trace), "a step over the token budget"
    for prompt, (output, reason) in zip(prompts, outputs.values()):
        if reason != "abort":
            assert (output, reason) == fake_expected(prompt, max_tokens)


# ---------------------------------------------------------------- Task 4: your stack so far


def test_task_4_your_stack_so_far():
    """Your week-3 code up to this day as one engine, on the workloads a server meets (tests/week3_stack.py)."""
    check_stack(STACK, day=2)
