"""Day 3.3's lab: a shared system prompt, with the prefix cache off and on.

    pdm run bench-prefix-cache                   # Qwen2-0.5B shape, float32: 1,024-token system prompt
    pdm run bench-prefix-cache --quick           # 512-token system prompt, fewer requests
    pdm run bench-prefix-cache --model embedded  # the tiny embedded model (seconds; figures mean nothing)
    pdm run bench-prefix-cache --solution student   # your prefix cache and engine (the reference for what is unwritten)

Workload: `--requests` requests, each the same `--system-tokens` system prompt followed by its own
`--user-tokens` user turn, `--max-tokens` output tokens, Poisson arrivals at `--rate` requests/s (a
fixed seed). The same workload runs twice on the same weights, cache off then on (a cold cache: the
first request computes the system prompt, the others reuse it). Printed side by side: TTFT p50/p99
(day 2.2's percentiles, interpolated), output throughput, hit rate, and the ratios. Results:
benches/results/prefix_cache.json (--out) and the plot prefix_cache_ttft.png beside it (the
chapter's copy is book/src/images/week3-03-ttft.png).
"""

from course import fast_mlx

fast_mlx.setup()

from benches import lab, runner, workloads  # noqa: E402
from benches.engines import Week3  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-prefix-cache"
COLUMNS = [lab.Column("cache", "label", "{}"), lab.Column("TTFT p50 s", "user_ttft_p50_s", "{:.3f}"),
           lab.Column("TTFT p99 s", "user_ttft_p99_s", "{:.3f}"), lab.Column("tokens/s", "output_tokens_per_s"),
           lab.Column("hit rate", "prefix_cache_hit_rate", "{:.1%}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="prefix_cache.json")
    lab.options(parser, system_tokens=1024, user_tokens=32, max_tokens=8, requests=10,
                rate=(0.5, "mean arrivals per second"), budget=(512, "the engine's token_budget"))
    return parser


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.system_tokens, args.requests = 512, 6
    lab.check_positive(PROG, args, "system_tokens", "user_tokens", "max_tokens", "requests", "budget")
    bench = lab.start(args, ("engine", "prefix_cache", "qwen2_week3"))
    model = bench.week3_model()
    arrivals = workloads.shared_prefix(args.requests, args.system_tokens, args.user_tokens, args.max_tokens, args.rate)
    kv_tokens = 2 * (args.system_tokens + args.user_tokens + args.max_tokens) * min(args.requests, 8)
    runs = {}
    for label, caching in lab.progress([("cache off", False), ("cache on", True)], "runs"):
        engine = Week3(bench.selection, model, bench.tokenizer, **dict(PLAIN_ENGINE, enable_prefix_caching=caching),
                       token_budget=args.budget, max_num_seqs=8, block_size=16, num_blocks=-(-kv_tokens // 16))
        runs[label] = runner.run(engine, arrivals, label)
    rows = [runner.summarize(run) for run in runs.values()]
    off, on = rows
    lab.print_table(f"{args.requests} requests: {args.system_tokens}-token system prompt + {args.user_tokens}-token "
                    f"user turn, {args.max_tokens} output tokens, Poisson {args.rate}/s", COLUMNS, rows)
    ratios = {"ttft_p50_speedup": off["user_ttft_p50_s"] / on["user_ttft_p50_s"],
              "ttft_p99_speedup": off["user_ttft_p99_s"] / on["user_ttft_p99_s"],
              "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"]}
    print(f"cache on vs off: TTFT p50 {ratios['ttft_p50_speedup']:.1f}x lower, p99 "
          f"{ratios['ttft_p99_speedup']:.1f}x lower, throughput {ratios['throughput_ratio']:.2f}x")
    plot = lab.ttft_plot(bench, runs, None, "Shared system prompt: TTFT per request, prefix cache off / on")
    return bench.save({"figures": rows, "ratios": ratios,
                       "token_times": {label: runner.token_times(run) for label, run in runs.items()}}, [plot])


if __name__ == "__main__":
    raise SystemExit(main())
