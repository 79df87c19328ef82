"""Generating text: run the model, pick the next token, detokenize it as it arrives, repeat."""

from typing import Callable

import mlx.core as mx

from .validation import check_generate


def send_new_text(detokenizer, on_text: Callable[[str], None] | None) -> None:
    """Pass `on_text` the text the streaming detokenizer could spell since the last call, if any (provided).

    A token can end in the middle of a multi-byte character or a word; the detokenizer holds such
    text back until it can be printed, so `last_segment` may be empty for a step.
    """
    segment = detokenizer.last_segment
    if segment and on_text is not None:
        on_text(segment)


def simple_generate(
    model,
    tokenizer,
    prompt: str,
    sampler: Callable[[mx.array], mx.array] | None = None,
    max_tokens: int = 256,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Generate up to `max_tokens` tokens after `prompt`, recomputing the whole sequence at each step.

    `prompt` is encoded as it is (callers apply the chat template). `sampler` maps log-probabilities
    `1 x vocab` to a token id `1`; None means greedy (the most likely token). Generation stops at any
    id in `tokenizer.eos_token_ids` (not emitted) or after `max_tokens` tokens. Each new piece of text
    is passed to `on_text` as soon as the streaming detokenizer can spell it. Returns the generated text.
    Raises ValueError or TypeError, before any model call, for an empty or invalid prompt or
    `max_tokens` below 1.
    """
    check_generate(prompt, max_tokens, sampler, on_text)
    # TODO: encode, then: model -> last row -> logprobs -> token; stop at EOS; add_token each token and send_new_text; finalize and send the rest at the end
    raise NotImplementedError("Week 1 Day 6 Task 1 (book/src/week1-06-generate-response.md): greedy generation loop")


def simple_generate_with_kv_cache(
    model,
    tokenizer,
    prompt: str,
    sampler: Callable[[mx.array], mx.array] | None = None,
    max_tokens: int = 256,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Generate like `simple_generate`, but feed the model only the new token at each step.

    `model` is a `Qwen2ModelWeek2`: the prompt is prefilled once into a fresh `model.make_cache()`,
    then each step runs one token at `offset` = the number of tokens already in the cache. Same
    contract as `simple_generate`: the same `sampler`, `max_tokens`, EOS and `on_text` behaviour,
    and, for greedy decoding, the same tokens, and the same checks of its arguments. Returns the text.
    """
    check_generate(prompt, max_tokens, sampler, on_text)
    # TODO: make_cache(); prefill the prompt at offset 0; then feed one token per step at the next offset
    raise NotImplementedError("Week 2 Day 1 Task 3 (book/src/week2-01-kv-cache.md): generation with the KV cache")


def pipelined_generate_with_kv_cache(
    model,
    tokenizer,
    prompt: str,
    sampler: Callable[[mx.array], mx.array] | None = None,
    max_tokens: int = 256,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Generate like `simple_generate_with_kv_cache`, but queue each step before reading the token before it.

    MLX is lazy: a model call only records a graph, and `mx.async_eval` starts computing it in the
    background. So step n + 1 can be built from step n's token while that token is still being computed,
    and the Python work of a step (building the graph of 30 layers, detokenizing, printing) overlaps the
    computation of the step before, instead of leaving the CPU's compute idle. The price: when a token
    turns out to be EOS, the step already queued after it is thrown away. Same contract as
    `simple_generate_with_kv_cache` (the same sampler, EOS and `on_text` behaviour, the same tokens for
    greedy decoding, the same argument checks), and never more than `max_tokens` model calls: the
    prompt's, then one per token after the first.
    """
    check_generate(prompt, max_tokens, sampler, on_text)
    # TODO: one helper queues a step: model call -> last row -> logprobs -> token, then mx.async_eval(token)
    # TODO: queue the prompt's step; then, each step: queue the next one on the unread token, and only then .item() it
    # TODO: the model runs at most max_tokens times; a token read as EOS ends the text (the step queued on it is dropped)
    raise NotImplementedError("Week 2 Day 1 Task 4 (book/src/week2-01-kv-cache.md): pipelined generation")
