"""`mlx_lm.server` as bench-serve's peer: the same fast BLAS and float32 weights on the CPU as our server.

    python -m benches.mlx_lm_peer --model DIR --port P      # any `mlx_lm.server` arguments

Our server loads models through `course.models.load_model`, which loads an optimized BLAS before MLX
and casts the weights to float32 on the CPU (half-precision matmuls are not BLAS-backed there). Run
as is, `mlx_lm.server` would get neither and lose for reasons that have nothing to do with serving;
this wrapper gives it both, then runs its own `main()` unchanged.
"""

from course import fast_mlx

fast_mlx.setup()

import mlx.core as mx  # noqa: E402
import mlx_lm.server as mlx_lm_server  # noqa: E402

_load = mlx_lm_server.load


def load_float32_on_cpu(*args, **kwargs):
    loaded = _load(*args, **kwargs)
    if mx.default_device() == mx.cpu:
        loaded[0].set_dtype(mx.float32)
        mx.eval(loaded[0].parameters())
    return loaded


mlx_lm_server.load = load_float32_on_cpu

if __name__ == "__main__":
    mlx_lm_server.main()
