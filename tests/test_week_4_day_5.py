"""Week 4 Day 5: structured outputs (book/src/week4-05-structured-outputs.md).

Oracles: Python's `json` (what a JSON text is, and json.dumps' ways of writing one), `jsonschema`
(whether a value meets its schema), random schemas and their instances drawn by hypothesis
(`schemas`, `instance`), each token's bytes walked one at a time (the mask's definition), mlx-lm's
model with the reference's masks and with llguidance's (a constrained greedy run, request alone),
and the same engine without the constraint (what a constrained request's neighbours must still get). Served:
the official `openai` client and LangChain's `ChatOpenAI` (what they parse is what OpenAI's API means), and
the same request without tools (what tool_choice "none" must answer).

Each task's tests take the student's code for that task alone (`solution(week=4, day=5, task=N)`): Task 2's
masks are built over the reference's automaton (Task 1), and Task 3's engine, speculation, quantized pool and
server run the reference's automaton and masks, so a bug in one task never costs another task's points. Task 4
runs the student's week-3 engine with their whole day 4.5.
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import actor_fakes, fetch, reference, solution, stack
from tests.week3_fakes import PLAIN_ENGINE

# Task N's tests: the student's Task N alone
TASKS = {n: solution(week=4, day=5, task=n, reads_text=True) for n in range(1, 4)}
STACK = stack(week=4, day=5, reads_text=True)  # "your stack so far": started now, its tokenizer too
ref = reference()

STEP_LIMIT = 400  # no engine run here needs more steps; a run past it is a hung engine
QUICK = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
NAMES = ["id", "name", "clé", "tags", "x"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text("abé\"\\ 中", max_size=4))
CHARS = st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",))  # one \\u escape each (no pairs)


# ---------------------------------------------------------------- random schemas, instances and a checker


def leaf_schemas():
    lengths = st.integers(0, 5)
    return st.one_of(
        st.builds(lambda: {"type": "string"}),
        st.builds(lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra}, lengths, lengths),
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                         {"type": ["string", "null"]}, {"type": ["integer", "boolean"]}]),
        st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps).map(lambda values: {"enum": values}),
        SCALARS.map(lambda value: {"const": value}),
    )


def object_schema(children):
    def build(props, required_flags):
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, flag in zip(names, required_flags) if flag]}
    return st.dictionaries(st.sampled_from(NAMES), children, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda flags: build(props, flags)))


def array_schema(children):
    def build(items, low, extra):
        schema = {"type": "array", "items": items, "minItems": low}
        if extra is not None:
            schema["maxItems"] = low + extra
        return schema
    return st.builds(build, children, st.integers(0, 2), st.one_of(st.none(), st.integers(0, 3)))


def node_schemas():
    return st.recursive(leaf_schemas(), lambda children: st.one_of(
        object_schema(children), array_schema(children),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options})), max_leaves=6)


@st.composite
def schemas(draw):
    """A random schema of the served subset, sometimes with a `$defs` entry the root reaches by `$ref`."""
    schema = draw(node_schemas())
    if draw(st.booleans()):
        schema = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}, "more": schema},
                  "required": ["item"], "$defs": {"Item": draw(node_schemas())}, "additionalProperties": False}
    return schema


def resolve(schema, root):
    while "$ref" in schema:
        schema = root["$defs"][schema["$ref"].split("/")[-1]]
    return schema


def instance(draw, schema, root):
    """A value `schema` allows, drawn with `draw`."""
    schema = resolve(schema, root)
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema:
        return instance(draw, draw(st.sampled_from(schema["anyOf"])), root)
    kind = schema["type"]
    if isinstance(kind, list):
        kind = draw(st.sampled_from(kind))
    if kind == "object":
        return {name: instance(draw, sub, root) for name, sub in schema["properties"].items()
                if name in schema["required"] or draw(st.booleans())}
    if kind == "array":
        high = schema.get("maxItems", schema["minItems"] + 3)
        n = draw(st.integers(schema["minItems"], high))
        return [instance(draw, schema["items"], root) for _ in range(n)]
    if kind == "string":
        return draw(st.text(CHARS, min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 6)))
    if kind == "integer":
        return draw(st.integers(-10**12, 10**12))
    if kind == "number":
        return draw(st.one_of(st.integers(-99, 99), st.floats(allow_nan=False, allow_infinity=False)))
    return {"boolean": lambda: draw(st.booleans()), "null": lambda: None}[kind]()


def meets(schema, value) -> bool:
    """Whether `value` (as json.loads gives it) meets `schema`, by jsonschema (the schema's meaning, not ours)."""
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def writings(value) -> list[bytes]:
    """json.dumps' ways of writing `value` that the automaton serves: spaced, compact, mixed (raw UTF-8: enum and
    const values are written one way only, so that a model copying one cannot wander into escapes)."""
    return [json.dumps(value, ensure_ascii=False, **options).encode() for options in
            ({}, {"separators": (",", ":")}, {"separators": (", ", ":")})]


def checked_text(data: bytes, schema) -> None:
    """Fail unless `data` is UTF-8 JSON that meets `schema`."""
    value = json.loads(data.decode("utf-8"))
    assert meets(schema, value), f"{data!r} does not meet {schema}"


def byte_walk(automaton, rng: random.Random, limit: int = 400) -> bytes | None:
    """Random allowed bytes from the start until the walk stops in an accepting state (None: it ran out).

    Walked on the table `explore` gives (one call, not one per byte, while grading), then checked with `matches`.
    """
    table, accepting = automaton.explore()
    state, data = automaton.start, bytearray()
    for _ in range(limit):
        allowed = np.nonzero(table[state])[0].tolist()
        if accepting[state] and (rng.random() < 0.3 or not allowed):
            assert automaton.matches(bytes(data)), f"the table accepts {bytes(data)!r}, matches() does not"
            return bytes(data)
        assert allowed, f"the walk reached a state with no way on and no acceptance after {bytes(data)!r}"
        byte = rng.choice(allowed)
        data.append(byte)
        state = int(table[state, byte])
    return None


# ---------------------------------------------------------------- Task 1: from schema to automaton


@QUICK
@given(st.data())
def test_task_1_accepts_every_instance(data):
    schema = data.draw(schemas())
    automaton = TASKS[1].structured.compile_schema(schema)
    value = instance(data.draw, schema, schema)
    for text in writings(value):
        assert automaton.matches(text), f"{text!r} meets {schema} but the automaton refuses it"


@QUICK
@given(schemas(), st.integers(0, 2**32))
def test_task_1_every_walk_meets_the_schema(schema, seed):
    automaton = TASKS[1].structured.compile_schema(schema)
    rng = random.Random(seed)
    for _ in range(3):
        text = byte_walk(automaton, rng)
        if text is not None:
            checked_text(text, schema)


@QUICK
@given(st.data())
def test_task_1_refuses_what_breaks_the_schema(data):
    schema = data.draw(schemas())
    automaton = TASKS[1].structured.compile_schema(schema)
    text = bytearray(json.dumps(instance(data.draw, schema, schema)).encode())
    at = data.draw(st.integers(0, len(text)))
    text[at:at] = data.draw(st.sampled_from([b"}", b"]", b",", b'"', b"0", b"x", b"\xff", b"\x80"]))
    try:
        valid = meets(schema, json.loads(bytes(text).decode("utf-8")))
    except (ValueError, UnicodeDecodeError):
        valid = False
    if not valid:
        assert not automaton.matches(bytes(text)), f"{bytes(text)!r} breaks {schema} but the automaton accepts it"


@pytest.mark.parametrize("schema, text, accepted", [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"],
      "additionalProperties": False}, b'{"b": "x"}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]},
     b'{"a": 1}', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]},
     b'{, "b": "x"}', False),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, b"[]", False),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, b"[true,false,true]", False),
    ({"type": "string", "maxLength": 2}, '"é\\n"'.encode(), True),
    ({"type": "string", "maxLength": 2}, '"é\\n!"'.encode(), False),
    ({"type": "string"}, b'"\xc3"', False),  # a lead byte with no continuation
    ({"type": "string"}, b'"\xed\xa0\x80"', False),  # a UTF-8-encoded surrogate
    ({"type": "number"}, b"-0.5e+3", True),
    ({"type": "number"}, b"01", False),
    ({"type": "array", "items": {"type": "null"}}, b"[null,  null]", False),  # two spaces: padding is refused
    ({"type": "array", "items": {"type": "null"}}, b"[null,\n null]", False),
    ({"type": "integer"}, b"1.0", False),
    ({"enum": ["é", 2]}, b'"\\u00e9"', False),  # enum values in raw UTF-8 only
    ({"type": "string"}, b'"\\u00e9"', True),
    ({"enum": ["é", 2]}, '"é"'.encode(), True),
], ids=range(17))
def test_task_1_chosen_cases(schema, text, accepted):
    assert TASKS[1].structured.compile_schema(schema).matches(text) == accepted


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "a+"}, "pattern"),
    ({"type": "integer", "minimum": 3}, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}, "multipleOf"),
    ({"type": "object", "additionalProperties": True}, "additionalProperties"),
    ({"$defs": {"N": {"type": "array", "items": {"$ref": "#/$defs/N"}}}, "$ref": "#/$defs/N"}, "recursive"),
    ({"enum": []}, "enum"),  # nothing allowed: refused, not served as a request that can never end
    ({"anyOf": []}, "anyOf"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
    ({"type": "string", "maxLength": 10**6}, "maxLength"),
])
def test_task_1_unsupported_keyword_is_named(schema, keyword):
    with pytest.raises(ValueError, match=keyword):
        TASKS[1].structured.compile_schema(schema)


