"""Days 4.3 and 4.4 lab: 1 and 2 ranks, ours and mlx-lm's sharded model, and a paper model of 2-8 Macs.

    pdm run bench-tensor-parallel                  # the Qwen2-0.5B shape: both days' runs
    pdm run bench-tensor-parallel --quick          # 16 new tokens, a batch of 4
    pdm run bench-tensor-parallel --day 4.4        # only the engine's runs (4.3: only one request's)
    pdm run bench-tensor-parallel --model embedded # seconds; the figures mean nothing
    pdm run bench-tensor-parallel --hostfile hosts.json  # the 2-rank runs on two machines

Each configuration is one launch (course/ranks.py: mlx.launch on loopback) of
benches/tensor_parallel_worker.py, on 1 rank (1 BLAS thread, 2 threads) and on 2 ranks of 1 thread each:
  - day 4.3, greedy decoding of one request (64-token prompt, 32 new tokens): ours is day 4.3's
    Qwen2TensorParallel under week 3's engine, mlx-lm its own Qwen2 with `model.shard()`;
  - day 4.4, a batch of 8 such requests at once to the end: ours is day 4.4's TensorParallelEngine
    (rank 0 plans and samples, the others follow), mlx-lm its BatchGenerator on its sharded model.
On one machine two ranks share its memory bandwidth and its cores: two processes on two cores are not
two Macs. What transfers to real machines is the shape of the costs, measured here: the compute of a
token and the latency of one all_sum. The paper model prices 2, 4 and 8 Macs from those and from
link figures stated in the JSON (assumed, not measured here). Results: benches/results/tensor_parallel.json,
and beside it the plots tensor_parallel_decode.png (4.3) and tensor_parallel_engine.png (4.4).
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from course import ranks  # noqa: E402
from benches import lab  # noqa: E402
from benches.lab import machine_line, model_note  # noqa: E402
from course.models import BENCH, resolve_model  # noqa: E402
from course.user_errors import user_error  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROG = "pdm run bench-tensor-parallel"
LAUNCH_TIMEOUT = 600.0

# (engine, ranks, BLAS threads per rank), ours and mlx-lm taking turns (a machine whose load changes slows both)
CONFIGS = [("ours", 1, 1), ("mlx-lm", 1, 1), ("ours", 1, 2), ("mlx-lm", 1, 2), ("ours", 2, 1), ("mlx-lm", 2, 1)]
BATCH_COLUMNS = [
    lab.Column("engine", "engine", "{}"), lab.Column("ranks x threads", "layout", "{}"),
    lab.Column("output tokens/s", "output_tokens_per_s"), lab.Column("vs 1 rank x 1", "speedup_vs_1_rank_1_thread"),
    lab.Column("ITL p50 (ms)", "itl_p50_ms", "{:.1f}"), lab.Column("ITL p99 (ms)", "itl_p99_ms", "{:.1f}"),
    lab.Column("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), lab.Column("steps", "steps", "{}"),
]

# Model shapes for the paper model: hidden, layers, heads, KV heads, intermediate, vocabulary, tied embeddings.
SHAPES = {
    "Qwen2-0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "Qwen2-7B": (3584, 28, 28, 4, 18944, 152064, False),
    "Qwen2-72B": (8192, 80, 64, 8, 29568, 152064, False),
}
# Assumed, not measured here: per-message latency (s) and bandwidth (bytes/s) of each link, and a Mac's
# memory bandwidth. Replace them with your own measurements (the worker's all_sum timing, on your hosts).
LINKS = {"10 GbE (TCP)": (50e-6, 1.1e9), "Thunderbolt 5 (TCP)": (25e-6, 6e9), "Thunderbolt 5 (RDMA)": (5e-6, 10e9)}
MAC_MEMORY_BANDWIDTH = 400e9  # bytes/s: an M-series Max-class Mac
BYTES_PER_WEIGHT = 2  # bfloat16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH, help=f"'{BENCH}' (default), 'embedded' or a local checkpoint")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, a batch of 4")
    parser.add_argument("--requests", type=int, default=8, help="day 4.4's batch: requests at once (default 8)")
    parser.add_argument("--day", choices=("4.3", "4.4"), default=None,
                        help="only one day's runs (default both; the paper model comes with 4.3's)")
    parser.add_argument("--solution", choices=("ref", "student"), default="ref",
                        help="whose tensor_parallel.py to time: the reference (default) or src/tiny_llm")
    parser.add_argument("--hostfile", help="run the 2-rank configurations on these two hosts (mlx.launch's hostfile "
                                           "format; this repository at the same path on each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.json", help="JSON output")
    return parser


def launch_worker(engine: str, world: int, threads: int, args, *extra: str) -> dict:
    """One launch of the worker; rank 0's result (a failed launch ends the lab with one line)."""
    program = [sys.executable, "-m", "benches.tensor_parallel_worker", "--engine", engine, "--model", args.model,
               "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
               "--solution", args.solution, *extra]
    with tempfile.TemporaryDirectory() as out_dir:
        hostfile = args.hostfile if world > 1 else None
        run = ranks.launch(program, world, Path(out_dir), timeout=LAUNCH_TIMEOUT, hostfile=hostfile,
                           threads_per_rank=threads)
    result = run.results[0]
    if result is None:
        raise SystemExit(f"{PROG}: error: {engine} on {world} rank(s) failed: {run.failure()}")
    return result


