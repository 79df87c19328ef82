"""Week 3 Day 1: one forward pass under a token budget (book/src/week3-01-token-budget.md).

Oracles: a fake runner that simulates the paged pool and predicts tokens by hashing the whole
sequence (tests/week3_fakes.py), for plans, budgets and outputs without a model; mlx-lm's own Qwen2,
one request at a time, for the fused call's logits and the engine's greedy outputs; MLX's argmax
and random draws for sampling; hand-made measurements for the budget policy.

Day 3.2's part of scheduler.py (`Scheduler.preempt`) comes from the reference here. Task 2's tests take the
student's Task 2 alone (`planner_engine`: Task 5's sequence updates are the reference's), so each task passes
once it is written.
Task 6 runs all of today's code together as one engine (tests/week3_stack.py).
"""

import random

import mlx.core as mx
import pytest

from tests.harness import actor_fakes, fetch, reference, solution, stack
from tests.week3_fakes import (EOS, PLAIN_ENGINE, FakeTokenizer, FakeWeek3Model, TraceRunner, block_size_of,
                                fake_expected, mlx_lm_greedy, outputs_of, replay, run_until_done,
                                trace_runner)
from tests.week3_stack import check_stack

STACK = stack(week=3, day=1)  # "your stack so far": started now, beside the collection
sol = solution(week=3, day=1)
ref = reference()

@pytest.fixture
def engine_module():
    """The engine module under test (day 3.2's parts of the scheduler come from the reference: the selector)."""
    return sol.engine


@pytest.fixture(scope="module")
def real(model32):
    """(Qwen2ModelWeek3 under test, mlx-lm model, tokenizer) on the embedded weights, float32."""
    mlx_model, tokenizer = model32
    return sol.qwen2_week3.Qwen2ModelWeek3(mlx_model), mlx_model, tokenizer


def fake_engine(package, **kwargs):
    """`package`'s engine over the trace runner; its fake model and tokenizer built beside it (read at every step).
    Check its run with `replay(engine, block_size_of(**kwargs), outputs)`."""
    fakes = actor_fakes(package)
    config = package.engine.EngineConfig(**{**PLAIN_ENGINE, **kwargs})
    engine = package.engine.LLMEngine(fakes.FakeWeek3Model(), fakes.FakeTokenizer(), config)
    engine.runner = trace_runner(package, engine)
    return engine


def planner_engine(**kwargs):
    """An engine of Task 2's selection (the student's planner, the reference's Task 5 sequence updates
    `update_from_output` and `append_token`): the planner is tested before Task 5 is written."""
    return fake_engine(solution(week=3, day=1, task=2), **kwargs)


def random_prompts(n, seed, longest=40):
    rng = random.Random(seed)
    return [[rng.randrange(0, EOS) for _ in range(rng.randint(1, longest))] for _ in range(n)]


# ---------------------------------------------------------------- Task 1: the token budget


def test_task_1_adaptive_budget_holds_the_target():
    fixed = sol.token_budget.FixedTokenBudget(48)
    assert fixed.budget(0) == fixed.budget(7) == 48
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sol.token_budget.FixedTokenBudget(0)
    policy = sol.token_budget.AdaptiveTokenBudget(target_itl=0.5, max_num_batched_tokens=512, min_tokens=8,
                                                  initial_tokens=32, smoothing=1.0)
    assert policy.budget(0) == 512  # nobody decodes: nobody waits
    assert policy.budget(4) == 4  # no base yet: a decode-only step measures it
    policy.observe_step(104, 4, 1.2)  # a mixed step before any decode-only one: no base to subtract, nothing learnt
    assert policy.seconds_per_token(0) is None and policy.budget(4) == 4
    policy.observe_step(4, 4, 0.2)  # decode-only: the base cost of a step
    assert policy.budget(4) == 32  # no per-token cost yet
    policy.observe_step(104, 4, 1.2)  # 100 prefill tokens added 1.0 s
    assert policy.base_seconds[4] == pytest.approx(0.2)
    assert policy.seconds_per_token(0) == pytest.approx(0.01)
    assert policy.budget(4) == 4 + 30  # (0.5 - 0.2) / 0.01 prefill tokens beside the 4 decodes
    policy.observe_step(4, 4, 0.6)  # a slow decode step leaves less room: the floor
    assert policy.budget(4) == 8
    policy.observe_step(4, 4, 0.0)
    policy.observe_step(14, 4, 0.001)
    assert policy.budget(4) == 512  # the ceiling


