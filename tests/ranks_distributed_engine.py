"""What each rank runs for day 4.4's tests: `python -m tests.ranks_distributed_engine --checks NAMES [--die-rank R]`
under mlx.launch (tests/harness.py's `RankLaunches`).

Every rank builds the code its launch names the way the tests do (`launched()`: the student's Task 3
alone for "engine", their stack so far for "stack"), and with it day 4.3's sharded model.
"engine": rank 0 runs week 3's engine across the ranks (`TensorParallelEngine`) over PROMPTS on the
embedded checkpoint, then shuts it down; every other rank follows its plans (`follow_engine(...).follow()`).
Each rank writes what it saw to `rank<r>.json` (course/ranks.py): rank 0 its outputs and the
oracles' (the single-process week-3 engine of the reference on the whole model, and mlx-lm's model
recomputing every token), every rank the steps it ran, how often it sampled and its pool's shape.
"stack", your stack so far (the student's week-3 engine, day-4.3 shards and day-4.4 distribution
together), serves week 3's pressure and seeded-sampling workloads (tests/week3_stack.py) on the
sharded tiny model: rank 0 runs `TensorParallelEngine`, the others follow, one engine per workload;
its record is added after the engine's is written, so a stack that breaks the ranks cannot take the
other results of the same launch with it. With `--die-rank R`, rank R exits after its first step (and
nothing else runs): rank 0 must then fail with `RankLost`, not wait.
"""

from course import fast_mlx

fast_mlx.setup(quiet=True)

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

import mlx.core as mx  # noqa: E402

from course import ranks  # noqa: E402
from course.models import load_model  # noqa: E402
from tests import week3_stack  # noqa: E402
from tests.harness import actor_fakes, fetch, launched, reference  # noqa: E402

# Prompts of several lengths; the longest needs two chunks of the budget, so decodes and prefill
# chunks share steps, and the pool is small enough that the run preempts and recomputes.
PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 7, 300, 9001, 17, 5, 88, 3, 1000, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [151000, 12], [500 + i for i in range(11)]]
MAX_TOKENS = 8
STEP_LIMIT = 200
DIED = 3  # the exit status of a rank told to die


# Your stack so far: (name, requests, EngineConfig fields) of each engine rank 0 runs and the others follow.
STACK_RUNS = [
    ("pressure", week3_stack.pressure_requests(4), dict(token_budget=16, max_num_seqs=4, block_size=4, num_blocks=14)),
    ("seeded sampling", week3_stack.seeded_requests(), dict(token_budget=16, max_num_seqs=4, block_size=4, num_blocks=10)),
]
STACK_OPTIONS = week3_stack.engine_options(4)  # prefix caching and priorities on, as a server runs them


def engine_config(sol):
    """The one configuration of every engine here (rank 0's, the others' pools, the single-process oracle)."""
    return sol.engine.EngineConfig(**week3_stack.PLAIN_ENGINE, token_budget=16, max_num_seqs=4, block_size=4, num_blocks=14)


def run_engine(engine, sol) -> dict:
    """Every prompt through `engine` to the end (bounded); outputs in prompt order, and the pool after."""
    seqs = [engine.add_request(prompt, sol.sequence.SamplingParams(max_tokens=MAX_TOKENS)) for prompt in PROMPTS]
    for _ in range(STEP_LIMIT):
        if not engine.has_work():
            break
        engine.step()
    return {"outputs": [seq.output_token_ids for seq in seqs], "unfinished": engine.has_work(),
            "free_blocks": engine.block_manager.num_free_blocks, "num_blocks": engine.block_manager.num_blocks,
            "preemptions": engine.num_preemptions, "steps": engine.num_steps}


def mlx_lm_greedy(mlx_model, prompt: list[int]) -> list[int]:
    """mlx-lm's model, whole, every token recomputed: the single-process oracle."""
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        tokens.append(mx.argmax(mlx_model(mx.array([tokens]))[0, -1]).item())
    return tokens[len(prompt):]


def count_samples(sol, runner):
    """A counter of the calls of the wrapped week-3 runner's `sample` on this rank, built where `sol`'s code runs
    (read back with `samples_counted`). Only rank 0 must sample: rank 0's count is checked against its steps.

    Taken on trust: no sound check exists. A follower's pick changes no output (all_sum hands every rank the same
    logits, and rank 0's token is the one every rank is sent next), and the counter is the actor's, so a follower
    could sample and rewrite it, or pick its tokens without the runner. It catches an honest follower that calls
    `sample`, not a forged count (only time would show the waste, and tests never time)."""
    return actor_fakes(sol, "week4_late").SampleCounter(runner)


def samples_counted(counter) -> int:
    [[calls]] = fetch([counter], "calls")
    return calls


