"""Week 3 day 4: priorities and preemption (book/src/week3-04-priorities.md).

Time is counted in engine steps (an injected clock that ticks once per step), never in seconds.
Oracles: the same requests under first-come-first-served give the same greedy tokens (preemption by
recompute changes when a token comes, never which); every block is back in the pool at the end.
Each task's tests take the student's code for that task alone (`solution(week=3, day=4, task=N)`): Task 2's
planner runs the reference's aging (Task 1) and preemption (Task 3), Task 3's the reference's order, so a bug
in one task never costs another task's points. Task 4's shortest-prefill-first order is tested alone and in
day 3.1's planner; Task 5's goodput budget on hand-made step times and a fake clock; Task 6 runs the student's days 3.1-3.4 together with priorities and caching on, with
shortest prefill first, and with the goodput budget on the stack's virtual clock (tests/week3_stack.py).
"""

import random

import pytest

from tests.harness import actor_fakes, reference, solution, stack
from tests.week3_fakes import PLAIN_ENGINE
from tests.week3_stack import check_stack

TASKS = {n: solution(week=3, day=4, task=n) for n in range(1, 6)}  # Task N's tests: the student's Task N alone
STACK = stack(week=3, day=4)  # "your stack so far": started now, beside the collection
ref = reference()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150_000) for _ in range(n)]


def make_scheduler(sol, num_blocks=64, block_size=4, budget=32, max_num_seqs=4, aging_steps=1000,
                   policy="PriorityPolicy"):
    """Day 3.1's one planner of `sol` with its priority policy (or `policy`, another of its order policies) plugged in."""
    bm = sol.block_manager.BlockManager(num_blocks, block_size)
    order = getattr(sol.order_policy, policy)(aging_steps=aging_steps)
    return sol.scheduler.Scheduler(bm, sol.token_budget.FixedTokenBudget(budget), max_num_seqs, order)


def seq(sol, request_id, n, priority=0, seed=0):
    """A sequence of `sol`'s package: while grading it lives in the sandbox with the policy and scheduler that
    read and change it, and a test reads it back as data."""
    return sol.sequence.Sequence(request_id, tokens(n, seed), priority=priority)


def names(seqs) -> list[str]:
    """The request ids of `seqs`, to compare (the sequences themselves are the submission's objects)."""
    return [x.request_id for x in seqs]


def holds(objects, obj) -> bool:
    """Whether `obj` itself is one of `objects` (`in` would ask the submission's objects to compare themselves)."""
    return any(x is obj for x in objects)


def complete(plan):
    """Pretend the plan ran: every chunk's tokens are computed; sampling ones get a token."""
    for chunk in plan.chunks:
        seq = chunk.seq
        seq.num_computed_tokens += chunk.length
        if chunk.samples:
            seq.output_token_ids = seq.output_token_ids + [7]  # set whole: a read of a submission's list is a copy


STEP_CLOCKS: dict[int, object] = {}  # id(engine) -> its clock (an `actor_fakes.ManualClock`)


@pytest.fixture
def engine_factory(model32, monkeypatch):
    """`make(sol, **config)`: an engine whose priority policies and preemption are `sol`'s (the rest of the engine
    is the reference's)."""
    mlx_model, tokenizer = model32

    def make(sol, **kwargs):
        monkeypatch.setattr(sol.engine, "PriorityPolicy", sol.order_policy.PriorityPolicy)
        monkeypatch.setattr(sol.engine, "ShortestPrefillFirst", sol.order_policy.ShortestPrefillFirst)
        options = dict(PLAIN_ENGINE, token_budget=32, max_num_seqs=4, block_size=4, num_blocks=64,
                       scheduling_policy="priority")
        options.update(kwargs)
        # The model and the clock beside the engine (while grading, in the sandbox): read at every step in place.
        clock = actor_fakes(sol).ManualClock()
        model = sol.qwen2_week3.Qwen2ModelWeek3(mlx_model)
        engine = sol.engine.LLMEngine(model, tokenizer, sol.engine.EngineConfig(**options), clock=clock)
        STEP_CLOCKS[id(engine)] = clock  # the test advances the clock by one per step
        return engine

    return make


