"""Bad input never crashes the process and never gives a quietly wrong answer (the serving path of weeks 1-2).

- A table of bad calls to every entry point (`Request`, `SlotScheduler`, `batch_generate`, the chunk
  policies, the generate functions, `make_sampler`): each raises the stated error type, naming the
  argument, before any model call (a counting wrapper around the embedded model says so).
- Property tests (hypothesis): random valid workloads give what one-request-at-a-time generation
  gives; random invalid arguments raise before any model call.
- Fault injection: an error in any layer at any step leaves nothing held, the scheduler refuses to
  step on until `release_all()`, and a later run is identical to a clean one.
- The commands: user errors are one line and exit status 2, no traceback.

These test the reference (the serving path the commands run); the checks live in provided code
(`validation.py`), which the skeleton shares, and one test runs the provided rows on the skeleton.
"""

import importlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import reference
from tests.scheduler_fakes import FakeModel, FakeTokenizer, ModelFailure, expected_tokens
from tests.serve_fakes import parse_prometheus, running_server, wait_until
from tests.week3_fakes import PLAIN_ENGINE

REPO_ROOT = Path(__file__).resolve().parent.parent
ref = reference()
VOCAB = 151936  # the embedded model's vocabulary (Qwen2's)
CONTEXT = 32768  # its max_position_embeddings


