"""`pdm run compare --week 4 --day 1`, `--day 2` and `--day 5`: your speculative engine, quantized pool or constrained
decoding against the reference.

Both sides get the same requests at the same steps on the embedded model, on week 3's machinery
(scripts/compare_week3.py): a KV pool too small for all of them (admission waits, preemption), day
3.4's goodput token budget on a virtual clock (each model call costs the same on both sides and on
any machine, so both runs are deterministic), the prefix cache and priorities on.

- Day 4.1: `SpeculativeEngine` with back-off, greedy and seeded temperature requests, the model as
  its own draft (`DraftModelProposer`: greedy guesses all right, sampled ones accepted by chance; the
  embedded model's random text never repeats, so prompt lookup would have nothing to guess). After
  every step each side notes its plan (decodes, prefill chunks, verify chunks with their guesses), the guesses
  accepted and rolled back, the blocks in use, the preemptions and the tokens it produced.
- Day 4.2: `LLMEngine` over an 8-bit and a 4-bit pool sized by `kv_cache_bytes`: the blocks that
  memory buys and the bytes the pool's arrays take, then the same per-step notes. Your pool must
  give the reference's tokens exactly: the same quantization stores the same numbers.
- Day 4.5: `LLMEngine` with three of the requests constrained by a JSON Schema each (an object with an
  enum, a bounded string and a boolean; an array of integers; a `$ref` in an `anyOf`), one of them
  sampled; the same per-step notes. Then, along each constrained request's output, your masks against
  the reference's, state after state (a token the model did not pick shows up here, not in the tokens).

The first step where the two differ is shown side by side with the steps around it; then every
request's tokens. Exit status 1 on any difference. Your side is the selector's command mode: your
code for every task you have written, the reference's for the rest (one line names those).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from course.engines import speculative_engine, week3_engine
from course import selector
from scripts.compare_week3 import CONTEXT_STEPS, TimedModel, VirtualClock, first_step_difference, instrument

BLOCK_SIZE, NUM_BLOCKS = 4, 24  # the speculative run's pool: 96 tokens, about half what the workload needs
MAX_NUM_SEQS, MAX_BUDGET = 4, 48
QUANTIZED_BLOCKS = 20  # the quantized runs' pool, in blocks the memory budget must buy
STEP_LIMIT = 500  # far more than the workload needs: a side still running after it is stuck
KNOBS = {"token_budget": MAX_BUDGET, "budget_policy": "goodput", "max_num_seqs": MAX_NUM_SEQS, "block_size": BLOCK_SIZE,
         "enable_prefix_caching": True, "scheduling_policy": "priority"}


@dataclass(frozen=True)
class Request:
    at_step: int  # added before this step
    prompt: list[int]
    max_tokens: int
    sampling: dict  # SamplingParams' other fields
    schema: str | None = None  # day 4.5: the name of its JSON Schema in SCHEMAS (None: free text)


# Day 4.5's schemas: every construct of Task 1 (object, enum with a character Qwen2 writes in pieces, bounded
# string, boolean, array with bounds, integer and number, anyOf, $ref), each answer a few dozen tokens.
SCHEMAS = {
    "pet": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                             "kind": {"enum": ["cat", "dög", "𓀀"]}, "happy": {"type": "boolean"}},
            "required": ["name", "kind"], "additionalProperties": False},
    "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "point or null": {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}},
                                          "required": ["x"]}},
                      "anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
}
CONSTRAINED = {0: ("pet", 40), 1: ("numbers", 30), 3: ("point or null", 30)}  # request: (schema, max_tokens)


def workload(day: int = 1) -> list[Request]:
    """Six requests arriving over the first steps, each prompt a phrase repeated; two sample at temperature 0.8
    with a seed. Day 4.5: three of them (one sampled) constrained by a schema each."""
    rng = random.Random(41)
    shapes = [(0, 5, 3, 16, {}), (0, 8, 2, 12, {"temperature": 0.8, "seed": 7}), (1, 4, 4, 20, {}),
              (3, 11, 2, 10, {}), (5, 6, 3, 14, {"temperature": 0.8, "seed": 11}), (8, 3, 5, 8, {})]
    requests = []
    for index, (step, phrase_length, repeats, max_tokens, sampling) in enumerate(shapes):
        phrase = [rng.randrange(100, 20_000) for _ in range(phrase_length)]
        schema, max_tokens = CONSTRAINED.get(index, (None, max_tokens)) if day == 5 else (None, max_tokens)
        requests.append(Request(step, phrase * repeats + [rng.randrange(100, 20_000)], max_tokens, sampling, schema))
    return requests


@dataclass
class Step:
    """What one side did in one step: plain data, so two sides compare with ==."""

    decodes: list = field(default_factory=list)  # request ids
    prefills: list = field(default_factory=list)  # (request id, start, length)
    verifies: list = field(default_factory=list)  # (request id, start, guesses)
    preempted: list = field(default_factory=list)
    budget: int | None = None
    accepted: int = 0  # guesses accepted this step
    rolled_back: int = 0  # guesses rejected this step: positions given back
    blocks_in_use: int = 0
    preemptions: int = 0
    tokens: list = field(default_factory=list)  # (request id, token, finish reason)

    def plan_text(self) -> str:
        parts = [f"decode {','.join(map(str, self.decodes))}" if self.decodes else "",
                 " ".join(f"prefill {rid}[{start}:{start + length}]" for rid, start, length in self.prefills),
                 " ".join(f"verify {rid}@{start}+{len(draft)}" for rid, start, draft in self.verifies),
                 f"preempt {','.join(map(str, self.preempted))}" if self.preempted else ""]
        return "; ".join(p for p in parts if p) or "-"


FIELDS = {5: [("plan", Step.plan_text), ("budget", lambda s: s.budget), ("blocks", lambda s: s.blocks_in_use),
              ("preemptions", lambda s: s.preemptions),
              ("tokens", lambda s: " ".join(f"{rid}:{'EOS' if t is None else t}" for rid, t, _ in s.tokens))],
          1: [("plan", Step.plan_text), ("budget", lambda s: s.budget), ("accepted", lambda s: s.accepted),
              ("rolled back", lambda s: s.rolled_back), ("blocks", lambda s: s.blocks_in_use),
              ("preemptions", lambda s: s.preemptions),
              ("tokens", lambda s: " ".join(f"{rid}:{'EOS' if t is None else t}" for rid, t, _ in s.tokens))],
          2: [("plan", Step.plan_text), ("budget", lambda s: s.budget), ("blocks", lambda s: s.blocks_in_use),
              ("preemptions", lambda s: s.preemptions),
              ("tokens", lambda s: " ".join(f"{rid}:{'EOS' if t is None else t}" for rid, t, _ in s.tokens))]}


@dataclass
class Side:
    steps: list[Step]
    outputs: dict  # request index -> output tokens
    pool: tuple = ()  # day 4.2: (blocks, bytes of the pool's arrays)
    constraints: dict = field(default_factory=dict)  # day 4.5: schema name -> the package's Constraint
    error: BaseException | None = None


# Day 4.1's runs, by how the guesses are made. The embedded model's random text never repeats, so prompt lookup
# would find nothing to guess; the model as its own draft guesses every greedy token right, sampled ones by chance.
PROPOSERS = {"the model as its own draft": lambda package, mlx_model: package.speculative.DraftModelProposer(mlx_model)}


def build(package, mlx_model, tokenizer, day: int, config, clock: VirtualClock):
    """The day's engine of `package`: speculative with the proposer named `config` (4.1), over a `config`-bit
    pool sized by memory (4.2), or week 3's on the speculative run's pool (4.5)."""
    model = TimedModel(package.qwen2_week3.Qwen2ModelWeek3(mlx_model), clock)
    if day == 5:
        return week3_engine(package, model, tokenizer, clock=clock, num_blocks=NUM_BLOCKS, **KNOBS)
    if day == 1:
        return speculative_engine(package, model, tokenizer, PROPOSERS[config](package, mlx_model), clock=clock,
                                  num_blocks=NUM_BLOCKS, **KNOBS)
    kv_bits = config
    ref = selector.reference()  # the memory is the reference's arithmetic: your engine must buy as many blocks
    memory = QUANTIZED_BLOCKS * BLOCK_SIZE * ref.quantized_kv.model_bytes_per_token(model, kv_bits)
    return week3_engine(package, model, tokenizer, clock=clock, kv_bits=kv_bits, kv_cache_bytes=memory, **KNOBS)


def drive(package, mlx_model, tokenizer, day: int, config) -> Side:
    """Run the workload through one package's engine (`build`'s `config`), step by step, noting what `Step` holds."""
    clock = VirtualClock()
    side = Side([], {})
    try:
        engine = build(package, mlx_model, tokenizer, day, config, clock)
        if day == 2:
            side.pool = (engine.block_manager.num_blocks, package.quantized_kv.pool_nbytes(engine.runner.pool))
        plans = []
        budget = instrument(engine, plans)
        pending = list(enumerate(workload(day)))
        while pending or engine.has_work():
            if len(side.steps) >= STEP_LIMIT:
                raise RuntimeError(f"still running after {STEP_LIMIT} steps (the workload needs far fewer)")
            while pending and pending[0][1].at_step <= len(side.steps):
                index, request = pending.pop(0)
                params = package.sequence.SamplingParams(max_tokens=request.max_tokens, **request.sampling,
                                                         constraint=constraint(side, package, tokenizer, mlx_model,
                                                                               request.schema))
                engine.add_request(request.prompt, params, request_id=index)
                side.outputs[index] = []
            side.steps.append(run_step(engine, budget, plans, side.outputs, day))
    except Exception as error:  # noqa: BLE001 - reported next to the reference's run, not raised
        side.error = error
    return side


def constraint(side: Side, package, tokenizer, mlx_model, schema: str | None):
    """The package's `Constraint` for the schema named `schema` (None for none), one per schema and side."""
    if schema is None:
        return None
    if schema not in side.constraints:
        side.constraints[schema] = package.structured.make_constraint(SCHEMAS[schema], tokenizer,
                                                                      mlx_model.args.vocab_size)
    return side.constraints[schema]


