"""Week 3 day 3: prefix caching on the paged KV pool (book/src/week3-03-prefix-caching.md).

The oracle is the engine without the cache: with the same prompts, greedy outputs must be identical
token for token, whatever the shared prefix's length relative to a block (on a boundary, one token
short, one token over), whether the sharers run at once or one after another, and under memory
pressure that evicts cached blocks. Block accounting is checked directly: no block is reused while a
sequence holds it, and the hit rate is counted exactly. Each task's tests take the student's code for
that task alone (`solution(week=3, day=3, task=N)`): Task 3's engines name blocks with the reference's
hashes (Task 1), free them with its free list (Task 2) and count with its Task 4, so a bug in one task
never costs another task's points. Task 5 runs the student's days 3.1-3.3 together with caching on
(tests/week3_stack.py), whose hit rate must be the reference engine's on the same workload.
"""

import hashlib
import random

import pytest

from tests.harness import actor_fakes, reference, solution, stack
from tests.week3_fakes import PLAIN_ENGINE, run_until_done
from tests.week3_stack import check_stack

TASKS = {n: solution(week=3, day=3, task=n) for n in range(1, 5)}  # Task N's tests: the student's Task N alone
STACK = stack(week=3, day=3)  # "your stack so far": started now, beside the collection
ref = reference()

BLOCK = 4  # small blocks: prefixes cross several of them with short prompts


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150_000) for _ in range(n)]


def make_seq(request_id, token_ids):
    """A sequence of Task 2's package (sequence.py is provided code): while grading it lives in the sandbox with
    the block manager that fills its block table, and the test reads the table back as data."""
    return TASKS[2].sequence.Sequence(request_id, token_ids)


@pytest.fixture
def week3_model(model32):
    return model32


def model_of(sol, week3_model):
    """The week-3 model of `sol`'s package, beside the engine that calls it (while grading, in the sandbox: each
    step's batch never crosses the pipe), and the tokenizer."""
    mlx_model, tokenizer = week3_model
    return sol.qwen2_week3.Qwen2ModelWeek3(mlx_model), tokenizer


def engines(sol, week3_model, monkeypatch):
    """Engines whose prefix cache is `sol`'s (the rest of the engine is the reference's)."""
    monkeypatch.setattr(sol.engine, "PrefixCachingBlockManager", sol.prefix_cache.PrefixCachingBlockManager)
    model, tokenizer = model_of(sol, week3_model)

    def make(enable_prefix_caching=True, **kwargs):
        options = dict(PLAIN_ENGINE, token_budget=64, max_num_seqs=8, block_size=BLOCK, num_blocks=64)
        options.update(kwargs, enable_prefix_caching=enable_prefix_caching)
        config = sol.engine.EngineConfig(**options)
        return sol.engine.LLMEngine(model, tokenizer, config)

    return make


@pytest.fixture
def engine_factory(week3_model, monkeypatch):
    """Engines whose prefix cache is Task 4's selection: the student's counting, the reference's Tasks 1-3."""
    return engines(TASKS[4], week3_model, monkeypatch)


@pytest.fixture
def engine_before_task_4(week3_model, monkeypatch):
    """Engines whose prefix cache is Task 3's selection: the student's sharing and naming of computed blocks, the
    reference's hashes (Task 1), free list (Task 2) and counting (Task 4); no log line asks for `hit_rate`."""
    make = engines(TASKS[3], week3_model, monkeypatch)

    def make_quiet(enable_prefix_caching=True, **kwargs):
        return make(enable_prefix_caching, log_interval=1e9, **kwargs)

    return make_quiet


def run(engine, prompts, max_tokens=6, one_at_a_time=False):
    """Greedy outputs of `prompts`, all queued at once or each run to the end before the next."""
    params = ref.sequence.SamplingParams(max_tokens=max_tokens)
    seqs = []
    for prompt in prompts:
        seqs.append(engine.add_request(prompt, params))
        if one_at_a_time:
            run_until_done(engine, rule="every request ends; a prompt found whole in the cache computes its last token")
    run_until_done(engine, rule="every request ends; a prompt found whole in the cache computes its last token")
    return [seq.output_token_ids for seq in seqs]


# ---------------------------------------------------------------- Task 1: block names


