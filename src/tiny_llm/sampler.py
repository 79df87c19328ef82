"""Sampling the next token: greedy, temperature, top-k and top-p (nucleus)."""

from typing import Callable

import mlx.core as mx

from .validation import check_sampling


def make_sampler(temp: float, top_p: float | None = None, top_k: int | None = None) -> Callable[[mx.array], mx.array]:
    """A function `sample(logprobs)` that maps log-probabilities `B x V` to token ids `B`.

    temp 0 is greedy (argmax). Otherwise the logits are divided by `temp` (below 1 sharpens, above 1
    flattens), then only the `top_k` most likely tokens are kept (when given), then only the smallest
    set of most likely tokens whose probability adds up to at least `top_p` (when given), and one token
    is drawn from what is left, renormalized. Draws use MLX's global random state (`mx.random.seed`).
    A `top_k` at least the vocabulary size keeps every token. Raises ValueError or TypeError for a
    temp that is negative or not finite, a top_p outside (0, 1], a top_k below 1.
    """
    check_sampling(temp, top_p, top_k)

    def sample(logprobs: mx.array) -> mx.array:
        """Pick one token id per row of `logprobs` (`B x V`)."""
        # TODO: temp 0 -> argmax; otherwise divide by temp into `logits` (drawn with mx.random.categorical below)
        raise NotImplementedError("Week 1 Day 7 Task 1 (book/src/week1-07-sampling.md): greedy and temperature")
        if top_k is not None and top_k < logprobs.shape[-1]:
            # TODO: before drawing, keep only the top_k largest logits (the rest become -inf)
            raise NotImplementedError("Week 1 Day 7 Task 2 (book/src/week1-07-sampling.md): top-k")
        if top_p is not None and 0 < top_p < 1:
            # TODO: then keep only the smallest set of most likely tokens whose mass reaches top_p
            raise NotImplementedError("Week 1 Day 7 Task 3 (book/src/week1-07-sampling.md): top-p")
        # categorical() draws index i with probability softmax(logits)_i; -inf entries are never drawn.
        return mx.random.categorical(logits, axis=-1)

    return sample


def seed_draw(sampling, num_output_tokens: int) -> None:
    """Seed MLX's global random state for a seeded request's next draw; one without a seed leaves it (provided).

    The seed is the request's plus the tokens it has produced so far, so its draw is the same whatever
    else shares the batch, and again when a preemption recomputes it. Week 3's runner and day 4.1's
    verification both draw after this call.
    """
    if sampling.seed is not None:
        mx.random.seed(sampling.seed + num_output_tokens)