# ---------------------------------------------------------------- Task 2: from characters to tokens


@pytest.fixture(scope="module")
def vocab(model32):
    """(tokenizer, vocabulary size, {token bytes: id}, [bytes or None by id]) of the embedded model."""
    mlx_model, tokenizer = model32
    size = mlx_model.args.vocab_size
    token_bytes = ref.structured.tokenizer_vocabulary(tokenizer, size).token_bytes
    by_bytes = {data: token for token, data in enumerate(token_bytes) if data}
    return tokenizer, size, by_bytes, token_bytes


def constraint_for(schema, vocab):
    tokenizer, size, _, _ = vocab
    return TASKS[2].structured.make_constraint(schema, tokenizer, size)


def tokenizations(text: bytes, vocab, rng: random.Random) -> list[list[int]]:
    """`text` as the tokenizer writes it, byte by byte, and cut at random into vocabulary tokens."""
    tokenizer, _, by_bytes, _ = vocab
    cuts = []
    at = 0
    while at < len(text):
        options = [n for n in range(1, 9) if text[at:at + n] in by_bytes and at + n <= len(text)]
        n = rng.choice(options)
        cuts.append(by_bytes[text[at:at + n]])
        at += n
    return [tokenizer.encode(text.decode("utf-8"), add_special_tokens=False),
            [by_bytes[bytes([b])] for b in text], cuts]


def eos_of(vocab) -> int:
    return min(vocab[0].eos_token_ids)


@SLOW
@given(st.data())
def test_task_2_every_tokenization_of_an_instance_is_allowed(vocab, data):
    schema = data.draw(schemas())
    constraint = constraint_for(schema, vocab)
    text = json.dumps(instance(data.draw, schema, schema), ensure_ascii=False).encode()
    for tokens in tokenizations(text, vocab, random.Random(data.draw(st.integers(0, 99)))):
        state = constraint.start
        for token in tokens:
            check_token_and_eos(constraint, state, token, vocab, text)
            state = constraint.next_state(state, token)
        assert bool(constraint.index.mask(state)[eos_of(vocab)].item()), f"EOS refused after all of {text!r}"


def check_token_and_eos(constraint, state: int, token: int, vocab, text: bytes) -> None:
    """`token` (the next one of `text`) allowed in `state`; EOS there only where the output may end."""
    mask = constraint.index.mask(state)
    assert bool(mask[token].item()), f"{vocab[3][token]!r} refused in {text!r}"
    if not constraint.automaton.accepts(state):
        assert not bool(mask[eos_of(vocab)].item()), f"EOS allowed before {vocab[3][token]!r} in {text!r}, " \
                                                      "where the output cannot end"


