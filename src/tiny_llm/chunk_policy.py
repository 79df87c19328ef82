"""How many prompt tokens the next prefill chunk may take.

Every scheduler iteration runs one prefill chunk and then one decode step, so the requests that are
decoding wait `chunk time + decode time` for their next token. The chunk size is the knob:

- big chunks finish a long prompt's prefill in few iterations (good time-to-first-token for it) but
  stall everybody else's next token for as long as one chunk takes;
- small chunks keep the other requests' inter-token latency low, and pay a little per chunk.

`FixedChunkPolicy` always answers the same size (the default). `AdaptiveChunkPolicy` measures how long
chunks and decode steps take and picks the largest chunk that keeps one iteration within a
decode-latency target; with nobody decoding there is nobody to keep waiting, so it goes full size.

A scheduler asks `next_chunk_size(num_decoding)` before each chunk, and reports what it measured
with `observe_chunk(tokens, seconds)` and `observe_decode(batch, seconds)`.
"""

from .validation import check_int, check_number


class FixedChunkPolicy:
    """Chunks of `chunk_size` tokens, always (provided: the default policy)."""

    def __init__(self, chunk_size: int = 128):
        """`chunk_size` >= 1 prompt tokens per chunk (an integer)."""
        self.chunk_size = check_int("FixedChunkPolicy chunk_size", chunk_size, 1)

    def next_chunk_size(self, num_decoding: int) -> int:
        """The size of the next chunk: `chunk_size`, whatever the load."""
        return self.chunk_size

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens took `seconds` (a fixed policy ignores it)."""

    def observe_decode(self, batch: int, seconds: float) -> None:
        """A decode step of `batch` requests took `seconds` (a fixed policy ignores it)."""

    def describe(self) -> str:
        """One line for the scheduler's start-up log."""
        return f"fixed chunks of {self.chunk_size} prompt tokens"


class AdaptiveChunkPolicy:
    """Chunk sizes chosen from measured times, to hold the decoding requests' inter-token latency near a target.

    One iteration takes about `chunk_tokens * seconds_per_token + decode_seconds`. Solving that for a
    target `target_itl` gives the chunk size; it is clamped to `min_chunk .. max_chunk`. Both times are
    exponential moving averages (`smoothing` is the weight of the newest measurement). Before the
    first measurement the policy answers `initial_chunk`; when no request is decoding it answers
    `max_chunk`, since no token is waiting on the prefill.
    """

    def __init__(
        self,
        target_itl: float = 0.5,
        min_chunk: int = 16,
        max_chunk: int = 2048,
        initial_chunk: int = 64,
        smoothing: float = 0.5,
    ):
        """A target of `target_itl` seconds per iteration while requests decode; sizes within `min_chunk .. max_chunk`."""
        for name, size in (("min_chunk", min_chunk), ("initial_chunk", initial_chunk), ("max_chunk", max_chunk)):
            check_int(f"AdaptiveChunkPolicy {name}", size, 1)
        if not min_chunk <= initial_chunk <= max_chunk:
            raise ValueError(f"AdaptiveChunkPolicy needs min_chunk <= initial_chunk <= max_chunk, "
                             f"got {min_chunk}, {initial_chunk}, {max_chunk}")
        check_number("AdaptiveChunkPolicy target_itl", target_itl, 0.0, low_open=True)
        check_number("AdaptiveChunkPolicy smoothing", smoothing, 0.0, 1.0, low_open=True)
        self.target_itl = target_itl
        self.min_chunk = min_chunk
        self.max_chunk = max_chunk
        self.initial_chunk = initial_chunk
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None  # prefill cost of one prompt token (moving average)
        self.decode_seconds: float | None = None  # cost of one decode step (moving average)

    def next_chunk_size(self, num_decoding: int) -> int:
        """The largest chunk that keeps `chunk time + decode time` within the target, clamped to `min_chunk .. max_chunk`.

        Nobody decoding: `max_chunk`. No chunk measured yet: `initial_chunk`. A chunk measured but no
        decode step yet: the decode time counts as 0, so the whole target goes to the chunk.
        """
        # TODO: nobody decoding: max_chunk; nothing measured: initial_chunk; else (target - decode) / per token, clamped
        raise NotImplementedError(
            "Week 2 Day 7 Task 6 (book/src/week2-07-chunked-prefill.md): the largest chunk within the latency target"
        )

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens took `seconds`: update the per-token cost."""
        # TODO: skip empty chunks; seconds_per_token = _average(old, seconds / tokens)
        raise NotImplementedError(
            "Week 2 Day 7 Task 6 (book/src/week2-07-chunked-prefill.md): update the per-token prefill cost"
        )

    def observe_decode(self, batch: int, seconds: float) -> None:
        """A decode step of `batch` requests took `seconds`: update the decode-step cost."""
        # TODO: decode_seconds = _average(old, seconds)
        raise NotImplementedError(
            "Week 2 Day 7 Task 6 (book/src/week2-07-chunked-prefill.md): update the decode-step cost"
        )

    def describe(self) -> str:
        """One line for the scheduler's start-up log."""
        return (f"adaptive chunks of {self.min_chunk}-{self.max_chunk} prompt tokens for a decode latency "
                f"target of {self.target_itl * 1000:.0f} ms")

    def _average(self, old: float | None, new: float) -> float:
        """Exponential moving average: the first measurement is taken as it is."""
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
