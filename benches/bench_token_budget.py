"""Week 3's lab: one forward pass under a token budget against mlx-lm's BatchGenerator and day 2.7, side by side.

    pdm run bench-token-budget                   # the Qwen2-0.5B-shape model, float32 (the issue's full workload)
    pdm run bench-token-budget --quick           # shorter prompts and outputs
    pdm run bench-token-budget --quick --long-after-tokens 2 --clock cpu   # on a busy shared machine: CPU seconds
    pdm run bench-token-budget --model embedded  # the tiny embedded model (seconds; the figures mean nothing)
    pdm run bench-token-budget --skip mixed      # only the head-of-line workload
    pdm run bench-token-budget --solution student   # your week-3 engine (and day 2.7), the reference for what is unwritten
    pdm run bench-token-budget --skip hol --frontier 1.5:5,2.5:10,4:20   # the mixed workload at more target pairs
    pdm run bench-token-budget --budgets "" --skip day27,adaptive --frontier 2.5:10   # the defaults and one candidate

Workloads (random prompt token ids, greedy, every request runs to its token budget):
  hol:   4 short requests (64 prompt + 64 output tokens) at t=0; a 1,536-token prompt (16 output
         tokens) arrives at t=4 s. Its prefill is what stalls the short requests' tokens.
  mixed: 20% long prompts, 80% short ones, Poisson arrivals (mean gap 1 s), a fixed seed.
Engines, each on the same weights, run one after the other, mlx-lm and ours alternating so that a
busy machine slows both alike: mlx-lm's BatchGenerator at prefill_step_size 64, 256 and 2048; day
2.7's SlotScheduler (prefill_step 256); week 3's LLMEngine at its defaults (`EngineConfig()`: the goodput
budget, shortest prefill first, prefix caching; the recommended engine, the one `pdm run serve`
starts) and at a few fixed token budgets. The mixed workload runs mlx-lm at 64 and 256, the
recommended engine, day 3.1's adaptive budget with shortest prefill first (what the goodput budget
adds), and day 3.1's adaptive engine first come, first served (shorts queue behind a long prompt's
chunks). For each: the short requests' TTFT and ITL percentiles (day 2.2's, interpolated), the long
prompt's TTFT, output tokens/s (output tokens over first arrival to last finish), goodput (the share
of all requests with TTFT <= --slo-ttft and TPOT <= --slo-tpot, and no token later than a reader at that
pace would reach it: benches/runner.py's `good_request`; by default 10 and 2.5 plain decode steps, a
decode step being mlx-lm's lowest short ITL p50 in the same run, so the targets scale with the machine
and its load as the engine's own do; "goodput, TPOT only" leaves the pace out, DistServe's and vLLM's view),
the ratios against mlx-lm's best (lowest ITL p99 among its step sizes; highest throughput; lowest
short TTFT p50; highest goodput), and whether the greedy tokens are mlx-lm's. `--frontier` adds runs
of the recommended engine at other target pairs (ITL target in decode steps : TTFT target in decode
steps), on every workload, each taking its turn with mlx-lm's runs, with the same ratios per row: the
trade between the two targets beside mlx-lm's steps (plotted for the mixed workload), and candidates for
the defaults compared in one run. Results:
benches/results/week3_hol.json (--out) with every token's timestamp and the six goal ratios
(`goal_ratios`), and the plots week3_hol_itl.png, week3_hol_sweep.png and, with --frontier,
week3_hol_frontier.png beside it.
"""

from course import fast_mlx

fast_mlx.setup()

