"""A quantized paged KV cache: the same memory holds 3.8x (8-bit) or 7x (4-bit) the tokens of float32 (SmolLM2).

Day 3.2's pool keeps every key and value as a float: `num_kv_heads x head_dim` numbers per token per
layer, 4 bytes each in float32. Here they are stored the way day 2.3 stored weights: cut into groups
of `group_size` consecutive features, each group an integer per value plus one scale and one bias.

- **Groups run along `head_dim`, one token and one head at a time.** A token's keys are quantized
  once, when the step that computed them writes them (`write`, the scatter), and never touched
  again: a group never spans two tokens, so appending a token never re-quantizes its neighbours,
  and a block freed and handed to another sequence is simply overwritten.
- **Reading dequantizes** (`gather`): attention sees `... x H x D` floats as before, so the model,
  the block tables and the scheduler do not change. Admission and preemption still count blocks;
  a block just costs fewer bytes, so the same memory holds more of them (`num_blocks_for_memory`).
- **Scales and biases are float16**, whatever the model's dtype: two bytes each, and their own
  rounding (about 1/2048 of their size) stays well under the width of an 8-bit level (1/255 of the
  group's range).

With SmolLM2's `head_dim` of 64 and one group per head vector, a key costs 64 bytes (8-bit) or 32
(4-bit) plus 4 bytes of scale and bias, against 256 in float32 and 128 in float16.
"""

from __future__ import annotations

import mlx.core as mx

from .block_manager import KvPool
from .quantize import dequantize, quantize

KV_GROUP_SIZE = 64  # mlx-lm's default `kv_group_size`
SCALE_DTYPE = mx.float16
KV_BITS = (None, 16, 8, 4)  # None: floats in the model's dtype; 16: float16; 8 and 4: quantized


def kv_group_size(head_dim: int, group_size: int = KV_GROUP_SIZE) -> int:
    """The group size for heads of `head_dim` features: `group_size`, or the whole head if it is smaller (provided)."""
    size = min(group_size, head_dim)
    if head_dim % size != 0:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the group size {size}")
    return size


def quantize_kv(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """`T x H x D` keys or values -> packed `T x H x D*bits/32` uint32, scales and biases `T x H x D/group_size`.

    Each head of each token is cut into groups of `group_size` features along D and quantized with
    day 2.3's `quantize`; scales and biases are stored as float16 (`SCALE_DTYPE`).
    """
    # BEGIN TASK Week 4 Day 2 Task 1: quantize keys or values in groups along head_dim
    # TODO: rows of D features (T*H of them) through day 2.3's quantize, then back to T x H x ...
    # TODO: scales and biases as SCALE_DTYPE
    tokens, heads, head_dim = x.shape
    packed, scales, biases = quantize(x.reshape(tokens * heads, head_dim), group_size, bits)
    return (packed.reshape(tokens, heads, -1), scales.reshape(tokens, heads, -1).astype(SCALE_DTYPE),
            biases.reshape(tokens, heads, -1).astype(SCALE_DTYPE))
    # END TASK


def dequantize_kv(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                  dtype: mx.Dtype) -> mx.array:
    """Packed `... x H x D*bits/32` with scales and biases `... x H x D/group_size` -> `... x H x D` in `dtype`."""
    # BEGIN TASK Week 4 Day 2 Task 1: dequantize keys or values
    # TODO: day 2.3's dequantize works on any leading shape; scales and biases in `dtype`
    return dequantize(packed, scales.astype(dtype), biases.astype(dtype), group_size, bits)
    # END TASK


class QuantizedKvPool:
    """Day 3.2's `KvPool`, quantized: per layer, keys and values as (packed, scales, biases) triples.

    The same interface (`write`, `gather`, `arrays`), the same slots: slot s holds the s-th row of
    each array, `H x D*bits/32` packed words and `H x D/group_size` scales and biases.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 bits: int = 8, group_size: int = KV_GROUP_SIZE, dtype: mx.Dtype = mx.float32):
        """Zero-filled pools, allocated once (provided). `dtype` is what `gather` returns: the model's."""
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits!r}")
        self.bits = bits
        self.group_size = kv_group_size(head_dim, group_size)
        self.dtype = dtype
        slots = num_blocks * block_size
        words = head_dim * bits // 32
        groups = head_dim // self.group_size

        def empty() -> list[mx.array]:
            return [mx.zeros((slots, num_kv_heads, words), dtype=mx.uint32),
                    mx.zeros((slots, num_kv_heads, groups), dtype=SCALE_DTYPE),
                    mx.zeros((slots, num_kv_heads, groups), dtype=SCALE_DTYPE)]

        self.keys = [empty() for _ in range(num_layers)]  # per layer: [packed, scales, biases]
        self.values = [empty() for _ in range(num_layers)]
        mx.eval(self.arrays())

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Quantize `T x H x D` keys and values and store them at the T given slots of `layer`."""
        # BEGIN TASK Week 4 Day 2 Task 2: quantize on scatter
        # TODO: quantize_kv keys and values; store each of the three parts at `slots`
        for stored, new in ((self.keys[layer], keys), (self.values[layer], values)):
            for part, new_part in zip(stored, quantize_kv(new, self.group_size, self.bits)):
                part[slots] = new_part
        # END TASK

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """The keys and values at `slots` (any shape `...`), dequantized to `... x H x D` in the pool's dtype."""
        # BEGIN TASK Week 4 Day 2 Task 2: dequantize on gather
        # TODO: index the three parts with slots, then dequantize_kv; keys and values alike
        return tuple(dequantize_kv(*(part[slots] for part in stored), self.group_size, self.bits, self.dtype)
                     for stored in (self.keys[layer], self.values[layer]))
        # END TASK

    def arrays(self) -> list[mx.array]:
        """Every pool array: what a step must evaluate so the writes happen (provided)."""
        return [part for stored in self.keys + self.values for part in stored]