def run_steps(engine, arrivals, max_steps=400):
    """arrivals: {step: [(request_id, prompt, max_tokens, priority)]}. Returns the sequences by id."""
    seqs, step = {}, 0
    while step < max_steps and (engine.has_work() or any(s >= step for s in arrivals)):
        for request_id, prompt, max_tokens, priority in arrivals.get(step, []):
            params = ref.sequence.SamplingParams(max_tokens=max_tokens)
            seqs[request_id] = engine.add_request(prompt, params, request_id=request_id, priority=priority)
        engine.step()
        step += 1
        STEP_CLOCKS[id(engine)].now = step
    assert not engine.has_work(), f"the engine made no progress in {max_steps} steps (every request ends, however " \
                                  f"urgent the others): {engine.num_running} running, {engine.num_waiting} waiting"
    return seqs


# ---------------------------------------------------------------- Task 1: effective priority, aging


def test_task_1_rank_orders_by_priority_then_arrival():
    sol = TASKS[1]
    policy = sol.order_policy.PriorityPolicy(aging_steps=1000)
    low, high, high_later = seq(sol, "low", 4, 0), seq(sol, "high", 4, 5), seq(sol, "high2", 4, 5)
    for x in (low, high):
        policy.add(x)
    policy.next_step()
    policy.add(high_later)
    assert names(sorted([low, high_later, high], key=policy.rank)) == ["high", "high2", "low"]
    assert policy.effective_priority(high) == 5 and policy.effective_priority(low) == 0


def test_task_1_priorities_age():
    sol = TASKS[1]
    policy = sol.order_policy.PriorityPolicy(aging_steps=10)
    old = seq(sol, "old", 4, priority=0)
    policy.add(old)
    policy.num_steps = 25
    young = seq(sol, "young", 4, priority=2)
    policy.add(young)
    assert policy.effective_priority(old) == 2, "one level per 10 steps waited"
    assert policy.rank(old) < policy.rank(young), "same effective priority: the earlier arrival first"
    policy.num_steps = 45
    assert policy.effective_priority(old) == 4 and policy.effective_priority(young) == 4
    with pytest.raises(ValueError, match="aging_steps"):
        sol.order_policy.PriorityPolicy(aging_steps=0)


# ---------------------------------------------------------------- Task 2: the plan follows priority


def test_task_2_order_and_outranks():
    sol = TASKS[2]
    policy = sol.order_policy.PriorityPolicy(aging_steps=1000)
    a, b, c = seq(sol, "a", 4, 1), seq(sol, "b", 4, 3), seq(sol, "c", 4, 1, seed=1)
    for x in (a, b, c):
        policy.add(x)
    assert names(policy.order([a, b, c])) == ["b", "a", "c"], "most urgent first; equals keep their order"
    assert names(policy.order([c, a])) == ["c", "a"], "stable among equals"
    assert policy.outranks(b, a) and not policy.outranks(a, b)
    assert not policy.outranks(a, c) and not policy.outranks(c, a), "equals never outrank each other"
    policy.next_step()
    later = seq(sol, "later", 4, 1, seed=2)
    policy.add(later)
    assert names(policy.order([later, c, a])) == ["c", "a", "later"], \
        "equal priorities: the earlier arrival first, whatever the order given (a later request never jumps the queue)"
    assert policy.outranks(a, later) and not policy.outranks(later, a)


