"""The course's table of contents, in one place.

For each day: its title, the chapter file, the modules of `tiny_llm` a student edits that day,
and the points of each task. The test runner, the grader, the per-day standalone check, the book
check and the README's roadmap all read this table. Tasks are numbered as the chapter numbers them
and as the tests are named (`test_task_N_...`).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Day:
    week: int
    day: int
    title: str
    chapter: str  # file under book/src/
    modules: tuple[str, ...]  # modules of tiny_llm the student fills this day
    points: dict[int, int] = field(default_factory=dict)  # task number -> points
    # The model-level workload `pdm run compare` runs for this day ("" when the day has none):
    # "model" (week-1 model + simple_generate), "kv-cache" (week-2 model + simple_generate_with_kv_cache),
    # "batch" (batch_generate, prompts prefilled whole), "chunked-prefill" (batch_generate, small chunks),
    # "engine" (week 3's LLMEngine step by step on a small KV pool: scripts/compare_week3.py).
    compare: str = ""

    @property
    def key(self) -> str:
        return f"week{self.week}-day{self.day}"

    @property
    def test_file(self) -> str:
        return f"tests/test_week_{self.week}_day_{self.day}.py"


DAYS: list[Day] = [
    Day(1, 1, "Attention", "week1-01-attention.md", ("basics", "attention"), {1: 5, 2: 5}),
    Day(1, 2, "RoPE", "week1-02-rope.md", ("positional_encoding",), {1: 5, 2: 5}),
    Day(1, 3, "Grouped-query attention", "week1-03-gqa.md", ("attention",), {1: 5, 2: 5}),
    Day(1, 4, "RMSNorm and MLP", "week1-04-rmsnorm-and-mlp.md", ("layer_norm", "mlp"), {1: 5, 2: 5}),
    Day(1, 5, "The Qwen2 model", "week1-05-qwen2-model.md", ("embedding", "qwen2_week1"),
        {1: 5, 2: 5, 3: 10}, compare="model"),
    Day(1, 6, "Generating a response", "week1-06-generate-response.md", ("generate",), {1: 10}, compare="model"),
    Day(1, 7, "Sampling", "week1-07-sampling.md", ("sampler",), {1: 5, 2: 5, 3: 5}, compare="model"),
    Day(2, 1, "KV cache", "week2-01-kv-cache.md", ("kv_cache", "qwen2_week2", "generate"),
        {1: 5, 2: 5, 3: 10, 4: 10}, compare="kv-cache"),
    Day(2, 2, "Serving metrics", "week2-02-serving-metrics.md", ("metrics",), {1: 5, 2: 5, 3: 5}),
    Day(2, 3, "Quantized weights", "week2-03-quantized-weights.md", ("quantize",), {1: 5, 2: 5, 3: 10}),
    Day(2, 4, "Flash attention", "week2-04-flash-attention.md", ("flash_attention",), {1: 5, 2: 15}),
    Day(2, 5, "Batching the model", "week2-05-batching-the-model.md", ("kv_cache", "qwen2_week2"),
        {1: 5, 2: 5, 3: 10}, compare="batch"),
    Day(2, 6, "Continuous batching", "week2-06-continuous-batching.md", ("batch",), {1: 5, 2: 10, 3: 10},
        compare="batch"),
    Day(2, 7, "Chunked prefill", "week2-07-chunked-prefill.md", ("batch", "chunk_policy"),
        {1: 10, 2: 5, 3: 10, 4: 5, 5: 10, 6: 5}, compare="chunked-prefill"),
    Day(3, 1, "One forward pass under a token budget", "week3-01-token-budget.md",
        ("token_budget", "scheduler", "qwen2_week3", "model_runner", "engine"), {1: 5, 2: 10, 3: 10, 4: 10, 5: 5, 6: 60},
        compare="engine"),
    Day(3, 2, "Paged KV cache and preemption", "week3-02-paged-kv-cache.md", ("block_manager", "scheduler"),
        {1: 10, 2: 5, 3: 10, 4: 40}, compare="engine"),
    Day(3, 3, "Prefix caching", "week3-03-prefix-caching.md", ("prefix_cache",), {1: 5, 2: 10, 3: 10, 4: 5, 5: 45},
        compare="engine"),
    Day(3, 4, "Priorities and preemption", "week3-04-priorities.md",
        ("order_policy", "scheduler", "engine", "token_budget"), {1: 5, 2: 10, 3: 10, 4: 10, 5: 10, 6: 50},
        compare="engine"),
    Day(3, 5, "Serving it", "week3-05-serving.md", ("server", "text_stream"), {1: 5, 2: 5, 3: 5, 4: 10, 5: 40}),
    Day(4, 1, "Speculative decoding", "week4-01-speculative-decoding.md", ("speculative",), {1: 5, 2: 5, 3: 10, 4: 10, 5: 10, 6: 60},
        compare="engine"),
    Day(4, 2, "A quantized paged KV cache", "week4-02-quantized-kv-cache.md", ("quantized_kv",), {1: 10, 2: 10, 3: 10, 4: 40},
        compare="engine"),
    Day(4, 3, "Tensor parallelism", "week4-03-tensor-parallelism.md", ("tensor_parallel",), {1: 5, 2: 10, 3: 10, 4: 15, 5: 60}),
    Day(4, 4, "Serving across ranks", "week4-04-serving-across-ranks.md", ("distributed_engine",), {1: 10, 2: 10, 3: 15, 4: 50}),
    Day(4, 5, "Structured outputs", "week4-05-structured-outputs.md",
        # The modules that call structured.py's functions come with it, so the day's engine, server and speculation
        # (the scheduler cuts a draft where the mask refuses a guess) run them.
        ("structured", "model_runner", "engine", "openai_api", "server", "scheduler", "speculative"),
        {1: 10, 2: 30, 3: 25, 4: 35},
        compare="engine"),
]


def find_day(week: int, day: int) -> Day:
    for d in DAYS:
        if d.week == week and d.day == day:
            return d
    known = ", ".join(f"{d.week}.{d.day}" for d in DAYS)
    raise SystemExit(f"week {week} day {day} is not in the course (days: {known})")
