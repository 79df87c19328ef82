"""How many tokens one engine step may run: the token budget (`max_num_batched_tokens`).

A step runs every decode token plus as many prefill tokens as the budget leaves. Since the step is
one model call, its time grows with its tokens: roughly `base + tokens * per_token`, where `base` is
what a step costs even for a few tokens (reading all the weights once) and `per_token` the compute
of one more row. A prefill token also attends to every key before it, so `per_token` grows with the
offset its chunk starts at: `per_token(offset) = per_token(0) + offset * per_key`. The budget is the
knob between the decoding requests' inter-token latency (every decode waits for the whole step) and
how fast prompts get prefilled.

- `FixedTokenBudget`: always the same budget.
- `AdaptiveTokenBudget`: while requests decode, the largest budget whose predicted step time stays
  within a latency target; with nobody decoding, the full budget (nobody waits on the step). A long
  prompt is then spread over the decode steps that have to run anyway, each one filled up to the
  target, instead of stalling them; late in the prompt, where a token costs more, with fewer tokens.

The scheduler asks `budget(num_decoding, offset)` before planning a step (`offset`: where the next
prefill chunk starts), and the engine reports each step with
`observe_step(num_tokens, num_decoding, seconds, offset)` (`offset`: where its prefill chunks started,
the mean over their tokens).
"""

from __future__ import annotations