class CountingModel:
    """Wraps a model and counts its calls; everything else (caches, sizes) is the model's."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class FailingLayer:
    """A transformer block that raises ModelFailure on its `fail_at`-th call (1-based) and otherwise runs the real one."""

    def __init__(self, layer, fail_at: int):
        self.layer, self.fail_at, self.calls = layer, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ModelFailure(f"layer failed on call {self.calls}")
        return self.layer(*args, **kwargs)


class ChunkAnswer:
    """A chunk policy that always answers `size` (what a buggy custom policy might)."""

    def __init__(self, size):
        self.size = size

    def next_chunk_size(self, num_decoding):
        return self.size

    def observe_chunk(self, tokens, seconds):
        pass

    def observe_decode(self, batch, seconds):
        pass

    def describe(self):
        return f"always {self.size}"


@pytest.fixture(scope="module")
def tiny(model32):
    """(week-2 model, tokenizer) of the embedded model in float32."""
    mlx_model, tokenizer = model32
    return ref.qwen2_week2.Qwen2ModelWeek2(mlx_model), tokenizer


@pytest.fixture
def counted(tiny):
    model, tokenizer = tiny
    return CountingModel(model), tokenizer


# ---------------------------------------------------------------- the table: error type, before any model call

# (row id, error type, words the message must hold, call(model, tokenizer))
ROWS = [
    # token ids outside the vocabulary (a segfault before: the embedding gather read past its table)
    ("token id 10**7", ValueError, "token 0", lambda m, t: ref.batch.batch_generate(m, t, [[10**7, 5]])),
    ("token id == vocab", ValueError, f"at most {VOCAB - 1}", lambda m, t: ref.batch.Request(m, t, [5, VOCAB])),
    ("token id negative", ValueError, "at least 0", lambda m, t: ref.batch.Request(m, t, [-1, 5])),
    ("token id a bool", TypeError, "integer", lambda m, t: ref.batch.Request(m, t, [True, 5])),
    ("token id a float", TypeError, "integer", lambda m, t: ref.batch.Request(m, t, [5.0])),
    ("prompt None", TypeError, "prompt", lambda m, t: ref.batch.Request(m, t, None)),
    ("prompt empty", ValueError, "empty", lambda m, t: ref.batch.Request(m, t, "")),
    ("prompt not UTF-8", ValueError, "UTF-8", lambda m, t: ref.batch.Request(m, t, "ab\udcff")),
    # batch sizes: bounded by memory; integers only
    ("prompts a str", TypeError, "prompts", lambda m, t: ref.batch.batch_generate(m, t, "Hello", max_seq_len=4)),
    ("prompts None", TypeError, "prompts", lambda m, t: ref.batch.batch_generate(m, t, None)),
    ("batch_size 2.0", TypeError, "batch_size", lambda m, t: ref.batch.batch_generate(m, t, ["a"], batch_size=2.0)),
    ("batch_size True", TypeError, "batch_size", lambda m, t: ref.batch.batch_generate(m, t, ["a"], batch_size=True)),
    ("batch_size 0", ValueError, "batch_size", lambda m, t: ref.batch.batch_generate(m, t, ["a"], batch_size=0)),
    ("prefill_step 2.5", TypeError, "prefill_step",
     lambda m, t: ref.batch.batch_generate(m, t, ["a"], prefill_step=2.5)),
    ("prefill_step 0", ValueError, "prefill_step", lambda m, t: ref.batch.batch_generate(m, t, ["a"], prefill_step=0)),
    ("max_seq_len None", TypeError, "max_seq_len", lambda m, t: ref.batch.batch_generate(m, t, ["a"], max_seq_len=None)),
    ("max_seq_len 1", ValueError, "max_seq_len", lambda m, t: ref.batch.batch_generate(m, t, ["a"], max_seq_len=1)),
    ("max_seq_len beyond context", ValueError, "max_position_embeddings",
     lambda m, t: ref.batch.SlotScheduler(m, t, max_seq_len=CONTEXT + 1)),
    ("Request max_seq_len beyond context", ValueError, "max_position_embeddings",
     lambda m, t: ref.batch.Request(m, t, "a", max_seq_len=CONTEXT + 1)),
    ("prompt fills max_seq_len", ValueError, "no room",
     lambda m, t: ref.batch.batch_generate(m, t, [[1, 2, 3]], max_seq_len=3)),
    ("Request prefill_max_step 2.5", TypeError, "prefill_max_step", lambda m, t: ref.batch.Request(m, t, "a", 2.5)),
    ("Request prompt_idx -1", ValueError, "prompt_idx", lambda m, t: ref.batch.Request(m, t, "a", prompt_idx=-1)),
    ("SlotScheduler log_interval nan", ValueError, "log_interval",
     lambda m, t: ref.batch.SlotScheduler(m, t, log_interval=math.nan)),
    ("add_request max_tokens 2.5", TypeError, "max_tokens",
     lambda m, t: ref.batch.SlotScheduler(m, t).add_request("a", max_tokens=2.5)),
    ("add_request max_tokens 0", ValueError, "max_tokens",
     lambda m, t: ref.batch.SlotScheduler(m, t).add_request("a", max_tokens=0)),
    ("add_request prompt_idx a str", TypeError, "prompt_idx",
     lambda m, t: ref.batch.SlotScheduler(m, t).add_request("a", prompt_idx="0")),
    # chunk policies: checked where they are made, and where they answer
    ("policy answers 0", ValueError, "ChunkAnswer",
     lambda m, t: ref.batch.batch_generate(m, t, ["abc"], policy=ChunkAnswer(0))),
    ("policy answers -1", ValueError, "ChunkAnswer",
     lambda m, t: ref.batch.batch_generate(m, t, ["abc"], policy=ChunkAnswer(-1))),
    ("policy answers 2.5", ValueError, "ChunkAnswer",
     lambda m, t: ref.batch.batch_generate(m, t, ["abc"], policy=ChunkAnswer(2.5))),
    ("Adaptive target_itl nan", ValueError, "target_itl",
     lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(target_itl=math.nan)),
    ("Adaptive target_itl inf", ValueError, "target_itl",
     lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(target_itl=math.inf)),
    ("Adaptive target_itl 0", ValueError, "target_itl", lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(target_itl=0)),
    ("Adaptive min_chunk 2.5", TypeError, "min_chunk", lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(min_chunk=2.5)),
    ("Adaptive smoothing 0", ValueError, "smoothing", lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(smoothing=0)),
    ("Adaptive min > initial", ValueError, "min_chunk",
     lambda m, t: ref.chunk_policy.AdaptiveChunkPolicy(min_chunk=100, initial_chunk=64)),
    ("Fixed chunk_size 0", ValueError, "chunk_size", lambda m, t: ref.chunk_policy.FixedChunkPolicy(0)),
    ("Fixed chunk_size 2.5", TypeError, "chunk_size", lambda m, t: ref.chunk_policy.FixedChunkPolicy(2.5)),
    # generation (week 1 and week 2 loops) and sampling
    ("generate prompt empty", ValueError, "empty",
     lambda m, t: ref.generate.simple_generate_with_kv_cache(m, t, "")),
    ("generate prompt not UTF-8", ValueError, "UTF-8",
     lambda m, t: ref.generate.simple_generate_with_kv_cache(m, t, "\udcff")),
    ("generate max_tokens 0", ValueError, "max_tokens",
     lambda m, t: ref.generate.simple_generate_with_kv_cache(m, t, "hi", max_tokens=0)),
    ("generate max_tokens 2.5", TypeError, "max_tokens",
     lambda m, t: ref.generate.simple_generate_with_kv_cache(m, t, "hi", max_tokens=2.5)),
    ("generate sampler not callable", TypeError, "sampler",
     lambda m, t: ref.generate.simple_generate_with_kv_cache(m, t, "hi", sampler=0.7)),
    ("pipelined generate prompt empty", ValueError, "empty",
     lambda m, t: ref.generate.pipelined_generate_with_kv_cache(m, t, "")),
    ("pipelined generate max_tokens 0", ValueError, "max_tokens",
     lambda m, t: ref.generate.pipelined_generate_with_kv_cache(m, t, "hi", max_tokens=0)),
    ("pipelined generate on_text not callable", TypeError, "on_text",
     lambda m, t: ref.generate.pipelined_generate_with_kv_cache(m, t, "hi", on_text="print")),
    ("week-1 generate prompt empty", ValueError, "empty", lambda m, t: ref.generate.simple_generate(m, t, "")),
    ("week-1 generate prompt ids", TypeError, "prompt", lambda m, t: ref.generate.simple_generate(m, t, [1, 2])),
    ("temp -1", ValueError, "temp", lambda m, t: ref.sampler.make_sampler(-1)),
    ("temp nan", ValueError, "temp", lambda m, t: ref.sampler.make_sampler(math.nan)),
    ("temp inf", ValueError, "temp", lambda m, t: ref.sampler.make_sampler(math.inf)),
    ("top_p 2", ValueError, "top_p", lambda m, t: ref.sampler.make_sampler(1.0, top_p=2)),
    ("top_p 0", ValueError, "top_p", lambda m, t: ref.sampler.make_sampler(1.0, top_p=0)),
    ("top_k 0", ValueError, "top_k", lambda m, t: ref.sampler.make_sampler(1.0, top_k=0)),
    ("top_k 2.5", TypeError, "top_k", lambda m, t: ref.sampler.make_sampler(1.0, top_k=2.5)),
]


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_bad_input_raises_before_any_model_call(counted, row):
    _, error, words, call = row
    model, tokenizer = counted
    with pytest.raises(error, match=None) as raised:
        call(model, tokenizer)
    assert words in str(raised.value), f"the message should name {words!r}: {raised.value}"
    assert model.calls == 0, "the error must come before any model call"


def test_batch_size_bound_by_the_machines_memory(counted, monkeypatch):
    """100,000 slots of 512 tokens need 26 GB of KV cache in float32: refused on an 8 GB machine, saying so.

    (Before: a segfault. With idle slots costing nothing it would now run, so the machine is made small.)
    """
    model, tokenizer = counted
    monkeypatch.setattr(ref.validation, "memory_bytes", lambda: 8 * 10**9)
    with pytest.raises(ValueError, match=r"batch_size=100000 .* 26\.2 GB .* 8\.0 GB of memory"):
        ref.batch.batch_generate(model, tokenizer, ["a", "b"], batch_size=100_000)
    assert model.calls == 0


def test_engine_refuses_a_kv_pool_the_machine_cannot_hold(model32, monkeypatch):
    """`--num-blocks 10000000` used to segfault the server (an 18.9 GB pool): now one line, before any allocation."""
    model = ref.qwen2_week3.Qwen2ModelWeek3(model32[0])
    monkeypatch.setattr(ref.validation, "memory_bytes", lambda: 8 * 10**9)
    with pytest.raises(ValueError, match=r"num_blocks=10000000 .* GB .* 8\.0 GB of memory"):
        ref.engine.LLMEngine(model, model32[1], ref.engine.EngineConfig(block_size=16, num_blocks=10_000_000))


def test_engine_refuses_what_would_break_a_later_step(model32):
    """A priority that is not an int would make every later comparison raise; sampling values the runner
    cannot use (NaN, infinities, seeds outside 0 .. 2**63 - 1) would fail mid-step: all refused up front."""
    model = ref.qwen2_week3.Qwen2ModelWeek3(model32[0])
    engine = ref.engine.LLMEngine(model, model32[1], ref.engine.EngineConfig(block_size=8))
    for priority in ("high", 1.5, None):
        with pytest.raises(TypeError, match="priority"):
            engine.add_request("x", priority=priority)
    assert not engine.has_work()
    for bad in ({"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"seed": -1},
                {"seed": 2**63}, {"seed": 2**64}):
        with pytest.raises(ValueError):
            ref.sequence.SamplingParams(**bad)
    ref.sequence.SamplingParams(temperature=1.0, seed=2**63 - 1)  # the top of the range is fine


# ---------------------------------------------------------------- right results where an input is odd, not bad


def test_idle_slots_cost_nothing(counted):
    """10,000 slots for 2 prompts: every decode step runs only the busy rows, and the text is batch_size=2's."""
    model, tokenizer = counted
    prompts = [[11, 22, 33], [44, 55]]
    wide = ref.batch.batch_generate(model, tokenizer, prompts, max_seq_len=12, batch_size=10_000)
    narrow = ref.batch.batch_generate(model.model, tokenizer, prompts, max_seq_len=12, batch_size=2)
    assert wide == narrow
    fake = FakeModel()
    ref.batch.batch_generate(fake, FakeTokenizer(), ["abc", "de"], max_seq_len=12, batch_size=50)
    assert fake.decode_calls and all(len(c.tokens) == len(c.active) <= 2 for c in fake.decode_calls)


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    logprobs = mx.log(mx.softmax(mx.random.normal((3, 50), key=mx.random.key(1)), axis=-1))
    mx.random.seed(7)
    wide = ref.sampler.make_sampler(1.0, top_k=10_000_000)(logprobs)
    mx.random.seed(7)
    plain = ref.sampler.make_sampler(1.0)(logprobs)
    assert wide.tolist() == plain.tolist()


