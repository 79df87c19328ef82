"""Day 4.2's lab: float32, float16, 8-bit and 4-bit KV pools in the same memory, against mlx-lm's `kv_bits`.

    pdm run bench-kv-quant                       # SmolLM2 once fetched (else the embedded model)
    pdm run bench-kv-quant --quick               # 8 requests, 48 tokens each, 12 MB
    pdm run bench-kv-quant --solution student    # your src/tiny_llm/quantized_kv.py (the reference for what is unwritten)

Four figures per pool format, every pool given the same `--memory-mb` of KV memory:

- bytes per token (the formula, and the pool's arrays measured), and how many tokens the memory holds;
- the most requests (prompt + `--output-tokens`) that fit at once;
- a memory-bound workload (`--requests` chat requests arriving together, `--max-num-seqs` allowed to
  run): preemptions, peak running sequences, generated tokens/s of the whole run;
- greedy agreement with the float32 pool: teacher-forced (the float32 run's tokens fed to each pool,
  the share of positions whose argmax is the same) and free-running (requests whose whole output is
  identical).

mlx-lm runs the same requests one at a time (its `generate_step`, `kv_bits` None, 8 and 4,
quantized from the first token, its default group of 64) on the same weights in float32: its bytes
per token, tokens/s, and its own quantized outputs' agreement with its float ones. A last line
times one decode step's attention over the pool three ways: float keys, dequantize then attend
(what the pool does), and `mx.quantized_matmul` on the packed keys (what mlx-lm does).
Results: benches/results/kv_quant.json (--out) and the plot kv_quant_pools.png beside it (the
chapter's copy is book/src/images/week4-02-kv-quant.png).
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches import lab  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course import selector  # noqa: E402
from course.engines import week3_engine  # noqa: E402
from course.models import build_prompt, default_model  # noqa: E402
from course.user_errors import command, user_error  # noqa: E402

PROG = "pdm run bench-kv-quant"
FORMATS = {"float32": None, "float16": 16, "8-bit": 8, "4-bit": 4}  # label -> the engine's kv_bits
BLOCK_SIZE = 16


POOL_COLUMNS = [lab.Column("pool", "label", "{}"), lab.Column("bytes/token", "bytes_per_token", "{:,}"),
                lab.Column("x float32", "vs_float32"), lab.Column("x float16", "vs_float16"),
                lab.Column("tokens held", "tokens_held", "{:,}"), lab.Column("requests at once", "max_concurrent", "{}"),
                lab.Column("preemptions", "preemptions", "{}"), lab.Column("peak running", "peak_running", "{}"),
                lab.Column("tokens/s", "tokens_per_s", "{:.1f}"), lab.Column("x float32", "speed_vs_float32"),
                lab.Column("agreement", "teacher_forced_agreement", "{:.1%}"),
                lab.Column("same outputs", "identical_requests", "{}")]
MLX_LM_COLUMNS = [lab.Column("kv_bits", "label", "{}"), lab.Column("bytes/token", "bytes_per_token", "{:,.0f}"),
                  lab.Column("tokens/s", "tokens_per_s", "{:.1f}"), lab.Column("same outputs", "identical_requests", "{}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="kv_quant.json")
    parser.set_defaults(model=default_model())  # a trained model when fetched: agreement means something
    lab.options(parser, memory_mb=(24.0, "MB of KV memory every pool gets"), requests=16,
                output_tokens=(64, "tokens each request generates"),
                max_num_seqs=(16, "the engine's cap on running sequences"), budget=(512, "the engine's token_budget"),
                mlx_lm_requests=(4, "requests mlx-lm runs, one at a time"))
    return parser


def memory_problem(args, model, prompts) -> str | None:
    """A `--memory-mb` too small for the float32 pool to hold one request, in one line; None if it fits."""
    float32_tokens = int(args.memory_mb * 2**20) // selector.reference().quantized_kv.model_bytes_per_token(model)
    longest = max(map(len, prompts)) + args.output_tokens
    if float32_tokens < longest:
        return (f"--memory-mb {args.memory_mb:g} holds {float32_tokens} float32 tokens of this model, less than one "
                f"request ({longest}): the float32 pool could never run it")
    return None


TOPICS = ["the Roman Empire", "photosynthesis", "the printing press", "black holes", "the French Revolution",
          "machine learning", "volcanoes", "the history of jazz", "honey bees", "the Silk Road", "plate tectonics",
          "the steam engine", "coral reefs", "the Renaissance", "vaccines", "the Moon landing"]


def prompts_of(args, tokenizer) -> list[list[int]]:
    """`--requests` chat prompts asking for an essay on a topic (about 45 tokens each): text a trained model continues."""
    prompts = []
    for i in range(args.requests):
        topic = TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f", part {i // len(TOPICS) + 1}")
        text = f"Write a long, detailed essay about {topic}: its history, its key ideas, and why it matters today."
        prompts.append(tokenizer.encode(build_prompt(tokenizer, text, use_chat_template=True), add_special_tokens=False))
    return prompts


def make_engine(selection, model, tokenizer, kv_bits, args):
    """The engine under test with a pool of `--memory-mb` in the given format: the one place one is built."""
    config = dict(PLAIN_ENGINE, token_budget=args.budget, max_num_seqs=args.max_num_seqs, block_size=BLOCK_SIZE, kv_bits=kv_bits,
                  kv_cache_bytes=int(args.memory_mb * 2**20))
    return week3_engine(selection, model, tokenizer, **config)


def run_engine(selection, model, tokenizer, kv_bits, prompts, args) -> dict:
    """The memory-bound workload through one engine: every request at the start, greedy, to EOS or its last token."""
    sampling = selection.sequence.SamplingParams(max_tokens=args.output_tokens)
    engine = make_engine(selection, model, tokenizer, kv_bits, args)
    seqs = [engine.add_request(p, sampling, request_id=i) for i, p in enumerate(prompts)]
    peak_running, steps = 0, 0
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
        peak_running = max(peak_running, engine.num_running)
    wall = time.perf_counter() - start
    generated = sum(len(s.output_token_ids) for s in seqs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    pool = engine.runner.pool
    tokens_held = engine.block_manager.num_blocks * BLOCK_SIZE
    return {"num_blocks": engine.block_manager.num_blocks, "tokens_held": tokens_held,
            "pool_bytes": selection.quantized_kv.pool_nbytes(pool),
            "bytes_per_token_measured": selection.quantized_kv.pool_nbytes(pool) / tokens_held,
            "bytes_per_token": selection.quantized_kv.model_bytes_per_token(model, kv_bits),
            "max_concurrent": engine.block_manager.num_blocks // blocks_per_request(prompts, args),
            "preemptions": engine.num_preemptions, "peak_running": peak_running, "steps": steps,
            "wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "outputs": [s.output_token_ids for s in seqs]}


def blocks_per_request(prompts, args) -> int:
    """Blocks the longest request holds at its end: what "sequences that fit at once" divides by."""
    return -(-(max(map(len, prompts)) + args.output_tokens) // BLOCK_SIZE)


def teacher_forced_agreement(selection, model, kv_bits, prompts, reference_outputs) -> float:
    """Feed prompt + the float32 run's output through a pool of this format in one prefill; share of equal argmaxes."""
    ref = selector.reference()
    agree = total = 0
    for prompt, output in zip(prompts, reference_outputs):
        tokens = prompt + output
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        runner = ref.model_runner.ModelRunner(model, num_blocks, BLOCK_SIZE)
        runner.pool = selection.quantized_kv.make_kv_pool(model, num_blocks, BLOCK_SIZE, kv_bits)
        seq = ref.sequence.Sequence("agreement", tokens)
        seq.block_table = list(range(num_blocks))
        batch = runner.prepare(ref.scheduler.StepPlan(prefills=[ref.scheduler.ScheduledChunk(seq, 0, len(tokens))]))
        # The rows that predict output tokens: positions len(prompt) - 1 .. len(tokens) - 2.
        batch.sample_rows = mx.arange(len(prompt) - 1, len(tokens) - 1)
        predicted = model(batch, runner.pool).argmax(axis=-1).tolist()
        agree += sum(p == t for p, t in zip(predicted, output))
        total += len(output)
    return agree / total