from benches import lab, runner, workloads  # noqa: E402
from benches.engines import Day27, MlxLm, Week3  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-token-budget"
RECOMMENDED = "week3 defaults"  # EngineConfig's defaults: the engine `pdm run serve` starts
GOALS = {  # issue 36: the recommended engine against mlx-lm's best, per workload
    "hol": {"itl_p99_ratio_vs_mlx_lm_best": "<= 0.5", "throughput_ratio_vs_mlx_lm_best": ">= 1.1",
            "ttft_p50_ratio_vs_mlx_lm_best": "<= 1.0", "goodput_vs_mlx_lm_best": "> 1"},
    "mixed": {"itl_p99_ratio_vs_mlx_lm_best": "<= 0.5", "throughput_ratio_vs_mlx_lm_best": ">= 1.05",
              "ttft_p50_ratio_vs_mlx_lm_best": "<= 0.8", "goodput_vs_mlx_lm_best": "> 1"},
}
COLUMNS = [lab.Column("engine", "label", "{}"), lab.Column("ITL p50", "short_itl_p50_s", "{:.3f}"),
           lab.Column("ITL p99", "short_itl_p99_s", "{:.3f}"), lab.Column("TTFT p50", "short_ttft_p50_s"),
           lab.Column("long TTFT", "long_ttft_mean_s"), lab.Column("out tok/s", "output_tokens_per_s"),
           lab.Column("goodput", "goodput", "{:.0%}"), lab.Column("goodput, TPOT only", "goodput_tpot", "{:.0%}"),
           lab.Column("ITL p99 vs mlx best", "itl_p99_vs_mlx_lm_best"),
           lab.Column("tok/s vs mlx best", "throughput_vs_mlx_lm_best"),
           lab.Column("tokens = mlx-lm's", "same_tokens_as_mlx_lm", "{}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="week3_hol.json")
    lab.options(parser, short_tokens=64, short_output=64, long_tokens=1536, long_output=16,
                long_at=(4.0, "when the long prompt arrives (s)"), mixed_requests=10)
    parser.add_argument("--long-after-tokens", type=int, metavar="N",
                        help="instead: once every short request has N tokens (the same moment on a slow or busy machine)")
    parser.add_argument("--budgets", default="32,64,256", help="week 3's fixed token budgets (comma-separated)")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                        help="goodput: a request's first token within this many seconds (default: 10 plain decode "
                             "steps of this run, EngineConfig's TTFT target)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="SECONDS",
                        help="goodput: and its time per output token after the first within this many seconds "
                             "(default: 2.5 plain decode steps of this run; the engine's own ITL target, 1.8 of its "
                             "plain steps with as many decodes, aims under it)")
    parser.add_argument("--frontier", default="", metavar="ITL:TTFT,...",
                        help="also run the recommended engine on every workload with these target pairs, each "
                             "in decode-only steps (EngineConfig's decode_multiple:ttft_multiple), and plot TTFT p50 "
                             "against ITL p99 beside mlx-lm's steps (default: none)")
    parser.add_argument("--mlx-steps", default="64,256,2048", help="mlx-lm's prefill_step_size values")
    parser.add_argument("--skip", default="",
                        help="'mixed', 'hol' (workloads), 'day27' or 'adaptive' (day 3.1's budget beside the "
                             "recommended engine on the mixed workload), comma-separated")
    parser.add_argument("--clock", choices=sorted(runner.CLOCKS), default="wall",
                        help="'cpu': time in this process's CPU seconds (all threads), which other processes on a "
                             "busy shared machine do not inflate; use with --long-after-tokens")
    return parser


def apply_quick(args) -> None:
    args.short_tokens, args.short_output = min(args.short_tokens, 32), min(args.short_output, 24)
    args.long_tokens, args.long_output, args.long_at = min(args.long_tokens, 512), min(args.long_output, 8), 2.0
    args.mixed_requests = min(args.mixed_requests, 5)


def build_workloads(args) -> dict:
    found = {}
    if "hol" not in args.skip:
        found["hol"] = workloads.head_of_line(4, args.short_tokens, args.short_output, args.long_tokens,
                                              args.long_output, long_at=args.long_at, after_tokens=args.long_after_tokens)
    if "mixed" not in args.skip:
        found["mixed"] = workloads.mixed(args.mixed_requests, args.short_tokens, args.short_output, args.long_tokens,
                                         args.long_output, seed=3, prompt_seed=300)
    return found


def configs(bench, model2, model3, arrivals, workload: str) -> list:
    """(label, make_adapter) in run order: mlx-lm and ours alternating (the --frontier pairs among ours)."""
    args, tokenizer, selection = bench.args, bench.tokenizer, bench.selection
    max_seq_len = max(len(a.prompt) + a.max_tokens for a in arrivals) + 1
    mlx = [(f"mlx-lm step {s}", lambda s=s: MlxLm(bench.mlx_model, tokenizer, prefill_step=s)) for s in args.mlx_steps]
    # Budgets that follow step times time them on the lab's clock (--clock cpu: CPU seconds, not inflated by a busy
    # machine).
    clock = runner.CLOCKS[args.clock]

    def engine(**config):
        return lambda: Week3(selection, model3, tokenizer, clock=clock, **config)

    ours = [(RECOMMENDED, engine())] + frontier_configs(bench, model3, args.frontier)
    if workload == "mixed" and "adaptive" in args.skip:
        return runner.alternate(mlx[:2], ours)
    if workload == "mixed":
        # Day 3.1's budget beside it, with day 3.4's order and without: what each of the two adds under mixed traffic.
        return runner.alternate(mlx[:2], ours + [
            ("week3 adaptive spf", engine(budget_policy="adaptive", scheduling_policy="shortest_prefill_first")),
            ("week3 adaptive fcfs", engine(**dict(PLAIN_ENGINE, budget_policy="adaptive")))])
    ours += [(f"week3 budget {b}", engine(**PLAIN_ENGINE, token_budget=b, max_num_seqs=8)) for b in args.budgets]
    if "day27" not in args.skip:
        ours.append(("day2.7 step 256", lambda: Day27(selection, model2, tokenizer, batch_size=5,
                                                      max_seq_len=max_seq_len, prefill_step=256)))
    return runner.alternate(mlx, ours)


def add_ratios(rows: list[dict], outputs: dict) -> dict:
    """Each row's ratios to mlx-lm's best (and whether its tokens are mlx-lm's); the recommended engine's ratios."""
    mlx_rows = [r for r in rows if r["label"].startswith("mlx-lm")]
    best_itl = min(mlx_rows, key=lambda r: r["short_itl_p99_s"])
    best_tps = max(mlx_rows, key=lambda r: r["output_tokens_per_s"])
    best_ttft = min(r["short_ttft_p50_s"] for r in mlx_rows)
    best_goodput = max(r["goodput"] for r in mlx_rows)
    best_goodput_tpot = max(r["goodput_tpot"] for r in mlx_rows)
    for row in rows:
        row["itl_p99_vs_mlx_lm_best"] = row["short_itl_p99_s"] / best_itl["short_itl_p99_s"]
        row["throughput_vs_mlx_lm_best"] = row["output_tokens_per_s"] / best_tps["output_tokens_per_s"]
        row["ttft_p50_vs_mlx_lm_best"] = row["short_ttft_p50_s"] / best_ttft
        row["goodput_vs_mlx_lm_best"] = row["goodput"] / best_goodput if best_goodput else None
        row["same_tokens_as_mlx_lm"] = "yes" if outputs[row["label"]] == outputs[best_tps["label"]] else "no"
    ours = next(r for r in rows if r["label"] == RECOMMENDED)
    return {"engine": RECOMMENDED, "mlx_lm_best_itl": best_itl["label"], "mlx_lm_best_throughput": best_tps["label"],
            "itl_p99_ratio_vs_mlx_lm_best": ours["itl_p99_vs_mlx_lm_best"],
            "throughput_ratio_vs_mlx_lm_best": ours["throughput_vs_mlx_lm_best"],
            "ttft_p50_ratio_vs_mlx_lm_best": ours["short_ttft_p50_s"] / best_ttft,
            "goodput": ours["goodput"], "mlx_lm_best_goodput": best_goodput,
            "goodput_vs_mlx_lm_best": ours["goodput_vs_mlx_lm_best"],
            "goodput_tpot": ours["goodput_tpot"], "mlx_lm_best_goodput_tpot": best_goodput_tpot}


def targets(args, rows: list[dict]) -> dict:
    """The goodput targets in seconds: --slo-ttft/--slo-tpot, or 10 and 2.5 plain decode steps of this run (mlx-lm's
    lowest short ITL p50: its decode steps carry no prefill most of the time)."""
    decode = min(r["short_itl_p50_s"] for r in rows if r["label"].startswith("mlx-lm"))
    return {"ttft_s": args.slo_ttft or 10 * decode, "tpot_s": args.slo_tpot or 2.5 * decode, "decode_step_s": decode}


def parse_pairs(text: str) -> list[tuple[float, float]]:
    """'1.5:5,2.5:10' -> [(1.5, 5.0), (2.5, 10.0)]: (ITL target, TTFT target) in decode-only steps."""
    pairs = []
    for item in filter(None, text.split(",")):
        itl, _, ttft = item.partition(":")
        pairs.append((float(itl), float(ttft)))
    return pairs


def frontier_configs(bench, model3, pairs) -> list:
    """(label, make_adapter) of the recommended engine at each target pair (the frontier's points, or candidates)."""
    clock = runner.CLOCKS[bench.args.clock]
    return [(f"week3 targets {itl:g}:{ttft:g}", lambda itl=itl, ttft=ttft: Week3(
        bench.selection, model3, bench.tokenizer, clock=clock, decode_multiple=itl, ttft_multiple=ttft))
        for itl, ttft in pairs]


def plot_frontier(path, machine: str, rows: list[dict]) -> None:
    """Shorts' TTFT p50 against their ITL p99: a point per target pair of ours, mlx-lm's steps on the same axes."""
    with lab.figure(path, machine, figsize=(7, 4.5)) as (fig, ax):
        for row in rows:
            mlx = row["label"].startswith("mlx-lm")
            if not (mlx or row["label"].startswith("week3 targets") or row["label"] == RECOMMENDED):
                continue
            marker, color = ("s", "C1") if mlx else ("o", "C0" if row["label"] != RECOMMENDED else "C2")
            ax.plot(row["short_itl_p99_s"], row["short_ttft_p50_s"], marker, color=color)
            ax.annotate(row["label"].replace("week3 targets ", "").replace("mlx-lm ", ""),
                        (row["short_itl_p99_s"], row["short_ttft_p50_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="short requests' ITL p99 (s)", ylabel="short requests' TTFT p50 (s)",
               title="mixed workload: the two targets' trade (ours: ITL:TTFT targets in decode steps)")


def plot(bench, runs: dict, rows: list[dict], ratios: dict) -> list:
    """The shorts' ITL over time (ours and mlx-lm's best), and the budget sweep against mlx-lm's best."""
    shown = [RECOMMENDED, ratios["mlx_lm_best_itl"], ratios["mlx_lm_best_throughput"], "day2.7 step 256"]
    itl_path, sweep_path = bench.figure_path("itl"), bench.figure_path("sweep")
    with lab.figure(itl_path, bench.machine, figsize=(9, 4.5)) as (fig, ax):
        lab.plot_series(ax, {label: runner.itl_points(runs[label], "short") for label in dict.fromkeys(shown)
                             if label in runs})
        if bench.args.long_after_tokens is None:
            ax.axvline(bench.args.long_at, color="gray", lw=0.8, ls=":")
        ax.set(yscale="log", xlabel="time since start (s)", ylabel="gap to the previous token (s)",
               title="short requests' inter-token latency while a long prompt prefills")
    plot_sweep(sweep_path, bench.machine, rows)
    return [itl_path, sweep_path]


def plot_sweep(path, machine: str, rows: list[dict]) -> None:
    """The budget sweep against mlx-lm's best, from the result rows alone (so the saved JSON redraws it)."""
    sweep = [r for r in rows if r["label"].startswith("week3")]
    mlx_rows = [r for r in rows if r["label"].startswith("mlx-lm")]
    with lab.figure(path, machine, figsize=(8, 4)) as (fig, ax):
        x = range(len(sweep))
        ax.plot(x, [r["short_itl_p99_s"] for r in sweep], "o-", label="week 3: short ITL p99 (s)")
        ax.axhline(min(r["short_itl_p99_s"] for r in mlx_rows), color="C0", ls=":", label="mlx-lm best ITL p99")
        ax.set_xticks(list(x), [r["label"].replace("week3 ", "") for r in sweep])
        ax.set(ylabel="seconds", title="token budget sweep on the head-of-line workload")
        ax2 = ax.twinx()
        ax2.plot(x, [r["output_tokens_per_s"] for r in sweep], "^--", color="C1", label="week 3: output tokens/s")
        ax2.axhline(max(r["output_tokens_per_s"] for r in mlx_rows), color="C1", ls=":", label="mlx-lm best tokens/s")
        ax2.set_ylim(bottom=0)
        lab.legend_below(ax, ax2)


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    if args.clock == "cpu" and args.long_after_tokens is None:
        return lab.user_error(PROG, "--clock cpu needs --long-after-tokens (arrival times in wall seconds would mean nothing)")
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    args.mlx_steps = [int(s) for s in args.mlx_steps.split(",") if s]
    if any(value is not None and not value > 0 for value in (args.slo_ttft, args.slo_tpot)):
        return lab.user_error(PROG, "--slo-ttft and --slo-tpot must be seconds > 0")
    try:
        args.frontier = parse_pairs(args.frontier)
    except ValueError:
        return lab.user_error(PROG, f"--frontier wants ITL:TTFT pairs of numbers, e.g. 1.5:5,2.5:10; got {args.frontier!r}")
    if any(itl <= 1 or ttft <= 0 for itl, ttft in args.frontier):
        return lab.user_error(PROG, "--frontier: an ITL target must be more than 1 decode step, a TTFT target more than 0")
    bench = lab.start(args, ("engine", "token_budget", "scheduler", "order_policy", "qwen2_week3", "batch",
                             "qwen2_week2"))
    clock = runner.CLOCKS[args.clock]
    model2, model3 = bench.week2_model(), bench.week3_model()
    # Warm-up: first-call costs must not land on whichever engine runs first.
    warm = [workloads.Arrival("short", workloads.random_prompt(8, 0), 2)]
    runner.run(Week3(bench.selection, model3, bench.tokenizer, token_budget=64), warm, "warm")
    runner.run(MlxLm(bench.mlx_model, bench.tokenizer, prefill_step=64), warm, "warm")

    results, goal_ratios = {}, {}
    plots = []
    for name, arrivals in build_workloads(args).items():
        runs = {}
        made = configs(bench, model2, model3, arrivals, name)
        for label, make in lab.progress(made, f"{name} runs"):
            runs[label] = runner.run(make(), arrivals, label, clock=clock)
        rows = sorted((runner.summarize(r) for r in runs.values()),
                      key=lambda r: (not r["label"].startswith("mlx"), r["label"]))
        slo = targets(args, rows)
        for row in rows:
            row["goodput"] = runner.goodput_share(runs[row["label"]], slo["ttft_s"], slo["tpot_s"])
            row["goodput_tpot"] = runner.goodput_share(runs[row["label"]], slo["ttft_s"], slo["tpot_s"], stalls=False)
        ratios = add_ratios(rows, {label: r.outputs for label, r in runs.items()})
        longs = sum(a.kind == "long" for a in arrivals)
        lab.print_table(f"{name}: {len(arrivals) - longs} short requests ({args.short_tokens} + {args.short_output} "
                        f"tokens), {longs} long ({args.long_tokens} + {args.long_output})", COLUMNS, rows,
                        caption="short requests' ITL and TTFT (s); output tokens/s over the whole run")
        goals = GOALS[name]
        goodput = ratios["goodput_vs_mlx_lm_best"]
        print(f"{RECOMMENDED} on {name}: ITL p99 {ratios['itl_p99_ratio_vs_mlx_lm_best']:.2f}x mlx-lm's best "
              f"(goal {goals['itl_p99_ratio_vs_mlx_lm_best']}), throughput "
              f"{ratios['throughput_ratio_vs_mlx_lm_best']:.2f}x (goal {goals['throughput_ratio_vs_mlx_lm_best']}), "
              f"short TTFT p50 {ratios['ttft_p50_ratio_vs_mlx_lm_best']:.2f}x (goal "
              f"{goals['ttft_p50_ratio_vs_mlx_lm_best']}); goodput {ratios['goodput']:.0%} against mlx-lm's best "
              f"{ratios['mlx_lm_best_goodput']:.0%}" + (f" ({goodput:.2f}x)" if goodput else "")
              + f" (TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s']:.2f} s and no token behind that pace; "
              f"by TTFT and TPOT alone {ratios['goodput_tpot']:.0%} against {ratios['mlx_lm_best_goodput_tpot']:.0%})")
        results[name] = {"rows": rows, "ratios": ratios, "slo": slo,
                         "token_times": {label: runner.token_times(r) for label, r in runs.items()}}
        goal_ratios[name] = {key: ratios[key] for key in goals}
        if name == "hol":
            plots += plot(bench, runs, rows, ratios)
        if name == "mixed" and args.frontier:
            plot_frontier(bench.figure_path("frontier"), bench.machine, rows)
            plots.append(bench.figure_path("frontier"))
    results.update(goal_ratios=goal_ratios, goals={name: GOALS[name] for name in goal_ratios})
    return bench.save(results, plots)


if __name__ == "__main__":
    raise SystemExit(main())