@SLOW
@given(schemas(), st.integers(0, 2**32))
def test_task_2_every_token_walk_meets_the_schema(vocab, schema, seed):
    constraint = constraint_for(schema, vocab)
    rng, eos = random.Random(seed), eos_of(vocab)
    state, text = constraint.start, b""
    for _ in range(40):
        allowed = np.nonzero(np.array(constraint.index.mask(state)))[0].tolist()
        assert allowed, f"no token allowed after {text!r}"
        assert (eos in allowed) == constraint.automaton.accepts(state), f"EOS allowed in a non-accepting state: {text!r}"
        if eos in allowed and (rng.random() < 0.4 or allowed == [eos]):
            return checked_text(text, schema)
        token = rng.choice([t for t in allowed if t != eos])
        text += vocab[3][token]
        state = constraint.next_state(state, token)


@pytest.mark.parametrize("prefix", [b"", b'{"name": "', b'{"name": "\xe4', b'{"name": "\xf0\x9f', b'{"name": "a"',
                                    b'{"name": "a", "size": 1', b'{"name": "a", "size": 12}'])
def test_task_2_mask_is_the_byte_walk_of_each_token(vocab, prefix):
    """Against the definition: a token is allowed when each of its bytes keeps the automaton alive."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "size": {"type": "integer"}},
              "required": ["name"], "additionalProperties": False}
    constraint = constraint_for(schema, vocab)
    oracle = ref.structured.compile_schema(schema)
    state, oracle_state = constraint.automaton.walk(constraint.start, prefix), oracle.walk(oracle.start, prefix)
    mask = np.array(constraint.index.mask(state))
    rng = random.Random(len(prefix))
    token_bytes = vocab[3]
    # Every byte-sized token, every token cutting a UTF-8 character, and a random sample of the rest.
    chosen = [t for t, data in enumerate(token_bytes) if data and (len(data) == 1 or not utf8(data))]
    chosen += rng.sample(range(len(token_bytes)), 3000)
    for token in chosen:
        data = token_bytes[token]
        alive = data is not None and oracle.walk(oracle_state, data) != 0
        assert mask[token] == alive, f"after {prefix!r}: token {data!r} should be {'allowed' if alive else 'refused'}"
    eos = eos_of(vocab)
    assert mask[eos] == oracle.accepts(oracle_state), f"EOS after {prefix!r}"
    assert not mask[len(token_bytes) - 1] or token_bytes[-1], "a padding id past the tokenizer is never allowed"


def utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_task_2_every_tokenization_of_an_answer(vocab):
    """A chosen answer whose characters need tokens that cut them (𓀀 is three tokens), token by token."""
    constraint = constraint_for(SCHEMA, vocab)
    text = json.dumps({"colour": "grün", "animal": "𓀀", "count": 12, "ok": True}, ensure_ascii=False).encode()
    for tokens in tokenizations(text, vocab, random.Random(7)):
        state = constraint.start
        for token in tokens:
            check_token_and_eos(constraint, state, token, vocab, text)
            state = constraint.next_state(state, token)
        assert constraint.is_complete(state), f"{text!r} should complete SCHEMA"


def test_task_2_utf8_split_across_tokens(vocab):
    """A character cut across two tokens: its first bytes alone are allowed inside a string, never outside one."""
    _, _, by_bytes, _ = vocab
    constraint = constraint_for({"type": "string"}, vocab)
    inside = constraint.automaton.walk(constraint.start, b'"')
    lead, tail = by_bytes[b"\xf0\x9f"], by_bytes[b"\x98"]
    assert bool(constraint.index.mask(inside)[lead].item()), "a token holding a 4-byte character's first bytes"
    after_lead = constraint.next_state(inside, lead)
    mask = np.array(constraint.index.mask(after_lead))
    assert not mask[by_bytes[b'"']], "a string cannot end in the middle of a character"
    assert not mask[by_bytes[b"a"]], "a character's continuation must be a continuation byte"
    assert not mask[tail] or constraint.next_state(after_lead, tail) != 0
    assert not bool(constraint.index.mask(constraint.start)[tail].item()), "a continuation byte cannot start a value"


def test_task_2_masks_are_built_once_per_state(vocab):
    constraint = constraint_for({"type": "boolean"}, vocab)
    first = constraint.index.mask(constraint.start)
    assert np.array_equal(np.array(first), np.array(constraint.index.mask(constraint.start)))
    assert len(constraint.index.masks) == 1, "the mask of a state already met is the cached one"


# ---------------------------------------------------------------- Task 3: in the engine's step


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "animal", "ok"], "properties": {
    "colour": {"enum": ["red", "grün", "blue"]}, "animal": {"const": "𓀀"},
    "count": {"type": "integer"}, "ok": {"type": "boolean"}}}


def constrained_rows(vocab, package):
    """Three sequences: a constrained one part way through SCHEMA, an unconstrained one, a constrained one at the start."""
    tokenizer, size, _, _ = vocab
    constraint = package.structured.make_constraint(SCHEMA, tokenizer, size)
    seqs = [package.sequence.Sequence(0, [1, 2], package.sequence.SamplingParams(constraint=constraint)),
            package.sequence.Sequence(1, [1, 2], package.sequence.SamplingParams()),
            package.sequence.Sequence(2, [3], package.sequence.SamplingParams(constraint=constraint, max_tokens=9))]
    seqs[0].output_token_ids = tokenizer.encode('{"colour": "gr', add_special_tokens=False)
    return constraint, seqs


def test_task_3_apply_constraints_masks_only_constrained_rows(vocab):
    constraint, seqs = constrained_rows(vocab, TASKS[3])
    logits = mx.random.normal((3, vocab[1]), key=mx.random.key(5))
    out = np.array(TASKS[3].structured.apply_constraints(logits, seqs))
    raw = np.array(logits)
    assert np.array_equal(out[1], raw[1]), "an unconstrained row must come back unchanged"
    text = b'{"colour": "gr'
    oracle = oracle_constraint(vocab[0], vocab[1])
    for row, prefix in ((0, text), (2, b"")):
        allowed = np.array(oracle.index.mask(oracle.automaton.walk(oracle.start, prefix)))
        assert np.array_equal(out[row][allowed], raw[row][allowed]), f"row {row}: an allowed token's logit changed"
        assert np.all(out[row][~allowed] == -np.inf), f"row {row}: a refused token keeps a finite logit"
    # A step later (one more token; the sequence as a preemption left it, nothing computed): the mask follows.
    token = vocab[0].encode("ün", add_special_tokens=False)[0]
    seqs[0].output_token_ids = list(seqs[0].output_token_ids) + [token]
    seqs[0].num_computed_tokens = 0
    out = np.array(TASKS[3].structured.apply_constraints(logits, seqs))
    allowed = np.array(oracle.index.mask(oracle.automaton.walk(oracle.start, text + vocab[3][token])))
    assert np.all(out[0][~allowed] == -np.inf) and np.array_equal(out[0][allowed], raw[0][allowed]), \
        "the mask after one more token"
    none = TASKS[3].structured.apply_constraints(logits[1:2], seqs[1:2])
    assert np.array_equal(np.array(none), raw[1:2])


def test_task_3_state_follows_the_output(vocab):
    constraint, seqs = constrained_rows(vocab, TASKS[3])
    seq = seqs[0]
    text = b'{"colour": "gr'
    expected = constraint.automaton.walk(constraint.start, text)
    assert TASKS[3].structured.constraint_state(seq) == expected
    output = list(seq.output_token_ids)
    for token in vocab[0].encode('ün", "animal": ', add_special_tokens=False):
        output.append(token)
        seq.output_token_ids = list(output)  # the whole list each time: while grading, `seq` is in the sandbox
        text += vocab[3][token]
        assert TASKS[3].structured.constraint_state(seq) == constraint.automaton.walk(constraint.start, text)
    # Preempted: its blocks freed and nothing computed; its output kept, so its state too.
    seq.num_computed_tokens, seq.block_table = 0, []
    assert TASKS[3].structured.constraint_state(seq) == constraint.automaton.walk(constraint.start, text), \
        "after a preemption the state is still the one after the whole output"


@functools.cache
def oracle_constraint(tokenizer, vocab_size: int):
    """The reference's constraint for SCHEMA, one for the module: its masks are built once."""
    return ref.structured.make_constraint(SCHEMA, tokenizer, vocab_size)