# ---------------------------------------------------------------- the scheduler's state after an error


def test_add_request_changes_nothing_when_it_raises():
    model = FakeModel()
    scheduler = ref.batch.SlotScheduler(model, FakeTokenizer(), max_seq_len=16, batch_size=2, prefill_step=4)
    scheduler.add_request("abc", prompt_idx=0)
    before = (list(scheduler.queue), scheduler.next_prompt_idx, dict(scheduler.metrics.requests))
    for bad in (dict(prompt="xyz", prompt_idx=0), dict(prompt="", prompt_idx=1), dict(prompt="xyz", max_tokens=0),
                dict(prompt="a" * 16, prompt_idx=1), dict(prompt=[99], prompt_idx=1)):
        with pytest.raises((ValueError, TypeError)):
            scheduler.add_request(**bad)
        assert (list(scheduler.queue), scheduler.next_prompt_idx, dict(scheduler.metrics.requests)) == before, bad
    while scheduler.has_work():
        scheduler.step()
    assert [r.prompt_idx for r in scheduler.finished] == [0], "the rejected duplicate must not run"


def assert_nothing_held(scheduler, requests) -> None:
    assert not scheduler.has_work() and scheduler.prefilling is None and not scheduler.queue
    assert all(slot is None for slot in scheduler.slots)
    for layer in scheduler.batch_cache:
        held = layer.held() if hasattr(layer, "held") else [s for s, c in enumerate(layer.kv_caches) if c is not None]
        assert held == [], "no decode slot may stay held in any layer"
    assert all(r.kv_cache is None and r.is_done for r in requests)


PROMPTS = [[101, 102, 103, 104, 105, 106, 107], [201, 202], [301, 302, 303, 304], [401, 402, 403]]
RUN = dict(max_seq_len=12, batch_size=2, prefill_step=3)