def test_task_2_urgent_prefill_goes_first_in_the_budget():
    sol = TASKS[2]
    s = make_scheduler(sol, budget=32)
    batch = seq(sol, "batch", 100, priority=0)
    s.add(batch)
    complete(s.schedule())  # the long batch prompt is part-way through
    assert batch.num_computed_tokens == 32
    urgent = seq(sol, "urgent", 20, priority=1, seed=1)
    s.add(urgent)
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.prefills] == ["urgent", "batch"]
    assert plan.prefills[0].length == 20 and plan.prefills[1].length == 12


def test_task_2_waiting_queue_served_by_priority():
    sol = TASKS[2]
    s = make_scheduler(sol, budget=16, max_num_seqs=4)
    for i, p in enumerate([0, 2, 1]):
        s.add(seq(sol, f"p{p}", 16, priority=p, seed=i))
    order = []
    for _ in range(3):
        plan = s.schedule()
        order += [c.seq.request_id for c in plan.prefills]
        complete(plan)
    assert order == ["p2", "p1", "p0"]


def test_task_2_decodes_in_priority_order():
    sol = TASKS[2]
    s = make_scheduler(sol, budget=32)
    s.add(seq(sol, "p0", 4, priority=0))
    complete(s.schedule())  # p0 is admitted first...
    for i, p in enumerate([3, 1], start=1):
        s.add(seq(sol, f"p{p}", 4, priority=p, seed=i))
    complete(s.schedule())  # ...then p3 and p1
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.decodes] == ["p3", "p1", "p0"]


# ---------------------------------------------------------------- Task 3: preemption of lower priority


def test_task_3_slot_taken_from_lower_priority():
    sol = TASKS[3]
    s = make_scheduler(sol, max_num_seqs=2)
    lows = [seq(sol, f"low{i}", 8, priority=0, seed=i) for i in range(2)]
    for x in lows:
        s.add(x)
    complete(s.schedule())
    urgent = seq(sol, "urgent", 8, priority=1, seed=9)
    s.add(urgent)
    plan = s.schedule()
    assert [x.request_id for x in plan.preempted] == ["low1"], "the least urgent, most recent one goes"
    assert holds(s.running, urgent) and holds(s.waiting, lows[1]) and lows[1].num_computed_tokens == 0
    assert s.block_manager.num_free_blocks == 64 - 3 - 2  # low0 (8 tokens + 1 new), urgent's 8 tokens


def test_task_3_blocks_taken_from_lower_priority():
    sol = TASKS[3]
    s = make_scheduler(sol, num_blocks=6, block_size=4, budget=32, max_num_seqs=4)
    low = seq(sol, "low", 20, priority=0)
    s.add(low)
    complete(s.schedule())
    assert s.block_manager.num_free_blocks == 1
    urgent = seq(sol, "urgent", 8, priority=2, seed=1)
    s.add(urgent)
    plan = s.schedule()
    assert names(plan.preempted) == ["low"] and plan.prefills[0].seq is urgent and plan.prefills[0].length == 8
    complete(plan)
    equal = seq(sol, "equal", 12, priority=2, seed=2)
    s.add(equal)
    plan = s.schedule()
    assert not holds(plan.preempted, urgent), "a sequence is never preempted for one of the same priority"
    assert urgent.status.name == "RUNNING"  # by name: the judge may not have loaded the enum's module yet


def test_task_3_no_preemption_among_equals():
    sol = TASKS[3]
    s = make_scheduler(sol, max_num_seqs=1)
    a, b = seq(sol, "a", 8, priority=1), seq(sol, "b", 8, priority=1, seed=1)
    s.add(a)
    s.add(b)  # same priority, same step, one slot: b waits for a, it does not push it out
    for _ in range(3):
        plan = s.schedule()
        assert plan.preempted == [] and holds(s.running, a) and holds(s.waiting, b)
        complete(plan)


