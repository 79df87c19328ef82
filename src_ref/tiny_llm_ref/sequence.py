"""A request's state as plain data: what the scheduler plans with and the engine updates.

A `Sequence` is one request on its way through the engine:

    WAITING ──(admitted: blocks allocated)──> RUNNING ──(EOS, max_tokens, abort)──> FINISHED
       ^                                          |
       └──────────(preempted: blocks freed)───────┘

Its tokens are the prompt followed by the output so far. `num_computed_tokens` counts the tokens
whose keys and values are in the KV cache; the tokens after them are the work still to do: a whole
prompt (or the rest of it) while prefilling, exactly one token (the newest output) while decoding.
A preempted sequence simply has `num_computed_tokens` set back to 0: prompt and output are
recomputed as one longer prompt, and generation resumes where it stopped.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Seeds in 0 .. 2**63 - 1: `mx.random.seed` takes 0 .. 2**64 - 1, and the runner adds the number of
# tokens generated so far, so every seed it derives stays in MLX's range. The server takes the same range.
MAX_SEED = 2**63 - 1


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (new or preempted), admitted, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """How to pick each next token: temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    `max_tokens` bounds the output; `seed` makes a sampled sequence reproducible on its own,
    whatever else runs in the same batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None

    def __post_init__(self):
        """Reject values no sampler can use, naming the field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # `not x >= 0` (rather than `x < 0`) also refuses NaN, which compares False with everything.
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0 .. 2**63 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the most likely one."""
        return self.temperature == 0


class Sequence:
    """One request: its prompt and output token ids, its progress, its blocks and how it samples."""

    def __init__(
        self,
        request_id,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
    ):
        """A WAITING sequence with nothing computed and no blocks (provided)."""
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling or SamplingParams()
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose keys and values are in the KV cache
        self.block_table: list[int] = []  # block ids of the KV pool, in position order
        self.finish_reason: str | None = None  # "stop" (EOS or a stop string) | "length" | "abort"
        self.num_preemptions = 0

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output: everything the model has to have seen to produce the next token."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """How many tokens the sequence holds (prompt + output)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when only the newest token is left to run: the next step is a decode step."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens > 0

    @property
    def is_finished(self) -> bool:
        """True once the sequence has ended (EOS, max_tokens, abort or stop)."""
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