class FixedTokenBudget:
    """Every step may run up to `max_num_batched_tokens` tokens (provided)."""

    def __init__(self, max_num_batched_tokens: int = 256):
        """`max_num_batched_tokens` >= 1."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens

    def budget(self, num_decoding: int, offset: int = 0) -> int:
        """The token budget of the next step: always `max_num_batched_tokens`."""
        return self.max_num_batched_tokens

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        """A step ran `num_tokens` tokens, `num_decoding` of them decodes, in `seconds` (ignored)."""

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        return f"a fixed token budget of {self.max_num_batched_tokens} tokens per step"


class AdaptiveTokenBudget:
    """A budget that holds a step near `target_itl` seconds while requests decode.

    It learns the cost model `base + prefill_tokens * (intercept + slope * offset)`: `base_seconds`
    is a moving average of decode-only steps; each other step, once the base is known, gives one
    point: its prefill chunks' `offset` (mean over their tokens) and what each prefill token added,
    `(seconds - base) / tokens`. `seconds_per_token(offset)` is the least-squares line through the
    recent points (moving averages of x, y, x*x and x*y: `moments`, so old points fade like the
    base's), used only upward: below the recent offsets, their average cost. The budget is then `num_decoding + (target - base_seconds) / seconds_per_token(offset)`
    at the next chunk's offset, clamped to `min_tokens .. max_num_batched_tokens`. While the base is
    unknown it answers `num_decoding` (a decode-only step, the only kind that measures it); then
    `initial_tokens` until a prefill token is measured.

    The target is `target_itl` seconds, or, with `target_itl=None`, `decode_multiple` times the
    measured decode-only step: "a step may take 2 plain decode steps", which holds on a fast machine
    and a slow (or busy) one alike.
    """

    def __init__(self, target_itl: float | None = 0.4, max_num_batched_tokens: int = 2048, min_tokens: int = 16,
                 initial_tokens: int = 64, smoothing: float = 0.5, decode_multiple: float = 2.0):
        """A latency target (seconds, or a multiple of a decode step); budgets within `min_tokens .. max_num_batched_tokens`."""
        if not 1 <= min_tokens <= initial_tokens <= max_num_batched_tokens:
            raise ValueError("need 1 <= min_tokens <= initial_tokens <= max_num_batched_tokens, got "
                             f"{min_tokens}, {initial_tokens}, {max_num_batched_tokens}")
        if target_itl is not None and target_itl <= 0:
            raise ValueError(f"target_itl must be > 0 seconds (or None), got {target_itl}")
        if decode_multiple <= 1:
            raise ValueError(f"decode_multiple must be > 1, got {decode_multiple}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.target_itl = target_itl
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_tokens = min_tokens
        self.initial_tokens = initial_tokens
        self.smoothing = smoothing
        self.decode_multiple = decode_multiple
        self.base_seconds: float | None = None  # a decode-only step
        # Moving averages of (offset, seconds per prefill token, offset^2, offset * seconds per token).
        self.moments: tuple[float, float, float, float] | None = None

    def budget(self, num_decoding: int, offset: int = 0) -> int:
        """The largest budget whose predicted step time is within the target (full budget when nobody decodes)."""
        # BEGIN TASK Week 3 Day 1 Task 1: the largest budget within the latency target
        # TODO: nobody decoding: the full budget; no base yet: num_decoding; no per-token cost yet: initial_tokens;
        # TODO: else num_decoding + (target() - base) / seconds_per_token(offset), clamped
        if num_decoding == 0:
            return self.max_num_batched_tokens
        if self.base_seconds is None:
            return num_decoding  # one decode-only step measures the base; no other step can
        per_token = self.seconds_per_token(offset)
        if per_token is None:
            return self.initial_tokens
        if per_token <= 0:
            return self.max_num_batched_tokens  # prefill tokens measured as free: nothing to hold back
        spare = self.target() - self.base_seconds
        tokens = num_decoding + int(spare / per_token)
        return max(self.min_tokens, min(self.max_num_batched_tokens, tokens))
        # END TASK

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        """Update the averages from one step: decode-only steps give the base, the others a point of the line."""
        # BEGIN TASK Week 3 Day 1 Task 1: update the step-time averages
        # TODO: decode-only step: base_seconds; no base yet: nothing to learn; otherwise the point
        # TODO: (offset, (seconds - base) / prefill tokens) enters the moments (x, y, x*x, x*y)
        prefill_tokens = num_tokens - num_decoding
        if prefill_tokens <= 0:
            self.base_seconds = self._average(self.base_seconds, seconds)
            return
        if self.base_seconds is None:
            return  # without the base, a step's time cannot be split into base and prefill tokens
        per_token = max(seconds - self.base_seconds, 0.0) / prefill_tokens
        point = (offset, per_token, offset * offset, offset * per_token)
        before = self.moments or point  # the first point is taken as it is
        self.moments = tuple(self._average(average, value) for average, value in zip(before, point))
        # END TASK

    def seconds_per_token(self, offset: float) -> float | None:
        """What a prefill token at `offset` adds to a step: the fitted line there (None before any point)."""
        # BEGIN TASK Week 3 Day 1 Task 1: the least-squares line through the recent points
        # TODO: slope = (mean xy - mean x * mean y) / (mean xx - mean x^2), 0 when that variance is under 1 (token^2);
        # TODO: clamp it to 0 .. mean y / mean x; mean y + slope * (offset - mean x), never below mean y
        if self.moments is None:
            return None
        x, y, xx, xy = self.moments
        variance = xx - x * x
        slope = (xy - x * y) / variance if variance > 1.0 else 0.0  # offsets within a token: no slope to see
        slope = max(0.0, min(slope, y / x if x > 0 else 0.0))  # never cheaper with more keys; at most 2x at mean x
        # Only upward from the recent points: smaller chunks also cost more per token (small matmuls), which the
        # line takes for the offset, so back at offset 0 it would promise too much.
        return y + slope * max(0.0, offset - x)
        # END TASK

    def target(self) -> float:
        """The step time to aim for, in seconds (provided)."""
        if self.target_itl is not None:
            return self.target_itl
        return self.decode_multiple * (self.base_seconds or 0.0)

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        target = (f"{self.target_itl * 1000:.0f} ms" if self.target_itl is not None
                  else f"{self.decode_multiple:g} decode steps")
        return (f"an adaptive token budget of {self.min_tokens}-{self.max_num_batched_tokens} tokens for a "
                f"decode latency target of {target}")

    def _average(self, old: float | None, new: float) -> float:
        """Exponential moving average; the first measurement is taken as it is (provided)."""
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