def run(model, tokenizer):
    scheduler = ref.batch.SlotScheduler(model, tokenizer, **RUN)
    requests = [scheduler.add_request(p) for p in PROMPTS]
    while scheduler.has_work():
        scheduler.step()
    return scheduler, requests, sorted((r.prompt_idx, r.output_tokens) for r in scheduler.finished)


@pytest.fixture(scope="module")
def clean_run(tiny):
    model, tokenizer = tiny
    return run(model, tokenizer)[2]


# (layer, its call that fails): prefill chunks come first, then decode steps interleave with them.
FAULTS = [(layer, call) for layer in (0, 1) for call in (1, 3, 6, 12)]


@pytest.mark.parametrize("layer,fail_at", FAULTS, ids=[f"layer{layer}-call{call}" for layer, call in FAULTS])
def test_a_layer_error_leaves_nothing_behind_and_a_later_run_is_identical(tiny, clean_run, layer, fail_at):
    model, tokenizer = tiny
    real_layer = model.layers[layer]
    model.layers[layer] = FailingLayer(real_layer, fail_at)
    try:
        scheduler = ref.batch.SlotScheduler(model, tokenizer, **RUN)
        requests = [scheduler.add_request(p) for p in PROMPTS]
        with pytest.raises(ModelFailure):
            while scheduler.has_work():
                scheduler.step()
        # The failed step may have put a token into some layers' caches only: stepping on is refused.
        with pytest.raises(RuntimeError, match="release_all"):
            scheduler.step()
        scheduler.release_all()
        assert_nothing_held(scheduler, [r for r in requests if r not in scheduler.finished])
        scheduler.step()  # allowed again (nothing to do)
    finally:
        model.layers[layer] = real_layer
    assert run(model, tokenizer)[2] == clean_run, "a later run must be identical to a clean one"


@pytest.mark.parametrize("fail_on_call", [1, 2, 5, 9])
def test_batch_generate_after_a_model_error_is_identical(fail_on_call):
    prompts = ["abcdefg", "hi", "jklm", "nop", "qrstuvwxyz"]
    expected = ref.batch.batch_generate(FakeModel(), FakeTokenizer(), prompts, max_seq_len=16, batch_size=2,
                                        prefill_step=3)
    model = FakeModel(fail_on_call=fail_on_call)
    with pytest.raises(ModelFailure):
        ref.batch.batch_generate(model, FakeTokenizer(), prompts, max_seq_len=16, batch_size=2, prefill_step=3)
    assert all(layer.held() == [] for layer in model.batch_caches[0])
    model.fail_on_call = None
    assert ref.batch.batch_generate(model, FakeTokenizer(), prompts, max_seq_len=16, batch_size=2,
                                    prefill_step=3) == expected


# ---------------------------------------------------------------- properties (hypothesis)

fake_prompt = st.lists(st.integers(0, 38), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(fake_prompt, min_size=1, max_size=6), batch_size=st.integers(1, 4),
       prefill_step=st.integers(1, 8), extra=st.integers(1, 10))
def test_property_random_workloads_equal_one_at_a_time(prompts, batch_size, prefill_step, extra):
    max_seq_len = max(len(p) for p in prompts) + extra
    scheduler = ref.batch.SlotScheduler(FakeModel(), FakeTokenizer(), max_seq_len=max_seq_len, batch_size=batch_size,
                                    prefill_step=prefill_step)
    for prompt in prompts:
        scheduler.add_request(prompt)
    while scheduler.has_work():
        scheduler.step()
    got = {r.prompt_idx: (r.output_tokens, r.finish_reason) for r in scheduler.finished}
    assert got == {i: expected_tokens(p, max_seq_len) for i, p in enumerate(prompts)}


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, 151_000), min_size=1, max_size=6), min_size=1, max_size=4),
       batch_size=st.integers(1, 3), prefill_step=st.integers(1, 4))
def test_property_real_model_batched_equals_one_at_a_time(tiny, prompts, batch_size, prefill_step):
    model, tokenizer = tiny
    batched = ref.batch.batch_generate(model, tokenizer, prompts, max_seq_len=10, batch_size=batch_size,
                                       prefill_step=prefill_step)
    alone = [ref.batch.batch_generate(model, tokenizer, [p], max_seq_len=10, batch_size=1, prefill_step=64)[0][1]
             for p in prompts]
    assert [text for _, text in batched] == alone


bad_size = st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2))
bad_token = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.floats(), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["batch_size", "prefill_step", "max_seq_len", "prompts", "token"]),
       size=bad_size, token=bad_token, position=st.integers(0, 2))
def test_property_invalid_arguments_raise_before_any_model_call(counted, field, size, token, position):
    model, tokenizer = counted
    prompts = [[1, 2, 3], [4, 5]]
    kwargs = dict(max_seq_len=16, batch_size=2, prefill_step=4)
    if field == "prompts":
        prompts = size
    elif field == "token":
        prompts[0][position] = token
    else:
        kwargs[field] = size
    with pytest.raises((ValueError, TypeError)):
        ref.batch.batch_generate(model, tokenizer, prompts, **kwargs)
    assert model.calls == 0


# ---------------------------------------------------------------- the skeleton shares the provided checks


