"""The head-of-line lab (day 2.7): chunked against unchunked prefill, and a chunk-size sweep.

    pdm run bench-chunked-prefill                    # the Qwen2-0.5B-shape model (under 5 minutes on 2 cores)
    pdm run bench-chunked-prefill --quick            # smaller prompts, fewer sweep points (~1.5 minutes)
    pdm run bench-chunked-prefill --model embedded   # the tiny embedded model (about 30 seconds)
    pdm run bench-chunked-prefill --model Qwen/Qwen2-0.5B-Instruct-MLX   # any model, real ones included
    pdm run bench-chunked-prefill --solution student # your src/tiny_llm/batch.py
    pdm run bench-chunked-prefill --adaptive 1.0     # also (a) under AdaptiveChunkPolicy, target ITL 1 s

Workloads (prompts are random token ids; every request decodes greedily to its token budget):
  (a) head of line: a few short requests stream; once each has a few tokens, one long prompt arrives.
      Unchunked, its prefill stalls every short request's next token for the whole prompt.
  (b) mixed: about 20% long prompts and 80% short ones, arriving at random (Poisson) times.
  (c) a sweep of prefill_step over 32 .. 2048 and unchunked, on workload (a).
For each configuration: TTFT p50/p99 and ITL p50/p99 of the short requests, the p99/p50 ITL ratio,
the longest decode stall, the long requests' TTFT, throughput (prompt + output tokens per second of
the whole run) and peak memory above the weights. Results: benches/results/chunked_prefill.json
(--out), plots chunked_prefill_itl.png (ITL over time, chunked against unchunked) and
chunked_prefill_sweep.png beside it.
"""

from course import fast_mlx

fast_mlx.setup()

