"""Peak memory and time of a long prefill's attention: plain against tiled, side by side (day 2.4).

    pdm run bench-flash-attention                            # 2k to 8k tokens, one layer at Qwen2-0.5B's shape
    pdm run bench-flash-attention --quick                    # 512 to 2k tokens
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
Results go to benches/results/flash_attention.json (--out) and flash_attention.png beside it.
"""

from course import fast_mlx

fast_mlx.setup()

import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches import lab  # noqa: E402
from course import selector  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-flash-attention"
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B
WAYS = ("plain", "mx.fast", "tiled")


def build_parser():
    parser = lab.parser(PROG, __doc__, out="flash_attention.json", model=False)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 6144, 8192],
                        help="prompt lengths (default: 2048 4096 6144 8192)")
    parser.add_argument("--tile", type=int, default=128, help="tile_q = tile_kv of the tiled attention (default 128)")
    parser.add_argument("--max-plain-gib", type=float, default=1.0,
                        help="skip the plain and mx.fast runs whose L x L scores exceed this (default 1)")
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


def plot(bench, rows: list[dict]):
    path = bench.figure_path("plot")
    with lab.figure(path, bench.machine, ncols=2, figsize=(10, 4)) as (fig, (memory, speed)):
        for name, style in zip(WAYS, ("o-", "^--", "s-")):
            points = [(r["length"], r[name]) for r in rows if r.get(name)]
            memory.plot([p[0] for p in points], [p[1]["peak_bytes"] / 2**20 for p in points], style, label=name)
            speed.plot([p[0] for p in points], [p[1]["seconds"] for p in points], style, label=name)
        memory.set(yscale="log", xlabel="prompt tokens", ylabel="peak memory above the inputs (MiB, log scale)")
        speed.set(xlabel="prompt tokens", ylabel="seconds (one layer)")
        memory.legend()
        speed.legend()
        fig.suptitle("One layer's causal attention at Qwen2-0.5B's shape (14 heads, 2 KV heads, d=64)")
    return path


def table_row(row: dict) -> dict:
    """One length's figures as the table prints them (None: the run was skipped)."""
    out = {"length": row["length"], "score_gib": row["score_matrix_bytes"] / 2**30}
    for name in WAYS:
        out[f"{name}_mib"] = row[name]["peak_bytes"] / 2**20 if row.get(name) else None
        out[f"{name}_s"] = row[name]["seconds"] if row.get(name) else None
    if row.get("plain"):
        out["memory_ratio"] = row["plain"]["peak_bytes"] / row["tiled"]["peak_bytes"]
        out["time_ratio"] = row["tiled"]["seconds"] / row["plain"]["seconds"]
    return out


COLUMNS = [lab.Column("tokens", "length", "{}"), lab.Column("scores GiB", "score_gib"),
           *(lab.Column(f"{name} MiB", f"{name}_mib", "{:.1f}") for name in WAYS),
           lab.Column("plain / tiled memory", "memory_ratio", "{:.0f}x"),
           *(lab.Column(f"{name} s", f"{name}_s") for name in WAYS),
           lab.Column("tiled / plain time", "time_ratio", "{:.2f}x")]


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.lengths = [n for n in args.lengths if n <= 2048] or [512, 1024, 2048]
    if min(args.lengths) < 1 or args.tile < 1:
        return lab.user_error(PROG, "--lengths and --tile must be positive")
    bench = lab.start(args, ("flash_attention",), load=False)
    flash = bench.selection.flash_attention.flash_attention
    plain = selector.reference().attention.scaled_dot_product_attention_grouped  # the untiled baseline
    scale = HEAD_DIM**-0.5
    print(f"tiles {args.tile} x {args.tile}")

    ways = {
        "plain": lambda q, k, v: plain(q, k, v, scale=scale, mask="causal"),
        "mx.fast": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
        "tiled": lambda q, k, v: flash(q, k, v, scale=scale, mask="causal", tile_q=args.tile, tile_kv=args.tile),
    }
    rows = []
    for length in lab.progress(args.lengths, "prompt lengths"):
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

    lab.print_table("peak memory above the inputs and time of one layer's attention", COLUMNS, map(table_row, rows),
                    caption=f"a run whose L x L scores exceed {args.max_plain_gib:g} GiB is skipped (-)")
    diffs = [row["tiled_max_abs_diff"] for row in rows if "tiled_max_abs_diff" in row]
    if diffs:
        print(f"tiled against the untiled output: max |difference| {max(diffs):.2e}")

    shape = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32"}
    return bench.save({"tile": args.tile, "rows": rows, "shape": shape}, [plot(bench, rows)])


if __name__ == "__main__":
    raise SystemExit(main())