ORACLE_RUNS: dict[tuple[int, ...], tuple[list[int], str]] = {}  # by prompt: the same model32 in every test


def greedy_oracle(mlx_model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """mlx-lm's model on the request alone, each step's logits masked by the reference's constraint (cached)."""
    if tuple(prompt) not in ORACLE_RUNS:
        ORACLE_RUNS[tuple(prompt)] = greedy_run(mlx_model, tokenizer, prompt, max_tokens)
    return ORACLE_RUNS[tuple(prompt)]


def greedy_run(mlx_model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    constraint = oracle_constraint(tokenizer, mlx_model.args.vocab_size)
    tokens, output, state = list(prompt), [], constraint.start
    for _ in range(max_tokens):
        logits = mlx_model(mx.array([tokens]))[0, -1]
        token = mx.argmax(mx.where(constraint.index.mask(state), logits, -mx.inf)).item()
        if token in tokenizer.eos_token_ids:
            return output, "stop"
        output.append(token)
        tokens.append(token)
        state = constraint.next_state(state, token)
        if constraint.is_complete(state):
            return output, "stop"
    return output, "length"


def run_engine(package, model32, requests, proposer=None, on_engine=None, **config) -> tuple[dict, dict, dict]:
    """Every request through `package`'s engine (day 4.1's, with `proposer`'s guesses, when one is given):
    (tokens by id, finish reason by id, the Sequence by id). `on_engine` is handed the engine first."""
    mlx_model, tokenizer = model32
    model, engine_config = package.qwen2_week3.Qwen2ModelWeek3(mlx_model), package.engine.EngineConfig(
        **{**PLAIN_ENGINE, **config})
    if proposer is None:
        engine = package.engine.LLMEngine(model, tokenizer, engine_config)
    else:
        engine = package.speculative.SpeculativeEngine(model, tokenizer, engine_config, proposer=proposer,
                                                       speculation=package.speculative.SpeculativeConfig(3))
    if on_engine is not None:
        on_engine(engine)
    seqs = {rid: engine.add_request(prompt, sampling, request_id=rid) for rid, prompt, sampling in requests}
    tokens, reasons = {rid: [] for rid in seqs}, {}
    for _ in range(STEP_LIMIT):
        if not engine.has_work():
            return tokens, reasons, seqs
        for output in engine.step():
            if output.token is not None:
                tokens[output.request_id].append(output.token)
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    pytest.fail(f"the engine was still working after {STEP_LIMIT} steps")


MAX_TOKENS = 45  # both constrained requests complete SCHEMA within it (40 and 41 tokens)
PROMPTS = ["Describe an animal as JSON.", "Once upon a time", "The colour of the sky is", "List three numbers:"]


def check_mixed_outputs(package, model32, tokens, reasons, free, bound, options) -> None:
    """A mixed run's outputs: each free request's tokens as when it runs without the constrained ones, each
    constrained one's the oracle's greedy output under the schema (and, where it ended, text the schema accepts)."""
    mlx_model, tokenizer = model32
    alone, _, _ = run_engine(package, model32, free, **options)
    for rid, _, _ in free:
        assert tokens[rid] == alone[rid], f"{rid}: an unconstrained neighbour's tokens changed beside constrained ones"
    for rid, prompt, _ in bound:
        expected, reason = greedy_oracle(mlx_model, tokenizer, prompt, MAX_TOKENS)
        assert (tokens[rid], reasons[rid]) == (expected, reason), \
            f"{rid}: {tokenizer.decode(tokens[rid])!r} ({reasons[rid]}), expected {tokenizer.decode(expected)!r} ({reason})"
        if reason == "stop":
            checked_text(tokenizer.decode(tokens[rid]).encode(), SCHEMA)


def check_constrained_engine(package, model32, on_engine=None, **config) -> None:
    """Constrained requests beside unconstrained ones on a pool small enough to preempt: every constrained
    output equals the masked greedy oracle and meets SCHEMA; the neighbours get what they get alone.
    `on_engine` is handed the engine of the mixed run."""
    mlx_model, tokenizer = model32
    constraint = package.structured.make_constraint(SCHEMA, tokenizer, mlx_model.args.vocab_size)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    free = [(f"free{i}", prompts[i], package.sequence.SamplingParams(max_tokens=20)) for i in (1, 2)]
    bound = [(f"json{i}", prompts[i], package.sequence.SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint))
             for i in (0, 3)]
    options = dict(block_size=4, num_blocks=22, token_budget=32, max_num_seqs=4, **config)
    tokens, reasons, seqs = run_engine(package, model32, free[:1] + bound[:1] + free[1:] + bound[1:],
                                       on_engine=on_engine, **options)
    check_mixed_outputs(package, model32, tokens, reasons, free, bound, options)
    assert any(seqs[rid].num_preemptions for rid, _, _ in bound), "the pool was meant to preempt a constrained request"


def test_task_3_constrained_batch_with_neighbours(model32):
    check_constrained_engine(TASKS[3], model32)


# ---------------------------------------------------------------- Task 3 with the rest of the engine


def test_task_3_constrained_requests_reuse_cached_blocks(model32):
    """With the prefix cache on, the preempted constrained requests come back over their own cached blocks (their
    output's included): the state still follows the whole output, and every token is the oracle's."""
    mlx_model, _ = model32
    hits = []
    check_constrained_engine(TASKS[3], model32, enable_prefix_caching=True, on_engine=hits.append)
    assert hits[0].prefix_cache_hit_rate > 0, "the workload was meant to find blocks in the prefix cache"


def schema_breaker(package, truths: dict, constraint, vocab_size: int, seed: int):
    """A proposer built where `package`'s engine runs (tests/actor_fakes/week4_late.py's SchemaBreaker): for each
    constrained request, its true continuation (`truths`) for a random number of tokens, then a token `constraint`
    (this process's oracle) refuses there, then anything; for a free request, anything."""
    rng, refused = random.Random(seed), {}
    for request_id, truth in truths.items():
        state, refused[request_id] = constraint.start, []
        for token in [*truth, None]:
            options = np.nonzero(~np.array(constraint.index.mask(state)))[0]
            refused[request_id].append([int(t) for t in rng.sample(list(options), 4)])
            if token is not None:
                state = constraint.next_state(state, token)
    return actor_fakes(package, "week4_late").SchemaBreaker(truths, refused, vocab_size, seed)


def guesses_to_verify(calls: list, truths: dict, constraint) -> int:
    """The guesses of a SchemaBreaker's recorded proposals the engine must verify, counted with this process's oracle
    `constraint`: a constrained draft up to its first guess the schema refuses, a free draft whole. (A record that
    lied would have to hold drafts whose oracle count is the number the engine reports, beside outputs that are the
    oracle's.)"""
    count = 0
    for request_id, done, draft in calls:
        if request_id not in truths:
            count += len(draft)
            continue
        state = constraint.start
        for token in truths[request_id][:done]:
            state = constraint.next_state(state, token)
        for token in draft:
            if not constraint.index.mask(state)[token].item():
                break
            count += 1
            state = constraint.next_state(state, token)
    return count


def test_task_3_constraints_with_speculation(model32):
    """Day 4.1's speculation with constrained requests: each proposal is cut before the first guess the mask refuses
    (only the guesses before it are verified), each verify row is masked for the state its guesses reach, so the
    accepted tokens are the constrained greedy ones; free neighbours keep all their guesses and their tokens."""
    mlx_model, tokenizer = model32
    package, vocab_size = TASKS[3], mlx_model.args.vocab_size
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    truths = {f"json{i}": greedy_oracle(mlx_model, tokenizer, prompts[i], MAX_TOKENS)[0] for i in (0, 3)}
    oracle = oracle_constraint(tokenizer, vocab_size)
    proposer = schema_breaker(package, truths, oracle, vocab_size, seed=3)
    constraint = package.structured.make_constraint(SCHEMA, tokenizer, vocab_size)
    free = [(f"free{i}", prompts[i], package.sequence.SamplingParams(max_tokens=12)) for i in (1, 2)]
    bound = [(f"json{i}", prompts[i], package.sequence.SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint))
             for i in (0, 3)]
    options = dict(block_size=4, num_blocks=128, token_budget=32, max_num_seqs=4)
    engines = []
    tokens, reasons, _ = run_engine(package, model32, free + bound, proposer=proposer, on_engine=engines.append,
                                    **options)
    check_mixed_outputs(package, model32, tokens, reasons, free, bound, options)
    engine = engines[0]
    [[calls]] = fetch([proposer], "calls")
    expected = guesses_to_verify(calls, truths, oracle)
    assert engine.speculation.proposed == expected, \
        f"{engine.speculation.proposed} guesses verified; a constrained draft cut before its first refused guess " \
        f"(and free drafts whole) make {expected}"
    assert engine.speculation.accepted > 0, "the true guesses were meant to be accepted"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks left held"


