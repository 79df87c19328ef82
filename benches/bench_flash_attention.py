"""Peak memory and time of a long prefill's attention: plain against tiled, side by side (day 2.4).

    pdm run bench-flash-attention                            # 2k to 8k tokens, one layer at Qwen2-0.5B's shape
    pdm run bench-flash-attention --lengths 512 1024         # quick
    pdm run bench-flash-attention --max-plain-gib 2          # skip plain runs whose score matrix needs more
    pdm run bench-flash-attention --solution student         # time your own flash_attention

One layer's causal attention over a prompt of L tokens (queries, keys and values already projected),
at Qwen2-0.5B's shape: 14 query heads on 2 key/value heads of 64 dimensions, float32. Layers run one
after another, so one layer's attention is what sets the prefill's peak. Three ways:
  - plain: day 1.3's scaled_dot_product_attention_grouped (the L x L scores of every head at once);
  - tiled: day 2.4's flash_attention (one tile_q x tile_kv block of scores at a time);
  - mx.fast: MLX's fused scaled_dot_product_attention (the peer).
Peak memory is MLX's own counter (mx.get_peak_memory) above what the inputs hold. Plain attention
needs 14 x L x L x 4 bytes per copy of its scores, 3.5 GiB at 8k: a run whose score matrix alone
exceeds --max-plain-gib is skipped and marked so, to keep a shared machine alive.
Results go to benches/results/flash_attention.json and flash_attention.png.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from course.user_errors import user_error  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-flash-attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 6144, 8192],
                        help="prompt lengths (default: 2048 4096 6144 8192)")
    parser.add_argument("--tile", type=int, default=128, help="tile_q = tile_kv of the tiled attention (default 128)")
    parser.add_argument("--max-plain-gib", type=float, default=1.0,
                        help="skip the plain and mx.fast runs whose L x L scores exceed this (default 1)")
    parser.add_argument("--solution", choices=("ref", "student"), default="ref",
                        help="whose flash_attention to time: the reference (default) or src/tiny_llm")
    parser.add_argument("--out", type=Path, default=RESULTS / "flash_attention.json", help="JSON output")
    return parser


def measure(attend, q, k, v) -> tuple[mx.array, float, int]:
    """(output, seconds, peak bytes above what was allocated before) of one evaluated call."""
    mx.eval(q, k, v)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    out = attend(q, k, v)
    mx.eval(out)
    seconds = time.perf_counter() - start
    return out, seconds, mx.get_peak_memory() - before


def machine_line() -> str:
    blas = fast_mlx.blas_in_use().split(" (")[0]
    return f"{platform.system()} {platform.machine()}, {mx.default_device()}, BLAS {blas}"


def plot(rows: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("plain", "o-"), ("mx.fast", "^--"), ("tiled", "s-")):
        points = [(r["length"], r[name]) for r in rows if r.get(name)]
        memory.plot([p[0] for p in points], [p[1]["peak_bytes"] / 2**20 for p in points], style, label=name)
        speed.plot([p[0] for p in points], [p[1]["seconds"] for p in points], style, label=name)
    memory.set_yscale("log")
    memory.set_xlabel("prompt tokens")
    memory.set_ylabel("peak memory above the inputs (MiB, log scale)")
    speed.set_xlabel("prompt tokens")
    speed.set_ylabel("seconds (one layer)")
    memory.legend()
    speed.legend()
    fig.suptitle("One layer's causal attention at Qwen2-0.5B's shape (14 heads, 2 KV heads, d=64)")
    fig.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.lengths) < 1 or args.tile < 1:
        return user_error("pdm run bench-flash-attention", "--lengths and --tile must be positive")
    package = "tiny_llm_ref" if args.solution == "ref" else "tiny_llm"
    flash = importlib.import_module(f"{package}.flash_attention").flash_attention
    plain = importlib.import_module("tiny_llm_ref.attention").scaled_dot_product_attention_grouped
    scale = HEAD_DIM**-0.5
    machine = machine_line()
    print(f"{args.solution} flash_attention, tiles {args.tile} x {args.tile}, {machine}")

    ways = {
        "plain": lambda q, k, v: plain(q, k, v, scale=scale, mask="causal"),
        "mx.fast": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
        "tiled": lambda q, k, v: flash(q, k, v, scale=scale, mask="causal", tile_q=args.tile, tile_kv=args.tile),
    }
    rows = []
    for length in tqdm(args.lengths, desc="prompt lengths", unit="length"):
        keys = mx.random.split(mx.random.key(length), 3)
        q = mx.random.normal((1, HEADS, length, HEAD_DIM), key=keys[0])
        k = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=keys[1])
        v = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=keys[2])
        score_bytes = HEADS * length * length * 4
        row = {"length": length, "score_matrix_bytes": score_bytes}
        outputs = {}
        for name, attend in ways.items():
            if name != "tiled" and score_bytes > args.max_plain_gib * 2**30:
                row[name] = None  # skipped: its scores alone exceed --max-plain-gib
                continue
            outputs[name], seconds, peak = measure(attend, q, k, v)
            row[name] = {"seconds": seconds, "peak_bytes": peak}
        reference_out = outputs.get("mx.fast", outputs.get("plain"))
        if reference_out is not None:
            row["tiled_max_abs_diff"] = float(mx.abs(outputs["tiled"] - reference_out).max())
        rows.append(row)
        del outputs, reference_out

    print()
    print(f"{'tokens':>7s} {'scores GiB':>10s} | {'plain MiB':>10s} {'mx.fast MiB':>11s} {'tiled MiB':>10s} "
          f"{'plain/tiled':>11s} | {'plain s':>8s} {'mx.fast s':>9s} {'tiled s':>8s} {'tiled/plain':>11s}")

    def cell(row, name, key, scale_by, width, digits):
        return f"{row[name][key] / scale_by:{width}.{digits}f}" if row.get(name) else f"{'skipped':>{width}s}"

    for row in rows:
        tiled = row["tiled"]
        memory_ratio = f"{row['plain']['peak_bytes'] / tiled['peak_bytes']:10.0f}x" if row.get("plain") else f"{'':>11s}"
        time_ratio = f"{tiled['seconds'] / row['plain']['seconds']:10.2f}x" if row.get("plain") else f"{'':>11s}"
        print(f"{row['length']:7d} {row['score_matrix_bytes'] / 2**30:10.2f} | "
              f"{cell(row, 'plain', 'peak_bytes', 2**20, 10, 0)} {cell(row, 'mx.fast', 'peak_bytes', 2**20, 11, 0)} "
              f"{cell(row, 'tiled', 'peak_bytes', 2**20, 10, 1)} {memory_ratio} | "
              f"{cell(row, 'plain', 'seconds', 1, 8, 2)} {cell(row, 'mx.fast', 'seconds', 1, 9, 2)} "
              f"{cell(row, 'tiled', 'seconds', 1, 8, 2)} {time_ratio}")
    diffs = [row["tiled_max_abs_diff"] for row in rows if "tiled_max_abs_diff" in row]
    if diffs:
        print(f"tiled against the untiled output: max |difference| {max(diffs):.2e}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"solution": args.solution, "machine": machine, "tile": args.tile,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
              "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(rows, png, machine)
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
