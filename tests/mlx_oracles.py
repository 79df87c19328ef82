"""Where the tests run MLX's own quantization kernels when those kernels are the oracle.

On a Mac (Metal) and on the CPU, MLX's quantize and dequantize round like the array operations a student
writes, so the tests compare bit for bit on the default device. MLX's CUDA backend does not (0.32.4 on an
H100): its dequantize rounds scale * q + bias once (about half of the values differ in the last bit), its
bfloat16 quantize rounds a few scales the other way, its quantized matmul hung on one of day 2.3's shapes,
and mlx-lm's 4-bit model gave all-zero logits on the course's tiny shapes. On a CUDA GPU the oracles
therefore run on MLX's CPU; the code under test still runs on the GPU.
"""

import contextlib

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX's default device is a GPU that is not Metal's."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def quantization_oracle():
    """A `with` block in which MLX's quantization kernels compute the expected values."""
    return mx.stream(mx.cpu) if on_cuda() else contextlib.nullcontext()


def quantize(*args, **kwargs):
    """mx.quantize, where its answer is the one the course's array operations must match."""
    with quantization_oracle():
        return mx.quantize(*args, **kwargs)


def dequantize(*args, **kwargs):
    """mx.dequantize, likewise."""
    with quantization_oracle():
        return mx.dequantize(*args, **kwargs)


def quantized_matmul(*args, **kwargs):
    """mx.quantized_matmul, MLX's fused kernel, likewise."""
    with quantization_oracle():
        return mx.quantized_matmul(*args, **kwargs)
