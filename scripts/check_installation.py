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
    return parser


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
    from scripts import fast_mlx

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
    from scripts.models import EMBEDDED_MODEL_DIR

    ok = (EMBEDDED_MODEL_DIR / "model.safetensors").exists()
    print(f"embedded model {EMBEDDED_MODEL_DIR} ({'present' if ok else 'MISSING: is the clone complete?'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