def test_task_1_adaptive_budget_relative_target_and_smoothing():
    policy = sol.token_budget.AdaptiveTokenBudget(target_itl=None, decode_multiple=3.0, max_num_batched_tokens=1000,
                                                  min_tokens=1, initial_tokens=10, smoothing=0.5)
    policy.observe_step(2, 2, 0.1)
    policy.observe_step(2, 2, 0.3)  # moving average: 0.2
    assert policy.base_seconds[2] == pytest.approx(0.2)
    policy.observe_step(42, 2, 0.6)  # 40 tokens added 0.4 s
    assert policy.budget(2) == 2 + 40  # target 3 x 0.2 = 0.6 s: 0.4 s of room at 0.01 s per token
    for bad in (dict(target_itl=-1.0), dict(min_tokens=0), dict(min_tokens=50, initial_tokens=10),
                dict(smoothing=0.0), dict(decode_multiple=1.0)):
        with pytest.raises(ValueError):
            sol.token_budget.AdaptiveTokenBudget(**bad)


def test_task_1_base_per_number_of_decodes():
    # A machine where a plain step costs 0.1 s plus 0.1 s a decode (each decode's attention and sampling), and a
    # prefill token 0.01 s. A base measured with 1 decode must not be used for a step with 4.
    policy = sol.token_budget.AdaptiveTokenBudget(target_itl=0.8, max_num_batched_tokens=512, min_tokens=1,
                                                  initial_tokens=32, smoothing=1.0)
    policy.observe_step(1, 1, 0.2)
    policy.observe_step(21, 1, 0.2 + 20 * 0.01)  # 1 decode and 20 prefill tokens: 0.01 s a token
    assert policy.budget(1) == 1 + 60  # (0.8 - 0.2) / 0.01
    assert policy.budget(4) == 4, "no decode-only step with 4 decodes measured yet: one measures it"
    policy.observe_step(24, 4, 0.5 + 20 * 0.01)  # before its base is known, a 4-decode step teaches nothing
    assert policy.seconds_per_token(0) == pytest.approx(0.01), "a 4-decode step's time split with a 1-decode base"
    policy.observe_step(4, 4, 0.5)
    assert policy.base_seconds == {1: pytest.approx(0.2), 4: pytest.approx(0.5)}
    assert policy.budget(4) == 4 + 30, "(0.8 - 0.5) / 0.01 prefill tokens beside 4 decodes"
    policy.observe_step(34, 4, 0.5 + 30 * 0.01)
    assert policy.seconds_per_token(0) == pytest.approx(0.01)
    assert policy.budget(1) == 1 + 60 and policy.budget(4) == 4 + 30
    # A target in decode steps is in steps of as many decodes: 2 x 0.5 s with 4 decoding.
    relative = sol.token_budget.AdaptiveTokenBudget(target_itl=None, decode_multiple=2.0, max_num_batched_tokens=512,
                                                    min_tokens=1, initial_tokens=32, smoothing=1.0)
    for num_tokens, decodes, seconds in ((1, 1, 0.2), (4, 4, 0.5), (24, 4, 0.7)):
        relative.observe_step(num_tokens, decodes, seconds)
    assert relative.budget(4) == 4 + 50 and relative.budget(1) == 1 + 20


def test_task_1_budget_fills_the_step_time_the_policy_allows():
    """`budget` sizes the step for `step_seconds(waited)`: day 3.4's goodput budget moves that time with the queue's
    age (its `step_seconds` is the reference's here), and the same budget code must follow it."""
    policy = sol.token_budget.GoodputTokenBudget(target_ttft=2.0, target_itl=0.75, max_num_batched_tokens=512,
                                                 min_tokens=1, initial_tokens=32, smoothing=1.0)
    policy.observe_step(4, 4, 0.25)
    policy.observe_step(68, 4, 1.25)  # 1/64 s a prefill token
    assert policy.budget(4, 0, 0.0) == 4 + 16  # nobody waits: half the 0.5 s of room above a decode step
    assert policy.budget(4, 0, 5.0) == 4 + 32  # past the TTFT target: all of it
    assert policy.budget(0, 0, 5.0) == 512  # nobody decodes: nobody waits on the step


