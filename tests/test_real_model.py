"""The reference on a real, trained model: SmolLM2-135M-Instruct (`pdm run models fetch smollm2-135m`).

Random weights cannot tell a right answer from noise; these tests can. They check the reference's
weeks 1 and 2 against mlx-lm's own Llama on the same checkpoint (dequantized, float32), that greedy
answers carry the expected facts, that a request ends at `<|im_end|>`, and that batching and chunking
change nothing. Without the fetched model they are skipped, unless TINY_LLM_REQUIRE_REAL_MODEL=1 (CI
sets it) turns the skip into a failure, so that CI cannot pass by not running them.
"""

import os

import mlx.core as mx
import pytest

from tests.harness import reference

QUESTION = "What is the capital of France?"
# Short questions whose greedy answers this model gets right, and a fact each answer must contain.
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the chemical symbol for water?", "H2O"),
]
# SmolLM2's ChatML template, with the system message it adds when none is given.
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
IM_START, IM_END = 1, 2


def _require_smollm2():
    from course.models import SMOLLM2, SMOLLM2_DIR

    if (SMOLLM2_DIR / "model.safetensors").exists():
        return SMOLLM2_DIR
    reason = f"SmolLM2 is not fetched (`pdm run models fetch {SMOLLM2}`; {SMOLLM2_DIR} is missing)"
    if os.environ.get("TINY_LLM_REQUIRE_REAL_MODEL") == "1":
        pytest.fail(f"{reason}, and TINY_LLM_REQUIRE_REAL_MODEL=1 requires it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def smollm2():
    """(mlx-lm model, tokenizer): the checkpoint as stored (4-bit weights), scales and norms in float32."""
    from mlx_lm import load

    model, tokenizer = load(str(_require_smollm2()))
    model.set_dtype(mx.float32)  # only the floating-point parameters: packed weights stay packed
    mx.eval(model.parameters())
    return model, tokenizer


@pytest.fixture(scope="module")
def oracle():
    """mlx-lm's own Llama on the same checkpoint, every weight dequantized to float32: the oracle."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, _ = load(str(_require_smollm2()))
    model.set_dtype(mx.float32)  # scales first, so the dequantized weights are not rounded to float16
    model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def ours(smollm2):
    """(the reference's week-2 model, tokenizer) on SmolLM2."""
    model, tokenizer = smollm2
    return reference().qwen2_week2.Qwen2ModelWeek2(model), tokenizer


def chat_prompt(tokenizer, question: str) -> str:
    from course.models import build_prompt

    return build_prompt(tokenizer, question, use_chat_template=True)


def test_chat_template_applied_as_mlx_lm_does(smollm2):
    _, tokenizer = smollm2
    prompt = chat_prompt(tokenizer, QUESTION)
    assert prompt == EXPECTED_PROMPT
    ours = tokenizer.encode(prompt, add_special_tokens=False)
    # mlx-lm's generate tokenizes the template's output in one go; the markers must be single tokens.
    theirs = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert ours == list(theirs)
    assert ours[0] == IM_START and ours.count(IM_START) == 3 and ours.count(IM_END) == 2
    assert tokenizer.eos_token_ids == {IM_END}


def test_tokenizer_splits_digits_and_round_trips(smollm2):
    _, tokenizer = smollm2
    text = "In 2024, 12 émigrés paid €3.50 for 🍞 — naïve?\n\tYes."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # SmolLM2's pre-tokenizer puts every digit in a token of its own.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024", add_special_tokens=False)] == list("2024")


@pytest.mark.parametrize("week", [1, 2])
def test_logits_match_mlx_lm(smollm2, oracle, week):
    model, tokenizer = smollm2
    ids = mx.array([tokenizer.encode(chat_prompt(tokenizer, QUESTION), add_special_tokens=False)])
    expected = oracle(ids)
    ref = reference()
    if week == 1:
        logits = ref.qwen2_week1.Qwen2ModelWeek1(model)(ids)
    else:
        ours = ref.qwen2_week2.Qwen2ModelWeek2(model)
        cache = ours.make_cache()
        # The prompt in two chunks, then one decode step: every position through the KV cache.
        first = ours(ids[:, :20], 0, cache)
        rest = ours(ids[:, 20:-1], 20, cache)
        last = ours(ids[:, -1:], ids.shape[1] - 1, cache)
        logits = mx.concatenate([first, rest, last], axis=1)
    assert logits.shape == expected.shape
    gap = mx.abs(logits - expected).max().item()
    assert gap < 1e-4 * mx.abs(expected).max().item(), f"week {week}: logits differ from mlx-lm's by {gap}"
    assert mx.array_equal(logits[0, -1].argmax(), expected[0, -1].argmax())


@pytest.fixture(scope="module")
def answers(ours):
    """Each question's greedy answer, one request at a time, through the reference's week-2 loop."""
    model, tokenizer = ours
    generate = reference().generate.simple_generate_with_kv_cache
    return {question: generate(model, tokenizer, chat_prompt(tokenizer, question), max_tokens=48)
            for question, _ in FACTS}


@pytest.mark.parametrize("question,fact", FACTS)
def test_greedy_answer_contains_the_fact(answers, question, fact):
    assert fact in answers[question], f"{question!r} -> {answers[question]!r}"


def test_greedy_text_equals_mlx_lm_generate(answers, oracle, smollm2):
    from mlx_lm import generate

    _, tokenizer = smollm2
    theirs = generate(oracle, tokenizer, chat_prompt(tokenizer, QUESTION), max_tokens=48)
    assert answers[QUESTION] == theirs


def test_pipelined_loop_gives_the_same_answer(ours, answers):
    # Day 2.1 Task 4's loop, which `pdm run main` runs: on a trained model the answer ends at EOS with a
    # step already queued after it, which must change nothing.
    model, tokenizer = ours
    generate = reference().generate.pipelined_generate_with_kv_cache
    assert generate(model, tokenizer, chat_prompt(tokenizer, QUESTION), max_tokens=48) == answers[QUESTION]


def test_request_stops_at_im_end(ours, answers):
    model, tokenizer = ours
    scheduler = reference().batch.SlotScheduler(model, tokenizer, max_seq_len=128, batch_size=2, prefill_step=16)
    scheduler.add_request(chat_prompt(tokenizer, QUESTION))
    while scheduler.has_work():
        scheduler.step()
    (request,) = scheduler.finished
    assert request.finish_reason == "stop"
    assert request.next_token == IM_END and IM_END not in request.output_tokens
    assert request.text() == answers[QUESTION] and "<|im_end|>" not in request.text()


def test_batched_and_chunked_equal_one_at_a_time(ours, answers):
    model, tokenizer = ours
    prompts = [chat_prompt(tokenizer, question) for question, _ in FACTS]
    # All together, in prefill chunks of 16 tokens (three per prompt), with fewer decode slots than requests.
    together = reference().batch.batch_generate(model, tokenizer, prompts, max_seq_len=96, batch_size=2,
                                                prefill_step=16)
    assert [text for _, text in together] == [answers[question] for question, _ in FACTS]
