"""Decode with and without the KV cache, side by side (day 2.1).

    pdm run bench-kv-cache                          # the Qwen2-0.5B-shape model, 64-token prompt, 16 tokens
    pdm run bench-kv-cache --model embedded         # the tiny embedded model (seconds)
    pdm run bench-kv-cache --prompt-tokens 256 --decode-tokens 32
    pdm run bench-kv-cache --quick                  # 32-token prompt, 8 tokens
    pdm run bench-kv-cache --solution student       # time your own src/tiny_llm

Both runs use the same week-2 model and greedy decoding, so they must produce the same tokens.
Without the cache, every step runs the whole sequence so far (as week 1's loop does): step i costs
prompt + i tokens of work. With it, the prompt is prefilled once and each step runs one token.
Decode tokens/s counts the tokens after the first (the first one comes out of the prefill in both).
Results go to benches/results/kv_cache.json (--out).
"""

from course import fast_mlx

fast_mlx.setup()

import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches import lab  # noqa: E402
from course.user_errors import command  # noqa: E402

PROG = "pdm run bench-kv-cache"


def build_parser():
    parser = lab.parser(PROG, __doc__, out="kv_cache.json")
    lab.options(parser, prompt_tokens=(64, "prompt length"), decode_tokens=(16, "tokens to generate"))
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


COLUMNS = [lab.Column("", "what", "{}"), lab.Column("no cache", "plain", "{:.3f}"),
           lab.Column("KV cache", "cached", "{:.3f}"), lab.Column("ratio", "ratio", "{:.2f}x")]


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.decode_tokens = min(args.prompt_tokens, 32), min(args.decode_tokens, 8)
    if args.decode_tokens < 2:
        return lab.user_error(PROG, "--decode-tokens must be at least 2 (decode speed counts the tokens after the first)")
    lab.check_positive(PROG, args, "prompt_tokens")
    bench = lab.start(args, ("qwen2_week2", "kv_cache"))
    model = bench.week2_model()
    # A fixed, readable prompt, cut or repeated to the requested length.
    text = "The KV cache stores the keys and values of every token, so each new token costs one step. "
    ids = bench.tokenizer.encode(text, add_special_tokens=False)
    prompt = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]
    print(f"prompt {len(prompt)} tokens, {args.decode_tokens} new tokens, greedy")
    # Warm up both paths (first calls pay for allocation and thread start-up).
    decode_with_cache(model, prompt[:8], 2)
    decode_without_cache(model, prompt[:8], 2)

    cached_tokens, cached_first, cached_rest = decode_with_cache(model, prompt, args.decode_tokens)
    plain_tokens, plain_first, plain_rest = decode_without_cache(model, prompt, args.decode_tokens)
    rest = args.decode_tokens - 1
    with_tps, without_tps = rest / cached_rest, rest / plain_rest
    same = cached_tokens == plain_tokens
    # The first token costs the same prefill either way: only the steps after it differ.
    lab.print_table("greedy decoding without and with the KV cache", COLUMNS, [
        {"what": "first token (prefill) s", "plain": plain_first, "cached": cached_first},
        {"what": "decode tokens/s", "plain": without_tps, "cached": with_tps, "ratio": with_tps / without_tps},
        {"what": "decode ms/token", "plain": 1000 / without_tps, "cached": 1000 / with_tps}])
    dtype = model.embedding.weight.dtype
    if same:
        print("same tokens: yes")
    elif dtype == mx.float32:
        print("same tokens: NO: in float32 the cached model must give the cacheless one's tokens (a bug)")
    else:
        print(f"same tokens: no, in {dtype}: the two paths round differently, which can flip a near-tie")
    bench.save({"benchmark": "kv_cache", "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens,
                       "without_cache": {"first_token_s": plain_first, "decode_tokens_per_s": without_tps},
                       "with_cache": {"first_token_s": cached_first, "decode_tokens_per_s": with_tps},
                       "decode_speedup": with_tps / without_tps, "same_tokens": same, "dtype": str(dtype)})
    return 0 if same or dtype != mx.float32 else 1


if __name__ == "__main__":
    raise SystemExit(main())
