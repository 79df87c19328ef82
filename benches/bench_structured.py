"""Day 4.5's lab: structured outputs on a trained model, against free text, mlx-lm and llguidance.

    pdm run bench-structured                      # SmolLM2-135M once fetched: 20 schemas x 5 prompts
    pdm run bench-structured --quick              # 4 schemas x 2 prompts, fewer tokens
    pdm run bench-structured --solution student   # your src/tiny_llm (the reference where unwritten)
    pdm run bench-structured --model embedded     # the tiny embedded model (seconds; its text means nothing)

Three parts, one run, the same model and tokenizer throughout:

1. Valid outputs. Each schema asked with each prompt, greedy, five ways, the share of answers that parse
   and meet the schema (checked with `jsonschema`); each way's requests all go to one engine at once:
   - as `response_format` (the schema also written into the prompt, as a client without constrained
     decoding would): through week 3's engine with the schema's constraint (ours), through the same
     engine without it (free), and through mlx-lm's `BatchGenerator` on the same weights, which is what
     `mlx_lm.server` answers: it ignores `response_format`. Read strictly (the whole text is the JSON
     value) and leniently (the first JSON value in the text, as a tolerant client digs one out);
   - as a tool call (the schema as the arguments of the one tool, "required"): our server's way (the
     tools in the system message, decoding constrained by the call's schema, the text read back by
     `CallReader` into OpenAI's `tool_calls`), and `mlx_lm.server`'s: free text, each
     `<tool_call>...</tool_call>` span read by its `json_tools` parser through its own `TextStateMachine`
     and `ToolCallFormatter` (the format Qwen2.5's and Hermes' templates ask for; SmolLM2's template has
     no tools, so `mlx_lm.server` would not even show them to the model: the prompt here writes them into
     the system message in that format, the best case for it). Valid: a call of the right function whose
     arguments meet the schema.
   mlx-lm runs on the dequantized weights, as ours does: MLX's CPU quantized matmul is some 40x slower than
   float32 BLAS at batch shapes (2-3 against ~100 GFLOPS here), which made this part take hours.
2. Masks. The constrained outputs of part 1 replayed token by token through our `TokenIndex` (a fresh
   one per schema: cold, then its cache) and through llguidance (the peer: Rust, its own trie and
   lexer) on the same vocabulary, in the same run: index build time (ours: the tokenizer's trie once,
   then each schema's automaton; llguidance: its tokenizer once, then each schema's grammar), mask time
   per step (ours the first time a state is met, and over every step; llguidance's every step), whether
   the two masks agree token for token (llguidance's widened by the non-canonical prefixes of the bytes it
   forces, and DEL left out: its two documented differences), and the states a lazy index met against all.
3. Throughput. A batch of constrained requests against the same batch free, decode tokens/s while the
   whole batch decodes (masks cold: a fresh constraint per request; warm: the same ones again).

Results: benches/results/structured.json (--out) and the plot beside it (structured_summary.png).
Timings on a shared machine move with its load (the machine line says how busy it was at the start).
"""

from course import fast_mlx

fast_mlx.setup()

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benches import lab, runner  # noqa: E402
from benches.engines import MlxLm, Week3  # noqa: E402
from benches.workloads import Arrival  # noqa: E402
from course.models import default_model  # noqa: E402
from course.user_errors import user_error  # noqa: E402

PROG = "pdm run bench-structured"


def text(longest: int) -> dict:
    return {"type": "string", "maxLength": longest}


def record(properties: dict, required=None) -> dict:
    """An object of these properties, all required unless named otherwise, nothing else."""
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