def mask_difference(yours: Side, theirs: Side, tokenizer) -> list[str]:
    """Along each constrained request's output (the reference's), the first state where your mask differs from
    the reference's: what each allows that the other does not. Empty when every mask agrees."""
    import numpy as np

    found = []
    for index, request in enumerate(workload(5)):
        if request.schema is None:
            continue
        mine, ref = yours.constraints[request.schema], theirs.constraints[request.schema]
        my_state, ref_state = mine.start, ref.start
        for position, token in enumerate(theirs.outputs[index] + [None]):  # the masks after every output token
            my_mask, ref_mask = (np.array(c.index.mask(s)) for c, s in ((mine, my_state), (ref, ref_state)))
            if my_mask.shape != ref_mask.shape or (my_mask != ref_mask).any():
                found.append(mask_report(index, request.schema, position, theirs.outputs[index], my_mask, ref_mask,
                                         tokenizer))
                break
            if token is not None:
                my_state, ref_state = mine.next_state(my_state, token), ref.next_state(ref_state, token)
    return found


def mask_report(index: int, schema: str, position: int, output: list[int], mine, ref, tokenizer) -> str:
    """One line: where the masks part, and a few tokens only one side allows."""
    import numpy as np

    if mine.shape != ref.shape:
        return f"request {index} ({schema}): your mask has {mine.shape} entries, the reference's {ref.shape}"

    def some(tokens) -> str:
        shown = ", ".join(f"{int(t)} {tokenizer.decode([int(t)])!r}" for t in tokens[:5])
        return f"{len(tokens)} tokens ({shown}{', ...' if len(tokens) > 5 else ''})"

    after = tokenizer.decode(output[:position])
    return (f"request {index} ({schema}): after {position} output tokens ({after!r}) your mask allows "
            f"{some(np.nonzero(mine & ~ref)[0])} the reference's does not, and refuses {some(np.nonzero(ref & ~mine)[0])} "
            f"it allows")


