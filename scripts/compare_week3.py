"""`pdm run compare --week 3 --day D`: your week-3 engine and the reference's, step by step on one workload.

Both engines get the same requests at the same steps, on the embedded model, with a KV pool too
small for all of them (so admission waits and preemption happen), day 3.1's adaptive token budget,
and from day 3.3 on the prefix cache (the prompts share a system prompt), from day 3.4 on priorities and
the goodput budget.
The budget's clock is virtual: every model call advances it by a fixed cost per token, so the
adaptive budget sees the same step times on both sides and on any machine, and the two runs are
deterministic. After every step each side notes its plan (decode tokens, prefill chunks, the
budget it was given, who was preempted), the blocks in use, the preemptions so far, the hit rate,
and the tokens it produced. The first step where the two differ is shown side by side with the
steps around it; then every request's tokens. Your side is the selector's command mode: your code
for every task you have written, the reference's for the rest (one line names those; `--strict`:
yours only).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from course import selector
from course.engines import week3_engine

BLOCK_SIZE, NUM_BLOCKS = 4, 24  # a pool of 96 tokens: the workload needs about twice that
MAX_NUM_SEQS, MAX_BUDGET = 4, 48
SYSTEM_TOKENS = 12  # three blocks every prompt shares (what day 3.3's cache can reuse)
STEP_LIMIT = 500  # far more than the workload needs: a side still running after it is stuck
CONTEXT_STEPS = 3  # steps shown before and after the first difference
STEP_COST, TOKEN_COST = 1.0, 0.1  # the virtual clock: a model call costs 1 + 0.1 per token


@dataclass(frozen=True)
class Request:
    at_step: int  # added before this step
    prompt: list[int]
    max_tokens: int
    priority: int


def workload() -> list[Request]:
    """Seven requests arriving over the first steps: a shared system prompt, then each one's own tokens."""
    rng = random.Random(33)
    system = [rng.randrange(100, 20_000) for _ in range(SYSTEM_TOKENS)]
    shapes = [(0, 10, 14, 0), (0, 22, 10, 0), (1, 6, 18, 1), (3, 30, 8, 0), (5, 4, 12, 1), (8, 16, 16, 0),
              (12, 9, 6, 1)]  # (step, own prompt tokens, max_tokens, priority)
    return [Request(step, system + [rng.randrange(100, 20_000) for _ in range(own)], max_tokens, priority)
            for step, own, max_tokens, priority in shapes]


def knobs(day: int) -> dict:
    """The engine's settings (`EngineConfig` fields) on day 3.`day`: what that day adds is switched on."""
    settings = {"token_budget": MAX_BUDGET, "budget_policy": "adaptive", "max_num_seqs": MAX_NUM_SEQS,
                "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "enable_prefix_caching": day >= 3,
                "scheduling_policy": "fcfs"}
    if day >= 4:
        settings.update(scheduling_policy="priority", aging_steps=6, budget_policy="goodput")
    return settings


# ---------------------------------------------------------------- recording one side


class VirtualClock:
    """A clock that only a model call moves: `STEP_COST + TOKEN_COST` per token run."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedModel:
    """The week-3 model, advancing the virtual clock by the cost of each call's tokens."""

    def __init__(self, model, clock: VirtualClock):
        self.model, self.clock = model, clock

    def __call__(self, batch, pool):
        self.clock.now += STEP_COST + TOKEN_COST * batch.token_ids.shape[0]
        return self.model(batch, pool)

    def __getattr__(self, name):
        return getattr(self.model, name)


class RecordingBudget:
    """The budget policy, noting what it answered and what the engine reported to it in the current step."""

    def __init__(self, policy):
        self.policy, self.answers, self.observed = policy, [], []

    def budget(self, num_decoding: int, offset: int = 0, waited: float = 0.0) -> int:
        answer = self.policy.budget(num_decoding, offset, waited)
        self.answers.append(answer)
        return answer

    def observe_step(self, num_tokens: int, num_decoding: int, seconds: float, offset: float = 0) -> None:
        self.observed.append((num_tokens, num_decoding, round(seconds, 6), round(offset, 3)))
        self.policy.observe_step(num_tokens, num_decoding, seconds, offset)

    def __getattr__(self, name):
        return getattr(self.policy, name)