def test_task_1_hash_block_chains_parent_and_tokens():
    sol = TASKS[1]
    hash_block = sol.prefix_cache.hash_block
    a = hash_block(b"", [1, 2, 3, 4])
    assert isinstance(a, bytes) and a == hash_block(b"", [1, 2, 3, 4])
    assert a != hash_block(b"", [1, 2, 3, 5])
    assert a != hash_block(b"", [4, 3, 2, 1])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])  # the parent is part of the name
    # An independent SHA-256 of the same bytes: the name is a cryptographic hash, not Python's hash().
    expected = hashlib.sha256(a + b"".join(t.to_bytes(4, "little") for t in [5, 6, 7, 8])).digest()
    assert hash_block(a, [5, 6, 7, 8]) == expected


def test_task_1_prefix_block_hashes_names_full_blocks_only():
    sol = TASKS[1]
    names = sol.prefix_cache.prefix_block_hashes
    ids = tokens(11, 0)
    assert len(names(ids, BLOCK)) == 2  # 11 tokens: two full blocks, the partial third is unnamed
    assert len(names(ids[:8], BLOCK)) == 2 and len(names(ids[:3], BLOCK)) == 0
    assert names(ids, BLOCK) == names(ids[:8], BLOCK)
    other = ids[:4] + [ids[4] + 1] + ids[5:]
    assert names(other, BLOCK)[0] == names(ids, BLOCK)[0]
    assert names(other, BLOCK)[1] != names(ids, BLOCK)[1]
    # Same tokens in the second block behind a different first block: different name (the chain).
    swapped = [ids[0] + 1] + ids[1:]
    assert names(swapped, BLOCK)[1] != names(ids, BLOCK)[1]
    assert names(ids, BLOCK)[1] == sol.prefix_cache.hash_block(names(ids, BLOCK)[0], ids[4:8])


# ---------------------------------------------------------------- Task 2: reference counts, LRU free list


def name_block(bm, block, name):
    """Give a block a cached name directly, as `cache_computed_blocks` would. Whole attributes are set: while
    grading, the block manager is the submission's and an attribute read is a copy of its data."""
    bm.cached_blocks = {**bm.cached_blocks, name: block}
    bm.block_names = {**bm.block_names, block: name}


def test_task_2_shared_block_is_not_freed_while_referenced():
    sol = TASKS[2]
    bm = sol.prefix_cache.PrefixCachingBlockManager(num_blocks=4, block_size=BLOCK)
    a, b = make_seq("a", tokens(8, 1)), make_seq("b", tokens(8, 1))
    bm.allocate(a, 8)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 2
    assert [bm.ref_counts[x] for x in a.block_table] == [1, 1]
    shared = a.block_table[0]
    counts = bm.ref_counts
    counts[shared] += 1  # b shares a's first block, as a cache hit does
    bm.ref_counts = counts
    b.block_table = [shared]
    bm.free(a)
    assert a.block_table == [] and bm.ref_counts[shared] == 1
    assert bm.num_free_blocks == 3, "a's shared block must stay held while b references it"
    bm.allocate(make_seq("c", tokens(12, 2)), 12)  # takes every free block...
    assert bm.num_free_blocks == 0 and bm.ref_counts[shared] == 1  # ...and never b's
    bm.free(b)
    assert bm.num_free_blocks == 1 and bm.ref_counts[shared] == 0


def test_task_2_freed_named_blocks_stay_cached_until_evicted_lru():
    sol = TASKS[2]
    bm = sol.prefix_cache.PrefixCachingBlockManager(num_blocks=4, block_size=BLOCK)
    a, b = make_seq("a", tokens(8, 1)), make_seq("b", tokens(8, 2))
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    for i, block in enumerate(a.block_table + b.block_table):
        name_block(bm, block, bytes([i]))
    bm.free(a)  # a's blocks freed first: least recently used
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.cached_blocks) == 4, "freed named blocks stay in the cache"
    c = make_seq("c", tokens(4, 3))
    bm.allocate(c, 4)
    assert c.block_table[0] in a.block_table or c.block_table[0] in (0, 1)
    evicted = c.block_table[0]
    assert evicted not in bm.block_names and len(bm.cached_blocks) == 3, "reusing a block evicts its name"
    # LRU: the evicted block is one of a's (freed before b's), and a's last block goes before its first.
    a_blocks = [x for x in range(4) if x not in b.block_table]
    assert evicted in a_blocks


