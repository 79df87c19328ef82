"""Argument checks for the serving path (provided: not a task).

Every entry point (`Request`, `SlotScheduler`, `batch_generate`, the chunk policies, the generate
functions, `make_sampler`) calls these before it runs the model, so bad input is a ValueError or a
TypeError that names the argument, the value and what is allowed, instead of a crash deep inside
MLX (a token id past the embedding table reads memory that is not there) or a quietly wrong answer.
"""

from __future__ import annotations

import functools
import math
import numbers
import os


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int within `minimum .. maximum`; TypeError for a non-integer (a bool or a float too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_number(name: str, value, low: float, high: float = math.inf, low_open: bool = False,
                 high_open: bool = False) -> float:
    """`value` as a finite float in the interval from `low` to `high` (open ends where said)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if not math.isfinite(value) or too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value}")
    return value


def check_text(name: str, text) -> str:
    """A non-empty str that is valid Unicode (a command line's stray bytes arrive as lone surrogates)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{name} is empty: there is nothing to prefill")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid UTF-8 text (at character {error.start})") from None
    return text


def model_limits(model) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) of a model, None where the model does not say."""
    args = getattr(model, "args", None)
    vocab = getattr(model, "vocab_size", None) or getattr(args, "vocab_size", None)
    return vocab, getattr(args, "max_position_embeddings", None)


def check_prompt(model, tokenizer, prompt, name: str = "prompt") -> list[int]:
    """A prompt (a str, or a list of token ids) as token ids, each in `[0, vocab_size)`; never empty."""
    if isinstance(prompt, str):
        tokens = tokenizer.encode(check_text(name, prompt), add_special_tokens=False)
    elif isinstance(prompt, (list, tuple)):
        tokens = list(prompt)
    else:
        raise TypeError(f"{name} must be a str or a list of token ids, got {type(prompt).__name__}")
    if not tokens:
        raise ValueError(f"{name} is empty: there is nothing to prefill")
    vocab, _ = model_limits(model)
    for position, token in enumerate(tokens):
        # Past the embedding table, a gather reads memory that is not there: it must never reach MLX.
        check_int(f"{name} token {position}", token, 0, None if vocab is None else vocab - 1)
    return [int(token) for token in tokens]


def check_prompts(prompts) -> list:
    """A list (or tuple) of prompts; a bare str would be taken for a list of one-character prompts."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (str or token-id lists), got {type(prompts).__name__}")
    return list(prompts)


def check_max_seq_len(model, max_seq_len) -> int:
    """At least 2 (a prompt token and an output token), at most the model's context length (RoPE's table)."""
    _, context = model_limits(model)
    if context is not None and not isinstance(max_seq_len, bool) and isinstance(max_seq_len, numbers.Integral) \
            and max_seq_len > context:
        raise ValueError(f"max_seq_len={max_seq_len} is more than the model's context "
                         f"(max_position_embeddings={context})")
    return check_int("max_seq_len", max_seq_len, 2)


def kv_bytes_per_token(model) -> int | None:
    """Bytes of keys and values one token takes in every layer's cache (None when the model does not say)."""
    args = getattr(model, "args", None)
    if not all(hasattr(args, name) for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
        return None  # a test's stand-in model, or no args at all
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = getattr(getattr(getattr(model, "embedding", None), "weight", None), "dtype", None)
    itemsize = dtype.size if dtype is not None else 4
    return args.num_hidden_layers * 2 * heads * head_dim * itemsize  # 2: a key and a value


def memory_bytes() -> int:
    """The machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_batch_size(model, batch_size, max_seq_len: int) -> int:
    """At least 1, and few enough that every slot full to `max_seq_len` fits in the machine's memory."""
    batch_size = check_int("batch_size", batch_size, 1)
    per_token = kv_bytes_per_token(model)
    if per_token is not None and batch_size * max_seq_len * per_token > memory_bytes():
        need = batch_size * max_seq_len * per_token / 1e9
        raise ValueError(f"batch_size={batch_size} slots of max_seq_len={max_seq_len} tokens would need {need:.1f} GB "
                         f"of KV cache when full, more than this machine's {memory_bytes() / 1e9:.1f} GB of memory: "
                         f"use fewer slots or a shorter max_seq_len")
    return batch_size


def check_kv_pool(model, num_blocks: int, block_size: int) -> None:
    """A paged KV pool of `num_blocks` x `block_size` tokens must fit in the machine's memory (day 3.2's pool)."""
    per_token = kv_bytes_per_token(model)
    need = num_blocks * block_size * (per_token or 0)
    if need > memory_bytes():
        raise ValueError(f"num_blocks={num_blocks} blocks of block_size={block_size} tokens would need "
                         f"{need / 1e9:.1f} GB of KV cache, more than this machine's {memory_bytes() / 1e9:.1f} GB "
                         f"of memory: use fewer blocks")


def check_chunk_size(policy, size) -> int:
    """A policy's answer to `next_chunk_size`: an integer of at least 1 prompt token."""
    try:
        return check_int(f"{type(policy).__name__}.next_chunk_size()", size, 1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"chunk policy answered a bad size: {error}") from None


def check_optional_callable(name: str, value) -> None:
    """None or something callable."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable (or None), got {type(value).__name__}")


def check_sampling(temp, top_p, top_k) -> None:
    """temp finite and >= 0 (0: greedy); top_p None or in (0, 1]; top_k None or an integer >= 1."""
    check_number("temp", temp, 0.0)
    if top_p is not None:
        check_number("top_p", top_p, 0.0, 1.0, low_open=True)
    if top_k is not None:
        check_int("top_k", top_k, 1)


def check_generate(prompt, max_tokens, sampler, on_text) -> None:
    """The arguments of the generate functions: a non-empty valid prompt, max_tokens >= 1, callables or None."""
    check_text("prompt", prompt)
    check_int("max_tokens", max_tokens, 1)
    check_optional_callable("sampler", sampler)
    check_optional_callable("on_text", on_text)


def refuse_after_failure(step):
    """Wrap `SlotScheduler.step`: after a step raised, refuse to step again until `release_all()`.

    A step that failed halfway may have put a token into some layers' caches and not others; another
    step would compute on that state and give a quietly wrong answer.
    """

    @functools.wraps(step)
    def guarded(scheduler, *args, **kwargs):
        if getattr(scheduler, "failure", None) is not None:
            raise RuntimeError(f"an earlier step failed ({scheduler.failure!r}); call release_all() before stepping again")
        try:
            return step(scheduler, *args, **kwargs)
        except BaseException as error:
            scheduler.failure = error
            raise

    return guarded


def clear_failure(release_all):
    """Wrap `SlotScheduler.release_all`: once everything is released, the scheduler may step again."""

    @functools.wraps(release_all)
    def releasing(scheduler, *args, **kwargs):
        result = release_all(scheduler, *args, **kwargs)
        scheduler.failure = None
        return result

    return releasing
