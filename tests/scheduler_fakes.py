"""The judge's side of the scheduler days (2.6 and 2.7): the one-at-a-time oracle and the replay of the fake model.

The fake model (tests/actor_fakes/schedulers.py) runs where the scheduler under test runs: its caches hold token
ids, and the token it predicts is a hash of the whole history in the cache, so a scheduler that mixes up slots,
caches or offsets gets different tokens. `expected_tokens` computes what one-request-at-a-time greedy generation
gives, straight from the same rule, with no scheduler at all.

What the fake records (every model call, every slot taken and freed) comes back as data written where the
submission runs, so the judge does not take it as it comes: `replay` runs it through the judge's own `Tape`
(every operation checked as the fake checks it), and `check_replay` requires that the replayed calls predict
exactly the tokens the scheduler returned. A lying record would have to be a valid run of the fake, call by call,
whose predictions are those outputs: a schedule built to match, which is the scheduler's work itself.
"""

from collections import Counter

from tests.actor_fakes import EOS, VOCAB, FakeTokenizer  # noqa: F401  (one tokenizer for every fake model)
from tests.actor_fakes.schedulers import (  # noqa: F401  (the fake model, used in one process by test_bad_input)
    FakeModel, ModelFailure, Tape, next_token_of,
)


def expected_tokens(prompt: list[int], max_seq_len: int, eos: bool = True) -> tuple[list[int], str]:
    """One-request-at-a-time greedy generation under the fake model: (output tokens, "stop" or "length")."""
    history, output = list(prompt), []
    while True:
        token = next_token_of(history, eos)
        if token == EOS:
            return output, "stop"
        output.append(token)
        history.append(token)
        if len(history) >= max_seq_len:
            return output, "length"


def prompt_of(length: int, seed: int) -> str:
    """A fake-tokenizer prompt of exactly `length` tokens."""
    return "".join(chr(ord("a") + (seed * 7 + i * 3) % 26) for i in range(length))


def replay(events: list, num_layers: int = 2, eos: bool = True) -> Tape:
    """The judge's own run of the operations a FakeModel recorded, each checked as the fake checks it (an
    AssertionError names the first that is not a valid run of the fake)."""
    tape = Tape(num_layers, eos)
    for event in events:
        tape.apply(event)
    return tape


def check_replay(tape: Tape, finished: list[dict], prompts: list) -> None:
    """The replayed calls predicted exactly what the scheduler returned: every finished request (`drive`'s dicts)
    has a request cache of its own whose prompt is the request's and whose predictions are its output tokens (and
    the EOS that stopped it), and no request cache was prefilled for anything else."""
    tokenizer = FakeTokenizer()
    returned = Counter()
    for request in finished:
        prompt = prompts[request["idx"]]
        prompt = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        tokens = tuple(request["tokens"]) + ((EOS,) if request["reason"] == "stop" else ())
        returned[tuple(prompt), tokens] += 1
    assert Counter(tape.generations()) == returned, (
        "the model calls the fake recorded do not predict the tokens the scheduler returned")


def replay_steps(events: list, views: list[dict], num_layers: int = 2, eos: bool = True):
    """(the replay as it stood after a step, that step's view of the slots), for every step `drive` watched."""
    tape, done = Tape(num_layers, eos), 0
    for view in views:
        assert done <= view["at"] <= len(events), "a step's view points outside the record"
        for event in events[done : view["at"]]:
            tape.apply(event)
        done = view["at"]
        yield tape, view