def test_task_1_cost_grows_with_the_offset():
    # Hand-made steps of a machine where a prefill token costs 0.01 s + 0.00001 s per key before it.
    policy = sol.token_budget.AdaptiveTokenBudget(target_itl=0.5, max_num_batched_tokens=512, min_tokens=8,
                                                  initial_tokens=32, smoothing=0.5)
    policy.observe_step(4, 4, 0.2)
    for offset in (0, 400, 800):  # 20 prefill tokens each, starting ever later in a long prompt
        policy.observe_step(24, 4, 0.2 + 20 * (0.01 + 1e-5 * offset), offset)
    # Moving averages (smoothing 0.5): offset 500, 0.015 s per token; the line through the points has slope 1e-5.
    assert policy.seconds_per_token(1600) == pytest.approx(0.026)
    assert policy.budget(4, 900) == 4 + 15  # 0.3 s of room at 0.019 s per token
    assert policy.budget(4, 1600) == 4 + 11  # at 0.026 s per token
    # Below the recent offsets the line is not trusted: their average cost, 0.015 s.
    assert policy.seconds_per_token(0) == pytest.approx(0.015)
    assert policy.budget(4, 100) in (4 + 19, 4 + 20)  # 0.3 s / 0.015 s, whichever way the division rounds
    # A cost that falls with the offset is noise: the line never slopes down.
    policy.observe_step(24, 4, 0.2 + 20 * 0.001, 1200)
    assert policy.seconds_per_token(5000) == pytest.approx(policy.seconds_per_token(0))


def test_task_1_late_chunks_stay_within_the_target():
    # A simulated long prompt beside 4 decodes: each chunk starts where the last one ended.
    def step_seconds(prefill_tokens, offset):
        return 0.2 + prefill_tokens * (0.004 + 2e-5 * offset)

    policy = sol.token_budget.AdaptiveTokenBudget(target_itl=0.5, max_num_batched_tokens=512, min_tokens=1,
                                                  initial_tokens=32, smoothing=0.5)
    policy.observe_step(4, 4, step_seconds(0, 0))
    offset, seconds = 0, []
    for _ in range(40):
        chunk = policy.budget(4, offset) - 4
        seconds.append(step_seconds(chunk, offset))
        policy.observe_step(4 + chunk, 4, seconds[-1], offset)
        offset += chunk
    assert offset > 800, "the prompt advanced too little: budgets far below the target"
    # The first two chunks cannot know the slope yet; from then on the line predicts every step.
    assert max(seconds[2:]) <= 0.5 + 1e-9, f"steps over the 0.5 s target: {[round(s, 3) for s in seconds]}"
    assert min(seconds[2:]) >= 0.5 - step_seconds(1, offset) + 0.2, "steps a whole token under the target"


def test_task_1_the_engine_shrinks_late_chunks():
    # The whole loop on a simulated machine: the fake runner advances the engine's clock by 0.2 s a
    # step plus, per prefill token, 0.004 s and 0.000005 s per key before it. The reference's engine
    # and scheduler run the policy under test, so this passes once Task 1 is written.
    now = [0.0]
    config = ref.engine.EngineConfig(**PLAIN_ENGINE, token_budget=256, max_num_seqs=8)
    engine = ref.engine.LLMEngine(FakeWeek3Model(), FakeTokenizer(), config, clock=lambda: now[0])
    engine.scheduler.token_budget = sol.token_budget.AdaptiveTokenBudget(
        target_itl=0.5, max_num_batched_tokens=256, min_tokens=16, initial_tokens=64)
    runner = engine.runner = TraceRunner(engine, eos=False)  # the reference's engine, here: the runner is local
    plans = []

    def timed_run(plan):
        plans.append(plan)
        now[0] += 0.2 + sum(chunk.length * (0.004 + 5e-6 * chunk.start) for chunk in plan.prefills)
        return TraceRunner.run(runner, plan)

    runner.run = timed_run
    for i in range(4):
        engine.add_request([1, 2], ref.sequence.SamplingParams(max_tokens=400), request_id=i)
    for _ in range(3):
        engine.step()  # the prompts, then decode-only steps: the base
    long = engine.add_request([3] * 2000, ref.sequence.SamplingParams(max_tokens=1), request_id="long")
    chunks, seconds = [], []
    for _ in range(200):
        if long.status == ref.sequence.SequenceStatus.FINISHED:
            break
        start = now[0]
        engine.step()
        if plans[-1].prefills:  # (the prompt's last token runs as a decode)
            chunks.append(plans[-1].prefills[0].length)
            seconds.append(now[0] - start)
    assert long.status == ref.sequence.SequenceStatus.FINISHED, f"the long prompt did not finish in 200 steps: {chunks}"
    # Two chunks measure the line; from then on every step lands within the target (to 0.1%).
    assert max(seconds[2:]) <= 0.5 * 1.001, f"steps over the 0.5 s target: {[round(s, 3) for s in seconds]}"
    assert chunks[-2] < chunks[2] / 2, f"late chunks must be smaller: {chunks}"


