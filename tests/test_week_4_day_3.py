"""Week 4 Day 3: tensor parallelism (book/src/week4-03-tensor-parallelism.md).

Oracles: mlx-lm's own Qwen2 (its MLP, its attention, its whole model) on the same weights, run whole
in one process; array identities for the splits (the blocks put back together are the matrix; the
partial products add up to the full one). Two kinds of test:

- in this process, with a stand-in group that only answers rank() and size(): what each rank keeps,
  and each rank's output under a simulated all_sum (its argument plus the other ranks' partials,
  computed beforehand from their local parts), which must be the whole layer's output;
- across two real ranks, `mlx.launch -n 2 --backend ring` on loopback (course/ranks.py): each rank runs
  tests/ranks_tensor_parallel.py, which builds the code its launch names as these tests do; one launch
  per task (`LAUNCHES`, made when its first test runs), and one for your stack so far (your week-3
  engine and model, sharded by your day-4.3 code) on week 3's workloads; another kills a rank on purpose.

Each task's tests, in this process and on the ranks, take your code for that task alone
(`solution(week=4, day=3, task=N)`: the reference's for the day's other tasks), so a bug in one task
never costs another its points; your stack so far runs all of your code together.

Tolerance: float32 sums taken in another order (each rank sums half the features, then all_sum adds
the halves), so |got - mlx-lm| <= 1e-4 + 1e-5 x the largest |value| of mlx-lm's output.
"""

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from course import ranks
from tests.harness import RankLaunches, actor_fakes, solution
from tests.ranks_tensor_parallel import DIED, TOKENS, prefill, rope_angles
from tests.week4_stack import two_rank_stack_records

TASKS = {n: solution(week=4, day=3, task=n) for n in range(1, 5)}  # Task N's tests: the student's Task N alone

WORLD = 2
# Seconds for both ranks to start, load the embedded model and run every check: about 10 on two idle
# cores, and under the grader's 60 s per test; a machine shared with other work may need more.
LAUNCH_TIMEOUT = float(os.environ.get("TINY_LLM_RANKS_TIMEOUT", "55"))
RANKS_PROGRAM = [sys.executable, "-m", "tests.ranks_tensor_parallel"]
# Each launch: whose code its ranks run (tests/harness.py's RankLaunches), and the checks they make with it.
LAUNCHES = {"task2": ["mlp"], "task3": ["attention"], "task4": ["model"], "stack": ["stack"]}


def stand_in_group(package, rank: int, size: int):
    """A group that only answers rank() and size(), built where `package`'s code runs (tests/actor_fakes/week4_late.py)."""
    return actor_fakes(package, "week4_late").StandInGroup(rank, size)


@contextlib.contextmanager
def simulated_all_sum(package, partials: list[mx.array]):
    """`mx.distributed.all_sum` as rank r of a stand-in group sees it, for `package`'s code: its own argument plus
    the other ranks' partials.

    With `partials[r]` what rank r's local part computes, a rank that all_sums its partial gets the full
    output; one that skips the all_sum keeps its partial, and one that sums anything else gets garbage. The
    stand-in is built where the code under test runs (no call-back into this process); the expected output is
    mlx-lm's, computed here. (The stand-in holds the partials, which the code under test could read; it could as
    well compute the whole layer from the weights it is handed: what is graded is each rank's shards, checked
    above, and that rank r's own output, all_summed, is the layer's.)
    """
    distributed = package.tensor_parallel.mx.distributed  # where the code under test runs (while grading, its sandbox)
    real = distributed.all_sum
    distributed.all_sum = actor_fakes(package, "week4_late").AllSumOfOthers(partials)
    try:
        yield
    finally:
        distributed.all_sum = real


def assert_close(got: mx.array, expected: mx.array, what: str):
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    error, scale = mx.abs(got - expected).max().item(), mx.abs(expected).max().item()
    assert error <= 1e-4 + 1e-5 * scale, f"{what}: off by up to {error:.3g} (largest value {scale:.3g})"


@pytest.fixture(scope="module")
def week3(model32):
    """`week3(N)`: (unsharded week-3 model, built by Task N's package; mlx-lm model), on the embedded weights, float32."""
    mlx_model, _ = model32

    @functools.cache
    def of_task(task: int):
        return TASKS[task].qwen2_week3.Qwen2ModelWeek3(mlx_model), mlx_model

    return of_task


