"""The model runner: executes a `StepPlan` in one model call and picks each sampling sequence's next token.

It owns the paged KV pool. For a plan it lays every chunk's tokens end to end (decodes first, then
prefill chunks), works out for each token its position and its slot in the pool (through the
sequence's block table), and for each sequence which slots hold its keys; that is the
`RaggedBatch` the model runs. Then it samples: greedy rows all at once, the others each with its
own sampler (temperature, top-k, top-p, seed), using week 1's `make_sampler`, after the logits
processing a request asks for (penalties, min_p, logit_bias: logits_processors.py, provided).
"""

from __future__ import annotations

import mlx.core as mx

from .attention import causal_mask
from .block_manager import slot_mapping
from .logits_processors import TokenLogprobs, process_logits, token_logprobs
from .quantized_kv import make_kv_pool
from .qwen2_week3 import PrefillChunk, RaggedBatch
from .sampler import make_sampler, seed_draw
from .scheduler import ScheduledChunk, StepPlan
from .structured import apply_constraints
from .sequence import Sequence


class ModelRunner:
    """Runs plans on a week-3 model over its own KV pool of `num_blocks` blocks of `block_size` positions."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_bits: int | None = None):
        """Allocate the KV pool once (provided); `kv_bits` 16, 8 or 4 stores it in fewer bytes (day 4.2)."""
        self.model = model
        self.block_size = block_size
        self.pool = make_kv_pool(model, num_blocks, block_size, kv_bits)
        self.logprobs: dict[object, TokenLogprobs] = {}  # the last step's, by request id (requests that asked)

    def run(self, plan: StepPlan) -> list[int]:
        """Run the plan in one model call; return the next token of each chunk that samples, in plan order."""
        sampling = [chunk for chunk in plan.chunks if chunk.samples]
        batch = self.prepare(plan)
        logits = self.model(batch, self.pool)
        # Evaluate the new keys and values with the logits: left lazy, the pool's writes would pile up. Started,
        # not waited for: while the model runs (on the GPU, or MLX's CPU thread), Python builds any token mask a
        # constrained row needs (day 4.5), off the step's critical path; sampling waits for the logits.
        mx.async_eval(logits, *self.pool.arrays())
        seqs = [chunk.seq for chunk in sampling]
        # A request's penalties, min_p and logit_bias, then its constraint's mask (day 4.5); none asked:
        # the logits themselves, at no cost.
        tokens = self.sample(apply_constraints(process_logits(logits, seqs), seqs), seqs)
        self.logprobs = token_logprobs(logits, seqs, tokens)  # only for the requests that ask
        return tokens

    def prepare(self, plan: StepPlan) -> RaggedBatch:
        """The plan as a `RaggedBatch`: token ids, positions, pool slots, attention views, sampling rows."""
        # TODO: token ids, positions, write slots (slot_mapping), sample rows, decode view, chunk views
        raise NotImplementedError(
            "Week 3 Day 1 Task 4 (book/src/week3-01-token-budget.md): lay the plan out as a RaggedBatch"
        )

    def decode_view(self, decodes: list[ScheduledChunk]) -> tuple[mx.array | None, mx.array | None]:
        """Slots of every decoding sequence's keys, padded to the longest (`n x S`), and the mask hiding the padding."""
        # TODO: slots of positions 0..start per decode, padded with slot 0 to the longest; mask 0 / -inf, n x 1 x 1 x S
        raise NotImplementedError(
            "Week 3 Day 1 Task 4 (book/src/week3-01-token-budget.md): the decode rows' key slots and padding mask"
        )

    def chunk_view(self, chunk: ScheduledChunk) -> PrefillChunk:
        """A prefill chunk's keys (its sequence's positions 0 .. end-1) and its mask: day 2.7's chunk mask,
        which is week 1's `causal_mask(L, S)` with L the chunk's length and S its end."""
        # TODO: slots of positions 0 .. start+length-1 and causal_mask(length, start + length)
        raise NotImplementedError(
            "Week 3 Day 1 Task 4 (book/src/week3-01-token-budget.md): a prefill chunk's key slots and chunk mask"
        )

    def sample(self, logits: mx.array, seqs: list[Sequence]) -> list[int]:
        """The next token of each sequence from its row of `logits`: argmax for greedy ones, its own sampler otherwise."""
        # TODO: argmax for all rows; a sampled sequence uses make_sampler, after seed_draw(its params, outputs so far)
        raise NotImplementedError(
            "Week 3 Day 1 Task 4 (book/src/week3-01-token-budget.md): pick each sequence's next token"
        )