@dataclass
class Step:
    """What one side did in one step: all plain data, so two sides compare with ==."""

    decodes: list = field(default_factory=list)  # request ids
    prefills: list = field(default_factory=list)  # (request id, start, length)
    preempted: list = field(default_factory=list)  # request ids
    budget: int | None = None  # the policy's first answer this step
    observed: list = field(default_factory=list)  # what the engine reported to the policy
    tokens: list = field(default_factory=list)  # (request id, token, finish reason)
    blocks_in_use: int = 0
    preemptions: int = 0
    hit_rate: float = 0.0

    def plan_text(self) -> str:
        parts = [f"decode {','.join(map(str, self.decodes))}" if self.decodes else "",
                 " ".join(f"prefill {rid}[{start}:{start + length}]" for rid, start, length in self.prefills),
                 f"preempt {','.join(map(str, self.preempted))}" if self.preempted else ""]
        return "; ".join(p for p in parts if p) or "-"


def instrument(engine, plans: list) -> RecordingBudget:
    """Note every plan the engine's scheduler makes, and what its budget policy answers and hears.

    The one place this reaches inside the engine: `engine.scheduler`, its `schedule` and its
    `token_budget`.
    """
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    scheduler.schedule = recording
    scheduler.token_budget = RecordingBudget(scheduler.token_budget)
    return scheduler.token_budget


@dataclass
class Side:
    steps: list[Step]
    outputs: dict  # request index -> output tokens
    error: BaseException | None = None


def drive(package, mlx_model, tokenizer, day: int) -> Side:
    """Run the workload through one package's engine, step by step, noting everything `Step` holds."""
    clock = VirtualClock()
    side = Side([], {})
    try:
        model = TimedModel(package.qwen2_week3.Qwen2ModelWeek3(mlx_model), clock)
        engine = week3_engine(package, model, tokenizer, clock=clock, **knobs(day))
        plans = []
        budget = instrument(engine, plans)
        pending = list(enumerate(workload()))
        while pending or engine.has_work():
            if len(side.steps) >= STEP_LIMIT:
                raise RuntimeError(f"still running after {STEP_LIMIT} steps (the workload needs far fewer)")
            while pending and pending[0][1].at_step <= len(side.steps):
                index, request = pending.pop(0)
                engine.add_request(request.prompt, package.sequence.SamplingParams(max_tokens=request.max_tokens),
                                   request_id=index, priority=request.priority)
                side.outputs[index] = []
            side.steps.append(run_step(engine, budget, plans, side.outputs))
    except Exception as error:  # noqa: BLE001 - reported next to the reference's run, not raised
        side.error = error
    return side


def run_step(engine, budget: RecordingBudget, plans: list, outputs: dict) -> Step:
    budget.answers, budget.observed, plans[:] = [], [], []
    results = engine.step()
    plan = plans[-1] if plans else None
    step = Step(budget=budget.answers[0] if budget.answers else None, observed=list(budget.observed),
                blocks_in_use=round(engine.kv_cache_usage * NUM_BLOCKS), preemptions=engine.num_preemptions,
                hit_rate=round(engine.prefix_cache_hit_rate, 4))
    if plan is not None:
        step.decodes = [chunk.seq.request_id for chunk in plan.decodes]
        step.prefills = [(chunk.seq.request_id, chunk.start, chunk.length) for chunk in plan.prefills]
        step.preempted = [seq.request_id for seq in plan.preempted]
    for output in results:
        step.tokens.append((output.request_id, output.token, output.finish_reason))
        if output.token is not None:
            outputs[output.request_id].append(output.token)
    return step


# ---------------------------------------------------------------- the report