@pytest.fixture(scope="module")
def two_ranks():
    """The module's two-rank launches (tests/ranks_tensor_parallel.py), each made when a test first needs it."""
    return RankLaunches(RANKS_PROGRAM, 4, 3, LAUNCHES, WORLD, LAUNCH_TIMEOUT)


def rank_checks(run: ranks.RankRun, name: str) -> list[dict]:
    """Every rank's record of check `name`; an unwritten task surfaces as the skeleton's NotImplementedError."""
    failure = run.failure()
    assert failure is None, f"the two-rank run did not finish: {failure}"
    records = [result[name] for result in run.results]
    for rank, record in enumerate(records):
        if "not_implemented" in record:
            raise NotImplementedError(record["not_implemented"])
        assert "error" not in record, f"rank {rank} raised: {record['error']}"
    return records


def assert_rank_close(record: dict, what: str):
    assert record["shape"] == record["expected_shape"], f"{what}: shape {record['shape']}, expected {record['expected_shape']}"
    error, scale = record["max_abs_diff"], record["scale"]
    assert error <= 1e-4 + 1e-5 * scale, (
        f"{what}: off from mlx-lm's by up to {error:.3g} (largest value {scale:.3g}); "
        "a missing all_sum leaves each rank with its partial sum only")


# ---------------------------------------------------------------- Task 1: splitting a weight