from benches import lab, runner, workloads  # noqa: E402
from benches.engines import Day27  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-chunked-prefill"
UNCHUNKED = "unchunked"
DEFAULT_STEP = 256  # chosen from the sweep (c) on our machine: see book/src/week2-07-chunked-prefill.md
SWEEP = [32, 64, 128, 256, 512, 1024, 2048]
COLUMNS = [lab.Column("config", "prefill_step", "{}"), lab.Column("TTFT p50", "short_ttft_p50_s"),
           lab.Column("TTFT p99", "short_ttft_p99_s"), lab.Column("ITL p50", "short_itl_p50_s"),
           lab.Column("ITL p99", "short_itl_p99_s"), lab.Column("p99/p50", "short_itl_p99_over_p50", "{:.1f}"),
           lab.Column("stall", "short_longest_stall_s"), lab.Column("long TTFT", "long_ttft_mean_s"),
           lab.Column("tok/s", "total_tokens_per_s", "{:.1f}"), lab.Column("peak MB", "peak_memory_mb", "{:.0f}"),
           lab.Column("chunks", "chunks", "{}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="chunked_prefill.json")
    lab.options(parser, prefill_step=(DEFAULT_STEP, "the chunked configuration of (a) and (b)"),
                batch_size=(5, "decode slots"), shorts=(4, "short requests in (a)"),
                short_tokens=(32, "short prompt length"), short_output=(16, "tokens each short request generates"),
                long_tokens=(1024, "the long prompt of (a) and (c)"), long_output=(4, "tokens a long request generates"),
                mixed_requests=(5, "requests in (b), 20%% of them long"), mixed_long_tokens=(3000, "long prompts of (b)"))
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="prefill_step values of (c), comma-separated")
    parser.add_argument("--adaptive", type=float, metavar="SECONDS",
                        help="also run (a) with AdaptiveChunkPolicy and this decode-latency target")
    parser.add_argument("--skip", default="", help="parts to skip, e.g. 'b' or 'b,c'")
    return parser


def apply_quick(args) -> None:
    """--quick: the same shape of experiment, small enough for about a minute on 2 cores."""
    args.long_tokens = min(args.long_tokens, 512)
    args.mixed_long_tokens = min(args.mixed_long_tokens, 768)
    args.short_output = min(args.short_output, 12)
    args.sweep = "32,128,512"
    if args.prefill_step == DEFAULT_STEP:
        args.prefill_step = 128  # the same quarter of the (shorter) long prompt as the default


def effective_step(step, longest_prompt: int) -> int | str:
    """A chunk at least as long as every prompt is no chunking at all."""
    return UNCHUNKED if step == UNCHUNKED or step >= longest_prompt else step


def run_config(bench, model, arrivals, step, label, policy=None) -> dict:
    """One configuration of day 2.7's scheduler on a workload: its figures and its short requests' ITL timeline."""
    longest = max(len(a.prompt) for a in arrivals)
    max_seq_len = max(len(a.prompt) + a.max_tokens for a in arrivals) + 1
    scheduler = Day27(bench.selection, model, bench.tokenizer, batch_size=bench.args.batch_size,
                      max_seq_len=max_seq_len, prefill_step=max_seq_len if step == UNCHUNKED else step, policy=policy)
    run = runner.run(scheduler, arrivals, label)
    row = runner.summarize(run)
    row["prefill_step"] = step if step != UNCHUNKED and step < longest else UNCHUNKED
    row["itl_timeline"] = runner.itl_points(run, "short")
    return row


def verdict(chunked: dict, unchunked: dict) -> dict:
    """The lab's criterion: ITL p99 chunked <= 1/3 of unchunked, throughput within 15%."""
    itl_ratio = chunked["short_itl_p99_s"] / unchunked["short_itl_p99_s"]
    throughput_ratio = chunked["total_tokens_per_s"] / unchunked["total_tokens_per_s"]
    return {"itl_p99_ratio": itl_ratio, "throughput_ratio": throughput_ratio,
            "pass": itl_ratio <= 1 / 3 and throughput_ratio >= 0.85}


def plot(bench, results: dict) -> list:
    written = []
    a = results.get("a")
    if a:
        path = bench.figure_path("itl")
        with lab.figure(path, bench.machine, figsize=(8, 4)) as (fig, ax):
            lab.plot_series(ax, {f"prefill_step={row['prefill_step']}": row["itl_timeline"]
                                 for row in (a["unchunked"], a["chunked"])})
            ax.set(xlabel="time since start (s)", ylabel="gap to the previous token (s)",
                   title=f"(a) short requests' inter-token latency while a {a['long_tokens']}-token prompt prefills")
        written.append(path)
    sweep = results.get("c")
    if sweep:
        rows, path = sweep["rows"], bench.figure_path("sweep")
        with lab.figure(path, bench.machine, figsize=(8, 4)) as (fig, ax):
            x = range(len(rows))
            ax.plot(x, [r["short_itl_p99_s"] for r in rows], "o-", label="short requests' ITL p99 (s)")
            ax.plot(x, [r.get("long_ttft_mean_s") for r in rows], "s-", label="long prompt's TTFT (s)")
            ax.set_xticks(list(x), [str(r["prefill_step"]).replace("=unch.", "\n(= unch.)") for r in rows])
            ax.set(xlabel="prefill_step (tokens per chunk)", ylabel="seconds",
                   title="(c) the chunk-size sweep: decode latency against time to first token")
            ax2 = ax.twinx()
            ax2.plot(x, [r["total_tokens_per_s"] for r in rows], "^--", color="gray", label="throughput (tokens/s)")
            ax2.set_ylabel("tokens/s")
            ax2.set_ylim(bottom=0)
            lab.legend_below(ax, ax2)
        written.append(path)
    return written


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    lab.check_positive(PROG, args, "prefill_step", "batch_size", "shorts", "short_tokens", "short_output",
                       "long_tokens", "long_output", "mixed_requests", "mixed_long_tokens")
    skip = set(filter(None, args.skip.split(",")))
    bench = lab.start(args, ("batch", "chunk_policy", "qwen2_week2"))
    model = bench.week2_model()
    # Warm up once (first-call costs would land on whichever configuration runs first).
    run_config(bench, model, [workloads.Arrival("short", workloads.random_prompt(8, 0), 2)], 8, "warm-up")

    results: dict = {}
    workload_a = workloads.head_of_line(args.shorts, args.short_tokens, args.short_output, args.long_tokens,
                                        args.long_output, after_tokens=2)
    sweep_steps = [int(s) for s in args.sweep.split(",") if s] + [UNCHUNKED]
    if "c" in skip:
        sweep_steps = [args.prefill_step, UNCHUNKED]
    longest_a = max(len(a.prompt) for a in workload_a)

    # (a) and (c): every distinct effective configuration runs once; (a) reads two of them.
    steps = sorted({effective_step(s, longest_a) for s in sweep_steps + [args.prefill_step]},
                   key=lambda s: float("inf") if s == UNCHUNKED else s)
    rows_by_step = {step: run_config(bench, model, workload_a, step, f"a-{step}")
                    for step in lab.progress(steps, "(a/c) prefill_step")}
    chunked_a = rows_by_step[effective_step(args.prefill_step, longest_a)]
    unchunked_a = rows_by_step[UNCHUNKED]
    results["a"] = {"long_tokens": args.long_tokens, "chunked": chunked_a, "unchunked": unchunked_a,
                    "verdict": verdict(chunked_a, unchunked_a)}
    shown = [unchunked_a, chunked_a]
    if args.adaptive:
        policy = bench.selection.chunk_policy.AdaptiveChunkPolicy(target_itl=args.adaptive)
        print(f"  (a) {policy.describe()} ...", flush=True)
        adaptive = run_config(bench, model, workload_a, args.prefill_step, "a-adaptive", policy=policy)
        adaptive["prefill_step"] = f"adapt {args.adaptive:g}s"
        results["a"]["adaptive"] = adaptive
        shown.append(adaptive)
    lab.print_table(f"(a) head of line: {args.shorts} short requests stream, a {args.long_tokens}-token prompt arrives",
                    COLUMNS, shown, caption="seconds; TTFT and ITL of the short requests; tok/s = prompt + output")
    v = results["a"]["verdict"]
    print(f"ITL p99 chunked / unchunked = {v['itl_p99_ratio']:.2f} (goal <= 0.33); "
          f"throughput chunked / unchunked = {v['throughput_ratio']:.2f} (goal >= 0.85): "
          f"{'PASS' if v['pass'] else 'not met'}")

    if "c" not in skip:
        sweep_rows = []
        for step in sweep_steps:
            row = dict(rows_by_step[effective_step(step, longest_a)])
            row["prefill_step"] = step if effective_step(step, longest_a) != UNCHUNKED or step == UNCHUNKED \
                else f"{step}=unch."
            sweep_rows.append(row)
        results["c"] = {"rows": sweep_rows}
        lab.print_table(f"(c) sweep on workload (a) (a step >= {longest_a} tokens is one chunk: unchunked)",
                        COLUMNS, sweep_rows)

    if "b" not in skip:
        workload_b = workloads.mixed(args.mixed_requests, args.short_tokens, args.short_output, args.mixed_long_tokens,
                                     args.long_output, seed=7, prompt_seed=200)
        rows_b = [run_config(bench, model, workload_b, step, f"b-{step}")
                  for step in lab.progress([UNCHUNKED, args.prefill_step], "(b) prefill_step")]
        results["b"] = {"rows": rows_b, "verdict": verdict(rows_b[1], rows_b[0])}
        longs = sum(a.kind == "long" for a in workload_b)
        lab.print_table(f"(b) mixed: {len(workload_b)} requests, {longs} of {args.mixed_long_tokens} tokens, "
                        f"Poisson arrivals", COLUMNS, rows_b)

    return bench.save(results, plot(bench, results))


if __name__ == "__main__":
    raise SystemExit(main())
