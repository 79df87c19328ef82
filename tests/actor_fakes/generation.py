"""Day 1.6's helpers, built where the generation loop under test runs (tests/test_week_1_day_6.py).

Each writes down what the loop did with it (the tokens a sampler picked, the model's calls, the order of model
calls and streamed text); the test reads the record back as data and checks it against mlx-lm's own generation,
computed in the test's process.
"""

import mlx.core as mx


class Recorder:
    """A greedy sampler that writes down each token it picks."""

    def __init__(self):
        self.tokens = []

    def __call__(self, logprobs):
        token = mx.argmax(logprobs, axis=-1)
        self.tokens.append(int(token.item()))
        return token


class Always:
    """A sampler that always answers `token`, writing down the shape of each log-probability array it gets."""

    def __init__(self, token: int):
        self.token, self.shapes = token, []

    def __call__(self, logprobs):
        self.shapes.append(tuple(logprobs.shape))
        return mx.array([self.token])


class EosAfter:
    """Wraps a model; from the n-th generated token on, EOS is the most likely token."""

    def __init__(self, model, prompt_len, n, eos):
        self.model, self.prompt_len, self.n, self.eos = model, prompt_len, n, eos
        self.calls = 0

    def __call__(self, inputs):
        self.calls += 1
        logits = self.model(inputs)
        if inputs.shape[1] >= self.prompt_len + self.n:
            bump = mx.zeros((logits.shape[-1],)).at[self.eos].add(1e4)
            logits = logits + bump
        return logits


class Streaming:
    """A model wrapper and an `on_text` that write down, in order, each model call ("model") and each piece of
    text streamed ("text")."""

    def __init__(self, model):
        self.model, self.events, self.pieces = model, [], []

    def __call__(self, inputs):
        self.events.append("model")
        return self.model(inputs)

    def on_text(self, piece):
        self.events.append("text")
        self.pieces.append(piece)