def test_task_2_unnamed_free_blocks_are_taken_before_cached_ones():
    sol = TASKS[2]
    bm = sol.prefix_cache.PrefixCachingBlockManager(num_blocks=4, block_size=BLOCK)
    a = make_seq("a", tokens(16, 1))
    bm.allocate(a, 16)
    table = list(a.block_table)
    name_block(bm, table[0], b"first")
    name_block(bm, table[1], b"second")
    bm.free(a)
    d = make_seq("d", tokens(8, 4))
    bm.allocate(d, 8)
    assert sorted(d.block_table) == sorted(table[2:]), "the unnamed blocks go first"
    assert len(bm.cached_blocks) == 2
    e = make_seq("e", tokens(4, 5))
    bm.allocate(e, 4)
    assert e.block_table == [table[1]], "then the least recently used named block: a sequence's tail first"
    assert b"second" not in bm.cached_blocks and b"first" in bm.cached_blocks
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq("f", tokens(8, 6)), 8)


# ---------------------------------------------------------------- Task 3: reuse and naming, in the engine


@pytest.mark.parametrize("prefix_len", [2 * BLOCK, 2 * BLOCK - 1, 2 * BLOCK + 1, 3 * BLOCK])
def test_task_3_outputs_identical_with_and_without_cache(engine_before_task_4, prefix_len):
    shared = tokens(prefix_len, 10)
    prompts = [shared + tokens(3, 20 + i) for i in range(3)] + [shared]  # the last one is the prefix alone
    plain = run(engine_before_task_4(enable_prefix_caching=False), prompts, one_at_a_time=True)
    engine = engine_before_task_4()
    cached = run(engine, prompts, one_at_a_time=True)
    assert cached == plain
    blocks = prefix_len // BLOCK
    bm = engine.block_manager
    # Every later request found the shared full blocks (the prompt-only one leaves its last token to compute).
    prompt_only_blocks = (prefix_len - 1) // BLOCK
    assert bm.hit_tokens == BLOCK * (2 * blocks + prompt_only_blocks)
    assert bm.num_free_blocks == bm.num_blocks and all(count == 0 for count in bm.ref_counts)


def test_task_3_whole_prompt_cached_still_computes_its_last_token(engine_before_task_4):
    prompt = tokens(3 * BLOCK, 11)
    engine = engine_before_task_4()
    first = run(engine, [prompt], one_at_a_time=True)
    seq = engine.add_request(prompt, ref.sequence.SamplingParams(max_tokens=6), request_id="again")
    run_until_done(engine, max_steps=50, rule="a prompt found whole in the cache still computes its last token")
    assert seq.output_token_ids == first[0]
    assert engine.block_manager.hit_tokens == 2 * BLOCK


def test_task_3_concurrent_requests_share_blocks(engine_before_task_4):
    shared = tokens(3 * BLOCK, 12)
    prompts = [shared + tokens(2 + i, 30 + i) for i in range(4)]
    plain = run(engine_before_task_4(enable_prefix_caching=False), prompts, max_tokens=8)
    engine = engine_before_task_4(token_budget=32)
    params = ref.sequence.SamplingParams(max_tokens=8)
    first = engine.add_request(prompts[0], params, request_id=0)
    engine.step()  # the first prompt is computed; its three full blocks are named
    others = [engine.add_request(p, params, request_id=i) for i, p in enumerate(prompts[1:], start=1)]
    engine.step()
    bm = engine.block_manager
    shared_blocks = first.block_table[:3]
    assert all(seq.block_table[:3] == shared_blocks for seq in others), "the later requests hold the same blocks"
    assert [bm.ref_counts[b] for b in shared_blocks] == [4, 4, 4]
    engine.abort(0)
    assert [bm.ref_counts[b] for b in shared_blocks] == [3, 3, 3], "aborting one sharer frees nothing shared"
    assert all(b not in bm.free_blocks for b in shared_blocks)
    run_until_done(engine, rule="every request ends")
    assert [seq.output_token_ids for seq in others] == plain[1:]
    assert bm.num_free_blocks == bm.num_blocks


