"""Day 3.4's lab: interactive and batch traffic together, first-come-first-served against priorities.

    pdm run bench-priorities                   # Qwen2-0.5B shape, float32
    pdm run bench-priorities --quick           # fewer, shorter requests
    pdm run bench-priorities --model embedded  # the tiny embedded model (seconds; figures mean nothing)

Workload (random prompt token ids, greedy, fixed seeds):
  batch:       `--batch` requests of `--batch-tokens` prompt tokens and `--batch-output` output tokens,
               all at t=0, priority 0;
  interactive: `--interactive` requests of `--interactive-tokens` prompt tokens and
               `--interactive-output` output tokens, Poisson arrivals at `--rate`/s from t=1 s, priority 1.
Three runs on the same weights and token budget: the interactive class alone; both classes under
FCFS (scheduling_policy "fcfs": priorities ignored); both under scheduling_policy "priority".
Printed side by side: the interactive class's TTFT p50/p99 and ITL p99, the batch class's output
throughput (its tokens over its makespan), preemptions, and the ratios to the interactive-alone run.
Results: benches/results/priorities.json and the plot book/src/images/week3-04-ttft.png.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
from pathlib import Path  # noqa: E402

from tqdm import tqdm  # noqa: E402

from benches.engine_driver import Arrival, drive, percentile, poisson_times, random_tokens  # noqa: E402
from course.models import BENCH, MEANINGLESS_NOTE, is_embedded, load_model  # noqa: E402
from tiny_llm_ref.engine import EngineConfig, LLMEngine  # noqa: E402
from tiny_llm_ref.qwen2_week3 import Qwen2ModelWeek3  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "priorities.json"
PLOT = Path(__file__).parent.parent / "book" / "src" / "images" / "week3-04-ttft.png"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=BENCH, help=f"model name or path (default {BENCH})")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--batch-output", type=int, default=32)
    parser.add_argument("--interactive", type=int, default=10)
    parser.add_argument("--interactive-tokens", type=int, default=24)
    parser.add_argument("--interactive-output", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second")
    parser.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    parser.add_argument("--quick", action="store_true", help="256-token batch prompts, 6 interactive requests")
    return parser


def workload(args, with_batch: bool) -> list[Arrival]:
    arrivals = []
    if with_batch:
        arrivals += [Arrival("batch", random_tokens(args.batch_tokens, seed=i), args.batch_output, at=0.0, priority=0)
                     for i in range(args.batch)]
    times = poisson_times(args.interactive, args.rate, seed=7)
    arrivals += [Arrival("interactive", random_tokens(args.interactive_tokens, seed=100 + i), args.interactive_output,
                         at=1.0 + t, priority=1) for i, t in enumerate(times)]
    return arrivals


def figures(label: str, run: dict) -> dict:
    inter = [r for r in run["requests"] if r["kind"] == "interactive"]
    batch = [r for r in run["requests"] if r["kind"] == "batch"]
    ttfts = [r["ttft_s"] for r in inter if r["ttft_s"] is not None]
    itls = [gap for r in inter for gap in r["itls_s"]]
    steps = [r["ttft_steps"] for r in inter if r["ttft_steps"] is not None]
    work = [r["ttft_tokens"] for r in inter if r["ttft_tokens"] is not None]
    row = {"label": label, "interactive_ttft_p50_s": percentile(ttfts, 50),
           "interactive_ttft_p99_steps": percentile(steps, 99), "interactive_ttft_p99_tokens": percentile(work, 99),
           "interactive_ttft_p99_s": percentile(ttfts, 99), "interactive_itl_p99_s": percentile(itls, 99),
           "batch_tokens_per_s": None, "preemptions": run["num_preemptions"]}
    if batch:
        row["batch_tokens_per_s"] = sum(r["output_tokens"] for r in batch) / max(r["finish_s"] for r in batch)
    return row


def plot(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, run in runs.items():
        points = sorted((r["arrival_s"], r["ttft_s"]) for r in run["requests"] if r["kind"] == "interactive")
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set_xlabel("interactive request arrival (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("Interactive TTFT: alone, under batch load (FCFS), under batch load (priority)")
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch_tokens, args.interactive = 256, 6
    for name in ("batch", "batch_tokens", "batch_output", "interactive", "interactive_tokens",
                 "interactive_output", "budget"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    mlx_model, tokenizer = load_model(args.model)
    if is_embedded(args.model):
        print(MEANINGLESS_NOTE)
    model = Qwen2ModelWeek3(mlx_model)
    plans = [("interactive alone", "fcfs", False), ("FCFS", "fcfs", True), ("priority", "priority", True)]
    runs, rows = {}, []
    total = sum(len(workload(args, with_batch)) for _, _, with_batch in plans)
    with tqdm(total=total, desc="requests", unit="req") as progress:
        for label, policy, with_batch in plans:
            engine = LLMEngine(model, tokenizer, EngineConfig(token_budget=args.budget, max_num_seqs=8, block_size=16,
                                                              scheduling_policy=policy))
            runs[label] = drive(engine, workload(args, with_batch), progress)
            rows.append(figures(label, runs[label]))
    print(f"\nbatch: {args.batch} x {args.batch_tokens}+{args.batch_output} tokens at t=0; interactive: "
          f"{args.interactive} x {args.interactive_tokens}+{args.interactive_output}, Poisson {args.rate}/s; "
          f"budget {args.budget}; model {args.model}")
    print(f"{'':18s} {'TTFT p50 s':>11s} {'TTFT p99 s':>11s} {'ITL p99 s':>10s} {'batch tok/s':>12s} {'preempt':>8s} "
          f"{'TTFT p99 steps':>15s} {'TTFT p99 tokens':>16s}")
    for row in rows:
        batch = "-" if row["batch_tokens_per_s"] is None else f"{row['batch_tokens_per_s']:.2f}"
        print(f"{row['label']:18s} {row['interactive_ttft_p50_s']:11.3f} {row['interactive_ttft_p99_s']:11.3f} "
              f"{row['interactive_itl_p99_s']:10.3f} {batch:>12s} {row['preemptions']:8d} "
              f"{row['interactive_ttft_p99_steps']:15d} {row['interactive_ttft_p99_tokens']:16d}")
    alone, fcfs, prio = rows
    ratios = {"fcfs_ttft_p99_vs_alone": fcfs["interactive_ttft_p99_s"] / alone["interactive_ttft_p99_s"],
              "priority_ttft_p99_vs_alone": prio["interactive_ttft_p99_s"] / alone["interactive_ttft_p99_s"],
              "priority_itl_p99_vs_alone": prio["interactive_itl_p99_s"] / alone["interactive_itl_p99_s"],
              "priority_ttft_p99_tokens_vs_alone": prio["interactive_ttft_p99_tokens"] / alone["interactive_ttft_p99_tokens"],
              "fcfs_ttft_p99_tokens_vs_alone": fcfs["interactive_ttft_p99_tokens"] / alone["interactive_ttft_p99_tokens"],
              "batch_throughput_priority_vs_fcfs": prio["batch_tokens_per_s"] / fcfs["batch_tokens_per_s"]}
    print(f"interactive TTFT p99 vs alone: FCFS {ratios['fcfs_ttft_p99_vs_alone']:.1f}x, priority "
          f"{ratios['priority_ttft_p99_vs_alone']:.1f}x (in model tokens run before the first token: FCFS "
          f"{ratios['fcfs_ttft_p99_tokens_vs_alone']:.1f}x, priority {ratios['priority_ttft_p99_tokens_vs_alone']:.1f}x); "
          f"batch throughput priority/FCFS "
          f"{ratios['batch_throughput_priority_vs_fcfs']:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "machine": platform.platform(), "figures": rows,
                                   "ratios": ratios, "runs": runs}, indent=1))
    plot(runs)
    print(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
