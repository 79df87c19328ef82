"""Decode with and without the KV cache, side by side (day 2.1).

    pdm run bench-kv-cache                          # the Qwen2-0.5B-shape model, 64-token prompt, 16 tokens
    pdm run bench-kv-cache --model embedded         # the tiny embedded model (seconds)
    pdm run bench-kv-cache --prompt-tokens 256 --decode-tokens 32
    pdm run bench-kv-cache --solution student       # time your own src/tiny_llm

Both runs use the same week-2 model and greedy decoding, so they must produce the same tokens.
Without the cache, every step runs the whole sequence so far (as week 1's loop does): step i costs
prompt + i tokens of work. With it, the prompt is prefilled once and each step runs one token.
Decode tokens/s counts the tokens after the first (the first one comes out of the prefill in both).
Results go to benches/results/kv_cache.json.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from course import selector  # noqa: E402
from course.models import MEANINGLESS_NOTE, BENCH, is_embedded, load_model, resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_cache.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-kv-cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH,
                        help=f"'{BENCH}' (default), 'embedded', a local checkpoint or a Hugging Face id")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens to generate (default 16)")
    selector.add_arguments(parser)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    return parser


def next_token(logits: mx.array) -> int:
    """Greedy: the most likely token after the last position."""
    return int(mx.argmax(logits[0, -1]).item())  # .item() waits for the computation to finish


def decode_without_cache(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """Greedy decoding that runs the whole sequence at every step. Returns (tokens, first-token s, rest s)."""
    tokens = list(prompt)
    start = time.perf_counter()
    out = [next_token(model(mx.array([tokens]), 0, model.make_cache()))]
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n - 1):
        tokens.append(out[-1])
        out.append(next_token(model(mx.array([tokens]), 0, model.make_cache())))  # a fresh cache: recompute all
    return out, first, time.perf_counter() - start


def decode_with_cache(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """Greedy decoding with the KV cache: prefill once, then one token per step."""
    cache = model.make_cache()
    start = time.perf_counter()
    out = [next_token(model(mx.array([prompt]), 0, cache))]
    first = time.perf_counter() - start
    offset = len(prompt)
    start = time.perf_counter()
    for _ in range(n - 1):
        out.append(next_token(model(mx.array([[out[-1]]]), offset, cache)))
        offset += 1
    return out, first, time.perf_counter() - start


@selector.command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.decode_tokens < 2:
        raise SystemExit("--decode-tokens must be at least 2 (decode speed counts the tokens after the first)")
    path = resolve_model(args.model)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    selection = selector.from_arguments(args)
    qwen2_week2 = selection.qwen2_week2
    selector.announce(selection)
    mlx_model, tokenizer = load_model(args.model)
    model = qwen2_week2.Qwen2ModelWeek2(mlx_model)
    # A fixed, readable prompt, cut or repeated to the requested length.
    text = "The KV cache stores the keys and values of every token, so each new token costs one step. "
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]

    print(f"model {args.model} ({path.name}), {args.solution} solution, device {mx.default_device()}, "
          f"BLAS: {fast_mlx.blas_in_use()}")
    print(f"prompt {len(prompt)} tokens, {args.decode_tokens} new tokens, greedy")
    # Warm up both paths (first calls pay for allocation and thread start-up).
    decode_with_cache(model, prompt[:8], 2)
    decode_without_cache(model, prompt[:8], 2)

    cached_tokens, cached_first, cached_rest = decode_with_cache(model, prompt, args.decode_tokens)
    plain_tokens, plain_first, plain_rest = decode_without_cache(model, prompt, args.decode_tokens)
    rest = args.decode_tokens - 1
    with_tps, without_tps = rest / cached_rest, rest / plain_rest
    same = cached_tokens == plain_tokens

    print()
    print(f"{'':24s} {'no cache':>12s} {'KV cache':>12s} {'ratio':>8s}")
    # The first token costs the same prefill either way: only the steps after it differ.
    print(f"{'first token (prefill) s':24s} {plain_first:12.3f} {cached_first:12.3f}")
    print(f"{'decode tokens/s':24s} {without_tps:12.2f} {with_tps:12.2f} {with_tps / without_tps:7.2f}x")
    print(f"{'decode ms/token':24s} {1000 / without_tps:12.1f} {1000 / with_tps:12.1f}")
    dtype = model.embedding.weight.dtype
    if same:
        print("same tokens: yes")
    elif dtype == mx.float32:
        print("same tokens: NO: in float32 the cached model must give the cacheless one's tokens (a bug)")
    else:
        print(f"same tokens: no, in {dtype}: the two paths round differently, which can flip a near-tie")

    result = {
        "benchmark": "kv_cache",
        "model": args.model,
        "model_path": str(path),
        "solution": args.solution,
        "device": str(mx.default_device()),
        "blas": fast_mlx.blas_in_use(),
        "mlx_version": mx.__version__,
        "machine": platform.machine(),
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens,
        "without_cache": {"first_token_s": plain_first, "decode_tokens_per_s": without_tps},
        "with_cache": {"first_token_s": cached_first, "decode_tokens_per_s": with_tps},
        "decode_speedup": with_tps / without_tps,
        "same_tokens": same,
        "dtype": str(dtype),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0 if same or dtype != mx.float32 else 1


if __name__ == "__main__":
    raise SystemExit(main())