def test_task_3_eviction_under_memory_pressure(engine_before_task_4):
    # Four prefixes, each used twice, three other requests in between. Each request holds 5 blocks:
    # a pool of 64 keeps every prefix cached, a pool of 12 must evict cached blocks to go on.
    prefixes = [tokens(2 * BLOCK, 40 + i) for i in range(4)]
    prompts = [prefixes[i % 4] + tokens(5, 50 + i) for i in range(8)]
    plain = run(engine_before_task_4(enable_prefix_caching=False, num_blocks=12), prompts, one_at_a_time=True)
    roomy = engine_before_task_4(num_blocks=64)
    assert run(roomy, prompts, one_at_a_time=True) == plain
    assert roomy.block_manager.hit_tokens == 4 * 2 * BLOCK
    engine = engine_before_task_4(num_blocks=12)
    assert run(engine, prompts, one_at_a_time=True) == plain
    bm = engine.block_manager
    assert bm.hit_tokens < 4 * 2 * BLOCK, "with 12 blocks some prefixes must have been evicted"
    assert len(bm.cached_blocks) == len(bm.block_names) <= 12
    assert all(bm.cached_blocks[name] == block for block, name in bm.block_names.items())
    assert bm.num_free_blocks == 12 and all(count == 0 for count in bm.ref_counts)


def test_task_3_preempted_requests_resume_identically_with_cache(engine_before_task_4):
    prompts = [tokens(2 * BLOCK, 60) + tokens(3, 61 + i) for i in range(4)]
    plain = run(engine_before_task_4(enable_prefix_caching=False), prompts, max_tokens=10)
    engine = engine_before_task_4(num_blocks=10)  # too small for all four to decode: preemption by recompute
    assert run(engine, prompts, max_tokens=10) == plain
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 10


# ---------------------------------------------------------------- Task 4: hit rate, logs, reset


def test_task_4_hit_rate_counts_exactly(engine_factory):
    shared = tokens(2 * BLOCK, 70)
    prompts = [shared + tokens(3, 71), shared + tokens(5, 72), tokens(7, 73)]
    engine = engine_factory()
    assert engine.prefix_cache_hit_rate == 0.0
    run(engine, prompts, one_at_a_time=True)
    looked_up = sum(len(p) for p in prompts)  # 11 + 13 + 7
    served = 2 * BLOCK  # only the second request finds blocks: the shared 8 tokens
    assert engine.block_manager.queried_tokens == looked_up
    assert engine.block_manager.hit_tokens == served
    assert engine.prefix_cache_hit_rate == pytest.approx(served / looked_up)
    assert engine.summary()["prefix_cache_hit_rate"] == pytest.approx(served / looked_up)
    assert engine_factory(enable_prefix_caching=False).prefix_cache_hit_rate == 0.0


def test_task_4_reset_forgets_cache_and_counters(engine_factory):
    prompt = tokens(3 * BLOCK + 1, 80)
    engine = engine_factory()
    run(engine, [prompt, prompt], one_at_a_time=True)
    assert engine.prefix_cache_hit_rate > 0
    engine.reset_prefix_cache()
    bm = engine.block_manager
    assert engine.prefix_cache_hit_rate == 0.0 and bm.queried_tokens == 0 and not bm.cached_blocks
    run(engine, [prompt], one_at_a_time=True)
    assert bm.hit_tokens == 0, "after a reset nothing is served from the cache"


def test_task_4_log_line_shows_hit_rate(week3_model, monkeypatch):
    sol = TASKS[4]
    monkeypatch.setattr(sol.engine, "PrefixCachingBlockManager", sol.prefix_cache.PrefixCachingBlockManager)
    model, tokenizer = model_of(sol, week3_model)
    fakes = actor_fakes(sol, "week3")  # the clock and the log sink, beside the engine that calls them
    clock = fakes.TickingClock(1.0)  # every reading one second later: a log line at every step
    log = fakes.Lines()
    config = sol.engine.EngineConfig(**{**PLAIN_ENGINE, "enable_prefix_caching": True}, token_budget=64, block_size=BLOCK,
                                     num_blocks=32, log_interval=1.0)
    engine = sol.engine.LLMEngine(model, tokenizer, config, clock=clock, log=log)
    prompt = tokens(2 * BLOCK + 1, 90)
    run(engine, [prompt, prompt], max_tokens=2, one_at_a_time=True)
    engine.step()
    assert engine.prefix_cache_hit_rate == pytest.approx(8 / 18)
    lines = log.lines
    assert any("prefix cache hit rate 44.4%" in line for line in lines), lines


# ---------------------------------------------------------------- Task 5: your stack so far


def test_task_5_your_stack_so_far():
    """Your week-3 code up to this day as one engine, on the workloads a server meets (tests/week3_stack.py)."""
    check_stack(STACK, day=3)