@pytest.mark.parametrize("world", [1, 2, 4])
def test_task_1_split_outputs_keeps_a_block_of_rows(world):
    w = mx.random.normal((8, 6), key=mx.random.key(0))
    x = mx.random.normal((3, 6), key=mx.random.key(1))
    shards = [TASKS[1].tensor_parallel.split_outputs(w, rank, world) for rank in range(world)]
    assert all(s.shape == (8 // world, 6) for s in shards), [s.shape for s in shards]
    assert mx.array_equal(mx.concatenate(shards, axis=0), w), "the ranks' rows, in rank order, must be the weight"
    # Column-parallel: each rank computes its own block of the outputs, in full.
    for rank, shard in enumerate(shards):
        assert mx.allclose(x @ shard.T, (x @ w.T)[:, rank * 8 // world : (rank + 1) * 8 // world], atol=1e-5)
    bias = mx.arange(8)
    assert mx.array_equal(TASKS[1].tensor_parallel.split_outputs(bias, world - 1, world), bias[8 - 8 // world :])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_task_1_split_inputs_partial_products_add_up(world):
    w = mx.random.normal((4, 6), key=mx.random.key(2))
    x = mx.random.normal((3, 6), key=mx.random.key(3))
    share = 6 // world
    total = mx.zeros((3, 4))
    for rank in range(world):
        shard = TASKS[1].tensor_parallel.split_inputs(w, rank, world)
        assert shard.shape == (4, share), f"rank {rank} keeps {shard.shape}, expected (4, {share})"
        # Row-parallel: the rank sees only its block of the input features; its product is a partial sum.
        total = total + x[:, rank * share : (rank + 1) * share] @ shard.T
    assert mx.allclose(total, x @ w.T, atol=1e-5), "the ranks' partial products must add up to x @ W^T"


def test_task_1_uneven_split_is_refused():
    w = mx.zeros((6, 10))
    with pytest.raises(ValueError, match="divide"):
        TASKS[1].tensor_parallel.split_outputs(w, 0, 4)
    with pytest.raises(ValueError, match="divide"):
        TASKS[1].tensor_parallel.split_inputs(w, 0, 4)


# ---------------------------------------------------------------- Task 2: the sharded MLP


def test_task_2_mlp_shards_and_their_sum(week3):
    full, mlx_model = week3(2)
    mlp = full.layers[0].mlp
    x = mx.random.normal((TOKENS, full.args.hidden_size), key=mx.random.key(4))
    shards = [TASKS[2].tensor_parallel.ShardedMLP(mlp, stand_in_group(TASKS[2], rank, WORLD)) for rank in range(WORLD)]
    for rank, shard in enumerate(shards):
        local = shard.local
        assert local.w_gate.shape == local.w_up.shape == (full.args.intermediate_size // WORLD, full.args.hidden_size), (
            f"rank {rank}: gate {local.w_gate.shape}, up {local.w_up.shape}")
        assert local.w_down.shape == (full.args.hidden_size, full.args.intermediate_size // WORLD), f"rank {rank}: down {local.w_down.shape}"
    held = sum(s.local.w_gate.nbytes + s.local.w_up.nbytes + s.local.w_down.nbytes for s in shards)
    assert held == mlp.w_gate.nbytes + mlp.w_up.nbytes + mlp.w_down.nbytes, "the ranks must hold each weight once"
    expected = mlx_model.model.layers[0].mlp(x)
    with simulated_all_sum(TASKS[2], [s.local(x) for s in shards]):
        for rank, shard in enumerate(shards):
            assert_close(shard(x), expected, f"rank {rank}'s MLP output (its partial, all_summed)")


def test_task_2_mlp_on_two_ranks_matches_mlx_lm(two_ranks):
    for rank, record in enumerate(rank_checks(two_ranks.run("task2"), "mlp")):
        assert_rank_close(record, f"rank {rank}'s MLP output")


# ---------------------------------------------------------------- Task 3: the sharded attention


def test_task_3_attention_divides_heads_and_kv_heads(week3):
    full, mlx_model = week3(3)
    attention = full.layers[0].self_attn  # 4 query heads, 2 KV heads
    x = mx.random.normal((TOKENS, full.args.hidden_size), key=mx.random.key(5))
    cos, sin = rope_angles(full, mx.arange(TOKENS))
    shards = [TASKS[3].tensor_parallel.ShardedAttention(attention, stand_in_group(TASKS[3], rank, WORLD)) for rank in range(WORLD)]
    for rank, shard in enumerate(shards):
        local = shard.local
        assert (local.num_heads, local.num_kv_heads) == (attention.num_heads // WORLD, attention.num_kv_heads // WORLD), (
            f"rank {rank} has {local.num_heads} query heads and {local.num_kv_heads} KV heads, expected "
            f"{attention.num_heads // WORLD} and {attention.num_kv_heads // WORLD}")
        assert local.head_dim == attention.head_dim
        kv_rows = attention.num_kv_heads // WORLD * attention.head_dim
        assert local.wk.shape == local.wv.shape == (kv_rows, full.args.hidden_size)
        assert local.wo.shape == (full.args.hidden_size, attention.num_heads // WORLD * attention.head_dim)

    def run(shard, whole: bool):
        pool = TASKS[3].block_manager.KvPool(1, 4, 16, shard.local.num_kv_heads, shard.local.head_dim, full.dtype)
        call = shard if whole else shard.local
        return call(x, prefill(TASKS[3], list(range(TOKENS)), full.dtype), cos, sin, pool, 0)

    expected = mlx_model.model.layers[0].self_attn(x[None], mask="causal")[0]
    with simulated_all_sum(TASKS[3], [run(shard, whole=False) for shard in shards]):
        for rank, shard in enumerate(shards):
            assert_close(run(shard, whole=True), expected, f"rank {rank}'s attention output (its heads, all_summed)")
    with pytest.raises(ValueError, match="divide"):
        TASKS[3].tensor_parallel.ShardedAttention(attention, stand_in_group(TASKS[3], 0, 4))  # 2 KV heads among 4 ranks


def test_task_3_attention_on_two_ranks_matches_mlx_lm(two_ranks):
    for rank, record in enumerate(rank_checks(two_ranks.run("task3"), "attention")):
        assert (record["heads"], record["kv_heads"]) == (2, 1), f"rank {rank}: {record['heads']} heads, {record['kv_heads']} KV heads"
        assert_rank_close(record, f"rank {rank}'s attention output")


# ---------------------------------------------------------------- Task 4: the model on N ranks


def test_task_4_each_rank_holds_its_share_of_every_layer(week3):
    full, mlx_model = week3(4)
    replicated = full.embedding.weight.nbytes + full.norm.weight.nbytes + sum(
        b.input_layernorm.weight.nbytes + b.post_attention_layernorm.weight.nbytes for b in full.layers)
    layer_bytes = sum(a.nbytes for b in full.layers for a in (
        b.self_attn.wq, b.self_attn.wk, b.self_attn.wv, b.self_attn.wo, b.self_attn.bq, b.self_attn.bk,
        b.self_attn.bv, b.mlp.w_gate, b.mlp.w_up, b.mlp.w_down))
    models = [TASKS[4].tensor_parallel.Qwen2TensorParallel(mlx_model, stand_in_group(TASKS[4], rank, WORLD)) for rank in range(WORLD)]
    for rank, tp in enumerate(models):
        assert tp.weight_bytes() == {"sharded": layer_bytes // WORLD, "replicated": replicated}, f"rank {rank}"
        pool = tp.make_kv_pool(2, 16)
        assert pool.keys[0].shape[1] == full.num_kv_heads // WORLD, "each rank's KV pool holds its KV heads only"
    # Every layer's attention and MLP are sharded, and each rank's output all_summed, is mlx-lm's layer's.
    x = mx.random.normal((TOKENS, full.args.hidden_size), key=mx.random.key(6))
    cos, sin = rope_angles(full, mx.arange(TOKENS))
    batch = prefill(TASKS[4], list(range(TOKENS)), full.dtype)
    pools = [tp.make_kv_pool(4, 16) for tp in models]
    for index, block in enumerate(mlx_model.model.layers):
        mlps = [tp.layers[index].mlp for tp in models]
        with simulated_all_sum(TASKS[4], [mlp.local(x) for mlp in mlps]):
            for rank, mlp in enumerate(mlps):
                assert_close(mlp(x), block.mlp(x), f"rank {rank}'s layer {index} MLP")
        attentions = [tp.layers[index].self_attn for tp in models]
        partials = [a.local(x, batch, cos, sin, pool, index) for a, pool in zip(attentions, pools)]
        expected = block.self_attn(x[None], mask="causal")[0]
        with simulated_all_sum(TASKS[4], partials):
            for rank, (attention, pool) in enumerate(zip(attentions, pools)):
                assert_close(attention(x, batch, cos, sin, pool, index), expected, f"rank {rank}'s layer {index} attention")


def test_task_4_logits_on_two_ranks_match_mlx_lm(two_ranks):
    for rank, record in enumerate(rank_checks(two_ranks.run("task4"), "model")):
        assert_rank_close(record, f"rank {rank}'s logits")
        assert record["pool_kv_heads"] == record["model_kv_heads"] // WORLD, f"rank {rank}'s KV pool"


def test_task_4_every_rank_holds_the_same_logits(two_ranks):
    # all_sum hands every rank the same bits, so every rank would sample the same token.
    first, second = (record["logits_checksum"] for record in rank_checks(two_ranks.run("task4"), "model"))
    assert first == second, f"rank 0's logits sum to {first}, rank 1's to {second}"


def test_task_4_greedy_tokens_on_two_ranks_match_mlx_lm(two_ranks):
    for rank, record in enumerate(rank_checks(two_ranks.run("task4"), "model")):
        greedy = record["greedy"]
        assert not greedy["unfinished"], f"rank {rank}: the engine did not finish within its step limit"
        assert greedy["got"] == greedy["expected"], f"rank {rank}: week 3's engine on the sharded model"


# ---------------------------------------------------------------- Task 5: your stack so far


def test_task_5_your_stack_so_far_on_two_ranks(two_ranks):
    """Your week-3 engine and model, sharded by your day-4.3 code, on two ranks: week 3's workloads (refusals,
    preemptions, aborts, EOS, a failing model call, the adaptive budget, seeded sampling, prefix caching,
    priorities), every stream mlx-lm's for the request alone, every rank's pool back to full."""
    for rank, record in enumerate(two_rank_stack_records(TASKS[4], "tensor_parallel", two_ranks.run("stack"))):
        if record["failures"]:
            pytest.fail(f"rank {rank}: {record['failures']}", pytrace=False)


def rank_processes(out_dir: Path) -> list[int]:
    """Processes of ours whose environment names `out_dir` as their rank directory."""
    marker = f"TINY_LLM_RANK_DIR={out_dir}".encode()
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0") and b"Z" not in (entry / "stat").read_bytes().split(b")")[-1][:3]:
                alive.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return alive


def test_task_4_a_dead_rank_ends_the_run(two_ranks):
    with tempfile.TemporaryDirectory() as out_dir:
        run = two_ranks.launch("task4", ["model"], Path(out_dir), "--die-rank", "1")
        if os.path.isdir("/proc"):
            assert rank_processes(Path(out_dir)) == [], "a rank outlived its launch"
    if run.results[0] is not None:  # rank 0 finished: it never met rank 1 in a collective
        record = run.results[0]["model"]
        if "not_implemented" in record:
            raise NotImplementedError(record["not_implemented"])
        pytest.fail(f"rank 0 finished although rank 1 died before the first forward pass: {record}")
    assert not run.timed_out, "the surviving rank waited for the dead one until the time limit"
    assert run.results[1] is None and f"exited with code {DIED}" in run.output, run.output[-2000:]
    assert "rank(s) 0, 1 exited without a result" in run.failure()