def wide_model(mlx_model):
    """The embedded model's weights read as heads of 32 features (2 query heads, 1 KV head): a quantized KV pool
    needs groups of 32 at least, and the embedded model's heads have 16."""
    from mlx_lm.models import qwen2 as mlx_qwen2

    args = mlx_qwen2.ModelArgs.from_dict({**vars(mlx_model.args), "num_attention_heads": 2, "num_key_value_heads": 1})
    model = mlx_qwen2.Model(args)
    model.update(mlx_model.parameters())
    return model


def masked_greedy_over(mlx_model, tokenizer, prompt: list[int], max_tokens: int, make_cache) -> tuple[list[int], str]:
    """mlx-lm's `mlx_model` on the request alone over the caches `make_cache()` gives, each step masked by the
    reference's constraint for SCHEMA."""
    constraint = oracle_constraint(tokenizer, mlx_model.args.vocab_size)
    cache = [make_cache() for _ in mlx_model.layers]
    feed, output, state = list(prompt), [], constraint.start
    for _ in range(max_tokens):
        logits = mlx_model(mx.array([feed]), cache=cache)[0, -1]
        token = mx.argmax(mx.where(constraint.index.mask(state), logits, -mx.inf)).item()
        if token in tokenizer.eos_token_ids:
            return output, "stop"
        output.append(token)
        feed = [token]
        state = constraint.next_state(state, token)
        if constraint.is_complete(state):
            return output, "stop"
    return output, "length"