def lead(sol, model, tokenizer, mlx_model, die_rank) -> dict:
    """Rank 0: the engine across the ranks, then the oracles."""
    engine = sol.distributed_engine.TensorParallelEngine(model, tokenizer, engine_config(sol))
    sampled = count_samples(sol, engine.runner)
    try:
        got = run_engine(engine, sol)
        engine.shutdown()
    except sol.distributed_engine.RankLost as error:
        return {"lost": str(error)}
    if die_rank is not None:
        return got
    ref = reference()
    single = ref.engine.LLMEngine(ref.qwen2_week3.Qwen2ModelWeek3(mlx_model), tokenizer, engine_config(ref))
    return {**got, "sample_calls": samples_counted(sampled), "pool_shape": list(engine.runner.pool.keys[0].shape),
            "single_process": run_engine(single, ref), "mlx_lm": [mlx_lm_greedy(mlx_model, p) for p in PROMPTS]}


def follow(sol, model, die: bool) -> dict:
    """Every other rank: follow rank 0's plans until it stops."""
    runner = sol.distributed_engine.follow_engine(model, engine_config(sol))
    sampled = count_samples(sol, runner)
    fakes = actor_fakes(sol, "week4_late")
    if die:
        fakes.DieOnStep(runner, 2)  # raises as this rank starts its second step, after one plan run with the others
    try:
        steps = runner.follow()
    except fakes.ToldToDie:
        os._exit(DIED)  # this rank is gone, without a word to the others
    return {"steps": steps, "sample_calls": samples_counted(sampled), "pool_shape": list(runner.pool.keys[0].shape)}


def lead_stack(package, model) -> dict:
    """Rank 0 of your stack: each of STACK_RUNS through your TensorParallelEngine, then the stop message.

    Every stream is checked against mlx-lm's model on the request alone, and every block must be back.
    """
    failures, steps, fakes = [], [], actor_fakes(package)
    for name, requests, options in STACK_RUNS:
        probe = fakes.ModelProbe(model)  # built where the engine runs: it reads the probe at every step
        config = package.engine.EngineConfig(**options, **STACK_OPTIONS)
        engine = package.distributed_engine.TensorParallelEngine(probe, fakes.StackTokenizer(), config,
                                                                 clock=probe.clock)
        run = week3_stack.Run(engine, probe, requests, options["max_num_seqs"])
        try:
            run.drive()
            run.check_outputs()
            run.check_clean()
        except AssertionError as error:
            failures.append(f"{name}: {error}")
        finally:
            engine.shutdown()
        steps.append(engine.num_steps)
    return {"failures": failures, "steps": steps, "pool_kv_heads": engine.runner.pool.keys[0].shape[1]}


def follow_stack(package, model) -> dict:
    """Every other rank of your stack: follow each of STACK_RUNS' engines until rank 0 stops it."""
    steps, sample_calls = [], 0
    for _, _, options in STACK_RUNS:
        runner = package.distributed_engine.follow_engine(model, package.engine.EngineConfig(**options, **STACK_OPTIONS))
        sampled = count_samples(package, runner)
        steps.append(runner.follow())
        sample_calls += samples_counted(sampled)
    return {"steps": steps, "sample_calls": sample_calls, "pool_kv_heads": runner.pool.keys[0].shape[1]}


def run_stack(package, group) -> dict:
    model = package.tensor_parallel.Qwen2TensorParallel(week3_stack.tiny_mlx_model(), group)
    return lead_stack(package, model) if group.rank() == 0 else follow_stack(package, model)


CHECKS = ("engine", "stack")  # what --checks may name, in the order they run


def run_engine_checks(sol, group, die_rank) -> dict:
    """"engine": rank 0 leads PROMPTS through the ranks, the others follow."""
    mlx_model, tokenizer = load_model("embedded")
    model = sol.tensor_parallel.Qwen2TensorParallel(mlx_model, group)
    if group.rank() == 0:
        return lead(sol, model, tokenizer, mlx_model, die_rank)
    return follow(sol, model, group.rank() == die_rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", required=True, type=lambda text: text.split(","),
                        help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--die-rank", type=int, default=None)
    args = parser.parse_args()
    if set(args.checks) - set(CHECKS):
        parser.error(f"unknown checks {sorted(set(args.checks) - set(CHECKS))}; known: {', '.join(CHECKS)}")
    group = ranks.join()
    sol = launched()
    if args.die_rank is not None and group.rank() != args.die_rank:
        # mlx.launch terminates the other ranks when one fails: ignore it here, so that what is tested is
        # this rank's own reaction to the lost peer (the launch's timeout still bounds the run).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    result, running = {}, "engine"
    try:
        if "engine" in args.checks:
            result = run_engine_checks(sol, group, args.die_rank)
            ranks.write_result(group.rank(), result)
        running = "stack"
        if "stack" in args.checks and args.die_rank is None:
            ranks.write_result(group.rank(), {**result, "stack": run_stack(sol, group)})
    except Exception as error:  # noqa: BLE001 - the student's code may raise anything; the test reports it
        # Recorded for the part that raised (the stack's beside the engine's, once that is written); then the
        # launch ends (the other ranks may wait for this one in a collective).
        record = ({"not_implemented": str(error)} if isinstance(error, NotImplementedError)
                  else {"error": "".join(traceback.format_exception_only(error)).strip()})
        ranks.write_result(group.rank(), {**result, "stack": record} if running == "stack" else record)
        os._exit(1)


if __name__ == "__main__":
    main()