def test_task_3_high_priority_ttft_bounded_regardless_of_low_load(engine_factory):
    sol = TASKS[3]

    def urgent_ttft(num_low):
        engine = engine_factory(sol)
        arrivals = {0: [(f"low{i}", tokens(60, i), 12, 0) for i in range(num_low)],
                    3: [("urgent", tokens(10, 99), 4, 5)]}
        seqs = run_steps(engine, arrivals)
        assert all(seqs[f"low{i}"].finish_reason == "length" for i in range(num_low)), "low priority finishes"
        assert engine.block_manager.num_free_blocks == 64, "no block leaks"
        return engine.metrics.requests["urgent"].ttft

    alone = urgent_ttft(0)
    assert alone == 0  # the clock reads the step index: its first token comes in the step it arrives
    assert urgent_ttft(2) == alone and urgent_ttft(8) == alone, "low-priority load must not delay it"

    engine = engine_factory(sol, scheduling_policy="fcfs")  # the contrast: first come, first served
    run_steps(engine, {0: [(f"low{i}", tokens(60, i), 12, 0) for i in range(8)], 3: [("urgent", tokens(10, 99), 4, 5)]})
    assert engine.metrics.requests["urgent"].ttft > 5


def test_task_3_preempted_requests_resume_identically(engine_factory):
    sol = TASKS[3]
    lows = [(f"low{i}", tokens(30, 10 + i), 10, 0) for i in range(3)]
    urgents = [(f"urgent{i}", tokens(20, 20 + i), 6, 3) for i in range(2)]
    arrivals = {0: lows, 4: urgents}
    plain = run_steps(engine_factory(sol, scheduling_policy="fcfs", num_blocks=64), arrivals)
    engine = engine_factory(sol, num_blocks=24, max_num_seqs=3)  # tight: the urgent ones must preempt
    seqs = run_steps(engine, arrivals)
    assert engine.num_preemptions > 0
    assert {k: s.output_token_ids for k, s in seqs.items()} == {k: s.output_token_ids for k, s in plain.items()}
    assert engine.block_manager.num_free_blocks == 24 and not engine.scheduler.running


def test_task_3_aging_bounds_starvation(engine_factory):
    sol = TASKS[3]
    # A steady stream of urgent requests; the low one still finishes, within a bounded number of steps.
    engine = engine_factory(sol, max_num_seqs=1, aging_steps=8)
    arrivals = {step: [(f"u{step}", tokens(6, step), 3, 1)] for step in range(0, 60, 2)}
    arrivals[0].append(("low", tokens(6, 500), 3, 0))
    seqs = run_steps(engine, arrivals)
    low = engine.metrics.requests["low"]
    assert seqs["low"].finish_reason == "length"
    assert low.finish < 40, "aging lets it through long before the urgent stream ends"


# ---------------------------------------------------------------- Task 4: shortest prefill first


def test_task_4_fewest_uncomputed_tokens_first_within_a_priority():
    sol = TASKS[4]
    policy = sol.order_policy.ShortestPrefillFirst(aging_steps=1000)
    long, partway = seq(sol, "long", 100), seq(sol, "partway", 100, seed=1)
    short, twin = seq(sol, "short", 20, seed=2), seq(sol, "twin", 20, seed=3)
    urgent_long = seq(sol, "urgent long", 200, priority=1, seed=4)
    for x in (long, partway, short, twin, urgent_long):  # one step apart: arrival order is the last key
        policy.add(x)
        policy.next_step()
    partway.num_computed_tokens = 90  # 10 prompt tokens left: fewer than the short prompt's 20
    got = [x.request_id for x in sorted([long, twin, short, partway, urgent_long], key=policy.rank)]  # Task 4's rank alone
    assert got == ["urgent long", "partway", "short", "twin", "long"], \
        "priority first; then the fewest tokens left to compute (not the prompt's length); then arrival"


def test_task_4_length_never_outranks():
    sol = TASKS[4]
    policy = sol.order_policy.ShortestPrefillFirst(aging_steps=1000)
    long, short, urgent = seq(sol, "long", 100), seq(sol, "short", 4, seed=1), seq(sol, "urgent", 100, priority=1, seed=2)
    for x in (long, short, urgent):
        policy.add(x)
    assert not policy.outranks(short, long) and not policy.outranks(long, short), "being shorter takes no blocks"
    assert policy.outranks(urgent, short) and not policy.outranks(short, urgent), "priority still does"