# ---------------------------------------------------------------- Task 2: the planner


@pytest.mark.parametrize("budget", [4, 5, 9, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_task_2_budget_never_exceeded_decodes_never_starved(budget, seed):
    engine = planner_engine(token_budget=budget, max_num_seqs=4, block_size=4)
    prompts = random_prompts(7, seed)
    rng = random.Random(seed)
    pending = list(enumerate(prompts))
    alone = {}  # request id -> its one-at-a-time generation
    for _ in range(1000):  # a planner that stops making progress fails below instead of hanging
        if not (pending or engine.has_work()):
            break
        if pending and rng.random() < 0.4:  # requests arrive while others run
            i, prompt = pending.pop(0)
            max_tokens = rng.randint(1, 9)
            engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=max_tokens), request_id=i)
            alone[i] = fake_expected(prompt, max_tokens)
        # Whole lists and each list's fields at once: while grading, the engine is the submission's (round trips).
        scheduler = engine.scheduler
        running = scheduler.running
        decoding = [s for s, (is_decoding,) in zip(running, fetch(running, "is_decoding")) if is_decoding]
        plan = scheduler.schedule()
        [(num_tokens, decodes, prefills, chunks, is_empty)] = fetch([plan], "num_tokens", "decodes", "prefills",
                                                                    "chunks", "is_empty")
        assert num_tokens <= budget
        decode_fields = fetch(decodes, "seq", "length")
        assert [seq for seq, _ in decode_fields] == decoding, "every decoding sequence gets its token, first"
        assert all(length == 1 for _, length in decode_fields)
        assert not any(is_decoding for (is_decoding,) in fetch(prefills, "seq.is_decoding"))
        assert len({id(seq) for (seq,) in fetch(chunks, "seq")}) == len(chunks), "one chunk per sequence"
        if not pending and engine.has_work():
            assert not is_empty
        if not is_empty:
            scheduler.update_from_output(plan, engine.runner.run(plan))
    assert not (pending or engine.has_work()), \
        f"the planner made no progress in 1000 steps (every request ends): {len(engine.scheduler.waiting)} waiting"
    replay(engine, 4, alone)  # every block read back whole; each request sampled what it samples alone


def test_task_2_fills_the_budget_with_several_prefills():
    engine = planner_engine(token_budget=16, max_num_seqs=8, block_size=4)
    for i, n in enumerate([5, 6, 7]):
        engine.add_request(list(range(1, n + 1)), ref.sequence.SamplingParams(max_tokens=3), request_id=i)
    plan = engine.scheduler.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefills] == [(0, 0, 5), (1, 0, 6), (2, 0, 5)]
    assert not plan.decodes and plan.num_tokens == 16
    assert [c.samples for c in plan.prefills] == [True, True, False]
    engine.scheduler.update_from_output(plan, engine.runner.run(plan))
    # Prompts 0 and 1 sampled their first token, each read back whole through its blocks.
    replay(engine, 4, {i: fake_expected(list(range(1, n + 1)), 1) for i, n in enumerate([5, 6])})
    plan = engine.scheduler.schedule()  # two decodes first, then the rest of prompt 2
    assert [(c.seq.request_id, c.start, c.length) for c in plan.decodes] == [(0, 5, 1), (1, 6, 1)]
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefills] == [(2, 5, 2)]


def test_task_2_respects_max_num_seqs():
    engine = planner_engine(token_budget=64, max_num_seqs=2)
    for i in range(4):
        engine.add_request([1, 2, 3], ref.sequence.SamplingParams(max_tokens=4), request_id=i)
    plan = engine.scheduler.schedule()
    assert len(plan.prefills) == 2 and engine.num_running == 2 and engine.num_waiting == 2