FIELDS = [("plan", lambda s: s.plan_text()), ("budget", lambda s: s.budget), ("blocks", lambda s: s.blocks_in_use),
          ("preemptions", lambda s: s.preemptions), ("hit rate", lambda s: f"{s.hit_rate:.0%}"),
          ("reported to the budget", lambda s: s.observed),
          ("tokens", lambda s: " ".join(f"{rid}:{'EOS' if t is None else t}" for rid, t, _ in s.tokens))]


def first_step_difference(mine: list[Step], ref: list[Step]) -> int | None:
    for index, (a, b) in enumerate(zip(mine, ref)):
        if a != b:
            return index
    return None if len(mine) == len(ref) else min(len(mine), len(ref))


def print_steps(mine: list[Step], ref: list[Step], first: int, day: int) -> None:
    """The steps around the first difference: each field, yours above the reference's."""
    from rich.console import Console
    from rich.table import Table

    shown = [f for f in FIELDS if day >= 3 or f[0] != "hit rate"]
    table = Table(title=f"steps {max(0, first - CONTEXT_STEPS)}..{first + CONTEXT_STEPS} (first difference: step "
                        f"{first}); yours above, the reference's below", title_justify="left")
    table.add_column("step")
    table.add_column("")
    for name, _ in shown:
        table.add_column(name)
    for index in range(max(0, first - CONTEXT_STEPS), first + CONTEXT_STEPS + 1):
        for who, steps in (("yours", mine), ("ref", ref)):
            cells = [str(get(steps[index])) if index < len(steps) else "(ended)" for _, get in shown]
            style = "bold red" if index == first else None
            table.add_row(str(index) if who == "yours" else "", who, *cells, style=style)
    Console(width=max(160, Console().width)).print(table)


def summary_line(side: Side) -> str:
    steps = side.steps
    if not steps:
        return "no step ran"
    last = steps[-1]
    chunks = sum(len(s.prefills) for s in steps)
    return (f"{len(steps)} steps, {chunks} prefill chunks, {sum(len(s.decodes) for s in steps)} decode tokens, "
            f"{last.preemptions} preemptions, peak blocks {max(s.blocks_in_use for s in steps)}/{NUM_BLOCKS}, "
            f"blocks in use at the end {last.blocks_in_use}, hit rate {last.hit_rate:.1%}")


def compare_engines(args, day_entry, explain_failure) -> int:
    """Run both engines on the day's workload; print where they part; 0 when identical, 1 otherwise."""
    from course.models import load_model

    mine, ref = selector.for_command("student", strict=args.strict), selector.reference()
    mlx_model, tokenizer = load_model(args.model)
    for module in ("engine", "qwen2_week3", "token_budget", "sequence"):
        getattr(mine, module)  # imported now, so the line below names every task taken from the reference
    selector.announce(mine, file=sys.stdout)
    day = day_entry.day
    settings = ", ".join(f"{k}={v}" for k, v in knobs(day).items())
    print(f"week 3 day {day}: {day_entry.title}. Yours: src/tiny_llm; reference: src_ref/tiny_llm_ref.\n"
          f"workload: {len(workload())} requests sharing a {SYSTEM_TOKENS}-token system prompt, arriving over the "
          f"first steps; {settings}; the budget on a virtual clock; model {args.model}\n")
    theirs = drive(ref, mlx_model, tokenizer, day)
    if theirs.error is not None:
        raise theirs.error  # the reference must run this workload: a bug in the course, not in your code
    yours = drive(mine, mlx_model, tokenizer, day)
    print(f"reference: {summary_line(theirs)}\nyours:     {summary_line(yours)}")
    first = first_step_difference(yours.steps, theirs.steps)
    if yours.error is not None:
        print(f"\nyour engine raised at step {len(yours.steps)}: {explain_failure(yours.error, day_entry)}")
        if first is not None and first < len(yours.steps):
            print_steps(yours.steps, theirs.steps, first, day)  # it had parted from the reference before
        print("\nyour run differs from the reference")
        return 1
    problems = 0
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
    print(f"\n{'your run matches the reference' if not problems else 'your run differs from the reference'}")
    return 1 if problems else 0