def test_task_3_constraints_on_a_quantized_pool(model32):
    """Day 4.2's 8-bit pool, small enough to preempt: each constrained output is mlx-lm's greedy one over a cache
    that stores MLX's own quantize-dequantize of each key and value, masked by the schema."""
    from tests.week3_stack import RoundTripCache

    mlx_model, tokenizer = model32
    wide = wide_model(mlx_model)
    package = TASKS[3]
    constraint = package.structured.make_constraint(SCHEMA, tokenizer, mlx_model.args.vocab_size)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    bound = [(f"json{i}", prompts[i], package.sequence.SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint))
             for i in (0, 3)]
    free = [(f"free{i}", prompts[i], package.sequence.SamplingParams(max_tokens=20)) for i in (1, 2)]
    tokens, reasons, seqs = run_engine(package, (wide, tokenizer), free[:1] + bound[:1] + free[1:] + bound[1:],
                                       kv_bits=8, block_size=4, num_blocks=22, token_budget=32, max_num_seqs=4)
    for rid, prompt, _ in bound:
        expected, reason = masked_greedy_over(wide, tokenizer, prompt, MAX_TOKENS, lambda: RoundTripCache(8))
        assert (tokens[rid], reasons[rid]) == (expected, reason), \
            f"{rid}: {tokenizer.decode(tokens[rid])!r} ({reasons[rid]}), expected {tokenizer.decode(expected)!r} ({reason})"
    assert any(seqs[rid].num_preemptions for rid, _, _ in bound), "the pool was meant to preempt a constrained request"


# ---------------------------------------------------------------- Task 3 against a peer library: llguidance


# No free string: llguidance refuses DEL (0x7F) inside a string, which JSON allows and ours does too. An enum value
# that Qwen2 writes only in tokens that cut a character (dög), optional members, an array, anyOf, a number.
PEER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "count", "tags"], "properties": {
    "kind": {"enum": ["cat", "dög", "🦙"]}, "count": {"type": "integer"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "bé", None]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}
PEER_PROMPTS = ["JSON:", "Describe a pet as JSON."]
PEER_MAX_TOKENS = 40


@functools.cache
def peer_tokenizer(tokenizer, vocab_size: int):
    """(llguidance's tokenizer, {bytes: token} as llguidance decodes each token): built once, a few seconds."""
    import llguidance.hf

    peer = llguidance.hf.from_tokenizer(tokenizer._tokenizer, vocab_size, eos_token=sorted(tokenizer.eos_token_ids))
    return peer, {peer.decode_bytes([t]): t for t in range(vocab_size) if not peer.is_special_token(t)}


def peer_greedy(mlx_model, tokenizer, prompt: list[int]) -> tuple[list[int], str]:
    """mlx-lm's model on the request alone, each step's logits masked by llguidance's matcher for PEER_SCHEMA.

    Where the grammar forces bytes (after `{"` the key `kind":`), llguidance allows only the tokenizer's own
    first token of them (`kind`, not `k`, `ki`, `kin`: a choice it documents); ours allows every token whose
    bytes fit. So each step's peer mask is llguidance's plus the tokens that are a prefix of its forced bytes
    (`compute_ff_bytes`): then both are the mask of one language, and greedy picks the same token.
    """
    import llguidance
    import llguidance.numpy

    vocab_size = mlx_model.args.vocab_size
    peer, by_bytes = peer_tokenizer(tokenizer, vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PEER_SCHEMA, defaults={"whitespace_pattern": " ?"})
    matcher = llguidance.LLMatcher(peer, grammar, log_level=0)
    bits = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    tokens, output = list(prompt), []
    for _ in range(PEER_MAX_TOKENS):
        llguidance.numpy.fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
        forced = matcher.compute_ff_bytes()
        for end in range(1, len(forced) + 1):
            if forced[:end] in by_bytes:
                allowed[by_bytes[forced[:end]]] = True
        logits = mlx_model(mx.array([tokens]))[0, -1]
        token = mx.argmax(mx.where(mx.array(allowed), logits, -mx.inf)).item()
        if token in tokenizer.eos_token_ids:
            return output, "stop"
        assert matcher.consume_token(token), matcher.get_error()
        output.append(token)
        tokens.append(token)
        if matcher.is_stopped():  # nothing may follow: the output is complete
            return output, "stop"
    return output, "length"


def test_task_3_greedy_equals_llguidance(model32):
    """Your engine's greedy constrained output is the peer library's on the same model, schema and prompts."""
    mlx_model, tokenizer = model32
    constraint = TASKS[3].structured.make_constraint(PEER_SCHEMA, tokenizer, mlx_model.args.vocab_size)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PEER_PROMPTS]
    requests = [(f"json{i}", prompt, TASKS[3].sequence.SamplingParams(max_tokens=PEER_MAX_TOKENS, constraint=constraint))
                for i, prompt in enumerate(prompts)]
    tokens, reasons, _ = run_engine(TASKS[3], model32, requests, block_size=8, num_blocks=64, token_budget=64)
    for (rid, prompt, _), text in zip(requests, PEER_PROMPTS):
        expected, reason = peer_greedy(mlx_model, tokenizer, prompt)
        assert (tokens[rid], reasons[rid]) == (expected, reason), \
            f"after {text!r}: yours {tokenizer.decode(tokens[rid])!r} ({reasons[rid]}), llguidance's " \
            f"{tokenizer.decode(expected)!r} ({reason})"
        if reason == "stop":
            checked_text(tokenizer.decode(expected).encode(), PEER_SCHEMA)


# ---------------------------------------------------------------- Task 4: your stack so far


def test_task_4_your_stack_so_far(model32):
    """Your week-3 engine with your day 4.5: preemption and prefix caching, constrained and free requests."""
    check_constrained_engine(STACK, model32, enable_prefix_caching=True)


# ---------------------------------------------------------------- Task 3, served: response_format over HTTP


def app_factory(package, model32):
    """(app factory, tokenizer): `package`'s server on a fresh engine over the embedded model."""
    mlx_model, tokenizer = model32
    model = package.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    # MLX streams are thread-local: materialize the model's lazy arrays here, before the engine thread runs it.
    package.engine.generate(model, tokenizer, [[1]], package.sequence.SamplingParams(max_tokens=1))

    def app():
        engine = package.engine.LLMEngine(model, tokenizer, package.engine.EngineConfig(**PLAIN_ENGINE, token_budget=64,
                                                                                  block_size=8))
        return package.server.create_app(engine, tokenizer, "tiny")
    return app, tokenizer


