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
the whole run) and peak memory above the weights. Results: benches/results/chunked_prefill.json,
plots chunked_prefill_itl.png (ITL over time, chunked against unchunked) and chunked_prefill_sweep.png.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches.scheduler_driver import Arrival, itl_timeline, random_prompt, run_workload, summarize  # noqa: E402
from course import selector  # noqa: E402
from course.models import BENCH, MEANINGLESS_NOTE, is_embedded, load_model, resolve_model  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
UNCHUNKED = "unchunked"
DEFAULT_STEP = 256  # chosen from the sweep (c) on our machine: see book/src/week2-07-chunked-prefill.md
SWEEP = [32, 64, 128, 256, 512, 1024, 2048]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-chunked-prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH, help=f"'{BENCH}' (default), 'embedded', a path or a Hugging Face id")
    selector.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a smaller run: shorter prompts, fewer sweep points")
    parser.add_argument("--prefill-step", type=int, default=DEFAULT_STEP,
                        help=f"the chunked configuration of (a) and (b) (default {DEFAULT_STEP})")
    parser.add_argument("--batch-size", type=int, default=5, help="decode slots (default 5)")
    parser.add_argument("--shorts", type=int, default=4, help="short requests in (a) (default 4)")
    parser.add_argument("--short-tokens", type=int, default=32, help="short prompt length (default 32)")
    parser.add_argument("--short-output", type=int, default=16, help="tokens each short request generates (default 16)")
    parser.add_argument("--long-tokens", type=int, default=1024, help="the long prompt of (a) and (c) (default 1024)")
    parser.add_argument("--long-output", type=int, default=4, help="tokens a long request generates (default 4)")
    parser.add_argument("--mixed-requests", type=int, default=5, help="requests in (b), 20%% of them long (default 5)")
    parser.add_argument("--mixed-long-tokens", type=int, default=3000, help="long prompts of (b) (default 3000)")
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="prefill_step values of (c), comma-separated")
    parser.add_argument("--adaptive", type=float, metavar="SECONDS",
                        help="also run (a) with AdaptiveChunkPolicy and this decode-latency target")
    parser.add_argument("--skip", default="", help="parts to skip, e.g. 'b' or 'b,c'")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"where results go (default {RESULTS_DIR})")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plots of a saved results file")
    return parser


def apply_quick(args) -> None:
    """--quick: the same shape of experiment, small enough for about a minute on 2 cores."""
    args.long_tokens = min(args.long_tokens, 512)
    args.mixed_long_tokens = min(args.mixed_long_tokens, 768)
    args.short_output = min(args.short_output, 12)
    args.sweep = "32,128,512"
    if args.prefill_step == DEFAULT_STEP:
        args.prefill_step = 128  # the same quarter of the (shorter) long prompt as the default


def head_of_line_workload(args) -> list[Arrival]:
    """(a): `shorts` short requests at t=0; the long prompt once each of them has produced 2 tokens."""
    arrivals = [Arrival("short", random_prompt(args.short_tokens, seed=i), args.short_output) for i in range(args.shorts)]
    arrivals.append(Arrival("long", random_prompt(args.long_tokens, seed=100), args.long_output, after_tokens=2))
    return arrivals


def mixed_workload(args) -> list[Arrival]:
    """(b): every fifth request long, the rest short, Poisson arrivals (mean gap 1 s), a fixed seed."""
    rng = random.Random(7)
    arrivals, at = [], 0.0
    for i in range(args.mixed_requests):
        long = i % 5 == 1
        length = args.mixed_long_tokens if long else args.short_tokens
        arrivals.append(Arrival("long" if long else "short", random_prompt(length, seed=200 + i),
                                args.long_output if long else args.short_output, at=at))
        at += rng.expovariate(1.0)
    return arrivals


def effective_step(step, longest_prompt: int) -> int | str:
    """A chunk at least as long as every prompt is no chunking at all."""
    return UNCHUNKED if step == UNCHUNKED or step >= longest_prompt else step