@pytest.mark.parametrize("budget", [3, 8, 200])
def test_task_2_outputs_equal_one_at_a_time(budget):
    engine = planner_engine(token_budget=budget, max_num_seqs=3, block_size=2)
    prompts = random_prompts(6, seed=budget)
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=12)) for p in prompts]
    run_until_done(engine, rule="every request ends")
    outputs = outputs_of(seqs)
    replay(engine, 2, outputs)  # what the runner fed and sampled, checked here: every block read back whole
    for prompt, output in zip(prompts, outputs.values()):
        assert output == fake_expected(prompt, 12)


# ---------------------------------------------------------------- Task 3: the ragged model


def run_plan(model, plan_chunks, pool_blocks=64, block_size=4, pool=None):
    """Run one ragged step of (seq, start, length) chunks through `model` with the reference runner's layout."""
    runner = ref.model_runner.ModelRunner.__new__(ref.model_runner.ModelRunner)
    runner.model, runner.block_size = model, block_size
    runner.pool = pool if pool is not None else model.make_kv_pool(pool_blocks, block_size)
    plan = ref.scheduler.StepPlan()
    for seq, start, length in plan_chunks:
        chunk = ref.scheduler.ScheduledChunk(seq, start, length)
        (plan.decodes if length == 1 and start > 0 else plan.prefills).append(chunk)
    logits = model(runner.prepare(plan), runner.pool)
    mx.eval(logits)
    return plan, logits, runner.pool


def make_seq(request_id, tokens, first_block, package=ref):
    """A sequence of `package` (while grading, the student's is built in the sandbox, beside the code it meets)."""
    seq = package.sequence.Sequence(request_id, tokens)
    seq.block_table = list(range(first_block, first_block + 8))
    return seq


def test_task_3_fused_logits_equal_separate_calls(real):
    model, mlx_model, _ = real
    rng = random.Random(3)
    a, b, c = ([rng.randrange(100, 5000) for _ in range(n)] for n in (9, 13, 6))
    seq_a, seq_b, seq_c = make_seq("a", a, 0), make_seq("b", b, 8), make_seq("c", c, 16)
    # Step 1: a's whole prompt but its last token, b's first 10 tokens (neither samples).
    _, logits, pool = run_plan(model, [(seq_a, 0, 8), (seq_b, 0, 10)])
    assert logits.shape[0] == 0, "chunks that do not reach their sequence's end produce no logits"
    # Step 2, one call: a's last token (a decode), b's last 3 tokens (a chunk), c's whole prompt.
    plan, logits, _ = run_plan(model, [(seq_a, 8, 1), (seq_b, 10, 3), (seq_c, 0, 6)], pool=pool)
    assert logits.shape == (3, mlx_model.args.vocab_size)
    for row, tokens in enumerate((a, b, c)):
        alone = mlx_model(mx.array([tokens]))[0, -1]
        assert mx.allclose(logits[row], alone, atol=2e-4, rtol=1e-4).item(), f"row {row}"


def test_task_3_no_attention_bias_means_zero(model32):
    """A Llama-family checkpoint has no q/k/v biases: the model must run it as zero biases."""
    from mlx.utils import tree_map
    from mlx_lm.models import qwen2 as mlx_qwen2

    mlx_model, _ = model32
    zeroed = mlx_qwen2.Model(mlx_model.args)
    zeroed.update(tree_map(lambda p: p, mlx_model.parameters()))
    for layer in zeroed.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = mx.zeros_like(proj.bias)
    no_bias = sol.qwen2_week3.Qwen2ModelWeek3(zeroed)
    for layer in zeroed.model.layers:  # now drop them altogether, as a Llama checkpoint has none
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            del proj["bias"]
    without = sol.qwen2_week3.Qwen2ModelWeek3(zeroed)
    tokens = [5, 17, 300, 42, 9]
    _, expected, _ = run_plan(no_bias, [(make_seq("x", tokens, 0), 0, 5)])
    _, got, _ = run_plan(without, [(make_seq("x", tokens, 0), 0, 5)])
    assert mx.allclose(expected, got, atol=1e-5).item()


# ---------------------------------------------------------------- Task 4: the model runner


