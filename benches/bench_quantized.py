"""Decode speed and weight memory of quantized weights, side by side in one run (day 2.3).

    pdm run bench-quantized                          # the Qwen2-0.5B-shape model, float32 vs 8-bit vs 4-bit
    pdm run bench-quantized --model embedded         # the tiny embedded model (seconds)
    pdm run bench-quantized --decode-tokens 16 --bits 4
    pdm run bench-quantized --quick                  # 4 tokens, 4-bit only
    pdm run bench-quantized --solution student       # time your own src/tiny_llm

The same float32 checkpoint is quantized in-process (group size 64) to each bit width, then decoded
greedily by four engines on the same weights:
  - ours, dequantize then matmul: Qwen2ModelWeek2(keep_quantized=True) with day 2.3's quantized_linear,
    which unpacks a float copy of every weight it reads, at every step;
  - ours, fused: the same model with quantized_linear swapped for MLX's mx.quantized_matmul, which
    reads the packed integers directly;
  - float32: Qwen2ModelWeek2 on the unquantized weights (the baseline);
  - mlx-lm: its own model on the same weights (the peer; fused kernels).
Decode tokens/s counts the steps after the first token. Weight memory is the bytes the model holds.
Results go to benches/results/quantized.json (--out) and quantized_plot.png beside it.
"""

from course import fast_mlx

fast_mlx.setup()

import contextlib  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from benches import lab  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-quantized"
GROUP_SIZE = 64


def build_parser():
    parser = lab.parser(PROG, __doc__, out="quantized.json")
    lab.options(parser, prompt_tokens=(32, "prompt length"), decode_tokens=(8, "tokens to generate"))
    parser.add_argument("--bits", type=int, nargs="+", choices=(4, 8), default=[8, 4],
                        help="bit widths to measure (default: 8 4)")
    return parser


def quantized_copy(mlx_model, bits: int):
    """A copy of the mlx-lm model with every layer whose input is whole groups quantized (as mlx_lm.convert does)."""
    copy = type(mlx_model)(mlx_model.args)
    copy.update(mlx_model.parameters())
    nn.quantize(copy, group_size=GROUP_SIZE, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % GROUP_SIZE == 0)
    mx.eval(copy.parameters())
    return copy


def fused_quantized_linear(x: mx.array, w, bias: mx.array | None = None) -> mx.array:
    """MLX's fused kernel: multiplies by the packed integers without writing a float weight."""
    y = mx.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits)
    return y if bias is None else y + bias


@contextlib.contextmanager
def fused(quantize_module):
    """Swap the module's quantized_linear for the fused kernel, for the duration of a run."""
    ours = quantize_module.quantized_linear
    quantize_module.quantized_linear = fused_quantized_linear
    try:
        yield
    finally:
        quantize_module.quantized_linear = ours


def our_weight_bytes(model, quantize_module) -> int:
    """Bytes of every weight our model holds: packed integers, scales and biases count for a quantized one."""
    def size(w):
        if w is None:
            return 0
        return w.nbytes() if isinstance(w, quantize_module.QuantizedWeight) else w.nbytes

    total = size(model.embedding.weight) + size(model.w_lm_head) + size(model.norm.weight)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        total += sum(size(w) for w in (attn.wq, attn.wk, attn.wv, attn.wo, attn.bq, attn.bk, attn.bv,
                                       mlp.w_gate, mlp.w_up, mlp.w_down, layer.input_layernorm.weight,
                                       layer.post_attention_layernorm.weight))
    return total


def mlx_lm_weight_bytes(mlx_model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(mlx_model.parameters()))