def run_config(batch_module, model, tokenizer, arrivals, step, args, label, policy=None) -> dict:
    longest = max(len(a.prompt) for a in arrivals)
    max_seq_len = max(len(a.prompt) + a.max_tokens for a in arrivals) + 1
    prefill_step = max_seq_len if step == UNCHUNKED else step
    result = run_workload(batch_module, model, tokenizer, arrivals, label=label, batch_size=args.batch_size,
                          max_seq_len=max_seq_len, prefill_step=prefill_step, policy=policy)
    row = summarize(result)
    row["prefill_step"] = step if step != UNCHUNKED and step < longest else UNCHUNKED
    row["wall_s"] = result.wall_s
    row["itl_timeline"] = itl_timeline(result)
    return row


HEADER = (f"{'config':>12s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'p99/p50':>7s} "
          f"{'stall':>7s} {'long TTFT':>9s} {'tok/s':>7s} {'peak MB':>8s} {'chunks':>6s}")


def format_row(row: dict) -> str:
    def s(key, fmt="{:.2f}"):
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    return (f"{str(row['prefill_step']):>12s} {s('short_ttft_p50_s'):>9s} {s('short_ttft_p99_s'):>9s} "
            f"{s('short_itl_p50_s'):>8s} {s('short_itl_p99_s'):>8s} {s('short_itl_p99_over_p50', '{:.1f}'):>7s} "
            f"{s('longest_stall_s'):>7s} {s('long_ttft_mean_s'):>9s} {s('total_tokens_per_s', '{:.1f}'):>7s} "
            f"{s('peak_memory_mb', '{:.0f}'):>8s} {s('chunks', '{}'):>6s}")


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}  (seconds; TTFT and ITL of the short requests; tok/s = prompt + output tokens per second)")
    print(HEADER)
    for row in rows:
        print(format_row(row))


def verdict(chunked: dict, unchunked: dict) -> dict:
    """The lab's criterion: ITL p99 chunked <= 1/3 of unchunked, throughput within 15%."""
    itl_ratio = chunked["short_itl_p99_s"] / unchunked["short_itl_p99_s"]
    throughput_ratio = chunked["total_tokens_per_s"] / unchunked["total_tokens_per_s"]
    return {"itl_p99_ratio": itl_ratio, "throughput_ratio": throughput_ratio,
            "pass": itl_ratio <= 1 / 3 and throughput_ratio >= 0.85}


def plot(results: dict, out_dir: Path, machine: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    a = results.get("a")
    if a:
        fig, ax = plt.subplots(figsize=(8, 4))
        for row, style in ((a["unchunked"], "o"), (a["chunked"], ".")):
            points = row["itl_timeline"]
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"prefill_step={row['prefill_step']}")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("gap to the previous token (s)")
        ax.set_title(f"(a) short requests' inter-token latency while a {a['long_tokens']}-token prompt prefills")
        ax.legend()
        fig.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = out_dir / "chunked_prefill_itl.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    sweep = results.get("c")
    if sweep:
        rows = sweep["rows"]
        labels = [str(r["prefill_step"]).replace("=unch.", "\n(= unch.)") for r in rows]
        fig, ax = plt.subplots(figsize=(8, 4))
        x = range(len(rows))
        ax.plot(x, [r["short_itl_p99_s"] for r in rows], "o-", label="short requests' ITL p99 (s)")
        ax.plot(x, [r.get("long_ttft_mean_s") for r in rows], "s-", label="long prompt's TTFT (s)")
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("prefill_step (tokens per chunk)")
        ax.set_ylabel("seconds")
        ax2 = ax.twinx()
        ax2.plot(x, [r["total_tokens_per_s"] for r in rows], "^--", color="gray", label="throughput (tokens/s)")
        ax2.set_ylabel("tokens/s")
        ax2.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
        ax.set_title("(c) the chunk-size sweep: decode latency against time to first token")
        fig.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = out_dir / "chunked_prefill_sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def machine_line() -> str:
    blas = fast_mlx.blas_in_use().split(" (")[0]  # the library's name, not its path
    return (f"{platform.system()} {platform.machine()}, MLX {mx.__version__} on {mx.default_device()}, "
            f"{__import__('os').cpu_count()} cores, BLAS: {blas}")


