"""How many tokens one engine step may run: the token budget (`max_num_batched_tokens`).

A step runs every decode token plus as many prefill tokens as the budget leaves. Since the step is
one model call, its time grows with its tokens: roughly `base + tokens * per_token`, where `base` is
what a plain decode step costs (reading all the weights once, and each decoding request's own work:
its attention over its keys, its sampling; so `base` depends on how many requests decode) and
`per_token` the compute of one more prompt row. A prefill token also attends to every key before it,
so `per_token` grows with the offset its chunk starts at: `per_token(offset) = per_token(0) + offset *
per_key`. The budget is the knob between the decoding requests' inter-token latency (every decode
waits for the whole step) and how fast prompts get prefilled.

- `FixedTokenBudget`: always the same budget.
- `AdaptiveTokenBudget`: while requests decode, the largest budget whose predicted step time stays
  within a latency target; with nobody decoding, the full budget (nobody waits on the step). A long
  prompt is then spread over the decode steps that have to run anyway, each one filled up to the
  target, instead of stalling them; late in the prompt, where a token costs more, with fewer tokens.
- `GoodputTokenBudget` (day 3.4): the same cost model, and the two promises a server makes: a
  time-to-first-token target for the requests still waiting for their first token and an inter-token
  latency target for the ones streaming. A step normally takes half the room the ITL target leaves
  above a plain decode step (of as many decodes); as the longest-waiting request nears its TTFT target, prefill gets more
  of that room, all of it once the target is reached, never more.

The scheduler asks `budget(num_decoding, offset, waited)` before planning a step (`offset`: where the
next prefill chunk starts; `waited`: how long the longest-waiting request without a first token has
waited, in seconds), and the engine reports each step with
`observe_step(num_tokens, num_decoding, seconds, offset)` (`offset`: where its prefill chunks started,
the mean over their tokens). `BudgetPolicy` is that contract.
"""

from __future__ import annotations

from typing import Protocol


class BudgetPolicy(Protocol):
    """What the scheduler and the engine need of a token-budget policy (provided)."""

    max_num_batched_tokens: int  # the cap: no step runs more tokens, whatever the policy answers

    def budget(self, num_decoding: int, offset: int = 0, waited: float = 0.0) -> int:
        """The next step's token budget: `num_decoding` decodes are planned, the next prefill chunk starts at
        `offset`, and the longest-waiting request without a first token has waited `waited` seconds."""

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        """A step ran `num_tokens` tokens, `num_decoding` of them decodes, in `seconds`; its prefill at `offset`."""

    def describe(self) -> str:
        """One line for the engine's start-up log."""