def run_config(engine: str, world: int, threads: int, args) -> dict:
    """Day 4.3: one request, greedy; the median inter-token latency."""
    result = launch_worker(engine, world, threads, args)
    itl = statistics.median(result["itl_s"])
    return {"engine": engine, "ranks": world, "threads_per_rank": threads, "itl_p50_s": itl,
            "decode_tokens_per_s": 1.0 / itl, "all_sum_s": result.get("all_sum_s"), "tokens": result["tokens"]}


def run_batch(engine: str, world: int, threads: int, args) -> dict:
    """Day 4.4: `args.requests` requests at once through the engine (ours: TensorParallelEngine), to the end."""
    result = launch_worker(engine, world, threads, args, "--requests", str(args.requests))
    return {"engine": engine, "ranks": world, "threads_per_rank": threads, "layout": f"{world} x {threads}",
            "output_tokens_per_s": result["output_tokens_per_s"], "steps": result["steps"],
            "itl_p50_ms": result["batch_itl_p50_s"] * 1e3, "itl_p99_ms": result["batch_itl_p99_s"] * 1e3,
            "ttft_p50_ms": result["batch_ttft_p50_s"] * 1e3, "outputs": result["outputs"]}


def with_speedups(rows: list[dict], key: str, higher_is_better: bool) -> None:
    """Each row's `speedup_vs_1_rank_1_thread`: its figure against its engine's 1 rank x 1 thread run."""
    for row in rows:
        base = next(r for r in rows if r["engine"] == row["engine"] and r["ranks"] == 1 and r["threads_per_rank"] == 1)
        ratio = row[key] / base[key]
        row["speedup_vs_1_rank_1_thread"] = ratio if higher_is_better else 1 / ratio


def bar_plot(path: Path, machine: str, rows: list[dict], key: str, ylabel: str, title: str) -> Path:
    """`key` per layout (1 rank x 1 thread, ...), ours beside mlx-lm's, as bars."""
    layouts = list(dict.fromkeys(f"{r['ranks']} rank(s) x {r['threads_per_rank']} thread(s)" for r in rows))
    with lab.figure(path, machine, figsize=(7, 3.5)) as (fig, ax):
        width = 0.38
        for offset, engine in ((-width / 2, "ours"), (width / 2, "mlx-lm")):
            values = [r[key] for r in rows if r["engine"] == engine]
            ax.bar([i + offset for i in range(len(values))], values, width, label=engine)
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set(ylabel=ylabel, title=title)
        ax.legend()
    return path


def layer_weights(hidden, heads, kv_heads, intermediate) -> int:
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * kv_heads * head_dim * hidden + hidden + 2 * kv_heads * head_dim
    return attention + 3 * hidden * intermediate


def ring_all_reduce(n: int, message_bytes: float, latency: float, bandwidth: float) -> float:
    """A ring all-reduce: 2(N-1) steps (reduce-scatter, then all-gather), each moving 1/N of the message."""
    return 2 * (n - 1) * (latency + message_bytes / n / bandwidth)


def paper_model(links: dict) -> list[dict]:
    """Seconds per token of one sequence on N Macs: tensor parallel against pipeline parallel, per link."""
    rows = []
    for name, (hidden, layers, heads, kv_heads, intermediate, vocab, tied) in SHAPES.items():
        sharded = layers * layer_weights(hidden, heads, kv_heads, intermediate) * BYTES_PER_WEIGHT
        head = vocab * hidden * BYTES_PER_WEIGHT  # read every token (the tied table, or lm_head)
        replicated = head * (1 if tied else 2)  # the embedding, and lm_head when untied
        message = hidden * BYTES_PER_WEIGHT  # one token's hidden vector
        for n in (1, 2, 4, 8):
            if kv_heads % n or heads % n:
                rows.append({"shape": name, "macs": n, "possible": False,
                             "why": f"{kv_heads} KV heads do not divide among {n}"})
                continue
            compute_tp = (sharded / n + head) / MAC_MEMORY_BANDWIDTH
            compute_one = (sharded + head) / MAC_MEMORY_BANDWIDTH
            row = {"shape": name, "macs": n, "possible": True, "weights_per_mac_gb": (sharded / n + replicated) / 1e9,
                   "compute_ms": compute_tp * 1e3}
            for link, (latency, bandwidth) in links.items():
                tp = compute_tp + 2 * layers * ring_all_reduce(n, message, latency, bandwidth)
                pipeline = compute_one + (n - 1) * (latency + message / bandwidth)
                row[link] = {"tensor_parallel_ms": tp * 1e3, "pipeline_ms": pipeline * 1e3}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.decode_tokens, args.requests = 16, 4
    if args.decode_tokens < 3 or args.prompt_tokens < 1 or args.requests < 1:
        return user_error(PROG, "--decode-tokens must be at least 3, --prompt-tokens and --requests at least 1")
    if args.hostfile:
        try:
            hosts = ranks.read_hostfile(args.hostfile)
        except ValueError as error:
            return user_error(PROG, str(error))
        if len(hosts) != 2:
            return user_error(PROG, f"hostfile {args.hostfile}: the lab's runs are on 2 ranks, it names {len(hosts)} hosts")
    path = resolve_model(args.model)  # builds the benchmark model once, before any rank needs it
    note = model_note(path)
    if note:
        print(note)
    machine = machine_line()
    print(f"model {args.model}, prompt {args.prompt_tokens} tokens, {args.decode_tokens} new tokens, greedy; {machine}")
    results = {"machine": machine, "model": args.model, "prompt_tokens": args.prompt_tokens,
               "decode_tokens": args.decode_tokens, "requests": args.requests,
               "note": "two ranks on one machine share its cores and memory bandwidth; say how busy the machine was"}
    plots = []
    if args.day in (None, "4.3"):
        results.update(day_4_3(args, machine, plots))
    if args.day in (None, "4.4"):
        results.update(day_4_4(args, machine, plots))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"saved {args.out}" + "".join(f", {plot}" for plot in plots))
    return 0


