"""Decode speed and weight memory of quantized weights, side by side in one run (day 2.3).

    pdm run bench-quantized                          # the Qwen2-0.5B-shape model, float32 vs 8-bit vs 4-bit
    pdm run bench-quantized --model embedded         # the tiny embedded model (seconds)
    pdm run bench-quantized --decode-tokens 16 --bits 4
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
Results go to benches/results/quantized.json and quantized.png.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from tqdm import tqdm  # noqa: E402

from course.user_errors import user_error  # noqa: E402
from course.models import BENCH, MEANINGLESS_NOTE, is_embedded, load_model, resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GROUP_SIZE = 64


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-quantized", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH,
                        help=f"'{BENCH}' (default), 'embedded', a local float checkpoint or a Hugging Face id")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--decode-tokens", type=int, default=8, help="tokens to generate (default 8)")
    parser.add_argument("--bits", type=int, nargs="+", choices=(4, 8), default=[8, 4],
                        help="bit widths to measure (default: 8 4)")
    parser.add_argument("--solution", choices=("ref", "student"), default="ref",
                        help="whose quantize.py and qwen2_week2.py to time: the reference (default) or src/tiny_llm")
    parser.add_argument("--out", type=Path, default=RESULTS / "quantized.json", help="JSON output")
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


def machine_line() -> str:
    blas = fast_mlx.blas_in_use().split(" (")[0]
    return f"{platform.system()} {platform.machine()}, {mx.default_device()}, BLAS {blas}"


def plot(rows: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.decode_tokens < 2:
        return user_error("pdm run bench-quantized", "--decode-tokens must be at least 2 (decode speed counts the tokens after the first)")
    if args.prompt_tokens < 1:
        return user_error("pdm run bench-quantized", "--prompt-tokens must be at least 1")
    path = resolve_model(args.model)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    package = "tiny_llm_ref" if args.solution == "ref" else "tiny_llm"
    quantize = importlib.import_module(f"{package}.quantize")
    qwen2_week2 = importlib.import_module(f"{package}.qwen2_week2")
    mlx_model, tokenizer = load_model(args.model)
    if any(hasattr(m, "scales") for _, m in mlx_model.named_modules()):
        return user_error("pdm run bench-quantized", f"{args.model} is already quantized: give a float checkpoint, this bench quantizes it")
    text = "Decoding reads every weight once per token, so fewer bytes per weight mean faster steps. "
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]
    machine = machine_line()
    print(f"model {args.model} ({path.name}), {args.solution} solution, {machine}")
    print(f"prompt {len(prompt)} tokens, {args.decode_tokens} new tokens, greedy; group size {GROUP_SIZE}")

    runs = [("float32", "ours", None), ("float32", "mlx-lm", None)]
    for bits in args.bits:
        runs += [(f"{bits}-bit", "ours, dequantize + matmul", bits), (f"{bits}-bit", "ours, fused", bits),
                 (f"{bits}-bit", "mlx-lm", bits)]
    quantized = {}
    rows = []
    for weights, engine, bits in tqdm(runs, desc="decode runs", unit="run"):
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
    print()
    print(f"{'weights':8s} {'engine':28s} {'decode tok/s':>12s} {'vs float32':>10s} {'weights GiB':>11s} "
          f"{'vs float32':>10s}  same tokens as mlx-lm")
    for row in rows:
        peer = next(r for r in rows if r["weights"] == row["weights"] and r["engine"] == "mlx-lm")
        speedup = row["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
        shrink = row["weight_bytes"] / baseline["weight_bytes"]
        print(f"{row['weights']:8s} {row['engine']:28s} {row['decode_tokens_per_s']:12.2f} {speedup:9.2f}x "
              f"{row['weight_bytes'] / 2**30:11.3f} {shrink:9.2f}x  {'yes' if row['tokens'] == peer['tokens'] else 'no'}")
    for bits in args.bits:
        student = next(r for r in rows if r["bits"] == bits and r["engine"] == "ours, dequantize + matmul")
        fast = next(r for r in rows if r["bits"] == bits and r["engine"] == "ours, fused")
        print(f"{bits}-bit: the fused kernel decodes {fast['decode_tokens_per_s'] / student['decode_tokens_per_s']:.2f}x "
              f"as fast as dequantize + matmul")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "solution": args.solution, "machine": machine, "group_size": GROUP_SIZE,
              "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(rows, png, machine)
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