def run_step(engine, budget, plans: list, outputs: dict, day: int) -> Step:
    budget.answers, budget.observed, plans[:] = [], [], []
    before = (engine.speculation.proposed, engine.speculation.accepted) if day == 1 else (0, 0)
    results = engine.step()
    step = Step(budget=budget.answers[0] if budget.answers else None,
                blocks_in_use=engine.block_manager.num_blocks - engine.block_manager.num_free_blocks,
                preemptions=engine.num_preemptions)
    if day == 1:
        proposed, step.accepted = (now - then for now, then in zip((engine.speculation.proposed,
                                                                     engine.speculation.accepted), before))
        step.rolled_back = proposed - step.accepted
    if plans:
        plan = plans[-1]  # the plan the step ran; on day 4.1 its decodes became verify chunks in place
        step.decodes = [chunk.seq.request_id for chunk in plan.decodes]
        for chunk in plan.prefills:
            draft = getattr(chunk, "draft", None)
            if draft is None:
                step.prefills.append((chunk.seq.request_id, chunk.start, chunk.length))
            else:
                step.verifies.append((chunk.seq.request_id, chunk.start, list(draft)))
        step.preempted = [seq.request_id for seq in plan.preempted]
    for output in results:
        step.tokens.append((output.request_id, output.token, output.finish_reason))
        if output.token is not None:
            outputs[output.request_id].append(output.token)
    return step


