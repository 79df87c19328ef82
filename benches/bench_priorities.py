"""Day 3.4's lab: interactive and batch traffic together, first-come-first-served against priorities.

    pdm run bench-priorities                   # Qwen2-0.5B shape, float32
    pdm run bench-priorities --quick           # fewer, shorter requests
    pdm run bench-priorities --model embedded  # the tiny embedded model (seconds; figures mean nothing)
    pdm run bench-priorities --solution student   # your priority scheduler and engine

Workload (random prompt token ids, greedy, fixed seeds):
  batch:       `--batch` requests of `--batch-tokens` prompt tokens and `--batch-output` output tokens,
               all at t=0, priority 0;
  interactive: `--interactive` requests of `--interactive-tokens` prompt tokens and
               `--interactive-output` output tokens, Poisson arrivals at `--rate`/s from t=1 s, priority 1.
Three runs on the same weights and token budget: the interactive class alone; both classes under
FCFS (scheduling_policy "fcfs": priorities ignored); both under scheduling_policy "priority".
Printed side by side: the interactive class's TTFT p50/p99 and ITL p99 (day 2.2's percentiles,
interpolated), its TTFT p99 in engine steps and in model tokens run (figures a busy machine does
not change), the batch class's output throughput, preemptions, and the ratios to the
interactive-alone run. Results: benches/results/priorities.json (--out) and the plot
priorities_ttft.png beside it (the chapter's copy is book/src/images/week3-04-ttft.png).
"""

from course import fast_mlx

fast_mlx.setup()

from benches import lab, runner, workloads  # noqa: E402
from benches.engines import Week3  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-priorities"
COLUMNS = [lab.Column("run", "label", "{}"), lab.Column("TTFT p50 s", "interactive_ttft_p50_s", "{:.3f}"),
           lab.Column("TTFT p99 s", "interactive_ttft_p99_s", "{:.3f}"),
           lab.Column("ITL p99 s", "interactive_itl_p99_s", "{:.3f}"),
           lab.Column("batch tok/s", "batch_output_tokens_per_s"), lab.Column("preemptions", "num_preemptions", "{}"),
           lab.Column("TTFT p99 steps", "interactive_ttft_p99_steps", "{:.1f}"),
           lab.Column("TTFT p99 tokens", "interactive_ttft_p99_tokens", "{:.0f}")]
PLANS = [("interactive alone", "fcfs", False), ("FCFS", "fcfs", True), ("priority", "priority", True)]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="priorities.json")
    lab.options(parser, batch=4, batch_tokens=512, batch_output=32, interactive=10, interactive_tokens=24,
                interactive_output=8, rate=(0.5, "interactive arrivals per second"),
                budget=(64, "the engine's token_budget"))
    return parser


def workload(args, with_batch: bool):
    return workloads.interactive_and_batch(args.batch, args.batch_tokens, args.batch_output, args.interactive,
                                           args.interactive_tokens, args.interactive_output, args.rate, with_batch)


def ratio(a, b):
    return None if a is None or not b else a / b


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch_tokens, args.interactive = 256, 6
    lab.check_positive(PROG, args, "batch", "batch_tokens", "batch_output", "interactive", "interactive_tokens",
                       "interactive_output", "budget")
    bench = lab.start(args, ("engine", "order_policy", "qwen2_week3"))
    model = bench.week3_model()
    runs = {}
    for label, policy, with_batch in lab.progress(PLANS, "runs"):
        engine = Week3(bench.selection, model, bench.tokenizer, **dict(PLAIN_ENGINE, scheduling_policy=policy),
                       token_budget=args.budget, max_num_seqs=8, block_size=16)
        runs[label] = runner.run(engine, workload(args, with_batch), label)
    rows = [runner.summarize(run) for run in runs.values()]
    lab.print_table(f"batch: {args.batch} x {args.batch_tokens}+{args.batch_output} tokens at t=0; interactive: "
                    f"{args.interactive} x {args.interactive_tokens}+{args.interactive_output}, Poisson {args.rate}/s; "
                    f"budget {args.budget}", COLUMNS, rows)
    alone, fcfs, prio = rows
    ratios = {f"{name}_{figure}_vs_alone": ratio(row[f"interactive_{figure}"], alone[f"interactive_{figure}"])
              for name, row in (("fcfs", fcfs), ("priority", prio))
              for figure in ("ttft_p99_s", "itl_p99_s", "ttft_p99_tokens")}
    ratios["batch_throughput_priority_vs_fcfs"] = ratio(prio["batch_output_tokens_per_s"],
                                                        fcfs["batch_output_tokens_per_s"])
    print(f"interactive TTFT p99 vs alone: FCFS {ratios['fcfs_ttft_p99_s_vs_alone']:.1f}x, priority "
          f"{ratios['priority_ttft_p99_s_vs_alone']:.1f}x (in model tokens run before the first token: FCFS "
          f"{ratios['fcfs_ttft_p99_tokens_vs_alone']:.1f}x, priority {ratios['priority_ttft_p99_tokens_vs_alone']:.1f}x); "
          f"batch throughput priority/FCFS {ratios['batch_throughput_priority_vs_fcfs']:.2f}")
    plot = lab.ttft_plot(bench, runs, "interactive",
                         "Interactive TTFT: alone, under batch load (FCFS), under batch load (priority)")
    return bench.save({"figures": rows, "ratios": ratios,
                       "token_times": {label: runner.token_times(run) for label, run in runs.items()}}, [plot])


if __name__ == "__main__":
    raise SystemExit(main())
