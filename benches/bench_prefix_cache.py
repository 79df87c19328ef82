"""Day 3.3's lab: a shared system prompt, with the prefix cache off and on.

    pdm run bench-prefix-cache                   # Qwen2-0.5B shape, float32: 1,024-token system prompt
    pdm run bench-prefix-cache --quick           # 512-token system prompt, fewer requests
    pdm run bench-prefix-cache --model embedded  # the tiny embedded model (seconds; figures mean nothing)

Workload: `--requests` requests, each the same `--system-tokens` system prompt followed by its own
`--user-tokens` user turn, `--max-tokens` output tokens, Poisson arrivals at `--rate` requests/s (a
fixed seed). The same workload runs twice on the same weights, cache off then on (a cold cache: the
first request computes the system prompt, the others reuse it). Printed side by side: TTFT p50/p99,
output throughput, hit rate, and the ratios. Results: benches/results/prefix_cache.json and the plot
book/src/images/week3-03-ttft.png.
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

RESULTS = Path(__file__).parent / "results" / "prefix_cache.json"
PLOT = Path(__file__).parent.parent / "book" / "src" / "images" / "week3-03-ttft.png"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=BENCH, help=f"model name or path (default {BENCH})")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--quick", action="store_true", help="512-token system prompt, 6 requests")
    return parser


def workload(args) -> list[Arrival]:
    system = random_tokens(args.system_tokens, seed=0)
    times = poisson_times(args.requests, args.rate, seed=1)
    return [Arrival("user", system + random_tokens(args.user_tokens, seed=100 + i), args.max_tokens, at=t)
            for i, t in enumerate(times)]


def figures(label: str, run: dict) -> dict:
    ttfts = [r["ttft_s"] for r in run["requests"] if r["ttft_s"] is not None]
    output = sum(r["output_tokens"] for r in run["requests"])
    makespan = max(r["finish_s"] for r in run["requests"])
    return {"label": label, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "output_tokens_per_s": output / makespan, "hit_rate": run["prefix_cache_hit_rate"]}


def plot(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, run in runs.items():
        points = sorted((r["arrival_s"], r["ttft_s"]) for r in run["requests"])
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("Shared system prompt: TTFT per request, prefix cache off / on")
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.system_tokens, args.requests = 512, 6
    for name in ("system_tokens", "user_tokens", "max_tokens", "requests", "budget"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    mlx_model, tokenizer = load_model(args.model)
    if is_embedded(args.model):
        print(MEANINGLESS_NOTE)
    model = Qwen2ModelWeek3(mlx_model)
    arrivals = workload(args)
    kv_tokens = 2 * (args.system_tokens + args.user_tokens + args.max_tokens) * min(args.requests, 8)
    runs, rows = {}, []
    with tqdm(total=2 * len(arrivals), desc="requests", unit="req") as progress:
        for label, caching in (("cache off", False), ("cache on", True)):
            engine = LLMEngine(model, tokenizer, EngineConfig(token_budget=args.budget, max_num_seqs=8, block_size=16,
                                                              num_blocks=-(-kv_tokens // 16), enable_prefix_caching=caching))
            runs[label] = drive(engine, arrivals, progress)
            rows.append(figures(label, runs[label]))
    off, on = rows
    print(f"\n{args.requests} requests: {args.system_tokens}-token system prompt + {args.user_tokens}-token user turn, "
          f"{args.max_tokens} output tokens, Poisson {args.rate}/s, model {args.model}")
    print(f"{'':10s} {'TTFT p50 s':>11s} {'TTFT p99 s':>11s} {'tokens/s':>9s} {'hit rate':>9s}")
    for row in rows:
        print(f"{row['label']:10s} {row['ttft_p50_s']:11.3f} {row['ttft_p99_s']:11.3f} "
              f"{row['output_tokens_per_s']:9.2f} {100 * row['hit_rate']:8.1f}%")
    ratios = {"ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
              "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
              "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"]}
    print(f"cache on vs off: TTFT p50 {ratios['ttft_p50_speedup']:.1f}x lower, p99 "
          f"{ratios['ttft_p99_speedup']:.1f}x lower, throughput {ratios['throughput_ratio']:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "machine": platform.platform(), "figures": rows,
                                   "ratios": ratios, "runs": runs}, indent=1))
    plot(runs)
    print(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