# ---------------------------------------------------------------- the report


def print_steps(mine: list[Step], ref: list[Step], first: int, day: int) -> None:
    """The steps around the first difference: each field, yours above the reference's."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"steps {max(0, first - CONTEXT_STEPS)}..{first + CONTEXT_STEPS} (first difference: step "
                        f"{first}); yours above, the reference's below", title_justify="left")
    table.add_column("step")
    table.add_column("")
    for name, _ in FIELDS[day]:
        table.add_column(name)
    for index in range(max(0, first - CONTEXT_STEPS), first + CONTEXT_STEPS + 1):
        for who, steps in (("yours", mine), ("ref", ref)):
            cells = [str(get(steps[index])) if index < len(steps) else "(ended)" for _, get in FIELDS[day]]
            table.add_row(str(index) if who == "yours" else "", who, *cells,
                          style="bold red" if index == first else None)
    Console(width=max(160, Console().width)).print(table)


def summary_line(side: Side, day: int) -> str:
    steps = side.steps
    if not steps:
        return "no step ran"
    last = steps[-1]
    line = (f"{len(steps)} steps, {sum(len(s.prefills) for s in steps)} prefill chunks, "
            f"{sum(len(s.decodes) for s in steps)} plain decodes, {last.preemptions} preemptions, "
            f"peak blocks in use {max(s.blocks_in_use for s in steps)}, at the end {last.blocks_in_use}")
    if day == 1:
        line += (f"; {sum(len(s.verifies) for s in steps)} verify chunks, {sum(s.accepted for s in steps)} guesses "
                 f"accepted, {sum(s.rolled_back for s in steps)} rolled back")
    return line


def compare_sides(yours: Side, theirs: Side, day: int, label: str, explain) -> int:
    """Print how two runs of one configuration part; the number of differences found."""
    print(f"{label}\nreference: {summary_line(theirs, day)}\nyours:     {summary_line(yours, day)}")
    problems = 0
    if day == 2 and yours.pool != theirs.pool and yours.error is None:
        problems += 1
        print(f"pool: yours {yours.pool[0]} blocks in {yours.pool[1]} bytes of arrays, the reference's "
              f"{theirs.pool[0]} blocks in {theirs.pool[1]} bytes (the same kv_cache_bytes)")
    first = first_step_difference(yours.steps, theirs.steps)
    if yours.error is not None:
        print(f"\nyour engine raised at step {len(yours.steps)}: {explain(yours.error)}")
        if first is not None and first < len(yours.steps):
            print_steps(yours.steps, theirs.steps, first, day)
        return problems + 1
    if first is not None:
        problems += 1
        print()
        print_steps(yours.steps, theirs.steps, first, day)
    for index, ref_tokens in theirs.outputs.items():
        my_tokens = yours.outputs.get(index)
        if my_tokens == ref_tokens:
            print(f"request {index}: identical tokens ({len(ref_tokens)})")
        else:
            problems += 1
            print(f"request {index}: yours {my_tokens}\n{'':12s}reference {ref_tokens}")
    print()
    return problems


def compare_week4(args, day_entry, explain_failure) -> int:
    """Run both sides on the day's workload; print where they part; 0 when identical, 1 otherwise."""
    from course.models import load_model

    mine, ref = selector.for_command("student", strict=args.strict), selector.reference()
    mlx_model, tokenizer = load_model(args.model)
    for module in ("engine", "qwen2_week3", "token_budget", "sequence", "speculative", "quantized_kv", "structured"):
        getattr(mine, module)  # imported now, so the line below names every task taken from the reference
    selector.announce(mine, file=sys.stdout)
    day = day_entry.day
    settings = ", ".join(f"{k}={v}" for k, v in KNOBS.items())
    pool = {1: f"a pool of {NUM_BLOCKS} blocks, up to 4 guesses with back-off, the model as its own draft",
            2: f"8-bit and 4-bit pools sized by kv_cache_bytes to {QUANTIZED_BLOCKS} blocks",
            5: f"a pool of {NUM_BLOCKS} blocks; requests {', '.join(map(str, CONSTRAINED))} constrained by the "
               f"schemas {', '.join(repr(schema) for schema, _ in CONSTRAINED.values())}"}[day]
    print(f"week 4 day {day}: {day_entry.title}. Yours: src/tiny_llm; reference: src_ref/tiny_llm_ref.\n"
          f"workload: {len(workload(day))} requests with repeated phrases arriving over the first steps (two seeded at "
          f"temperature 0.8); {pool}; {settings}; goodput token budget on a virtual clock; model {args.model}\n")
    problems = 0
    for config in {1: list(PROPOSERS), 2: [8, 4], 5: ["constrained and free requests together"]}[day]:
        theirs = drive(ref, mlx_model, tokenizer, day, config)
        if theirs.error is not None:
            raise theirs.error  # the reference must run this workload: a bug in the course, not in your code
        yours = drive(mine, mlx_model, tokenizer, day, config)
        label = f"guesses by {config}:" if day == 1 else f"{config}:" if day == 5 else \
            f"{config}-bit pool: {theirs.pool[0]} blocks in {theirs.pool[1]} bytes (the reference's)"
        problems += compare_sides(yours, theirs, day, label, lambda error: explain_failure(error, day_entry))
        if day == 5 and yours.error is None:
            try:
                masks = mask_difference(yours, theirs, tokenizer)
            except Exception as error:  # noqa: BLE001 - your code raised on a state the reference's output reached
                masks = [f"your masks raised along the reference's output: {explain_failure(error, day_entry)}"]
            print("\n".join(masks) or "masks: yours and the reference's agree along every constrained output")
            problems += len(masks)
    print(f"{'your run matches the reference' if not problems else 'your run differs from the reference'}")
    return 1 if problems else 0