def test_task_4_prepare_lays_out_the_plan(real):
    model, _, _ = real
    runner = sol.model_runner.ModelRunner(model, num_blocks=16, block_size=4)
    seq_a = make_seq("a", list(range(10, 16)), 0, sol)  # 6 tokens, 5 computed: a decode at position 5
    seq_a.block_table = [7, 3]
    seq_b = make_seq("b", list(range(20, 30)), 0, sol)  # a chunk of 3 at positions 4..6 (does not sample)
    seq_b.block_table = [1, 9]
    plan = sol.scheduler.StepPlan(decodes=[sol.scheduler.ScheduledChunk(seq_a, 5, 1)],
                                  prefills=[sol.scheduler.ScheduledChunk(seq_b, 4, 3)])
    batch = runner.prepare(plan)
    assert batch.token_ids.tolist() == [15, 24, 25, 26]
    assert batch.positions.tolist() == [5, 4, 5, 6]
    assert batch.write_slots.tolist() == [3 * 4 + 1, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2]
    assert batch.num_decodes == 1
    assert batch.decode_key_slots.tolist() == [[28, 29, 30, 31, 12, 13]]
    assert batch.decode_mask.shape == (1, 1, 1, 6) and batch.decode_mask.max().item() == 0
    assert batch.sample_rows.tolist() == [0]
    (chunk,) = batch.chunks
    assert chunk.length == 3 and chunk.key_slots.tolist() == [4, 5, 6, 7, 36, 37, 38]
    assert mx.array_equal(chunk.mask, ref.attention.causal_mask(3, 7, chunk.mask.dtype)).item()  # day 2.7's chunk mask


def test_task_4_decode_view_masks_padding(real):
    model, _, _ = real
    runner = sol.model_runner.ModelRunner(model, num_blocks=16, block_size=4)
    short, long = make_seq("s", [1, 2], 0, sol), make_seq("l", [1, 2, 3, 4, 5], 8, sol)
    slots, mask = runner.decode_view([sol.scheduler.ScheduledChunk(short, 1, 1),
                                      sol.scheduler.ScheduledChunk(long, 4, 1)])
    assert slots.shape == (2, 5) and slots[1].tolist() == [32, 33, 34, 35, 36] and slots[0, :2].tolist() == [0, 1]
    assert mask.shape == (2, 1, 1, 5)
    assert mask[0, 0, 0].tolist() == [0, 0, -float("inf"), -float("inf"), -float("inf")]
    assert mask[1].max().item() == 0


def test_task_4_sampling_per_sequence(real):
    model, _, _ = real
    runner = sol.model_runner.ModelRunner(model, num_blocks=4, block_size=4)
    logits = mx.random.normal((3, 50), key=mx.random.key(1))
    greedy = sol.sequence.Sequence("g", [1])
    top1 = sol.sequence.Sequence("k", [1], ref.sequence.SamplingParams(temperature=1.0, top_k=1))
    seeded = sol.sequence.Sequence("s", [1], ref.sequence.SamplingParams(temperature=1.0, seed=7))
    tokens = runner.sample(logits, [greedy, top1, seeded])
    assert tokens[:2] == mx.argmax(logits[:2], axis=-1).tolist()  # top_k 1 is greedy whatever the temperature
    again = runner.sample(logits[::-1], [seeded, top1, greedy])
    assert again[0] == tokens[2], "a seeded sequence draws the same token whatever shares its batch"


# ---------------------------------------------------------------- Task 5: updating sequences from a step


@pytest.mark.parametrize("budget,order", [(4, "forward"), (7, "reverse"), (32, "staggered"), (512, "forward")])
def test_task_5_outputs_equal_one_at_a_time_mlx_lm(engine_module, real, budget, order):
    model, mlx_model, tokenizer = real
    rng = random.Random(budget)
    prompts = [[rng.randrange(100, 5000) for _ in range(n)] for n in (3, 17, 9, 30)]
    expected = [mlx_lm_greedy(mlx_model, p, 6, tokenizer.eos_token_ids) for p in prompts]
    engine = engine_module.LLMEngine(model, tokenizer,
                                     engine_module.EngineConfig(**PLAIN_ENGINE, token_budget=budget, max_num_seqs=4,
                                                                block_size=4))
    indices = list(range(len(prompts)))[::-1] if order == "reverse" else list(range(len(prompts)))
    seqs = {}
    for i in indices:
        seqs[i] = engine.add_request(prompts[i], ref.sequence.SamplingParams(max_tokens=6), request_id=i)
        if order == "staggered":
            engine.step()  # the next request arrives while this one runs
    run_until_done(engine, rule="every request ends at EOS or max_tokens")
    assert [seqs[i].output_token_ids for i in range(len(prompts))] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_task_5_step_outputs():
    engine = fake_engine(sol, token_budget=64)
    prompt = [3, 1, 4, 1, 5]
    expected, reason = fake_expected(prompt, 5)
    engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=5), request_id="r")
    outputs = run_until_done(engine, rule="a request ends at max_tokens")
    assert all(o.request_id == "r" for o in outputs)
    assert [o.token for o in outputs if o.token is not None] == expected
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].finish_reason == reason
    assert engine.generation_tokens_total == len(expected) and engine.prompt_tokens_total == len(prompt)
    replay(engine, block_size_of(token_budget=64), {"r": (expected, reason)})