class FixedTokenBudget:
    """Every step may run up to `max_num_batched_tokens` tokens (provided)."""

    def __init__(self, max_num_batched_tokens: int = 256):
        """`max_num_batched_tokens` >= 1."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens

    def budget(self, num_decoding: int, offset: int = 0, waited: float = 0.0) -> int:
        """The token budget of the next step: always `max_num_batched_tokens`."""
        return self.max_num_batched_tokens

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        """A step ran `num_tokens` tokens, `num_decoding` of them decodes, in `seconds` (ignored)."""

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        return f"a fixed token budget of {self.max_num_batched_tokens} tokens per step"


class AdaptiveTokenBudget:
    """A budget that holds a step near `target_itl` seconds while requests decode.

    It learns the cost model `base(num_decoding) + prefill_tokens * (intercept + slope * offset)`:
    `base_seconds[n]` is a moving average of the decode-only steps with `n` decodes (a decode row is not
    free: each brings its own attention and sampling, so a plain step with 8 decodes costs more than one
    with 1, and a base measured at 1 decode would charge the 7 others to the prefill tokens); each other
    step, once the base for its decodes is known, gives one point: its prefill chunks' `offset` (mean
    over their tokens) and what each prefill token added, `(seconds - base) / tokens`.
    `seconds_per_token(offset)` is the least-squares line through the recent points (moving averages
    of x, y, x*x and x*y: `moments`, so old points fade like the base's), used only upward: below the recent offsets, their average cost. The budget is then
    `num_decoding + (target - base) / seconds_per_token(offset)` at the next chunk's offset, clamped to
    `min_tokens .. max_num_batched_tokens`. While the base for `num_decoding` decodes is unknown it
    answers `num_decoding` (a decode-only step, the only kind that measures it: one plain step each
    time the number of decodes is new); then `initial_tokens` until a prefill token is measured.

    The target is `target_itl` seconds, or, with `target_itl=None`, `decode_multiple` times the
    measured decode-only step with as many decodes: "a step may take 2 plain decode steps", which holds
    on a fast machine and a slow (or busy) one alike, with few requests decoding or many.
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
        self.base_seconds: dict[int, float] = {}  # number of decodes -> a decode-only step with that many
        # Moving averages of (offset, seconds per prefill token, offset^2, offset * seconds per token).
        self.moments: tuple[float, float, float, float] | None = None

    def budget(self, num_decoding: int, offset: int = 0, waited: float = 0.0) -> int:
        """The largest budget whose predicted step time is within the target (full budget when nobody decodes).

        `waited` (how long the queue's oldest request has waited) is not this policy's concern: day 3.4's is."""
        # TODO: nobody decoding: the full budget; no base for num_decoding decodes yet: num_decoding; no per-token
        # TODO: cost yet: initial_tokens; else num_decoding + (step_seconds(num_decoding, waited) - base) /
        # TODO: seconds_per_token(offset), clamped
        raise NotImplementedError(
            "Week 3 Day 1 Task 1 (book/src/week3-01-token-budget.md): the largest budget within the latency target"
        )

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        """Update the averages from one step: decode-only steps give the base, the others a point of the line."""
        # TODO: decode-only step: base_seconds[num_decoding]; no base for its decodes yet: nothing to learn;
        # TODO: otherwise the point (offset, (seconds - base) / prefill tokens) enters the moments (x, y, x*x, x*y)
        raise NotImplementedError(
            "Week 3 Day 1 Task 1 (book/src/week3-01-token-budget.md): update the step-time averages"
        )

    def seconds_per_token(self, offset: float) -> float | None:
        """What a prefill token at `offset` adds to a step: the fitted line there (None before any point)."""
        # TODO: slope = (mean xy - mean x * mean y) / (mean xx - mean x^2), 0 when that variance is under 1 (token^2);
        # TODO: clamp it to 0 .. mean y / mean x; mean y + slope * (offset - mean x), never below mean y
        raise NotImplementedError(
            "Week 3 Day 1 Task 1 (book/src/week3-01-token-budget.md): the least-squares line through the recent points"
        )

    def target(self, num_decoding: int) -> float:
        """The ITL target, in seconds: `target_itl`, or `decode_multiple` decode-only steps of `num_decoding`
        decodes (provided)."""
        if self.target_itl is not None:
            return self.target_itl
        return self.decode_multiple * self.base_seconds.get(num_decoding, 0.0)

    def step_seconds(self, num_decoding: int, waited: float) -> float:
        """How long the next step (`num_decoding` decodes) may take: here always the target (provided; day 3.4's
        budget moves it with `waited`)."""
        return self.target(num_decoding)

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        target = (f"{self.target_itl * 1000:.0f} ms" if self.target_itl is not None
                  else f"{self.decode_multiple:g} decode steps")
        return (f"an adaptive token budget of {self.min_tokens}-{self.max_num_batched_tokens} tokens for a "
                f"decode latency target of {target}")

    def _average(self, old: float | None, new: float) -> float:
        """Exponential moving average; the first measurement is taken as it is (provided)."""
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new


class GoodputTokenBudget(AdaptiveTokenBudget):
    """Day 3.4: a budget that keeps both promises, the first token's (TTFT) and the next ones' (ITL).

    Goodput counts the requests that meet both targets (DistServe); a step's time is what trades them
    (Sarathi-Serve): a longer step prefills the waiting requests faster and makes every streaming one
    wait longer for its next token. Day 3.1's cost model (`base_seconds`, `seconds_per_token`) turns a
    step time into a budget; this class only chooses the step time, from how long the longest-waiting
    request without a first token has waited (`waited`):

        urgency = min(1, waited / ttft_target())
        step    = base + (itl_target - base) * (1 + urgency) / 2

    (`base`: a decode-only step with as many decodes as the next step.) The ITL target
    (`target(num_decoding)`: `target_itl` seconds, or `decode_multiple` decode-only steps) is the
    ceiling: no step is planned longer. While every waiting request is young a step takes half the
    room above a plain decode step, so tokens stream well inside their target; as the oldest nears
    its TTFT target (`target_ttft` seconds, or `ttft_multiple` decode-only steps), prefill gets more
    of the room, all of it once the target is reached, never more.
    """

    def __init__(self, target_ttft: float | None = None, ttft_multiple: float = 10.0, **adaptive):
        """Day 3.1's knobs (`adaptive`, the ITL target among them), and the TTFT target in seconds or decode-only steps."""
        super().__init__(**adaptive)
        if target_ttft is not None and not target_ttft > 0:
            raise ValueError(f"target_ttft must be > 0 seconds (or None), got {target_ttft}")
        if not ttft_multiple > 0:
            raise ValueError(f"ttft_multiple must be > 0, got {ttft_multiple}")
        self.target_ttft = target_ttft
        self.ttft_multiple = ttft_multiple

    def ttft_target(self, num_decoding: int) -> float:
        """The TTFT target, in seconds: `target_ttft`, or `ttft_multiple` decode-only steps of `num_decoding`
        decodes (provided)."""
        if self.target_ttft is not None:
            return self.target_ttft
        return self.ttft_multiple * self.base_seconds.get(num_decoding, 0.0)

    def step_seconds(self, num_decoding: int, waited: float) -> float:
        """Half the room between a decode step (of `num_decoding` decodes) and the ITL target, rising to all of it as
        `waited` reaches the TTFT target."""
        # TODO: urgency = waited / ttft_target(num_decoding), at most 1 (1 when that target is 0: nothing measured)
        # TODO: base = base_seconds for num_decoding decodes (0 before it is measured);
        # TODO: base + (target(num_decoding) - base) * (1 + urgency) / 2: half the room at no wait, all of it at the
        # TODO: TTFT target
        raise NotImplementedError(
            "Week 3 Day 4 Task 5 (book/src/week3-04-priorities.md): the step time both targets allow"
        )

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        itl = f"{self.target_itl * 1000:.0f} ms" if self.target_itl is not None else f"{self.decode_multiple:g} decode steps"
        ttft = f"{self.target_ttft:g} s" if self.target_ttft is not None else f"{self.ttft_multiple:g} decode steps"
        return (f"a goodput token budget of {self.min_tokens}-{self.max_num_batched_tokens} tokens for an ITL target "
                f"of {itl} and a TTFT target of {ttft}")