def test_skeleton_has_the_same_checks():
    assert (REPO_ROOT / "src" / "tiny_llm" / "validation.py").read_bytes() == \
        (REPO_ROOT / "src_ref" / "tiny_llm_ref" / "validation.py").read_bytes()
    skeleton = {name: importlib.import_module(f"tiny_llm.{name}") for name in ("batch", "chunk_policy", "sampler",
                                                                              "generate")}
    model = FakeModel()
    cases = [
        (TypeError, lambda: skeleton["batch"].SlotScheduler(model, FakeTokenizer(), batch_size=2.0)),
        (ValueError, lambda: skeleton["batch"].Request(model, FakeTokenizer(), [40])),
        (TypeError, lambda: skeleton["batch"].batch_generate(model, FakeTokenizer(), "Hello")),
        (ValueError, lambda: skeleton["chunk_policy"].AdaptiveChunkPolicy(target_itl=math.nan)),
        (ValueError, lambda: skeleton["sampler"].make_sampler(math.nan)),
        (ValueError, lambda: skeleton["generate"].simple_generate_with_kv_cache(model, FakeTokenizer(), "")),
        (ValueError, lambda: skeleton["generate"].pipelined_generate_with_kv_cache(model, FakeTokenizer(), "")),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    assert model.calls == []


# ---------------------------------------------------------------- the commands: one line, exit status 2


def write_bad_models(root: Path) -> dict[str, Path]:
    """Copies of the embedded model, each broken one way: {what is wrong: directory}."""
    good = REPO_ROOT / "models" / "qwen2-tiny-random"
    broken = {}
    for name in ("corrupt-config", "incomplete-config", "truncated-weights", "no-weights"):
        target = root / name
        target.mkdir()
        for file in good.iterdir():
            if file.suffix != ".safetensors" or name != "no-weights":
                os.symlink(file, target / file.name)
        broken[name] = target
    (broken["corrupt-config"] / "config.json").unlink()
    (broken["corrupt-config"] / "config.json").write_text('{"hidden_size": 64,')
    config = json.loads((good / "config.json").read_text())
    del config["hidden_size"]
    (broken["incomplete-config"] / "config.json").unlink()
    (broken["incomplete-config"] / "config.json").write_text(json.dumps(config))
    weights = broken["truncated-weights"] / "model.safetensors"
    weights.unlink()
    weights.write_bytes((good / "model.safetensors").read_bytes()[:100_000])
    (root / "empty").mkdir()
    broken["empty"] = root / "empty"
    return broken


def test_bad_model_directories_are_named_in_one_line(tmp_path):
    from course.models import ModelDirError, check_model_dir, resolve_model

    expected = {"corrupt-config": "config.json is not valid JSON", "incomplete-config": "config.json lacks hidden_size",
                "truncated-weights": "model.safetensors is corrupt: truncated", "no-weights": "no *.safetensors",
                "empty": "config.json is missing"}
    for name, path in write_bad_models(tmp_path).items():
        with pytest.raises(ModelDirError, match=None) as raised:
            check_model_dir(resolve_model(str(path)))
        assert expected[name] in str(raised.value) and "\n" not in str(raised.value)
    for name, words in (("", "empty"), ("/nonexistent/dir", "does not exist")):
        with pytest.raises(ModelDirError) as raised:
            resolve_model(name)
        assert words in str(raised.value) and "huggingface-cli" not in str(raised.value)
    check_model_dir(REPO_ROOT / "models" / "qwen2-tiny-random")  # the good one passes


def run_command(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", "src_ref", "."])}
    return subprocess.run([sys.executable, "-m", f"scripts.{script}", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, timeout=300)


def assert_one_line_user_error(result: subprocess.CompletedProcess, words: str) -> None:
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, f"exit status {result.returncode}: {stderr}"
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert words in stderr, stderr


# The in-process rows: (script, arguments, words of the one error line). Each calls main(argv) as the command does.
CLI_ROWS = [
    ("batch_main", ["--step-delay", "-1"], "--step-delay"),
    ("batch_main", ["--adaptive", "0"], "target_itl"),
    ("batch_main", ["--batch-size", "0"], "batch_size"),
    ("batch_main", ["--batch-size", "100000"], "memory"),  # on a machine of 8 GB
    ("batch_main", ["--prefill-step", "0"], "prefill_step"),
    ("batch_main", ["--max-seq-len", str(CONTEXT + 1)], "max_position_embeddings"),
    ("batch_main", ["--max-tokens", "0"], "max_tokens"),
    ("batch_main", ["--prompt", "", "--no-chat-template"], "empty"),
    ("batch_main", ["--prompt", "ab\udcff"], "UTF-8"),
    ("batch_main", ["--batch-size", "2.0"], "invalid int value"),
    ("main", ["--max-tokens", "0"], "--max-tokens"),
    ("main", ["--temp", "-1"], "temp"),
    ("main", ["--temp", "nan"], "temp"),
    ("main", ["--top-p", "2"], "top_p"),
    ("main", ["--top-p", "0"], "top_p"),
    ("main", ["--top-k", "0"], "top_k"),
    ("main", ["--prompt", "", "--no-chat-template"], "empty"),
    ("main", ["--prompt", "\udcff"], "UTF-8"),
    ("main", ["--model", ""], "empty"),
    ("main", ["--model", "/nonexistent/dir"], "does not exist"),
    ("serve", ["--port", "70000"], "--port"),
    ("serve", ["--num-blocks", "10000000"], "memory"),  # on a machine of 8 GB
    ("serve", ["--max-model-len", "100000"], "max_model_len"),
    ("serve", ["--target-itl", "0"], "--target-itl"),
]


@pytest.mark.parametrize("script,args,words", CLI_ROWS, ids=[f"{s}-{' '.join(a)}" for s, a, _ in CLI_ROWS])
def test_command_user_errors_in_process(capsys, monkeypatch, embedded_model, script, args, words):
    import course.models

    monkeypatch.setattr(course.models, "load_model", lambda name=None: embedded_model)  # loaded once per session
    monkeypatch.setattr(ref.validation, "memory_bytes", lambda: 8 * 10**9)
    command = importlib.import_module(f"scripts.{script}")
    if script == "serve" and "--port" not in args:
        args = [*args, "--port", str(free_port())]
    try:
        status = command.main([*args, "--no-live"] if script == "batch_main" else args)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "", out
    err = "\n".join(line for line in err.splitlines() if not line.startswith("[engine] "))  # the engine's own log
    assert len(err.strip().splitlines()) == 1 and words in err, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_busy_port_before_loading(capsys, monkeypatch):
    """A port already taken: one line, before the model loads (it used to load, say "serving on", then fail)."""
    import course.models

    def no_loading(name=None):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(course.models, "load_model", no_loading)
    command = importlib.import_module("scripts.serve")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        try:
            status = command.main(["--port", str(busy.getsockname()[1])])
        except SystemExit as exit_:
            status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "cannot listen" in err, err


def test_commands_exit_2_with_one_line(tmp_path):
    """A few rows through real processes (each found before the model loads): exit status 2, one line, no traceback."""
    broken = write_bad_models(tmp_path)
    assert_one_line_user_error(run_command("batch_main", ["--no-live", "--step-delay", "-1"]), "--step-delay")
    assert_one_line_user_error(run_command("main", ["--model", str(broken["truncated-weights"])]), "truncated")
    assert_one_line_user_error(run_command("main", ["--prompt", b"\xff".decode("utf-8", "surrogateescape")]), "UTF-8")


# ---------------------------------------------------------------- the server's edges (day 3.5's provided code)

SERVED = "edge-model"


@pytest.fixture(scope="module")
def week3(model32):
    """(week-3 model, tokenizer) on the embedded weights, its lazy arrays evaluated on this thread."""
    week3_model = ref.qwen2_week3.Qwen2ModelWeek3(model32[0])
    ref.engine.generate(week3_model, model32[1], [[1]], ref.sequence.SamplingParams(max_tokens=1))
    return week3_model, model32[1]


def edge_engine(week3, **config):
    settings_ = {**PLAIN_ENGINE, "token_budget": 64, "max_num_seqs": 16, "block_size": 8, **config}
    return ref.engine.LLMEngine(week3[0], week3[1], ref.engine.EngineConfig(**settings_))


class PublicEngine:
    """An engine seen only through what a server may use: add_request, step, abort, has_work and stats().

    Anything else (`sequences`, `block_manager`, `model`, ...) raises, so a server that reads the engine's
    insides fails here rather than breaking quietly when they change."""

    PUBLIC = ("add_request", "step", "abort", "has_work", "stats")

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name not in self.PUBLIC:
            raise AttributeError(f"the server read engine.{name}: it may only use {', '.join(self.PUBLIC)}")
        return getattr(self._engine, name)


def greedy_text(week3, prompt: str, max_tokens: int, **sampling) -> tuple[list[int], str]:
    """The engine's own greedy tokens and text for `prompt`: the oracle for the server's answers."""
    engine = edge_engine(week3)
    seq = engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=max_tokens, **sampling))
    while engine.has_work():
        engine.step()
    return seq.output_token_ids, week3[1].decode(seq.output_token_ids)


def completion(url: str, **fields) -> httpx.Response:
    body = {"model": SERVED, "prompt": "edge", "max_tokens": 3, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_engine_stats_say_what_the_server_needs(week3):
    """`EngineStats`: the one report the server and /metrics read (queues, blocks, prefix cache, ids held and scheduled)."""
    engine = edge_engine(week3, enable_prefix_caching=True, max_num_seqs=1)
    fresh = engine.stats()
    assert (fresh.num_running, fresh.num_waiting, fresh.num_blocks_used, fresh.held) == (0, 0, 0, frozenset())
    assert fresh.kv_cache_usage == 0 and fresh.max_request_tokens == min(fresh.num_blocks_free * 8, CONTEXT)
    engine.add_request([5] * 20, ref.sequence.SamplingParams(max_tokens=4), request_id="a")
    engine.add_request([5] * 20, ref.sequence.SamplingParams(max_tokens=4), request_id="b")
    waiting = engine.stats()
    assert waiting.held == {"a", "b"} and waiting.scheduled == frozenset() and waiting.num_waiting == 2
    engine.step()
    running = engine.stats()
    assert running.scheduled == {"a"} and running.num_running == 1 and running.num_blocks_used >= 3
    assert running.prefix_cache_queries == 20 and running.prompt_tokens == 20
    while engine.has_work():
        engine.step()
    done = engine.stats()
    assert done.held == done.scheduled == frozenset() and done.num_blocks_used == 0
    assert done.prefix_cache_hits >= 16 and done.generation_tokens == 8 and done.vocab_size == VOCAB


def test_server_reads_only_engine_stats(week3):
    """Streams, a disconnect, /metrics and a failure-free shutdown through an engine that hides its insides."""
    engine = edge_engine(week3)
    app = ref.server.create_app(PublicEngine(engine), week3[1], SERVED)
    _, expected = greedy_text(week3, "edge", 3)
    with running_server(app) as url:
        assert completion(url).json()["choices"][0]["text"] == expected
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": SERVED, "prompt": "edge", "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
            next(s.iter_lines())
        assert wait_until(lambda: not engine.has_work())
        assert httpx.get(f"{url}/metrics").status_code == 200
    assert engine.stats().num_blocks_used == 0


def test_server_refuses_a_large_body_before_reading_it(week3):
    """A body over `max_body_bytes` is a 413, declared (Content-Length) or chunked; one just under it is served."""
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, week3[1], SERVED, max_body_bytes=4096)
    body = json.dumps({"model": SERVED, "prompt": "x " * 3000, "max_tokens": 1}).encode()  # valid, 6 KB
    with running_server(app) as url:
        declared = httpx.post(f"{url}/v1/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})
        chunked = httpx.post(f"{url}/v1/completions", timeout=60, headers={"content-type": "application/json"},
                             content=(body[i:i + 1000] for i in range(0, len(body), 1000)))
        for response in (declared, chunked):
            assert response.status_code == 413, response.text
            assert response.json()["error"]["code"] == "request_too_large"
        small = json.dumps({"model": SERVED, "prompt": "x " * 1500, "max_tokens": 1}).encode()
        assert len(small) < 4096
        assert httpx.post(f"{url}/v1/completions", content=small, timeout=60).status_code == 200


def slow_steps(engine, seconds: float = 0.02):
    """Each step of `engine` takes at least `seconds`: long streams stay open while the test looks."""
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]


def test_server_admission_limit_answers_429_with_retry_after(week3):
    """Beyond `max_pending_requests` engine requests in flight: a 429 naming the limit, with Retry-After."""
    engine = edge_engine(week3, max_num_seqs=1)
    slow_steps(engine)
    app = ref.server.create_app(engine, week3[1], SERVED, max_pending_requests=2)
    long = {"model": SERVED, "prompt": "edge", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with running_server(app) as url, httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=long) as first, \
                client.stream("POST", f"{url}/v1/completions", json=long) as second:
            assert first.status_code == second.status_code == 200
            refused = completion(url)
            assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
            assert "at most 2" in refused.json()["error"]["message"]
            assert completion(url, n=1, prompt=["a", "b"]).status_code == 429
        assert wait_until(lambda: not engine.has_work())
        assert completion(url).status_code == 200


def test_server_keeps_a_waiting_stream_alive(week3):
    """A stream that waits (the engine's one slot is taken) gets SSE comments, which the openai client skips."""
    from openai import OpenAI

    engine = edge_engine(week3, max_num_seqs=1)
    slow_steps(engine)
    app = ref.server.create_app(engine, week3[1], SERVED, keepalive=0.05)
    long = {"model": SERVED, "prompt": "edge", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with running_server(app) as url, httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=long) as first:
            running = first.iter_lines()  # kept: a dropped iterator closes the connection
            # on a loaded machine the first token can come after a keep-alive comment or two
            assert next(line for line in running if not line.startswith(":") and line).startswith("data: ")
            with client.stream("POST", f"{url}/v1/completions", json={**long, "max_tokens": 2}) as waiting:
                assert wait_until(lambda: engine.num_waiting == 1), "the second request must wait for the engine's one slot"
                lines = waiting.iter_lines()
                assert next(lines) == ": keep-alive", "a waiting stream must hear from the server"
        assert wait_until(lambda: not engine.has_work())
        _, expected = greedy_text(week3, "edge", 8)
        openai = OpenAI(base_url=f"{url}/v1", api_key="none")
        pieces = [chunk.choices[0].text for chunk in openai.completions.create(
            model=SERVED, prompt="edge", max_tokens=8, temperature=0, stream=True) if chunk.choices]
        assert "".join(pieces) == expected


NULLABLE = {  # every optional field: an explicit null is its default (OpenAI's schema, vLLM)
    "both": ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
             "priority", "service_tier", "metadata", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "min_p", "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "n", "response_format", "store"],
    "/v1/completions": ["logprobs", "echo", "best_of", "suffix"],
    "/v1/chat/completions": ["max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                             "functions", "function_call", "parallel_tool_calls", "audio", "modalities", "prediction",
                             "reasoning_effort", "web_search_options"],
}


def test_server_reads_null_as_the_default(week3):
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, week3[1], SERVED, max_model_len=64)  # a chat without max_tokens stays short
    # Sampled at the default temperature with a seed: a field's null must give what leaving it out gives.
    bodies = {"/v1/completions": {"model": SERVED, "prompt": "edge", "max_tokens": 3, "seed": 7},
              "/v1/chat/completions": {"model": SERVED, "messages": [{"role": "user", "content": "edge",
                                                                      "name": None}], "max_tokens": 3, "seed": 7}}
    with running_server(app) as url:
        for path, body in bodies.items():
            left_out = httpx.post(f"{url}{path}", json=body, timeout=60).json()["choices"]
            for name in NULLABLE["both"] + NULLABLE[path]:
                response = httpx.post(f"{url}{path}", json={**body, name: None}, timeout=60)
                assert response.status_code == 200, (path, name, response.text)
                if name not in ("seed", "max_tokens"):  # null: unseeded, or (chat) up to the context
                    assert response.json()["choices"] == left_out, (path, name)