@pytest.fixture(scope="module")
def served(model32):
    """The day's server with your Task 3 (and the reference's Tasks 1-2)."""
    return app_factory(TASKS[3], model32)


@pytest.fixture(scope="module")
def served_task_1(model32):
    """The day's server with your Task 1 (the schema compiler that refuses, and reads calls), the reference's
    Tasks 2-3."""
    return app_factory(TASKS[1], model32)


def test_task_3_server_parses_with_the_openai_client(served):
    """`beta.chat.completions.parse` with a pydantic model: the answer parses into it, whatever the model says."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    from tests.serve_fakes import running_server

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        kind: Literal["cat", "dög"]
        happy: bool

    app, _ = served
    with running_server(app()) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        answer = client.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "A pet?"}],
                                                    response_format=Pet, max_tokens=200, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", "a bounded schema ends within 200 tokens"
    assert isinstance(choice.message.parsed, Pet)
    assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_task_3_server_json_object_and_refusals(served):
    import httpx

    from tests.serve_fakes import running_server

    app, _ = served
    oracle = ref.structured.json_object_automaton()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
            "temperature": 0}
    with running_server(app()) as url, httpx.Client(timeout=120) as client:
        answer = client.post(f"{url}/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
        assert answer.status_code == 200, answer.text
        content = answer.json()["choices"][0]["message"]["content"]
        if answer.json()["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict)
        else:  # cut by max_tokens: still on the way to an object
            assert oracle.walk(oracle.start, content.encode()) != 0, f"{content!r} left JSON"
        for response_format, named in [
                ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a"}}},
                 "pattern"),
                ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
                ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 10**9}}},
                 "maxLength"),
                ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": [1]}}},
                 "malformed"),
                ({"type": "yaml"}, "response_format")]:
            refused = client.post(f"{url}/v1/chat/completions", json={**chat, "response_format": response_format})
            assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text


# ---------------------------------------------------------------- Task 3, served: tools (a call is a constrained output)


def tool_models():
    """Two small tools as pydantic models: every call of either is a few tokens long (enums and booleans)."""
    from typing import Literal

    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Oslo"]
        celsius: bool

    class Clock(BaseModel):
        zone: Literal["UTC", "CET"]

    return Weather, Clock


def tool_specs():
    import openai

    weather, clock = tool_models()
    return [openai.pydantic_function_tool(weather, name="get_weather"),
            openai.pydantic_function_tool(clock, name="get_time")]


def streamed_call(chunks) -> tuple[dict, str | None, str]:
    """A streamed answer's one call ({id, type, name, arguments}), its finish reason and its content, checking the
    deltas' shape as OpenAI streams a call: id, type and name once, in the call's first delta; then arguments."""
    call, finish_reason, content = None, None, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        for part in delta.tool_calls or []:
            assert part.index == 0, "one call per answer: index 0"
            if call is None:
                assert part.id and part.type == "function" and part.function.name, f"a call's first delta: {part}"
                call = {"id": part.id, "type": part.type, "name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None, f"id and name come once, first: {part}"
            call["arguments"] += part.function.arguments or ""
    return call, finish_reason, content


def test_task_3_server_tool_calls_with_the_openai_client(served):
    """A named function among two tools, whole and streamed, read by the official client; then the tool's result
    sent back, and an answer with tool_choice "none" (the same as without tools)."""
    from openai import OpenAI

    from tests.serve_fakes import running_server

    weather, _ = tool_models()
    app, tokenizer = served
    tools = tool_specs()
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with running_server(app()) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        request = dict(model="tiny", messages=messages, tools=tools, max_tokens=60, temperature=0)
        # One function named among two, whole and streamed: the same greedy call. (LangChain's test below asks for
        # "required" over that one tool: the same schema, so its masks are built once.)
        answer = client.chat.completions.parse(**request, tool_choice=named)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", "a complete call ends with 'tool_calls'"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1, choice.message
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id and call.function.name == "get_weather", call
        assert isinstance(call.function.arguments, str), "arguments are a JSON text, not an object"
        assert weather.model_validate_json(call.function.arguments).model_dump() \
            == call.function.parsed_arguments.model_dump(), "the client parses the arguments into the tool's model"
        streamed, finish_reason, content = streamed_call(
            client.chat.completions.create(**request, tool_choice=named, stream=True))
        assert (streamed["name"], streamed["arguments"], finish_reason, content) \
            == (call.function.name, call.function.arguments, "tool_calls", ""), "streamed: the same call"
        described = httpx_tokenize(url, messages, tools)
        # The round trip: the client's own message of the call, the tool's result, then an answer in text.
        sent = messages + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "It is 18 degrees."}]
        final = client.chat.completions.create(**{**request, "messages": sent, "max_tokens": 4}, tool_choice="none")
        plain = client.chat.completions.create(**{**request, "messages": sent, "max_tokens": 4, "tools": None})
        prompt = httpx_tokenize(url, messages + [choice.message.model_dump(mode="json", include={"role", "tool_calls"}), sent[-1]])
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content == plain.choices[0].message.content, \
        "tool_choice 'none' answers as if there were no tools"
    assert final.usage.prompt_tokens == len(prompt), "with tool_choice 'none' the prompt does not list the tools"
    assert answer.usage.prompt_tokens == len(described), "the prompt describes the tools (as /tokenize with them)"
    listed = tokenizer.decode(described)
    assert all(json.dumps(tool["function"]["parameters"]) in listed for tool in tools), \
        f"every tool's parameters are in the prompt: {listed!r}"
    text = tokenizer.decode(prompt)
    assert "It is 18 degrees." in text and call.function.arguments in text, f"the call and its result: {text!r}"


def httpx_tokenize(url: str, messages: list, tools: list | None = None) -> list[int]:
    """The server's prompt for `messages` (and `tools`), from /tokenize."""
    import httpx

    response = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages, "tools": tools}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_task_3_server_tools_with_langchain(served):
    """LangChain's `bind_tools` (invoke and stream), `with_structured_output` by function calling and by JSON
    schema, and a ToolMessage sent back. The tool is given as OpenAI's dict (LangChain passes it on as it is):
    "required" over it is the schema the openai client's test compiled."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from tests.serve_fakes import running_server

    weather, _ = tool_models()
    app, _ = served
    question = [HumanMessage("Weather in Paris?")]
    with running_server(app()) as url:
        chat = ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="unused", temperature=0, max_retries=0,
                          timeout=120, max_completion_tokens=60)
        tool = tool_specs()[0]
        bound = chat.bind_tools([tool], tool_choice="required")
        message = bound.invoke(question)
        assert [call["name"] for call in message.tool_calls] == ["get_weather"] and not message.invalid_tool_calls
        weather.model_validate(message.tool_calls[0]["args"])
        assert message.response_metadata["finish_reason"] == "tool_calls"
        streamed = None
        for chunk in bound.stream(question):
            streamed = chunk if streamed is None else streamed + chunk
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", message.tool_calls[0]["args"])]
        weather.model_validate(chat.with_structured_output(tool, method="function_calling").invoke(question))
        assert isinstance(chat.with_structured_output(weather, method="json_schema").invoke(question), weather)
        result = ToolMessage("It is 18 degrees.", tool_call_id=message.tool_calls[0]["id"])
        answer = chat.invoke(question + [message, result], max_completion_tokens=3)
        assert isinstance(answer.content, str) and not answer.tool_calls


def test_task_1_server_tool_refusals(served_task_1, vocab):
    """Tools and tool messages the server cannot serve: a 400 naming the field (and the schema keyword)."""
    import httpx

    from tests.serve_fakes import running_server

    app, _ = served_task_1
    tokenizer, size, _, _ = vocab
    tool_reader("required", tokenizer, size)  # the tools it serves compile (a refusal is not "refuse everything")
    tools = tool_specs()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": tools}
    patterned = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}]
    cases = [
        ({"tools": patterned, "tool_choice": "required"}, "tools", "pattern"),
        ({"tools": patterned}, "tools", "pattern"),  # "auto" reads calls with the same automaton: refused too
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice", "nowhere"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tools"),
        ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
        ({"messages": [{"role": "tool", "content": "18"}]}, "messages", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages", "tool_call_id"),
        ({"messages": [{"role": "user", "tool_calls": []}]}, "messages", "tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions", "functions"),
    ]
    with running_server(app()) as url, httpx.Client(timeout=120) as client:
        for change, param, named in cases:
            refused = client.post(f"{url}/v1/chat/completions", json={**chat, **change})
            error = refused.json().get("error", {})
            assert refused.status_code == 400 and error["param"] == param and named in error["message"], \
                (change, refused.text)


def tool_reader(tool_choice, tokenizer, vocab_size: int):
    """A fresh `CallReader` of the day's server protocol for `tool_choice` over `tool_specs()`, reading calls with
    your Task 1's automaton (the rest is the reference's)."""
    # As the server reads a body: from its JSON text (which also crosses to a sandboxed submission as it is).
    body = TASKS[1].openai_api.ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "tools": tool_specs(), "tool_choice": tool_choice}))
    return TASKS[1].openai_api.CallReader(TASKS[1].openai_api.tool_calls_for(body, tokenizer, vocab_size), "call_1")


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": false}}'
AUTO_READS = [  # (text the model wrote, finish reason): is it a call? (tool_choice "auto")
    (CALL, "stop", True),
    ("\n" + CALL + "\n", "stop", True),
    ('{"name":"get_time","arguments":{"zone":"CET"}}', "stop", True),
    ("It is sunny.", "stop", False),
    (CALL.replace("Oslo", "Rome"), "stop", False),  # not an argument the schema allows
    (CALL.replace("get_weather", "get_rain"), "stop", False),
    (CALL + " Done.", "stop", False),
    (CALL[:30], "length", False),
    ("", "stop", False),
]


def test_task_1_auto_reads_a_call_out_of_the_text(vocab):
    """tool_choice "auto": the answer is a call exactly when the call's automaton accepts the whole text; streamed,
    nothing goes out while it may still be a call, and the pieces add up to the whole answer whatever the cuts."""
    tokenizer, size, _, _ = vocab
    rng = random.Random(5)
    for text, reason, is_call in AUTO_READS:
        message, finish_reason = tool_reader("auto", tokenizer, size).answer(text, reason)
        if is_call:
            call = message["tool_calls"][0]
            assert finish_reason == "tool_calls" and message["content"] is None, (text, message)
            assert json.loads(call["function"]["arguments"]) == json.loads(text)["arguments"], (text, message)
        else:
            assert (message, finish_reason) == ({"role": "assistant", "content": text}, reason), text
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1))) if len(text) > 1 else []
        reader = tool_reader("auto", tokenizer, size)
        deltas = [reader.add(text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)])]
        last, streamed_reason = reader.finish(reason)
        assert streamed_reason == finish_reason, text
        if is_call:
            assert deltas == [{}] * len(deltas), f"{text!r}: a call that may still be text is held back"
            assert last == {"tool_calls": [{**message["tool_calls"][0], "index": 0}]}, (text, last)
        else:
            assert "".join(d.get("content", "") for d in deltas + [last]) == text, text


def test_task_1_forced_call_streams_its_arguments(vocab):
    """A forced call ("required"): its head (id, type, name) goes out once the name is written, then the arguments
    as they come, holding back only a "}" that may close the call; cut short, the arguments as far as they got."""
    tokenizer, size, _, _ = vocab
    text = '{"name": "get_time", "arguments": {"zone": "UTC"} }'
    reader = tool_reader("required", tokenizer, size)
    deltas = [reader.add(text[i:i + 1]) for i in range(len(text))]
    last, finish_reason = reader.finish("stop")
    parts = [d["tool_calls"][0] for d in deltas + [last] if d]
    assert parts[0] == {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_time",
                                                                                     "arguments": "{"}}, parts[0]
    assert all(set(part) == {"index", "function"} and set(part["function"]) == {"arguments"} for part in parts[1:])
    assert "".join(part["function"]["arguments"] for part in parts) == '{"zone": "UTC"}'
    assert finish_reason == "tool_calls"
    message, finish_reason = tool_reader("required", tokenizer, size).answer(text[:-8], "length")
    assert finish_reason == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"zone": '
    named = {"type": "function", "function": {"name": "get_weather"}}
    message, finish_reason = tool_reader(named, tokenizer, size).answer(text, "stop")
    assert (message, finish_reason) == ({"role": "assistant", "content": text}, "stop"), \
        "a named function's schema allows only its own calls"