def run_mlx_lm(mlx_model, prompts, kv_bits, args) -> dict:
    """mlx-lm's generate_step, one request at a time, its KV cache quantized from the first token when kv_bits is set."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    outputs, generated, wall, cache_bytes, cache_tokens = [], 0, 0.0, 0, 0
    for prompt in prompts:
        cache = make_prompt_cache(mlx_model)
        start = time.perf_counter()
        tokens = [token for token, _ in generate_step(
            mx.array(prompt), mlx_model, max_tokens=args.output_tokens, sampler=lambda x: mx.argmax(x, axis=-1),
            prompt_cache=cache, kv_bits=kv_bits, kv_group_size=64, quantized_kv_start=0)]
        wall += time.perf_counter() - start
        outputs.append([int(t) for t in tokens])
        generated += len(tokens)
        cache_bytes += sum(layer.nbytes for layer in cache)
        cache_tokens += sum(capacity_of(layer) for layer in cache) // len(cache)
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "bytes_per_token": cache_bytes / cache_tokens, "outputs": outputs}


def capacity_of(layer_cache) -> int:
    """Positions an mlx-lm layer cache has allocated (it grows in steps of 256)."""
    keys = layer_cache.keys[0] if isinstance(layer_cache.keys, (tuple, list)) else layer_cache.keys
    return keys.shape[-2]


def attention_paths(model, num_seqs: int, keys_per_seq: int, bits: int = 8, repeats: int = 10) -> dict:
    """Seconds for one decode step's attention of `num_seqs` sequences over `keys_per_seq` keys, one layer, three ways.

    Random data in the model's head layout; head_dim at least 64, the group MLX's quantize takes here.
    """
    heads, kv_heads, head_dim = model.layers[0].self_attn.num_heads, model.num_kv_heads, max(64, model.head_dim)
    group = heads // kv_heads
    q = mx.random.normal((num_seqs, kv_heads, group, head_dim))
    keys = mx.random.normal((num_seqs, kv_heads, keys_per_seq, head_dim))
    values = mx.random.normal((num_seqs, kv_heads, keys_per_seq, head_dim))
    qk, qv = mx.quantize(keys, 64, bits), mx.quantize(values, 64, bits)
    mx.eval(q, keys, values, qk, qv)

    def float_path():
        scores = mx.softmax(q @ keys.swapaxes(-1, -2), axis=-1)
        return scores @ values

    def dequantize_path():
        k, v = mx.dequantize(*qk, 64, bits), mx.dequantize(*qv, 64, bits)
        return mx.softmax(q @ k.swapaxes(-1, -2), axis=-1) @ v

    def quantized_path():
        scores = mx.softmax(mx.quantized_matmul(q, *qk, transpose=True, group_size=64, bits=bits), axis=-1)
        return mx.quantized_matmul(scores, *qv, transpose=False, group_size=64, bits=bits)

    timings = {}
    for name, path in (("float", float_path), ("dequantize then attend", dequantize_path),
                       ("mx.quantized_matmul", quantized_path)):
        mx.eval(path())
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(path())
        timings[name] = (time.perf_counter() - start) / repeats
    return timings


def plot(path: Path, pools: dict, machine: str, title: str) -> Path:
    """Three panels, one bar per pool: tokens the memory holds, preemptions, generated tokens/s."""
    labels = list(pools)
    panels = (("tokens_held", "tokens held"), ("preemptions", "preemptions"), ("tokens_per_s", "generated tokens/s"))
    with lab.figure(path, machine, ncols=3, figsize=(10, 3.3)) as (fig, axes):
        for ax, (key, panel_title) in zip(axes, panels):
            ax.bar(labels, [pools[label][key] for label in labels], color=["#888", "#aaa", "#2a7", "#7b4"])
            ax.set_title(panel_title)
            ax.tick_params(axis="x", labelsize=8)
        fig.suptitle(title)
    return path


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens, args.memory_mb = 8, 48, 12.0
        args.max_num_seqs, args.mlx_lm_requests = min(args.max_num_seqs, 8), min(args.mlx_lm_requests, 2)
    lab.check_positive(PROG, args, "requests", "output_tokens", "max_num_seqs", "budget", "mlx_lm_requests")
    if args.memory_mb <= 0:
        raise SystemExit(user_error(PROG, "--memory-mb must be > 0"))
    began = time.perf_counter()
    bench = lab.start(args, ("engine", "quantized_kv", "qwen2_week3"))
    selection, tokenizer = bench.selection, bench.tokenizer
    model = bench.week3_model()
    mlx_model = bench.mlx_model
    if any(hasattr(module, "scales") for _, module in mlx_model.named_modules()):
        from mlx_lm.utils import dequantize_model

        mlx_model = dequantize_model(mlx_model)  # mlx-lm on float32 weights too, as ours
        mx.eval(mlx_model.parameters())
    prompts = prompts_of(args, tokenizer)
    problem = memory_problem(args, model, prompts)
    if problem:
        raise SystemExit(user_error(PROG, problem))
    workload = (f"{args.requests} requests of {min(map(len, prompts))}-{max(map(len, prompts))} + {args.output_tokens} "
                f"tokens, all at once, greedy; up to {args.max_num_seqs} running; {args.memory_mb:g} MB of KV memory "
                f"for every pool")
    print(f"workload: {workload}")

    run_engine(selection, model, tokenizer, None, prompts[:1], argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    rows = {}
    for label in lab.progress(list(FORMATS), "pools"):
        rows[label] = run_engine(selection, model, tokenizer, FORMATS[label], prompts, args)
    base = rows["float32"]
    for label, row in rows.items():
        row.update(label=label, vs_float32=base["bytes_per_token"] / row["bytes_per_token"],
                   vs_float16=rows["float16"]["bytes_per_token"] / row["bytes_per_token"],
                   speed_vs_float32=row["tokens_per_s"] / base["tokens_per_s"],
                   teacher_forced_agreement=teacher_forced_agreement(selection, model, FORMATS[label], prompts,
                                                                     base["outputs"]),
                   identical_requests=f"{sum(a == b for a, b in zip(row['outputs'], base['outputs']))}/{len(prompts)}")

    mlx_prompts = prompts[: args.mlx_lm_requests]
    run_mlx_lm(mlx_model, mlx_prompts[:1], None, argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    # MLX quantizes in groups of 32, 64 or 128: mlx-lm cannot quantize smaller heads (the embedded model's 16).
    their_formats = (("float32", None), ("8-bit", 8), ("4-bit", 4)) if model.head_dim % 64 == 0 else (("float32", None),)
    if len(their_formats) == 1:
        print(f"note: mlx-lm's kv_bits needs head_dim a multiple of its group of 64; this model's is {model.head_dim}")
    theirs = {label: run_mlx_lm(mlx_model, mlx_prompts, bits, args) for label, bits in their_formats}
    for label, row in theirs.items():
        same = sum(a == b for a, b in zip(row["outputs"], theirs["float32"]["outputs"]))
        row.update(label=label, identical_requests=f"{same}/{len(mlx_prompts)}")

    lab.print_table(f"KV pools in the same memory: {workload}", POOL_COLUMNS, list(rows.values()),
                    caption="agreement: teacher-forced argmax agreement with the float32 pool; same outputs: whole "
                            "outputs identical to float32's")
    lab.print_table(f"mlx-lm, {len(mlx_prompts)} of the requests one at a time (KVCache / QuantizedKVCache, group 64)",
                    MLX_LM_COLUMNS, list(theirs.values()))
    longest = max(map(len, prompts)) + args.output_tokens
    num_seqs = min(args.max_num_seqs, args.requests)
    timings = attention_paths(model, num_seqs=num_seqs, keys_per_seq=longest)
    print(f"one layer's decode attention, {num_seqs} sequences x {longest} keys, 8-bit: "
          + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in timings.items()))

    ratios = {"tokens_held_8bit_vs_float32": rows["8-bit"]["tokens_held"] / base["tokens_held"],
              "tokens_held_8bit_vs_float16": rows["8-bit"]["tokens_held"] / rows["float16"]["tokens_held"],
              "throughput_8bit_vs_float32": rows["8-bit"]["tokens_per_s"] / base["tokens_per_s"],
              "throughput_8bit_vs_float16": rows["8-bit"]["tokens_per_s"] / rows["float16"]["tokens_per_s"],
              "ours_8bit_vs_mlx_lm_float32_tokens_per_s": rows["8-bit"]["tokens_per_s"] / theirs["float32"]["tokens_per_s"]}
    if "8-bit" in theirs:
        ratios["ours_8bit_vs_mlx_lm_8bit_tokens_per_s"] = rows["8-bit"]["tokens_per_s"] / theirs["8-bit"]["tokens_per_s"]
    print(", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    pools = {k: {f: v for f, v in row.items() if f != "outputs"} for k, row in rows.items()}
    figure = plot(bench.figure_path("pools"), pools, bench.machine,
                  f"{args.model}: KV pools in the same {args.memory_mb:g} MB, {args.requests} requests at once")
    print(f"the whole run took {time.perf_counter() - began:.0f} s (a shared machine: compare ratios, not absolute times)")
    return bench.save({"pools": pools, "mlx_lm": {k: {f: v for f, v in row.items() if f != "outputs"}
                                                  for k, row in theirs.items()},
                       "attention_s": timings, "ratios": ratios, "wall_s": time.perf_counter() - began}, [figure])


if __name__ == "__main__":
    raise SystemExit(main())