def test_server_usage_counts_each_prompt_once(week3):
    """With n > 1, prompt_tokens and cached_tokens are the prompt's, not summed over its choices."""
    engine = edge_engine(week3, enable_prefix_caching=True)
    app = ref.server.create_app(engine, week3[1], SERVED)
    prompt = "a shared beginning that is long enough to fill a few blocks of eight tokens each, and then some"
    with running_server(app) as url:
        once = completion(url, prompt=prompt).json()["usage"]
        again = completion(url, prompt=prompt).json()["usage"]
        three = completion(url, prompt=prompt, n=3).json()["usage"]
        two_prompts = completion(url, prompt=[prompt, "edge"], n=2).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= 16
    assert three["prompt_tokens"] == once["prompt_tokens"]
    assert three["prompt_tokens_details"] == again["prompt_tokens_details"]
    assert three["completion_tokens"] == 3 * once["completion_tokens"]
    edge = len(week3[1].encode("edge", add_special_tokens=False))
    assert two_prompts["prompt_tokens"] == once["prompt_tokens"] + edge
    assert two_prompts["prompt_tokens_details"] == again["prompt_tokens_details"]


def test_server_serves_min_tokens_and_stop_token_ids(week3):
    """vLLM's `min_tokens` (no EOS or stop token before it) and `stop_token_ids` (they end the output, unsent)."""
    tokenizer = week3[1]
    eos = tokenizer.eos_token_ids[0] if isinstance(tokenizer.eos_token_ids, list) else next(iter(tokenizer.eos_token_ids))
    tokens, _ = greedy_text(week3, "edge", 6)
    stop_at = next(i for i, token in enumerate(tokens) if i >= 2 and token not in tokens[:i])
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, tokenizer, SERVED)
    with running_server(app) as url:
        forced_eos = completion(url, max_tokens=8, logit_bias={str(eos): 100}).json()
        held_off = completion(url, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3).json()
        stopped = completion(url, max_tokens=6, stop_token_ids=[tokens[stop_at]]).json()
        stop_held_off = completion(url, max_tokens=6, stop_token_ids=[tokens[stop_at]], min_tokens=6).json()
        too_many = completion(url, max_tokens=2, min_tokens=3)
        outside = completion(url, stop_token_ids=[10**8])
    assert forced_eos["usage"]["completion_tokens"] == 0
    assert held_off["usage"]["completion_tokens"] == 3 and held_off["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0] == {"index": 0, "text": tokenizer.decode(tokens[:stop_at]), "finish_reason": "stop",
                                     "logprobs": None}
    assert stop_held_off["usage"]["completion_tokens"] == 6
    assert stop_held_off["choices"][0]["finish_reason"] == "length"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "stop_token_ids"


