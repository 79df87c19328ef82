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

from .validation import check_int, check_number

# Seeds in 0 .. 2**63 - 1: `mx.random.seed` takes 0 .. 2**64 - 1, and the runner adds the number of
# tokens generated so far, so every seed it derives stays in MLX's range. The server takes the same range.
MAX_SEED = 2**63 - 1
# The ranges of the per-request logits processing (logits_processors.py), as OpenAI's and vLLM's APIs take them.
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty in (0, 2] (vLLM/HF's multiplicative one; 1 is off)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # each logit_bias value (OpenAI)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs, vLLM's max_logprobs)


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (new or preempted), admitted, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """How to pick each next token: temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    `max_tokens` bounds the output; `seed` makes a sampled sequence reproducible on its own,
    whatever else runs in the same batch. The penalties, `min_p` and `logit_bias` change the logits
    before a token is picked (logits_processors.py); `logprobs` asks for log-probabilities back.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides a positive (multiplies a negative) logit of a prompt or output token
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    ignore_eos: bool = False  # EOS does not end the sequence: it runs to max_tokens
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the k most likely
    stop_token_ids: tuple[int, ...] = ()  # end the output as EOS does (vLLM's): finish "stop", not in the output
    min_tokens: int = 0  # no EOS or stop token before this many outputs (vLLM's; the engine adds EOS to the list)
    constraint: object | None = None  # day 4.5: a structured.Constraint the output must match

    def __post_init__(self):
        """Reject values no sampler can use, naming the field."""
        check_int("max_tokens", self.max_tokens, 1)
        # `not x >= 0` (rather than `x < 0`) also refuses NaN, which compares False with everything.
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_int("top_k", self.top_k, 0)  # 0: off
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED)
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), *PENALTY_RANGE)
        check_number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        check_number("min_p", self.min_p, 0.0, 1.0)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check_int("min_tokens", self.min_tokens, 0)
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"stop_token_ids must be a tuple of token ids, got {type(self.stop_token_ids).__name__}")
        for token in self.stop_token_ids:
            check_int("a stop_token_ids token id", token, 0)
        # Not checked with isinstance: the constraint may come from another package (the grader's selections).
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot go with a constraint: a finished output ends at its EOS")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                check_int("a logit_bias token id", token, 0)
                check_number(f"logit_bias[{token}]", bias, *LOGIT_BIAS_RANGE)

    @property
    def processes_logits(self) -> bool:
        """True when a penalty, min_p or logit_bias changes the logits before the token is picked."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_p or self.logit_bias or (self.min_tokens and self.stop_token_ids))

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
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
        self.constraint_progress: tuple[int, int] | None = None  # day 4.5: (output tokens read, automaton state)

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