INTEGER, NUMBER, BOOLEAN = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# Twenty schemas of the served subset, each with what it describes (the prompts' subject).
SCHEMAS = {
    "a person": record({"name": text(30), "age": INTEGER, "email": text(40)}, ["name", "age"]),
    "a book": record({"title": text(40), "author": text(30), "year": INTEGER,
                      "genres": {"type": "array", "items": {"enum": ["fiction", "science", "history", "poetry"]},
                                 "maxItems": 3}}, ["title", "author", "year"]),
    "today's weather in a city": record({"city": text(20), "temperature_c": NUMBER,
                                         "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                                         "humidity": INTEGER}),
    "a product in a shop": record({"name": text(30), "price": NUMBER, "in_stock": BOOLEAN,
                                   "tags": {"type": "array", "items": text(12), "maxItems": 4}},
                                  ["name", "price", "in_stock"]),
    "a concert": record({"title": text(40), "date": text(10), "attendees": INTEGER, "sold_out": BOOLEAN}),
    "a recipe": record({"name": text(30), "servings": INTEGER, "vegetarian": BOOLEAN,
                        "ingredients": {"type": "array", "items": text(25), "minItems": 1, "maxItems": 5}}),
    "a postal address": record({"street": text(40), "city": text(25), "postcode": text(10), "country": text(25)}),
    "a movie": record({"title": text(40), "year": INTEGER, "rating": NUMBER, "director": text(30)}),
    "a to-do item": record({"task": text(50), "priority": {"enum": ["low", "medium", "high"]}, "done": BOOLEAN,
                            "due": {"type": ["string", "null"], "maxLength": 10}}),
    "a city": record({"name": text(30), "country": text(30), "population": INTEGER, "capital": BOOLEAN}),
    "an animal": record({"species": text(30), "legs": INTEGER, "endangered": BOOLEAN,
                         "habitat": {"enum": ["forest", "ocean", "desert", "grassland", "arctic"]}}),
    "a car": record({"make": text(20), "model": text(20), "year": INTEGER, "electric": BOOLEAN, "price_usd": NUMBER}),
    "a song": record({"title": text(40), "artist": text(30), "duration_s": INTEGER, "explicit": BOOLEAN}),
    "a company": {**record({"name": text(30), "founded": INTEGER, "public": BOOLEAN,
                            "headquarters": {"$ref": "#/$defs/place"}}),
                  "$defs": {"place": record({"city": text(25), "country": text(25)})}},
    "a flight": record({"flight_number": text(8), "origin": {"type": "string", "minLength": 3, "maxLength": 3},
                        "destination": {"type": "string", "minLength": 3, "maxLength": 3}, "seats_left": INTEGER}),
    "an invoice": record({"customer": text(30), "paid": BOOLEAN, "lines": {
        "type": "array", "items": record({"item": text(20), "quantity": INTEGER, "unit_price": NUMBER}),
        "minItems": 1, "maxItems": 3}}),
    "a planet": record({"name": text(20), "moons": INTEGER, "has_rings": BOOLEAN,
                        "kind": {"enum": ["rocky", "gas giant", "ice giant", "dwarf"]}}),
    "a football match": record({"home_team": text(25), "away_team": text(25), "home_score": INTEGER,
                                "away_score": INTEGER, "status": {"enum": ["scheduled", "live", "finished"]}}),
    "the sentiment of a product review": record({"review": text(60), "confidence": NUMBER,
                                                 "sentiment": {"enum": ["positive", "negative", "neutral"]}}),
    "a palette of colours": {"type": "array", "items": record({"name": text(15), "hex": text(7)}),
                             "minItems": 2, "maxItems": 4},
}
PROMPTS = ["Describe {}.", "Give an example of {}.", "Invent {} for a story.", "Tell me about {} you know well.",
           "Make up {} with realistic details."]
MODES = ["constrained (ours)", "free (ours)", "mlx_lm.server (ignores it)", "tool call, forced (ours)",
         "tool call, mlx_lm.server (json_tools)"]
MLX_LM_MODES = MODES[2], MODES[4]
VALID_COLUMNS = [lab.Column("mode", "mode", "{}"), lab.Column("parses", "parses", "{:.0%}"),
                 lab.Column("valid", "valid", "{:.0%}"), lab.Column("valid, lenient", "valid_lenient", "{:.0%}"),
                 lab.Column("finished", "finished", "{:.0%}"), lab.Column("cut off", "cut_off", "{}"),
                 lab.Column("tokens mean", "tokens_mean", "{:.0f}"), lab.Column("tokens max", "tokens_max", "{}")]
MASK_COLUMNS = [lab.Column("schema", "schema", "{}"), lab.Column("build ms", "ours_build_ms", "{:.1f}"),
                lab.Column("llg build ms", "llg_build_ms", "{:.1f}"),
                lab.Column("first mask ms", "ours_first_ms", "{:.2f}"), lab.Column("step ms", "ours_step_ms", "{:.3f}"),
                lab.Column("llg step ms", "llg_step_ms", "{:.3f}"), lab.Column("masks agree", "agree", "{:.0%}"),
                lab.Column("states met", "states_met", "{}"), lab.Column("states all", "states_all", "{}")]
THROUGHPUT_COLUMNS = [lab.Column("batch", "label", "{}"), lab.Column("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
                      lab.Column("vs free", "vs_free", "{:.2f}x"), lab.Column("tokens", "tokens", "{}")]
THROUGHPUT_GOAL = 0.9
# Part 1 sends every request of a mode to one engine at once; this many decode together (ours and mlx-lm's). On
# the 2-core CPU, 32 rows cost about half the CPU per token of 16 (the weights are read once per step for more
# rows); the KV pool holds 40 blocks of 16 tokens per row: a tool prompt and a whole answer, with room.
ENGINE_BATCH = 32
# Enough for every constrained answer to finish: the longest measured (greedy, SmolLM2, the six longest schemas x
# 5 prompts) were 93 tokens as response_format and 135 as a forced call (an invoice of three lines). Free text
# mostly runs to the limit, so the limit sets most of the run's time: 200 took about 20% longer for nothing.
MAX_TOKENS = 160
FULL_INDEX_LIMIT = 5000  # automaton states explored to size a full index; more is reported as "more"


def build_parser():
    parser = lab.parser(PROG, __doc__, out="structured.json")
    parser.set_defaults(model=default_model())
    lab.options(parser, schemas=(len(SCHEMAS), f"schemas, 1 .. {len(SCHEMAS)}"),
                prompts=(len(PROMPTS), f"prompts per schema, 1 .. {len(PROMPTS)}"),
                max_tokens=(MAX_TOKENS, "output tokens per request at most"),
                batch=(8, "requests in the throughput batch"),
                batch_tokens=(48, "output tokens per request of the throughput batch"))
    parser.add_argument("--skip-mlx-lm", action="store_true",
                        help="leave mlx-lm's two modes out of part 1 (its free greedy text is ours without the "
                             "constraint: a saving on a slow machine)")
    return parser


def chat(tokenizer, request: str, schema: dict) -> list[int]:
    """The prompt: the schema to follow, then the request (so one schema's prompts share a prefix for the prefix
    cache), in the model's chat template where it has one."""
    content = f"Answer with JSON only, following this JSON schema:\n{json.dumps(schema)}\n\n{request}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return tokenizer.encode(content, add_special_tokens=False)


class Constrained(Week3):
    """Week 3's engine, each request with its own constraint (None: free text)."""

    def __init__(self, selection, model, tokenizer, constraints: dict, **config):
        super().__init__(selection, model, tokenizer, **config)
        self.constraints = constraints

    def add(self, idx, arrival):
        sampling = self.sampling(max_tokens=arrival.max_tokens, constraint=self.constraints.get(idx))
        self.engine.add_request(arrival.prompt, sampling, request_id=idx)


# ---------------------------------------------------------------- part 1: valid outputs


def first_json_value(text: str):
    """The first JSON value that starts at a '{' or '[' of `text` (ValueError if none): a tolerant client's reading."""
    decoder = json.JSONDecoder()
    for at, char in enumerate(text):
        if char in "{[":
            try:
                return decoder.raw_decode(text, at)[0]
            except ValueError:
                continue
    raise ValueError("no JSON value in the text")


def tool_name(subject: str) -> str:
    """The one tool's name for a schema: `save_a_person`."""
    return "save_" + re.sub(r"[^a-z0-9]+", "_", subject.lower()).strip("_")


def tool_of(subject: str) -> dict:
    return {"type": "function", "function": {"name": tool_name(subject), "description": f"Save {subject}.",
                                             "parameters": SCHEMAS[subject]}}


def hermes_system(tool: dict) -> str:
    """The system message of a template with Hermes-style tools (Qwen2.5's, in our words): the tool's JSON
    inside <tools> tags, and a call to be written as {"name": ..., "arguments": ...} inside <tool_call> tags."""
    return ("You may call a function to answer. Its signature, inside <tools></tools> tags:\n<tools>\n"
            f"{json.dumps(tool['function'])}\n</tools>\n\nTo call it, write a JSON object with the function's name "
            'and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, '
            '"arguments": <arguments as a JSON object>}\n</tool_call>')


def mlx_lm_server_calls(text: str, tool: dict) -> list[dict]:
    """The `tool_calls` mlx_lm.server answers for `text` with its json_tools parser: its own text state machine
    splits the <tool_call> spans out (one cut short at the end still counts), its own formatter parses each
    (a span that does not parse is dropped with the warning "tool text was likely truncated")."""
    import logging

    from mlx_lm.generate import TextStateMachine
    from mlx_lm.server import ToolCallFormatter
    from mlx_lm.tool_parsers import json_tools

    machine = TextStateMachine({"normal": [(json_tools.tool_call_start, "tool")],
                                "tool": [(json_tools.tool_call_end, "normal")]})
    state, segments = TextStateMachine.split(machine.make_state("normal"), text)
    state, rest, current = TextStateMachine.flush(state)
    spans, open_span, previous = [], "", "normal"
    for name, piece in segments + [(current, rest)]:
        if name == "tool":
            open_span += piece
        elif previous == "tool":
            spans.append(open_span)
            open_span = ""
        previous = name
    if previous == "tool" and open_span:
        spans.append(open_span)
    logging.getLogger().setLevel(logging.ERROR)  # its warning per dropped span: counted here instead
    return ToolCallFormatter(json_tools.parse_tool_call, [tool])(spans)


def call_verdict(calls: list[dict], subject: str, finished: bool) -> dict:
    """Whether a client got a call of the subject's tool whose arguments meet its schema (the first call read)."""
    import jsonschema

    parses, valid = bool(calls), False
    if calls and calls[0]["function"]["name"] == tool_name(subject):
        try:
            valid = jsonschema.Draft202012Validator(SCHEMAS[subject]).is_valid(
                json.loads(calls[0]["function"]["arguments"]))
        except ValueError:
            valid = False
    return {"parses": parses, "valid": valid, "valid_lenient": valid, "finished": finished}


def verdict(text: str, schema: dict, finished: bool) -> dict:
    """Whether `text` parses and meets `schema`, strictly (the whole text) and leniently (the first JSON value in it)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    try:
        value = json.loads(text)
        parses, valid = True, validator.is_valid(value)
    except ValueError:
        parses, valid = False, False
    try:
        valid_lenient = validator.is_valid(first_json_value(text))
    except ValueError:
        valid_lenient = False
    return {"parses": parses, "valid": valid, "valid_lenient": valid_lenient, "finished": finished}


def tool_request(openai_api, subject: str, request: str):
    """Our server's reading of a chat request with the subject's tool, tool_choice "required"."""
    return openai_api.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": request}], "tools": [tool_of(subject)], "tool_choice": "required"})


def asks(bench, cases: list, constraints: dict, args) -> dict:
    """Each mode of part 1: (how to make its engine, its arrivals, how a client reads a case's text)."""
    tokenizer, selection, api = bench.tokenizer, bench.selection, bench.selection.openai_api
    vocab_size = bench.mlx_model.args.vocab_size
    config = dict(token_budget=512, max_num_seqs=ENGINE_BATCH, block_size=16, num_blocks=ENGINE_BATCH * 40,
                  enable_prefix_caching=True)

    def arrivals(prompts):
        return [Arrival(name, prompt, args.max_tokens) for (name, _), prompt in zip(cases, prompts)]

    formatted = arrivals([chat(tokenizer, prompt.format(name), SCHEMAS[name]) for name, prompt in cases])
    bodies = [tool_request(api, name, prompt.format(name)) for name, prompt in cases]
    tools = {i: api.tool_calls_for(body, tokenizer, vocab_size) for i, body in enumerate(bodies)}
    forced = arrivals([api.chat_prompt_ids(tokenizer, body.messages, tools=body.prompt_tools()) for body in bodies])
    hermes = arrivals([tokenizer.apply_chat_template([{"role": "system", "content": hermes_system(tool_of(name))},
                                                      {"role": "user", "content": prompt.format(name)}],
                                                     add_generation_prompt=True) for name, prompt in cases])

    def ours(engine_constraints):
        return lambda: Constrained(selection, bench.week3_model(), tokenizer, engine_constraints, **config)

    def as_text(i, text, finished):
        return verdict(text, SCHEMAS[cases[i][0]], finished)

    def our_call(i, text, finished):
        message, _ = api.CallReader(tools[i], f"call_{i}").answer(text, "stop" if finished else "length")
        return call_verdict(message.get("tool_calls") or [], cases[i][0], finished)

    def their_call(i, text, finished):
        return call_verdict(mlx_lm_server_calls(text, tool_of(cases[i][0])), cases[i][0], finished)

    mlx_lm = lambda: MlxLm(bench.mlx_model, tokenizer, batch_size=ENGINE_BATCH)  # noqa: E731
    return {MODES[0]: (ours(constraints), formatted, as_text), MODES[1]: (ours({}), formatted, as_text),
            MODES[2]: (mlx_lm, formatted, as_text),
            MODES[3]: (ours({i: calls.constraint for i, calls in tools.items()}), forced, our_call),
            MODES[4]: (mlx_lm, hermes, their_call)}


def validity(bench, cases: list, constraints: dict, args) -> tuple[dict, dict, dict]:
    """Every case through each mode: per mode, its rows' verdicts and texts, its runs' outputs, its wall time."""
    tokenizer = bench.tokenizer
    modes = asks(bench, cases, constraints, args)
    if args.skip_mlx_lm:
        modes = {mode: ask for mode, ask in modes.items() if mode not in MLX_LM_MODES}
    results, outputs, seconds = {}, {}, {}
    for mode, (make, arrivals, read) in lab.progress(list(modes.items()), "valid outputs"):
        run = runner.run(make(), arrivals, mode, max_steps=20 * args.max_tokens * len(arrivals))
        rows = []
        for idx, (name, prompt) in enumerate(cases):
            tokens = run.outputs[idx]
            text_out = tokenizer.decode(tokens)
            finished = len(tokens) < args.max_tokens  # ended by EOS or a complete constrained output
            rows.append({"schema": name, "prompt": prompt, "text": text_out, "tokens": len(tokens),
                         **read(idx, text_out, finished)})
        results[mode], outputs[mode] = rows, run.outputs
        seconds[mode] = run.wall_s
        print(f"{mode}: {run.wall_s:.0f} s, {sum(map(len, run.outputs.values()))} tokens")
    return results, outputs, seconds


def validity_summary(results: dict) -> list[dict]:
    rows = []
    for mode, cases in results.items():
        rows.append({"mode": mode, "cases": len(cases), "tokens_mean": statistics.mean(c["tokens"] for c in cases),
                     "tokens_max": max(c["tokens"] for c in cases), "cut_off": sum(not c["finished"] for c in cases),
                     **{key: sum(c[key] for c in cases) / len(cases)
                        for key in ("parses", "valid", "valid_lenient", "finished")}})
    return rows


# ---------------------------------------------------------------- part 2: masks against llguidance


def timed(function, *args):
    """(result, seconds) of one call."""
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def peer_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the tokenizer (built once, like our trie), or None with the reason when it is missing."""
    try:
        import llguidance.hf
    except ImportError:
        return None
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the Hugging Face one
    return llguidance.hf.from_tokenizer(hf, vocab_size, eos_token=sorted(tokenizer.eos_token_ids))


def peer_token_bytes(llg_tokenizer, vocab_size: int) -> dict[bytes, int]:
    """{bytes: token} as llguidance decodes each ordinary token."""
    return {llg_tokenizer.decode_bytes([t]): t for t in range(vocab_size) if not llg_tokenizer.is_special_token(t)}


def same_language(ours: np.ndarray, peer: np.ndarray, del_tokens: np.ndarray) -> bool:
    """Whether two masks agree on every token without a DEL byte (0x7F: JSON allows it in a string, as ours does;
    llguidance refuses it)."""
    return np.array_equal(ours[~del_tokens], peer[~del_tokens])


def peer_grammar(schema: dict) -> str:
    """llguidance's grammar for `schema`, with whitespace as ours: at most one space between JSON tokens."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": " ?"})


def peer_mask(matcher, vocab_size: int) -> np.ndarray:
    """The matcher's allowed tokens as a bool array (llguidance fills a bitmask, 32 tokens to an int32)."""
    import llguidance.numpy

    bits = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def replay_ours(structured, tokenizer, vocab_size: int, schema: dict, outputs: list[list[int]]) -> dict:
    """Our constraint built for `schema`, then its mask before every token of each output: times and masks."""
    constraint, build_s = timed(structured.make_constraint, schema, tokenizer, vocab_size)
    first, steps, masks = [], [], []
    for tokens in outputs:
        state = constraint.start
        for token in tokens:
            cold = state not in constraint.index.masks
            mask, seconds = timed(constraint.index.mask, state)
            if cold:
                first.append(seconds)
            steps.append(seconds)
            masks.append(np.array(mask))
            state = constraint.next_state(state, token)
    try:
        states_all = len(constraint.automaton.explore(FULL_INDEX_LIMIT)[1])
    except ValueError:
        states_all = None
    return {"build_s": build_s, "first": first, "steps": steps, "masks": masks,
            "states_met": len(constraint.index.masks), "states_all": states_all}


def replay_peer(llg_tokenizer, by_bytes: dict, vocab_size: int, schema: dict, outputs: list[list[int]]) -> dict:
    """llguidance's matcher for `schema` on the same outputs: build time, each step's time and mask.

    Where the grammar forces bytes (a key, the rest of an enum value), llguidance allows only the tokenizer's
    own first token of them (`name`, not `n` or `na`: its documented choice), where ours allows every token whose
    bytes fit. Each step's `masks` entry adds the tokens that are a prefix of its forced bytes (not timed): the
    mask of the language, to compare with ours.
    """
    import llguidance

    grammar, build_s = timed(peer_grammar, schema)
    steps, masks, refused = [], [], 0
    for tokens in outputs:
        matcher, seconds = timed(lambda: llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0))
        build_s += seconds / len(outputs)  # a matcher per request: its share of the build
        for token in tokens:
            mask, seconds = timed(peer_mask, matcher, vocab_size)
            steps.append(seconds)
            forced = matcher.compute_ff_bytes()
            mask[[by_bytes[forced[:end]] for end in range(1, len(forced) + 1) if forced[:end] in by_bytes]] = True
            masks.append(mask)
            if not matcher.consume_token(token):
                refused += 1
                break
    return {"build_s": build_s, "steps": steps, "masks": masks, "refused": refused}


def mask_figures(bench, cases: list, constrained_outputs: dict) -> dict:
    """Part 2: per schema, our index and masks against llguidance's on the constrained outputs of part 1."""
    structured, tokenizer = bench.selection.structured, bench.tokenizer
    vocab_size = bench.mlx_model.args.vocab_size
    structured.tokenizer_vocabulary.cache_clear()
    _, trie_s = timed(structured.tokenizer_vocabulary, tokenizer, vocab_size)
    llg_tokenizer, llg_tokenizer_s = timed(peer_tokenizer, tokenizer, vocab_size)
    if llg_tokenizer is None:
        print("llguidance is not installed (it is in the dev group: `pdm install`): ours alone")
    else:
        by_bytes = peer_token_bytes(llg_tokenizer, vocab_size)
        del_tokens = np.zeros(vocab_size, dtype=bool)
        del_tokens[[token for data, token in by_bytes.items() if 0x7F in data]] = True
    rows = []
    for name in lab.progress(list(dict.fromkeys(name for name, _ in cases)), "masks"):
        outputs = [constrained_outputs[i] for i, (n, _) in enumerate(cases) if n == name]
        ours = replay_ours(structured, tokenizer, vocab_size, SCHEMAS[name], outputs)
        row = {"schema": name, "steps": len(ours["steps"]), "ours_build_ms": 1000 * ours["build_s"],
               "ours_first_ms": 1000 * statistics.mean(ours["first"]) if ours["first"] else None,
               "ours_first_max_ms": 1000 * max(ours["first"], default=0),
               "ours_step_ms": 1000 * statistics.mean(ours["steps"]) if ours["steps"] else None,
               "states_met": ours["states_met"], "states_all": ours["states_all"] or f">{FULL_INDEX_LIMIT}"}
        if llg_tokenizer is not None:
            peer = replay_peer(llg_tokenizer, by_bytes, vocab_size, SCHEMAS[name], outputs)
            agree = [same_language(a, b, del_tokens) for a, b in zip(ours["masks"], peer["masks"])]
            row.update(llg_build_ms=1000 * peer["build_s"], refused_by_llg=peer["refused"],
                       llg_step_ms=1000 * statistics.mean(peer["steps"]) if peer["steps"] else None,
                       llg_step_max_ms=1000 * max(peer["steps"], default=0),
                       agree=sum(agree) / len(agree) if agree else None)
        rows.append(row)
    return {"tokenizer_index_s": {"ours": trie_s, "llguidance": llg_tokenizer_s if llg_tokenizer else None},
            "vocab_size": vocab_size, "mask_bytes": vocab_size, "schemas": rows}


# ---------------------------------------------------------------- part 3: throughput


def decode_rate(run) -> tuple[float | None, int]:
    """(tokens/s, tokens) from the moment every request has its first token until the first one finishes: the
    stretch where the whole batch decodes, so requests that end early (a complete output) do not shrink it."""
    timelines = [r for r in run.metrics.requests.values() if r.token_times]
    start = max(r.token_times[0] for r in timelines)
    end = min(r.token_times[-1] for r in timelines)
    tokens = sum(1 for r in timelines for t in r.token_times if start < t <= end)
    return (tokens / (end - start) if end > start else None), tokens


def throughput(bench, args) -> list[dict]:
    """Part 3: the first `batch` schemas' first prompt, as one batch: free, constrained cold, constrained warm."""
    tokenizer, selection, structured = bench.tokenizer, bench.selection, bench.selection.structured
    vocab_size = bench.mlx_model.args.vocab_size
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.batch)]
    arrivals = [Arrival(name, chat(tokenizer, PROMPTS[0].format(name), SCHEMAS[name]), args.batch_tokens)
                for name in names]
    config = dict(token_budget=512, max_num_seqs=args.batch, block_size=16, num_blocks=400)
    model = bench.week3_model()
    runner.run(Constrained(selection, model, tokenizer, {}, **config), arrivals[:1], "warm-up")

    def fresh():
        return {i: structured.make_constraint(SCHEMAS[name], tokenizer, vocab_size) for i, name in enumerate(names)}

    warm = fresh()
    plans = [("free", {}), ("constrained, masks cold", None), ("constrained, masks warm", warm)] * 2
    rates: dict[str, list] = {}
    for label, constraints in lab.progress(plans, "throughput"):  # each twice, in turns: a busy spell hits all
        run = runner.run(Constrained(selection, model, tokenizer, fresh() if constraints is None else constraints,
                                     **config), arrivals, label)
        rates.setdefault(label, []).append(decode_rate(run))
    rows = []
    for label, measured in rates.items():
        rate, tokens = max(measured, key=lambda m: m[0] or 0)  # the best of the turns: the least disturbed
        rows.append({"label": label, "decode_tokens_per_s": rate, "tokens": tokens})
    for row in rows:
        row["vs_free"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return rows


# ---------------------------------------------------------------- the plot


def plot(bench, valid_rows: list, masks: dict, rates: list):
    path = bench.figure_path("summary")
    with lab.figure(path, bench.machine, ncols=3, figsize=(16, 5)) as (fig, (left, middle, right)):
        # Modes down the side (their names are long: side by side under bars they overlap), two bars per mode.
        y = np.arange(len(valid_rows))
        for offset, key, label in ((-0.2, "valid", "whole text"), (0.2, "valid_lenient", "first JSON value in it")):
            left.barh(y + offset, [100 * row[key] for row in valid_rows], height=0.4, label=label)
        left.set_yticks(y, [row["mode"].replace(" (", "\n(") for row in valid_rows], fontsize=7)
        left.invert_yaxis()
        left.set(xlabel="outputs valid against the schema (%)", xlim=(0, 105), title="parses and validates")
        lab.legend_below(left)
        rows = masks["schemas"]
        y = np.arange(len(rows))
        for key, label, marker in (("ours_first_ms", "ours, first time a state is met", "o"),
                                   ("ours_step_ms", "ours, every step (cached after)", "s"),
                                   ("llg_step_ms", "llguidance, every step", "x")):
            middle.plot([row.get(key) or np.nan for row in rows], y, marker, label=label)
        middle.set_yticks(y, [row["schema"] for row in rows], fontsize=6)
        middle.set(xscale="log", xlabel="mask time per step (ms, log)", title="token masks, same vocabulary")
        middle.invert_yaxis()
        lab.legend_below(middle)
        right.barh([row["label"] for row in rates], [row["vs_free"] for row in rates],
                   color=["tab:gray"] + ["tab:blue"] * (len(rates) - 1))
        right.axvline(THROUGHPUT_GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {THROUGHPUT_GOAL}x")
        right.invert_yaxis()
        right.set(xlabel="decode tokens/s vs the free batch", title=f"a batch of {bench.args.batch}")
        right.legend(fontsize=8, loc="lower right")
    return path


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.schemas, args.prompts, args.max_tokens, args.batch, args.batch_tokens = 4, 2, 120, 4, 24
    if not 1 <= args.schemas <= len(SCHEMAS) or not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(user_error(PROG, f"--schemas must be 1 .. {len(SCHEMAS)} and --prompts 1 .. {len(PROMPTS)}"))
    lab.check_positive(PROG, args, "max_tokens", "batch", "batch_tokens")
    bench = lab.start(args, ("engine", "structured", "qwen2_week3", "openai_api"))
    clocks = Clocks()
    weights = same_format(bench)
    tokenizer, vocab_size = bench.tokenizer, bench.mlx_model.args.vocab_size
    cases = [(name, prompt) for name in list(SCHEMAS)[: args.schemas] for prompt in PROMPTS[: args.prompts]]
    print(f"{len(cases)} requests ({args.schemas} schemas x {args.prompts} prompts), greedy, at most "
          f"{args.max_tokens} tokens each")
    schema_constraints = {name: bench.selection.structured.make_constraint(SCHEMAS[name], tokenizer, vocab_size)
                          for name in dict.fromkeys(name for name, _ in cases)}
    constraints = {i: schema_constraints[name] for i, (name, _) in enumerate(cases)}
    results, outputs, seconds = validity(bench, cases, constraints, args)
    clocks.lap("valid outputs")
    valid_rows = validity_summary(results)
    lab.print_table("outputs that parse and meet their schema (jsonschema)", VALID_COLUMNS, valid_rows)
    same = None
    if MODES[2] in outputs:
        same = sum(outputs[MODES[1]][i] == outputs[MODES[2]][i] for i in range(len(cases)))
        print(f"free text: ours and mlx-lm's identical for {same} of {len(cases)} requests (greedy, same weights)")
    masks = mask_figures(bench, cases, outputs[MODES[0]])
    index = masks["tokenizer_index_s"]
    print(f"the tokenizer's index, once: ours (trie) {index['ours']:.2f} s, llguidance "
          + (f"{index['llguidance']:.2f} s" if index["llguidance"] is not None else "not installed"))
    lab.print_table("masks per schema: ours against llguidance (same vocabulary, the outputs above)", MASK_COLUMNS,
                    masks["schemas"])
    mask_totals = summarize_masks(masks["schemas"])
    clocks.lap("masks")
    print("over every schema: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in mask_totals.items() if v is not None))
    rates = throughput(bench, args)
    lab.print_table(f"a batch of {args.batch}, {args.batch_tokens} tokens each", THROUGHPUT_COLUMNS, rates)
    clocks.lap("throughput")
    print("wall (cpu) seconds per part: " + ", ".join(f"{k} {v['wall_s']:.0f} ({v['cpu_s']:.0f})"
                                                      for k, v in clocks.parts.items()))
    return bench.save({"commit": commit(), "load_average_end": os.getloadavg()[0], "parts_s": clocks.parts,
                       "validity": {"summary": valid_rows, "cases": results, "free_identical_to_mlx_lm": same,
                                    "wall_s": seconds, "mlx_lm_weights": weights},
                       "masks": {**masks, "totals": mask_totals}, "throughput": rates,
                       "throughput_goal": THROUGHPUT_GOAL}, plots=[plot(bench, valid_rows, masks, rates)])


class Clocks:
    """Wall and CPU seconds of each part of the run (CPU: every thread of this process; on a busy machine the wall
    time stretches with the load, the CPU time much less: it says what the run costs)."""

    def __init__(self):
        self.parts: dict[str, dict] = {}
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self, part: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.parts[part] = {"wall_s": wall - self.wall, "cpu_s": cpu - self.cpu}
        self.wall, self.cpu = wall, cpu


def commit() -> str:
    """The checkout's commit, with "+changes" when files differ from it: which code made the figures."""
    import subprocess

    def git(*words):
        return subprocess.run(["git", *words], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def same_format(bench) -> str:
    """Dequantize mlx-lm's model in place when it is quantized (ours dequantizes at load): one format, float32 on
    the CPU, for both engines. MLX's CPU quantized matmul runs at 2-3 GFLOPS where float32 BLAS runs near 100, so
    a quantized mlx-lm would measure that kernel, not the engine. Returns what mlx-lm runs on, for the JSON."""
    from mlx_lm.utils import dequantize_model

    if not any(hasattr(module, "scales") for _, module in bench.mlx_model.named_modules()):
        return "as loaded"
    dequantize_model(bench.mlx_model)
    mx.eval(bench.mlx_model.parameters())
    print("mlx-lm runs on the dequantized weights, as ours (MLX's CPU quantized kernels are far slower)")
    return "dequantized, as ours"


def summarize_masks(rows: list[dict]) -> dict:
    """Over every schema: step-weighted means (what one constrained step costs on this workload), our first-time
    mask weighted by the states met (each built once: the cost to set against llguidance's every step), the
    median build of one schema's index, and the lazy index's states against a full one's."""
    steps = sum(row["steps"] for row in rows)
    built = sum(row["states_met"] for row in rows if row.get("ours_first_ms") is not None)

    def weighted(key, weight="steps", total=steps):
        present = [row for row in rows if row.get(key) is not None]
        return sum(row[key] * row[weight] for row in present) / total if present and total else None

    def median(key):
        present = [row[key] for row in rows if row.get(key) is not None]
        return statistics.median(present) if present else None

    full = [row["states_all"] for row in rows if isinstance(row["states_all"], int)]
    return {"steps": steps, "ours_step_ms": weighted("ours_step_ms"), "llg_step_ms": weighted("llg_step_ms"),
            "ours_first_ms": weighted("ours_first_ms", "states_met", built), "agree": weighted("agree"),
            "ours_build_ms_median": median("ours_build_ms"), "llg_build_ms_median": median("llg_build_ms"),
            "states_met_range": [min(row["states_met"] for row in rows), max(row["states_met"] for row in rows)],
            "states_all_range": [min(full, default=None), max(full, default=None)],
            "schemas_over_full_limit": sum(not isinstance(row["states_all"], int) for row in rows)}

if __name__ == "__main__":
    raise SystemExit(main())