def ours_decode(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding with our KV cache. Returns (tokens, seconds of the n - 1 steps after the first)."""
    cache = model.make_cache()
    out = [int(mx.argmax(model(mx.array([prompt]), 0, cache)[0, -1]).item())]
    offset = len(prompt)
    start = time.perf_counter()
    for _ in range(n - 1):
        out.append(int(mx.argmax(model(mx.array([[out[-1]]]), offset, cache)[0, -1]).item()))
        offset += 1
    return out, time.perf_counter() - start


def mlx_lm_decode(mlx_model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """The same greedy loop on mlx-lm's model and its own KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(mlx_model)
    out = [int(mx.argmax(mlx_model(mx.array([prompt]), cache=cache)[0, -1]).item())]
    start = time.perf_counter()
    for _ in range(n - 1):
        out.append(int(mx.argmax(mlx_model(mx.array([[out[-1]]]), cache=cache)[0, -1]).item()))
    return out, time.perf_counter() - start


def plot(bench, rows: list[dict]):
    path = bench.figure_path("plot")
    with lab.figure(path, bench.machine, ncols=2, figsize=(10, 4)) as (fig, (speed, memory)):
        labels = [f"{r['weights']}\n{r['engine']}" for r in rows]
        colors = ["tab:gray" if r["weights"] == "float32" else "tab:blue" if r["weights"] == "8-bit" else "tab:green"
                  for r in rows]
        speed.barh(labels, [r["decode_tokens_per_s"] for r in rows], color=colors)
        speed.set_xlabel("decode tokens/s")
        speed.invert_yaxis()
        memory.barh(labels, [r["weight_bytes"] / 2**30 for r in rows], color=colors)
        memory.set_xlabel("weight memory (GiB)")
        memory.invert_yaxis()
        memory.set_yticks([])
        fig.suptitle("Decoding on quantized weights: speed and memory")
    return path


COLUMNS = [lab.Column("weights", "weights", "{}"), lab.Column("engine", "engine", "{}"),
           lab.Column("decode tok/s", "decode_tokens_per_s"), lab.Column("speed vs float32", "speedup", "{:.2f}x"),
           lab.Column("weights GiB", "weight_gib", "{:.3f}"), lab.Column("memory vs float32", "shrink", "{:.2f}x"),
           lab.Column("same tokens as mlx-lm", "same", "{}")]


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.decode_tokens, args.bits = min(args.decode_tokens, 4), [4]
    if args.decode_tokens < 2:
        return lab.user_error(PROG, "--decode-tokens must be at least 2 (decode speed counts the tokens after the first)")
    if args.prompt_tokens < 1:
        return lab.user_error(PROG, "--prompt-tokens must be at least 1")
    bench = lab.start(args, ("quantize", "qwen2_week2"))
    quantize, qwen2_week2 = bench.selection.quantize, bench.selection.qwen2_week2
    mlx_model, tokenizer = bench.mlx_model, bench.tokenizer
    if any(hasattr(m, "scales") for _, m in mlx_model.named_modules()):
        return lab.user_error(PROG, f"{args.model} is already quantized: give a float checkpoint, this bench quantizes it")
    text = "Decoding reads every weight once per token, so fewer bytes per weight mean faster steps. "
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]
    print(f"prompt {len(prompt)} tokens, {args.decode_tokens} new tokens, greedy; group size {GROUP_SIZE}")

    runs = [("float32", "ours", None), ("float32", "mlx-lm", None)]
    for bits in args.bits:
        runs += [(f"{bits}-bit", "ours, dequantize + matmul", bits), (f"{bits}-bit", "ours, fused", bits),
                 (f"{bits}-bit", "mlx-lm", bits)]
    quantized = {}
    rows = []
    for weights, engine, bits in lab.progress(runs, "decode runs"):
        source = mlx_model if bits is None else quantized.setdefault(bits, quantized_copy(mlx_model, bits))
        if engine == "mlx-lm":
            mlx_lm_decode(source, prompt[:8], 2)  # warm-up: first calls pay for allocation and threads
            tokens, seconds = mlx_lm_decode(source, prompt, args.decode_tokens)
            weight_bytes = mlx_lm_weight_bytes(source)
        else:
            model = qwen2_week2.Qwen2ModelWeek2(source, keep_quantized=bits is not None)
            with fused(quantize) if engine == "ours, fused" else contextlib.nullcontext():
                ours_decode(model, prompt[:8], 2)
                tokens, seconds = ours_decode(model, prompt, args.decode_tokens)
            weight_bytes = our_weight_bytes(model, quantize)
            del model
        rows.append({"weights": weights, "engine": engine, "bits": bits,
                     "decode_tokens_per_s": (args.decode_tokens - 1) / seconds,
                     "weight_bytes": weight_bytes, "tokens": tokens})

    baseline = rows[0]
    for row in rows:
        peer = next(r for r in rows if r["weights"] == row["weights"] and r["engine"] == "mlx-lm")
        row.update(speedup=row["decode_tokens_per_s"] / baseline["decode_tokens_per_s"],
                   shrink=row["weight_bytes"] / baseline["weight_bytes"], weight_gib=row["weight_bytes"] / 2**30,
                   same="yes" if row["tokens"] == peer["tokens"] else "no")
    lab.print_table(f"greedy decoding, {len(prompt)}-token prompt, {args.decode_tokens} new tokens, group size "
                    f"{GROUP_SIZE}", COLUMNS, rows)
    for bits in args.bits:
        student = next(r for r in rows if r["bits"] == bits and r["engine"] == "ours, dequantize + matmul")
        fast = next(r for r in rows if r["bits"] == bits and r["engine"] == "ours, fused")
        print(f"{bits}-bit: the fused kernel decodes {fast['decode_tokens_per_s'] / student['decode_tokens_per_s']:.2f}x "
              f"as fast as dequantize + matmul")

    return bench.save({"group_size": GROUP_SIZE, "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens,
                       "rows": rows}, [plot(bench, rows)])


if __name__ == "__main__":
    raise SystemExit(main())
