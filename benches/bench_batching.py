"""Continuous batching throughput at batch sizes 1, 2, 4, 8, against mlx-lm's BatchGenerator (days 2.6 and 3.1).

    pdm run bench-batching                     # the Qwen2-0.5B-shape model: 8 requests, 32-token prompts, 16 tokens each
    pdm run bench-batching --quick             # 8 requests of 8 tokens out: about half the time
    pdm run bench-batching --model embedded    # the tiny embedded model (seconds)
    pdm run bench-batching --solution student  # your day 2.6 scheduler and your week-3 engine
    pdm run bench-batching --quick --clock cpu # on a busy shared machine: CPU seconds
    pdm run bench-batching --rounds 5          # each figure the median of 5 alternated runs (default 3)

The same workload (every request arrives at the start, greedy, the same token budget) runs through
day 2.6's scheduler (Qwen2ModelWeek2 + batch.SlotScheduler), week 3's engine (LLMEngine with at most
`batch` sequences running, one model call per step) and mlx-lm's BatchGenerator on the same weights,
at each batch size, in the same process, mlx-lm between our two, `--rounds` times (the order reversed
every other round); each figure is the median round's, since one run of a few seconds moves by a
tenth with the machine. Throughput is generated tokens per
second of the whole run (prefill included), wall clock unless `--clock cpu`: this process's CPU seconds
(all threads), which other processes do not inflate but which give mlx-lm no credit for overlapping
its Python with its computation (`mx.async_eval`). Ours is written from mlx.core operations for teaching,
mlx-lm uses fused kernels (mx.fast.*); on a CPU a step costs about the same in both (its matmuls are most
of it), so week 3's lead is mostly in the passes each request takes: for 16 tokens, 16 model passes in
week 3 (the prompt's step samples the first token), 18 in BatchGenerator (it prefills all but the last
prompt token without sampling, then computes one token past the last, thrown away). The 'steps' columns
count them.
Results: benches/results/batching.json (--out).
"""

from course import fast_mlx

fast_mlx.setup()

from benches import lab, runner, workloads  # noqa: E402
from benches.engines import Day27, MlxLm, Week3  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-batching"
COLUMNS = [lab.Column("batch", "batch_size", "{}"), lab.Column("day2.6 tok/s", "day26_tokens_per_s"),
           lab.Column("week3 tok/s", "week3_tokens_per_s"), lab.Column("mlx-lm tok/s", "mlx_lm_tokens_per_s"),
           lab.Column("day2.6 / mlx", "ratio"), lab.Column("week3 / mlx", "week3_ratio"),
           lab.Column("week3 steps", "week3_steps", "{}"), lab.Column("mlx-lm steps", "mlx_lm_steps", "{}"),
           lab.Column("week3 tokens = mlx-lm's", "same_outputs", "{}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="batching.json")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    lab.options(parser, requests=(8, "requests in the workload"), prompt_tokens=(32, "prompt length"),
                output_tokens=(16, "tokens each request generates"), prefill_step=(128, "day 2.6's chunk size"))
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each engine at each batch size, alternated; the median counts (default 3, "
                             "--quick 1)")
    parser.add_argument("--clock", choices=sorted(runner.CLOCKS), default="wall",
                        help="'cpu': this process's CPU seconds (all threads), which other processes on a busy "
                             "shared machine do not inflate")
    return parser


def engines(bench, model2, model3, batch_size: int) -> list:
    """(name, make_adapter) of the three engines at one batch size, mlx-lm between ours."""
    args, tokenizer, selection = bench.args, bench.tokenizer, bench.selection
    return [("day26", lambda: Day27(selection, model2, tokenizer, batch_size=batch_size, prefill_step=args.prefill_step,
                                    max_seq_len=args.prompt_tokens + args.output_tokens + 1)),
            ("mlx_lm", lambda: MlxLm(bench.mlx_model, tokenizer, batch_size=batch_size)),
            ("week3", lambda: Week3(selection, model3, tokenizer, **PLAIN_ENGINE, token_budget=max(256, batch_size),
                                    max_num_seqs=batch_size))]


def throughput(run) -> dict:
    tokens = sum(len(t) for t in run.outputs.values())
    return {"seconds": run.wall_s, "tokens": tokens, "tokens_per_s": tokens / run.wall_s, "steps": run.steps}


def median_runs(made: list, arrivals, clock, rounds: int) -> dict:
    """Each engine's median run (by throughput) of `rounds` runs, the engines taking turns, reversed every other round."""
    runs: dict[str, list] = {name: [] for name, _ in made}
    for round_ in range(rounds):
        for name, make in made if round_ % 2 == 0 else made[::-1]:
            runs[name].append(runner.run(make(), arrivals, name, clock=clock))
    return {name: sorted(done, key=lambda run: throughput(run)["tokens_per_s"])[len(done) // 2]
            for name, done in runs.items()}


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.output_tokens, args.rounds = min(args.output_tokens, 8), 1
    lab.check_positive(PROG, args, "requests", "prompt_tokens", "output_tokens", "prefill_step", "rounds")
    bench = lab.start(args, ("batch", "qwen2_week2", "engine", "qwen2_week3"))
    model2, model3 = bench.week2_model(), bench.week3_model()
    arrivals = [workloads.Arrival("short", workloads.random_prompt(args.prompt_tokens, seed=i), args.output_tokens)
                for i in range(args.requests)]
    print(f"workload: {args.requests} requests, {args.prompt_tokens}-token prompts, {args.output_tokens} tokens each")
    warm = [workloads.Arrival("short", arrivals[0].prompt, 2)]
    clock = runner.CLOCKS[args.clock]
    for name, make in engines(bench, model2, model3, 1):  # no first-call cost lands on the first batch size
        runner.run(make(), warm, "warm-up", clock=clock)

    rows = []
    for batch_size in lab.progress([int(b) for b in args.batch_sizes.split(",")], "batch sizes"):
        runs = median_runs(engines(bench, model2, model3, batch_size), arrivals, clock, args.rounds)
        figures = {name: throughput(run) for name, run in runs.items()}
        same = sum(runs["week3"].outputs[i] == runs["mlx_lm"].outputs[i] for i in range(args.requests))
        rows.append({"batch_size": batch_size, "ours": figures["day26"], "week3": figures["week3"],
                     "mlx_lm": figures["mlx_lm"], **{f"{n}_tokens_per_s": f["tokens_per_s"] for n, f in figures.items()},
                     "week3_steps": figures["week3"]["steps"], "mlx_lm_steps": figures["mlx_lm"]["steps"],
                     "ratio": figures["day26"]["tokens_per_s"] / figures["mlx_lm"]["tokens_per_s"],
                     "week3_ratio": figures["week3"]["tokens_per_s"] / figures["mlx_lm"]["tokens_per_s"],
                     "same_outputs": f"{same}/{args.requests}"})
    lab.print_table(f"generated tokens per {args.clock} second of the whole run (prefill included)", COLUMNS, rows,
                    caption="'steps': calls of each engine's step (mlx-lm: BatchGenerator.next()). A request of n tokens "
                            "is n model passes for week 3, n + 2 for mlx-lm (a prefill that samples nothing, then n + 1 "
                            "one-token passes, the last thrown away); a step of mlx-lm's that ends a request may also "
                            "prefill the next.\n"
                            "'tokens = mlx-lm's': week 3's greedy outputs identical to mlx-lm's "
                            "(float32 sums in another order may flip a near-tie)")
    return bench.save({"rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