def test_server_refuses_what_it_would_otherwise_ignore(week3):
    """`messages[].name` (the template has no place for it) and `stream_options` without `stream`: a 400 naming
    them, as OpenAI answers the latter; never silently dropped."""
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, week3[1], SERVED)
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with running_server(app) as url:
        named = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           json={**chat, "messages": [{"role": "user", "content": "hi", "name": "ada"}]})
        options = completion(url, stream_options={"include_usage": True})
        streamed = completion(url, stream=True, stream_options={"include_usage": True})
    assert named.status_code == 400 and named.json()["error"]["param"] == "messages"
    assert "messages[0].name" in named.json()["error"]["message"]
    assert options.status_code == 400 and options.json()["error"]["param"] == "stream_options"
    assert streamed.status_code == 200 and '"usage"' in streamed.text


def test_server_tokenize_detokenize_and_version(week3):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize and /version."""
    tokenizer = week3[1]
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, tokenizer, SERVED, max_model_len=100)
    messages = [{"role": "user", "content": "hi there"}]
    with running_server(app) as url:
        plain = httpx.post(f"{url}/tokenize", json={"model": SERVED, "prompt": "hi there"}).json()
        strs = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
        chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
        back = httpx.post(f"{url}/detokenize", json={"model": SERVED, "tokens": plain["tokens"]}).json()
        outside = httpx.post(f"{url}/detokenize", json={"tokens": [10**8]})
        wrong_model = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"})
        version = httpx.get(f"{url}/version").json()
    assert plain == {"count": len(tokenizer.encode("hi there")), "max_model_len": 100,
                     "tokens": tokenizer.encode("hi there"), "token_strs": None}
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode("hi"))
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(templated, add_special_tokens=False)
    assert back == {"prompt": "hi there"}
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert wrong_model.status_code == 404
    assert isinstance(version["version"], str) and version["version"]


def test_metrics_has_vllm_token_histograms(week3):
    """vLLM's per-request token counts, max_tokens, n and time-per-output-token histograms, with its buckets."""
    engine = edge_engine(week3)
    app = ref.server.create_app(engine, week3[1], SERVED, max_model_len=600)
    with running_server(app) as url:
        completion(url, max_tokens=3, ignore_eos=True)
        completion(url, max_tokens=5, ignore_eos=True, n=2)
        families = parse_prometheus(httpx.get(f"{url}/metrics").text)

    def sample(name: str) -> float:
        family = families[f"tiny_llm:{name.rsplit('_', 1)[0]}"]
        return next(value for sample, labels, value in family["samples"] if sample == f"tiny_llm:{name}")

    prompt = len(week3[1].encode("edge", add_special_tokens=False))
    assert sample("request_prompt_tokens_count") == 3 and sample("request_prompt_tokens_sum") == 3 * prompt
    assert sample("request_generation_tokens_sum") == 3 + 5 + 5
    assert sample("request_params_max_tokens_sum") == 3 + 5 + 5
    assert sample("request_params_n_count") == 2 and sample("request_params_n_sum") == 3
    assert sample("request_time_per_output_token_seconds_count") == 3
    bounds = [labels["le"] for name, labels, _ in families["tiny_llm:request_prompt_tokens"]["samples"]
              if name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