def test_task_4_short_prompt_passes_a_long_ones_chunks():
    sol = TASKS[4]
    s = make_scheduler(sol, budget=32, policy="ShortestPrefillFirst")
    long = seq(sol, "long", 200)
    s.add(long)
    complete(s.schedule())  # part-way: 168 tokens left
    short = seq(sol, "short", 20, seed=1)
    s.add(short)
    plan = s.schedule()
    assert [(c.seq.request_id, c.length) for c in plan.prefills] == [("short", 20), ("long", 12)], \
        "the short prompt takes the budget first, the long one's chunk gets the rest"
    complete(plan)
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.decodes] == ["short"] and plan.prefills[0].seq is long


def test_task_4_shorts_stream_early_same_tokens(engine_factory):
    """A long prompt, then shorts behind it: their first tokens come within two steps, the tokens are FCFS's."""
    sol = TASKS[4]
    arrivals = {0: [("long", tokens(120, 1), 4, 0)], 1: [(f"short{i}", tokens(10, 2 + i), 4, 0) for i in range(3)]}
    plain_engine = engine_factory(sol, scheduling_policy="fcfs")
    plain = run_steps(plain_engine, arrivals)
    engine = engine_factory(sol, scheduling_policy="shortest_prefill_first")
    seqs = run_steps(engine, arrivals)
    ttfts = [engine.metrics.requests[f"short{i}"].ttft for i in range(3)]
    assert max(ttfts) <= 1, f"short prompts waited {ttfts} steps behind the long one's chunks"
    assert min(plain_engine.metrics.requests[f"short{i}"].ttft for i in range(3)) > 2  # the contrast: FCFS
    assert {k: s.output_token_ids for k, s in seqs.items()} == {k: s.output_token_ids for k, s in plain.items()}
    assert engine.block_manager.num_free_blocks == 64 and engine.num_preemptions == 0


# ---------------------------------------------------------------- Task 5: the goodput budget


def measured_goodput_budget(**targets):
    """The solution's goodput budget after two hand-made steps: a decode step costs 0.25 s, a prefill token 1/64 s
    (numbers a float holds exactly, so every budget is a whole number of tokens)."""
    policy = TASKS[5].token_budget.GoodputTokenBudget(max_num_batched_tokens=512, min_tokens=1, initial_tokens=32,
                                                 smoothing=1.0, **targets)
    policy.observe_step(4, 4, 0.25)
    policy.observe_step(68, 4, 1.25)
    return policy


def test_task_5_step_time_rises_with_the_oldest_wait_up_to_the_itl_target():
    policy = measured_goodput_budget(target_ttft=2.0, target_itl=0.75)
    # 0.5 s of room above a decode step: half of it while nobody has waited, all of it at the 2 s TTFT target.
    for waited, seconds in ((0.0, 0.5), (1.0, 0.625), (2.0, 0.75), (60.0, 0.75)):
        assert policy.step_seconds(4, waited) == pytest.approx(seconds), \
            f"the oldest request waited {waited} s (TTFT target 2 s, ITL target 0.75 s, decode step 0.25 s): a step " \
            f"may take {seconds} s, got {policy.step_seconds(4, waited)}"
    times = [policy.step_seconds(4, w / 10) for w in range(40)]
    assert times == sorted(times) and max(times) <= 0.75 + 1e-12, "the longer the wait, the longer the step, never " \
                                                                   "past the ITL target"
    assert [policy.budget(4, 0, w) for w in (0.0, 1.0, 2.0, 100.0)] == [4 + 16, 4 + 24, 4 + 32, 4 + 32]


