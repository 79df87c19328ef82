"""What the code under test uses besides its own objects, built where it runs (`actor_fakes(sol, "module")`,
tests/harness.py): this package, one module per group of days.

While grading, the code under test runs in the sandboxed worker, and the judge hands it nothing of its own but
data, models and the tests' tokenizer (course/remote.py): a fake model, a tokenizer, a clock, a sampler, a
proposer or a server the engine reads at every step is built in the worker from here (the sandbox's root holds
a copy of this package, and nothing else of tests/), and read in place. What a fake records comes back as data;
where a verdict rests on it, the test checks it against what the submission cannot cheaply forge (the judge
replays it through its own copy of the fake and requires the outputs it predicts), and every oracle stays with
the tests. Plain Python, MLX and mlx-lm only: the worker imports this package alone.
"""

import time
from types import SimpleNamespace

VOCAB = 40
EOS = VOCAB - 1


def next_token_of(history: list[int], eos: bool = True) -> int:
    """The fake model's greedy next token after `history`: a hash of the whole sequence."""
    h = 17
    for token in history:
        h = (h * 1_000_003 + token + 7) % 2_147_483_647
    return h % VOCAB if eos else h % (VOCAB - 1)


class Lines:
    """A log sink: every line it is given, in `lines` (read back as data)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


class FakeTokenizer:
    """Characters to token ids 0..38 and back; EOS is 39."""

    eos_token_ids = {EOS}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % EOS for c in text]

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(ord("0") + t) for t in tokens)


class FakeWeek3Model:
    """What LLMEngine needs of a model when the runner is a fake: its vocabulary size and longest sequence."""

    args = SimpleNamespace(vocab_size=VOCAB)
    max_position = 10**6

    def make_kv_pool(self, num_blocks, block_size):
        return None


class FixedGuess:
    """A proposer that always guesses one token, `k` times."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, seq, k):
        return [self.token] * k

    def forget(self, request_id):
        pass


class ManualClock:
    """A clock the test sets (`clock.now = step`): every reading returns `now`."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- week 3's stack (tests/week3_stack.py)

STACK_VOCAB = 64
STACK_EOS = 60


class StackTokenizer:
    """What the engine needs of a tokenizer when prompts are token ids: the EOS ids (and a decode for the server)."""

    eos_token_ids = {STACK_EOS}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % STACK_VOCAB for c in text]

    def decode(self, tokens):
        return " ".join(map(str, tokens))


class ModelFailure(Exception):
    """What the probe raises on its chosen call: the model failed mid-step."""


class ModelProbe:
    """The student's week-3 model, watched: tokens per call, a fake clock, a failure on a chosen call, and (with
    `logits_dtype`) a check that every call computes in the model's own dtype. Its `calls` are the trace a test reads
    back as data: (tokens, decode tokens, seconds on the fake clock) per call."""

    def __init__(self, model, fail_on_call: int | None = None, base_seconds=0.002, seconds_per_token=0.00025,
                 logits_dtype=None, pause_seconds=0.0):
        self.model = model
        self.pause_seconds = pause_seconds  # real seconds each call sleeps: steps as long as a server's real ones
        self.fail_on_call = fail_on_call
        self.base_seconds, self.seconds_per_token = base_seconds, seconds_per_token
        self.logits_dtype = logits_dtype  # not `dtype`: the engine reads the model's own through the probe
        self.now = 0.0
        self.calls: list[tuple[int, int, float]] = []

    def __getattr__(self, name):
        return getattr(self.model, name)  # args, max_position, dtype, make_kv_pool, ...

    def clock(self) -> float:
        return self.now

    def __call__(self, batch, pool):
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            self.calls.append((0, 0, 0.0))
            raise ModelFailure(f"the model failed on call {self.fail_on_call}, on purpose")
        num_tokens = batch.token_ids.shape[0]
        seconds = self.base_seconds + self.seconds_per_token * (num_tokens - batch.num_decodes)
        self.now += seconds
        self.calls.append((num_tokens, batch.num_decodes, seconds))
        time.sleep(self.pause_seconds)
        logits = self.model(batch, pool)
        want = self.logits_dtype
        assert want is None or logits.dtype == want, \
            f"a {want} model computed {logits.dtype} logits over the quantized pool: gather must return keys " \
            f"and values in the pool's dtype (the model's, {want}), or attention promotes every later layer"
        return logits
