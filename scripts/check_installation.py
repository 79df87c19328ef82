"""Check the installation: platform, MLX version and device, the BLAS in use, and fp32 matmul speed.

    pdm run check-installation            # measure with the optimized BLAS (the default set-up)
    pdm run check-installation --no-fast-blas   # measure MLX's stock BLAS, for comparison
"""

import argparse
import os
import platform
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdm run check-installation", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-fast-blas", action="store_true",
                        help="do not load an optimized BLAS (shows MLX's stock CPU speed)")
    parser.add_argument("--size", type=int, default=1024, help="square matrix size (default 1024)")
    parser.add_argument("--model", help="also measure prompt and decode tokens/s of this model with mlx-lm "
                                        "(e.g. bench-0.5b, the Qwen2-0.5B-shape model)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for --model (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens to generate for --model (default 16)")
    return parser


def model_speed(name: str, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of mlx-lm's own generation loop on model `name`."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from course.models import load_model

    model, tokenizer = load_model(name)
    prompt = list(range(1000, 1000 + prompt_tokens))
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=decode_tokens,
                                sampler=make_sampler(temp=0.0)):
        pass
    return last.prompt_tps, last.generation_tps


def matmul_gflops(size: int, repeats: int = 10) -> float:
    """Measured fp32 GFLOPS of a size x size matmul on MLX's default device."""
    import mlx.core as mx

    a = mx.random.normal((size, size), dtype=mx.float32)
    b = mx.random.normal((size, size), dtype=mx.float32)
    mx.eval(a, b)
    for _ in range(2):  # warm up: first calls pay for kernel set-up and thread start
        mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * size**3 / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_fast_blas:
        os.environ["TINY_LLM_NO_FAST_BLAS"] = "1"
    from course import fast_mlx

    fast_mlx.setup()
    import mlx.core as mx

    gflops = matmul_gflops(args.size)
    print(f"platform      {platform.system()} {platform.machine()}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")
    print(f"mlx           {mx.__version__}")
    print(f"device        {mx.default_device()}"
          + (" (Metal GPU available)" if sys.platform == "darwin" and mx.metal.is_available() else ""))
    print(f"BLAS          {fast_mlx.blas_in_use()}")
    print(f"fp32 matmul   {gflops:.1f} GFLOPS ({args.size}x{args.size})")
    if mx.default_device() == mx.cpu and gflops < 50 and not args.no_fast_blas:
        print("warning: matmuls are slow; without an optimized BLAS the course's models run ~30x slower.\n"
              "         Run `pdm install` again (it brings Intel MKL on x86_64 Linux) "
              "or install OpenBLAS (`apt-get install libopenblas0-pthread`).")
    from course.models import EMBEDDED_MODEL_DIR

    if args.model:
        prompt_tps, decode_tps = model_speed(args.model, args.prompt_tokens, args.decode_tokens)
        print(f"model {args.model}: prompt {prompt_tps:.1f} tokens/s ({args.prompt_tokens} tokens), "
              f"decode {decode_tps:.2f} tokens/s ({args.decode_tokens} tokens), mlx-lm's generation loop")
    ok = (EMBEDDED_MODEL_DIR / "model.safetensors").exists()
    print(f"embedded model {EMBEDDED_MODEL_DIR} ({'present' if ok else 'MISSING: is the clone complete?'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
