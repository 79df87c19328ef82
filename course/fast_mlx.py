"""Give MLX's Linux CPU backend an optimized BLAS, before `mlx.core` is imported.

MLX's Linux CPU wheel links a reference BLAS that runs an fp32 matmul at about
6 GFLOPS on a 2-core machine. Its BLAS symbols are resolved at load time, so a
library loaded earlier with RTLD_GLOBAL wins. We try, in order:

1. Intel MKL from the `mkl` / `intel-openmp` wheels in this environment
   (a Linux x86_64 dependency of the project: no manual step);
2. a system OpenBLAS (Debian/Ubuntu `libopenblas0-pthread`).

On macOS MLX uses Accelerate and Metal, and nothing here applies.
Call `setup()` first thing in every entry point (the test conftest does too).
"""

import ctypes
import os
import sys
from pathlib import Path

_state = {"done": False, "blas": None, "warning": None}

SYSTEM_OPENBLAS = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
]


def _env_lib_dirs() -> list[Path]:
    # The `mkl` wheel installs its shared objects in <prefix>/lib, not in site-packages.
    return [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]


def _try_mkl() -> str | None:
    for lib_dir in _env_lib_dirs():
        iomp = lib_dir / "libiomp5.so"
        mkl = lib_dir / "libmkl_rt.so.3"
        if iomp.exists() and mkl.exists():
            # MKL's threading layer needs the OpenMP runtime to be loaded first.
            ctypes.CDLL(str(iomp), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(mkl), mode=ctypes.RTLD_GLOBAL)
            return f"Intel MKL ({mkl})"
    return None


def _try_system_openblas() -> str | None:
    for path in SYSTEM_OPENBLAS:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return f"OpenBLAS ({path})"
    return None


def setup(quiet: bool = False, shared_cores: bool = False) -> str | None:
    """Load an optimized BLAS for MLX on Linux; return its description (None when none is used).

    `shared_cores`: this process takes turns on the same cores with another that computes too (while grading, the
    tests' process and the sandboxed worker call each other). MKL's OpenMP threads then sleep as soon as a parallel
    region ends: by default each spins for 200 ms waiting for more work, a core the other process needed (measured
    on 2 cores: a graded day 1.5 spent 13% less CPU, 2.1 12% less). Alone, a process gains nothing by it.
    """
    if _state["done"]:
        return _state["blas"]
    _state["done"] = True
    if shared_cores:
        os.environ.setdefault("KMP_BLOCKTIME", "0")  # read by Intel's OpenMP runtime when it starts, below
    if not sys.platform.startswith("linux") or os.environ.get("TINY_LLM_NO_FAST_BLAS"):
        return None
    if "mlx.core" in sys.modules:
        _state["warning"] = "mlx.core was imported before course.fast_mlx.setup(); BLAS left as is."
    else:
        try:
            _state["blas"] = _try_mkl() or _try_system_openblas()
        except OSError as error:
            _state["warning"] = f"loading an optimized BLAS failed: {error}"
        if _state["blas"] is None and _state["warning"] is None:
            _state["warning"] = (
                "no optimized BLAS found: MLX's CPU backend will run matmuls at a few GFLOPS. "
                "Run `pdm install` (it brings Intel MKL on x86_64) or `apt-get install libopenblas0-pthread`."
            )
    if _state["warning"] and not quiet:
        print(f"[tiny-llm] warning: {_state['warning']}", file=sys.stderr)
    return _state["blas"]


def blas_in_use() -> str:
    """A one-line description of the BLAS that MLX's CPU backend uses."""
    if sys.platform == "darwin":
        return "Apple Accelerate"
    return _state["blas"] or "MLX's bundled reference BLAS (slow)"