def test_task_5_eos_ends_a_sequence_without_a_token():
    engine = fake_engine(sol)
    for i in range(40):  # find a prompt whose generation meets EOS
        prompt = [i, i + 1]
        expected, reason = fake_expected(prompt, 30)
        if reason == "stop":
            break
    seq = engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=30))
    outputs = run_until_done(engine, rule="a request ends at EOS")
    assert seq.output_token_ids == expected and seq.finish_reason == "stop"
    replay(engine, block_size_of(), outputs_of([seq]))  # the EOS the runner sampled ended it
    assert (outputs[-1].token, outputs[-1].finished, outputs[-1].finish_reason) == (None, True, "stop")


def test_task_5_ignore_eos_runs_past_eos():
    """A request with `ignore_eos` keeps EOS as an output token and runs to max_tokens (the scheduler's ends_at_eos)."""
    engine = fake_engine(sol)
    for i in range(40):  # a prompt whose generation meets EOS
        prompt = [i, i + 1]
        expected, reason = fake_expected(prompt, 30)
        if reason == "stop":
            break
    seq = engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=30, ignore_eos=True))
    outputs = run_until_done(engine, rule="a request that ignores EOS ends at max_tokens")
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 30
    assert seq.output_token_ids[len(expected)] == EOS, "EOS is an output token of a request that ignores it"
    assert [o.token for o in outputs] == seq.output_token_ids
    replay(engine, block_size_of(), outputs_of([seq]))


def test_task_4_sampled_and_greedy_rows_see_the_logits_processing(engine_module, real):
    """A logit_bias of 100 on one token makes it every token, greedy or sampled: `sample` picks from the processed logits."""
    model, _, tokenizer = real
    engine = engine_module.LLMEngine(model, tokenizer, engine_module.EngineConfig(**PLAIN_ENGINE, token_budget=64,
                                                                                        block_size=4))
    forced = {1234: 100.0}
    seqs = [engine.add_request([5, 6, 7], ref.sequence.SamplingParams(max_tokens=4, logit_bias=forced, **extra))
            for extra in ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.7, "top_p": 0.5})]
    plain = engine.add_request([5, 6, 7], ref.sequence.SamplingParams(max_tokens=4))
    run_until_done(engine, max_steps=50, rule="every request ends at max_tokens")
    assert [seq.output_token_ids for seq in seqs] == [[1234] * 4] * 3
    assert plain.output_token_ids != [1234] * 4, "a request without a bias is not biased"


def test_task_5_bad_requests_rejected_before_the_model_runs():
    engine = fake_engine(sol, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([])
    with pytest.raises(TypeError, match="prompt"):
        engine.add_request(3.5)
    with pytest.raises(TypeError, match="sampling"):
        engine.add_request([1], sampling={"max_tokens": 3})
    with pytest.raises(ValueError, match="max_tokens"):
        ref.sequence.SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="never fit"):
        engine.add_request([1] * 10, ref.sequence.SamplingParams(max_tokens=8))  # 17 positions > 16 slots
    valid = engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1], request_id="x")
    assert engine.runner.num_plans == 0
    run_until_done(engine, rule="the valid request ends")  # only it runs
    ran = replay(engine, 4, outputs_of([valid])).trace
    assert {request_id for plan in ran for request_id, *_ in plan} == {"x"}


# ---------------------------------------------------------------- Task 6: your stack so far


def test_task_6_your_stack_so_far():
    """Your week-3 code up to this day as one engine, on the workloads a server meets (tests/week3_stack.py)."""
    check_stack(STACK, day=1)