@selector.command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        results = json.loads(args.replot.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        print("wrote", ", ".join(plot(results, args.out, results["machine"])))
        return 0
    if args.quick:
        apply_quick(args)
    skip = set(filter(None, args.skip.split(",")))
    began = time.perf_counter()
    path = resolve_model(args.model)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    selection = selector.from_arguments(args)
    batch_module, policy_module = selection.batch, selection.chunk_policy
    selector.announce(selection)
    package = selection.package
    model_module = selector.reference().qwen2_week2  # the reference model serves both
    mlx_model, tokenizer = load_model(str(path) if args.model not in ("embedded", BENCH) else args.model)
    model = model_module.Qwen2ModelWeek2(mlx_model)
    machine = machine_line()
    print(f"model {args.model} ({path}); scheduler: {package}.batch; {machine}")

    # Warm up once (first-call costs would land on whichever configuration runs first).
    run_workload(batch_module, model, tokenizer, [Arrival("short", random_prompt(8, 0), 2)], label="warm-up",
                 batch_size=args.batch_size, max_seq_len=16, prefill_step=8)

    results: dict = {"machine": machine, "model": args.model, "solution": args.solution, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    workload_a = head_of_line_workload(args)
    sweep_steps = [int(s) for s in args.sweep.split(",") if s] + [UNCHUNKED]
    if "c" in skip:
        sweep_steps = [args.prefill_step, UNCHUNKED]
    longest_a = max(len(a.prompt) for a in workload_a)

    # (a) and (c): every distinct effective configuration runs once; (a) reads two of them.
    rows_by_step: dict = {}
    for step in sorted({effective_step(s, longest_a) for s in sweep_steps + [args.prefill_step]},
                       key=lambda s: float("inf") if s == UNCHUNKED else s):
        print(f"  (a/c) prefill_step={step} ...", flush=True)
        rows_by_step[step] = run_config(batch_module, model, tokenizer, workload_a, step, args, f"a-{step}")
    chunked_a = rows_by_step[effective_step(args.prefill_step, longest_a)]
    unchunked_a = rows_by_step[UNCHUNKED]
    results["a"] = {"long_tokens": args.long_tokens, "chunked": chunked_a, "unchunked": unchunked_a,
                    "verdict": verdict(chunked_a, unchunked_a)}
    shown = [unchunked_a, chunked_a]
    if args.adaptive:
        policy = policy_module.AdaptiveChunkPolicy(target_itl=args.adaptive)
        print(f"  (a) {policy.describe()} ...", flush=True)
        adaptive = run_config(batch_module, model, tokenizer, workload_a, args.prefill_step, args, "a-adaptive",
                              policy=policy)
        adaptive["prefill_step"] = f"adapt {args.adaptive:g}s"
        results["a"]["adaptive"] = adaptive
        shown.append(adaptive)
    print_table(f"(a) head of line: {args.shorts} short requests stream, a {args.long_tokens}-token prompt arrives",
                shown)
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
        print_table(f"(c) sweep on workload (a) (a step >= {longest_a} tokens is one chunk: unchunked)", sweep_rows)

    if "b" not in skip:
        workload_b = mixed_workload(args)
        rows_b = []
        for step in (UNCHUNKED, args.prefill_step):
            print(f"  (b) prefill_step={step} ...", flush=True)
            rows_b.append(run_config(batch_module, model, tokenizer, workload_b, step, args, f"b-{step}"))
        results["b"] = {"rows": rows_b, "verdict": verdict(rows_b[1], rows_b[0])}
        longs = sum(a.kind == "long" for a in workload_b)
        print_table(f"(b) mixed: {len(workload_b)} requests, {longs} of {args.mixed_long_tokens} tokens, "
                    f"Poisson arrivals", rows_b)

    results["wall_s"] = time.perf_counter() - began
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "chunked_prefill.json"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written = plot(results, args.out, machine)
    print(f"\nwrote {json_path}" + "".join(f", {p}" for p in written) + f"; the whole run took {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