def day_4_3(args, machine: str, plots: list) -> dict:
    """One request on 1 and 2 ranks, ours and mlx-lm's; the paper model from the measured all_sum."""
    rows = []
    for engine, world, threads in CONFIGS:
        row = run_config(engine, world, threads, args)
        rows.append(row)
        extra = f", all_sum {row['all_sum_s'] * 1e6:.0f} us" if row["all_sum_s"] else ""
        print(f"{engine:7s} {world} rank(s) x {threads} thread(s): ITL p50 {row['itl_p50_s'] * 1e3:8.1f} ms, "
              f"{row['decode_tokens_per_s']:6.2f} tokens/s{extra}")
    with_speedups(rows, "itl_p50_s", higher_is_better=False)
    ours_2, theirs_2 = (next(r for r in rows if r["engine"] == e and r["ranks"] == 2) for e in ("ours", "mlx-lm"))
    print(f"2 ranks, ours / mlx-lm decode tokens/s: {ours_2['decode_tokens_per_s'] / theirs_2['decode_tokens_per_s']:.2f}x; "
          f"the same greedy tokens in all {len(rows)} runs: {len({tuple(r['tokens']) for r in rows}) == 1}")
    plots.append(bar_plot(args.out.with_name(f"{args.out.stem}_decode.png"), machine, rows, "decode_tokens_per_s",
                          "decode tokens/s (one request)", f"day 4.3: one request, {args.model}"))
    # Loopback, measured: a 2-rank all_sum is 2 ring steps; its messages are too small for bandwidth to show.
    links = {"loopback (measured)": (ours_2["all_sum_s"] / 2, 10e9), **LINKS}
    paper = paper_model(links)
    for row in paper:
        if not row["possible"]:
            print(f"{row['shape']:11s} {row['macs']} Macs: {row['why']}")
            continue
        costs = ", ".join(f"{link}: TP {row[link]['tensor_parallel_ms']:.1f} / PP {row[link]['pipeline_ms']:.1f} ms"
                          for link in links)
        print(f"{row['shape']:11s} {row['macs']} Macs ({row['weights_per_mac_gb']:.1f} GB each): {costs}")
    return {"runs": rows, "paper_model": {
        "links": {k: {"latency_s": v[0], "bandwidth_bytes_per_s": v[1]} for k, v in links.items()},
        "mac_memory_bandwidth_bytes_per_s": MAC_MEMORY_BANDWIDTH, "bytes_per_weight": BYTES_PER_WEIGHT, "rows": paper}}


def day_4_4(args, machine: str, plots: list) -> dict:
    """A batch through day 4.4's engine on 1 and 2 ranks, beside mlx-lm's BatchGenerator on its sharded model."""
    rows = [run_batch(engine, world, threads, args) for engine, world, threads in CONFIGS]
    with_speedups(rows, "output_tokens_per_s", higher_is_better=True)
    lab.print_table(f"day 4.4: {args.requests} requests at once, {args.prompt_tokens}-token prompts, "
                    f"{args.decode_tokens} new tokens each", BATCH_COLUMNS, rows, caption=machine)
    ours_2, theirs_2 = (next(r for r in rows if r["engine"] == e and r["ranks"] == 2) for e in ("ours", "mlx-lm"))
    print(f"2 ranks, ours / mlx-lm output tokens/s: {ours_2['output_tokens_per_s'] / theirs_2['output_tokens_per_s']:.2f}x; "
          f"the same greedy tokens in all {len(rows)} runs: {len({json.dumps(r['outputs']) for r in rows}) == 1}")
    plots.append(bar_plot(args.out.with_name(f"{args.out.stem}_engine.png"), machine, rows, "output_tokens_per_s",
                          "output tokens/s (whole batch)", f"day 4.4: {args.requests} requests at once, {args.model}"))
    return {"batch_runs": rows}


if __name__ == "__main__":
    raise SystemExit(main())