def test_task_5_targets_in_decode_steps():
    # No targets in seconds: the ITL target is 3 decode steps (0.75 s), the TTFT target 8 (2 s).
    policy = measured_goodput_budget(target_ttft=None, ttft_multiple=8.0, target_itl=None, decode_multiple=3.0)
    assert [policy.step_seconds(4, w) for w in (0.0, 1.0, 3.0)] == pytest.approx([0.5, 0.625, 0.75])
    # A long TTFT target and a tight ITL target are not the same as the other way round.
    tight_itl = measured_goodput_budget(target_ttft=4.0, target_itl=0.5)
    assert [tight_itl.budget(4, 0, w) for w in (0.0, 2.0, 4.0, 9.0)] == [4 + 8, 4 + 12, 4 + 16, 4 + 16]
    for bad in (dict(target_ttft=0.0), dict(target_ttft=-1.0), dict(ttft_multiple=0.0)):
        with pytest.raises(ValueError):
            TASKS[5].token_budget.GoodputTokenBudget(**bad)


def test_task_5_base_of_as_many_decodes():
    # Decode-only steps with 1 decode cost 0.25 s, with 4 decodes 0.5 s: each step's room lies above the decode step
    # of its own decodes, and targets in decode steps count steps of that many decodes.
    policy = measured_goodput_budget(target_ttft=None, ttft_multiple=8.0, target_itl=None, decode_multiple=3.0)
    policy.observe_step(4, 4, 0.5)
    policy.observe_step(1, 1, 0.25)
    # 4 decodes: ITL target 1.5 s, TTFT target 4 s; 1 decode: 0.75 s and 2 s.
    assert [policy.step_seconds(4, w) for w in (0.0, 2.0, 4.0)] == pytest.approx([1.0, 1.25, 1.5])
    assert [policy.step_seconds(1, w) for w in (0.0, 1.0, 2.0)] == pytest.approx([0.5, 0.625, 0.75])
    seconds = measured_goodput_budget(target_ttft=2.0, target_itl=1.0)
    seconds.observe_step(1, 1, 0.25)
    seconds.observe_step(4, 4, 0.5)
    assert [seconds.step_seconds(4, w) for w in (0.0, 2.0)] == pytest.approx([0.75, 1.0])
    assert [seconds.step_seconds(1, w) for w in (0.0, 2.0)] == pytest.approx([0.625, 1.0])


def test_task_5_the_planner_hears_the_oldest_wait():
    """Day 3.1's planner with the solution's goodput budget and a fake clock: the step's budget follows the age of
    the oldest request still without its first token, and no other."""
    now = [0.0]
    policy = measured_goodput_budget(target_ttft=2.0, target_itl=0.75)
    scheduler = ref.scheduler.Scheduler(ref.block_manager.BlockManager(64, 4), policy, 4, clock=lambda: now[0])
    assert scheduler.step_budget(4) == 4 + 16  # nobody waits
    streamed = ref.sequence.Sequence("preempted", tokens(8, 0), arrival_time=0.0)
    streamed.output_token_ids.append(7)  # preempted after its first token: its TTFT is behind it
    scheduler.add(streamed)
    now[0] = 10.0
    assert scheduler.step_budget(4) == 4 + 16, "a request that already streamed is not waiting for a first token"
    scheduler.add(ref.sequence.Sequence("young", tokens(8, 1), arrival_time=9.0))
    scheduler.add(ref.sequence.Sequence("old", tokens(8, 2), arrival_time=8.0))
    assert scheduler.step_budget(4) == 4 + 32, "the oldest request has waited 2 s: the whole room"
    now[0] = 9.0
    assert scheduler.step_budget(4) == 4 + 24, "the oldest request has waited 1 s: three quarters of the room"


# ---------------------------------------------------------------- Task 6: your stack so far


def test_task_6_your_stack_so_far():
    """Your week-3 code up to this day as one engine, on the workloads a server meets (tests/week3_stack.py)."""
    check_stack(STACK, day=4)