def pool_nbytes(pool) -> int:
    """Bytes a pool's arrays occupy, float or quantized (provided)."""
    return sum(array.nbytes for array in pool.arrays())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_bits: int | None = None,
                       dtype: mx.Dtype = mx.float32, group_size: int = KV_GROUP_SIZE) -> int:
    """Bytes one token's keys and values take in every layer of a pool with these `kv_bits` (see `KV_BITS`).

    `dtype` is the model's: what a float pool (`kv_bits` None) stores.
    """
    # BEGIN TASK Week 4 Day 2 Task 3: bytes per token of a float or quantized pool
    # TODO: per layer, keys and values, per head: D floats (dtype's size, or float16's for kv_bits 16)
    # TODO: quantized: D*bits/8 bytes plus a float16 scale and bias per group of kv_group_size(head_dim, group_size)
    if kv_bits is None or kv_bits == 16:
        per_head = head_dim * (dtype.size if kv_bits is None else mx.float16.size)
    else:
        groups = head_dim // kv_group_size(head_dim, group_size)
        per_head = head_dim * kv_bits // 8 + 2 * groups * SCALE_DTYPE.size
    return 2 * num_layers * num_kv_heads * per_head
    # END TASK


def num_blocks_for_memory(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks of `block_size` tokens fit in `memory_bytes`; ValueError if not even one."""
    # BEGIN TASK Week 4 Day 2 Task 3: the pool's size in blocks from a memory budget
    # TODO: whole blocks only; a budget below one block is an error naming the bytes one block needs
    block_bytes = block_size * bytes_per_token
    if memory_bytes < block_bytes:
        raise ValueError(f"a KV cache of {memory_bytes} bytes holds no block: one block of {block_size} tokens "
                         f"takes {block_bytes} bytes")
    return memory_bytes // block_bytes
    # END TASK


def make_kv_pool(model, num_blocks: int, block_size: int, kv_bits: int | None = None) -> KvPool | QuantizedKvPool:
    """The pool the runner allocates for `model`: float in the model's dtype, float16, 8-bit or 4-bit (provided)."""
    if kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, not {kv_bits!r}")
    if kv_bits is None:
        return model.make_kv_pool(num_blocks, block_size)
    shape = (model.num_hidden_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    if kv_bits == 16:
        return KvPool(*shape, dtype=mx.float16)
    return QuantizedKvPool(*shape, bits=kv_bits, dtype=model.dtype)


def model_bytes_per_token(model, kv_bits: int | None = None) -> int:
    """`kv_bytes_per_token` for a week-3 model's shape and dtype (provided)."""
    return kv_bytes_per_token(model.num_hidden_layers, model.num_kv_heads, model.head_dim, kv_bits, model.dtype)
