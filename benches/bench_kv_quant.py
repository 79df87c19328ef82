"""Day 4.2's lab: float32, float16, 8-bit and 4-bit KV pools in the same memory, against mlx-lm's `kv_bits`.

    pdm run bench-kv-quant                       # SmolLM2 once fetched (else the embedded model)
    pdm run bench-kv-quant --quick               # 8 requests, 48 tokens each, 12 MB
    pdm run bench-kv-quant --solution student    # your src/tiny_llm/quantized_kv.py

Four figures per pool format, every pool given the same `--memory-mb` of KV memory:

- bytes per token (the formula, and the pool's arrays measured), and how many tokens the memory holds;
- the most requests (prompt + `--output-tokens`) that fit at once;
- a memory-bound workload (`--requests` requests arriving together, `--max-num-seqs` allowed to run):
  preemptions, peak running sequences, generated tokens/s of the whole run;
- greedy agreement with the float32 pool: teacher-forced (the float32 run's tokens fed to each pool,
  the share of positions whose argmax is the same) and free-running (requests whose whole output is
  identical).

mlx-lm runs the same requests one at a time (its `generate_step`, `kv_bits` None, 8 and 4,
quantized from the first token, its default group of 64) on the same weights in float32: its bytes
per token, tokens/s, and its own quantized outputs' agreement with its float ones. A last table
times one decode step's attention over the pool three ways: float keys, dequantize then attend
(what the pool does), and `mx.quantized_matmul` on the packed keys (what mlx-lm does).
Results: benches/results/kv_quant.json and the plot book/src/images/week4-02-kv-quant.png
(`--replot JSON` redraws it from saved results).
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from course import selector  # noqa: E402
from course.user_errors import OneLineParser, user_error  # noqa: E402
from scripts.main import build_prompt  # noqa: E402
from course.models import MEANINGLESS_NOTE, default_model, describe_model, is_embedded, load_model, resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_quant.json"
PLOT = Path(__file__).resolve().parent.parent / "book" / "src" / "images" / "week4-02-kv-quant.png"
FORMATS = {"float32": None, "float16": 16, "8-bit": 8, "4-bit": 4}  # label -> the engine's kv_bits
BLOCK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pdm run bench-kv-quant", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="'smollm2-135m' (default once fetched), 'embedded', a path")
    selector.add_arguments(parser)
    parser.add_argument("--memory-mb", type=float, default=24.0, help="KV memory every pool gets (default 24)")
    parser.add_argument("--requests", type=int, default=16, help="requests in the workload (default 16)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens each request generates (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's cap on running sequences")
    parser.add_argument("--budget", type=int, default=512, help="the engine's token_budget (default 512)")
    parser.add_argument("--mlx-lm-requests", type=int, default=4, help="requests mlx-lm runs, one at a time")
    parser.add_argument("--quick", action="store_true", help="8 requests, 48 tokens each, 12 MB")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    parser.add_argument("--replot", type=Path, help="redraw the chapter's plot from a saved JSON, run nothing")
    return parser


def count_problem(args) -> str | None:
    """A count below 1 or memory at or below 0, in one line; None if none."""
    for name in ("requests", "output_tokens", "max_num_seqs", "budget", "mlx_lm_requests"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    return "--memory-mb must be > 0" if args.memory_mb <= 0 else None


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
    config = selection.engine.EngineConfig(token_budget=args.budget, max_num_seqs=args.max_num_seqs,
                                           block_size=BLOCK_SIZE, kv_bits=kv_bits,
                                           kv_cache_bytes=int(args.memory_mb * 2**20))
    return selection.engine.LLMEngine(model, tokenizer, config)


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


def plot(report: dict) -> None:
    """Three panels, one bar per pool: tokens the memory holds, preemptions, generated tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = report["pools"]
    labels = list(pools)
    panels = (("tokens_held", "tokens held"), ("preemptions", "preemptions"), ("tokens_per_s", "generated tokens/s"))
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, (key, title) in zip(axes, panels):
        ax.bar(labels, [pools[label][key] for label in labels], color=["#888", "#aaa", "#2a7", "#7b4"])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    memory = report["args"]["memory_mb"]
    fig.suptitle(f"{report['model']}: KV pools in the same {memory:g} MB, {report['args']['requests']} requests at once")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


@selector.command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens, args.memory_mb = 8, 48, 12.0
        args.max_num_seqs = min(args.max_num_seqs, 8)
        args.mlx_lm_requests = min(args.mlx_lm_requests, 2)
    if args.replot:
        if not args.replot.is_file():
            return user_error(build_parser().prog, f"--replot {args.replot}: no such file")
        plot(json.loads(args.replot.read_text()))
        print(f"wrote {PLOT}")
        return 0
    if count_problem(args):
        return user_error(build_parser().prog, count_problem(args))
    began = time.perf_counter()
    name = args.model or default_model()
    path = resolve_model(name)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    selection = selector.from_arguments(args)
    selector.announce(selection)
    mlx_model, tokenizer = load_model(name)
    model = selector.reference().qwen2_week3.Qwen2ModelWeek3(mlx_model)  # the reference model serves every pool
    if any(hasattr(module, "scales") for _, module in mlx_model.named_modules()):
        from mlx_lm.utils import dequantize_model

        mlx_model = dequantize_model(mlx_model)  # mlx-lm on float32 weights too, as ours
        mx.eval(mlx_model.parameters())
    machine = (f"{platform.system()} {platform.machine()}, MLX {mx.__version__} on {mx.default_device()}, "
               f"{os.cpu_count()} cores, BLAS: {fast_mlx.blas_in_use()}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"model: {describe_model(path)}\nmachine: {machine}")
    prompts = prompts_of(args, tokenizer)
    problem = memory_problem(args, model, prompts)
    if problem:
        return user_error(build_parser().prog, problem)
    print(f"workload: {args.requests} requests of {min(map(len, prompts))}-{max(map(len, prompts))} + "
          f"{args.output_tokens} tokens, all at once, "
          f"greedy; up to {args.max_num_seqs} running; {args.memory_mb:g} MB of KV memory for every pool")

    run_engine(selection, model, tokenizer, None, prompts[:1], argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    rows = {}
    for label, kv_bits in FORMATS.items():
        rows[label] = run_engine(selection, model, tokenizer, kv_bits, prompts, args)
        print(f"  {label}: {rows[label]['tokens_per_s']:.1f} tokens/s, {rows[label]['preemptions']} preemptions",
              flush=True)
    base = rows["float32"]
    for label, kv_bits in FORMATS.items():
        row = rows[label]
        row["teacher_forced_agreement"] = teacher_forced_agreement(selection, model, kv_bits, prompts, base["outputs"])
        row["identical_requests"] = sum(a == b for a, b in zip(row["outputs"], base["outputs"]))

    mlx_prompts = prompts[: args.mlx_lm_requests]
    run_mlx_lm(mlx_model, mlx_prompts[:1], None, argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    # MLX quantizes in groups of 32, 64 or 128: mlx-lm cannot quantize smaller heads (the embedded model's 16).
    their_formats = (("float32", None), ("8-bit", 8), ("4-bit", 4)) if model.head_dim % 64 == 0 else (("float32", None),)
    if len(their_formats) == 1:
        print(f"note: mlx-lm's kv_bits needs head_dim a multiple of its group of 64; this model's is {model.head_dim}")
    theirs = {label: run_mlx_lm(mlx_model, mlx_prompts, bits, args) for label, bits in their_formats}
    for row in theirs.values():
        row["identical_requests"] = sum(a == b for a, b in zip(row["outputs"], theirs["float32"]["outputs"]))

    print(f"\n{'pool':8s} {'B/token':>8s} {'x f32':>6s} {'x f16':>6s} {'tokens':>7s} {'max seqs':>8s} "
          f"{'preempt':>7s} {'peak run':>8s} {'tok/s':>7s} {'x f32':>6s} {'agree':>6s} {'same req':>8s}")
    for label, row in rows.items():
        print(f"{label:8s} {row['bytes_per_token']:8d} {base['bytes_per_token'] / row['bytes_per_token']:6.2f} "
              f"{rows['float16']['bytes_per_token'] / row['bytes_per_token']:6.2f} {row['tokens_held']:7d} "
              f"{row['max_concurrent']:8d} {row['preemptions']:7d} {row['peak_running']:8d} {row['tokens_per_s']:7.1f} "
              f"{row['tokens_per_s'] / base['tokens_per_s']:6.2f} {100 * row['teacher_forced_agreement']:5.1f}% "
              f"{row['identical_requests']:>5d}/{len(prompts)}")
    print(f"\nmlx-lm, {len(mlx_prompts)} requests one at a time (its KVCache / QuantizedKVCache, group 64):")
    print(f"{'kv_bits':8s} {'B/token':>8s} {'tok/s':>7s} {'same req':>8s}")
    for label, row in theirs.items():
        print(f"{label:8s} {row['bytes_per_token']:8.0f} {row['tokens_per_s']:7.1f} "
              f"{row['identical_requests']:>5d}/{len(mlx_prompts)}")

    longest = max(map(len, prompts)) + args.output_tokens
    timings = attention_paths(model, num_seqs=min(args.max_num_seqs, args.requests), keys_per_seq=longest)
    print(f"\none layer's decode attention, {min(args.max_num_seqs, args.requests)} sequences x {longest} keys, "
          f"8-bit: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in timings.items()))

    ratios = {"tokens_held_8bit_vs_float32": rows["8-bit"]["tokens_held"] / base["tokens_held"],
              "tokens_held_8bit_vs_float16": rows["8-bit"]["tokens_held"] / rows["float16"]["tokens_held"],
              "throughput_8bit_vs_float32": rows["8-bit"]["tokens_per_s"] / base["tokens_per_s"],
              "throughput_8bit_vs_float16": rows["8-bit"]["tokens_per_s"] / rows["float16"]["tokens_per_s"],
              "ours_8bit_vs_mlx_lm_float32_tokens_per_s": rows["8-bit"]["tokens_per_s"] / theirs["float32"]["tokens_per_s"]}
    if "8-bit" in theirs:
        ratios["ours_8bit_vs_mlx_lm_8bit_tokens_per_s"] = rows["8-bit"]["tokens_per_s"] / theirs["8-bit"]["tokens_per_s"]
    print("\n" + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "model": name, "solution": args.solution,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "pools": {k: {f: v for f, v in row.items() if f != "outputs"} for k, row in rows.items()},
              "mlx_lm": {k: {f: v for f, v in row.items() if f != "outputs"} for k, row in theirs.items()},
              "attention_s": timings, "ratios": ratios, "wall_s": time.perf_counter() - began}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report)
    print(f"wrote {args.out} and {PLOT}; the whole run took {report['wall_s']:.0f} s (machine shared: ratios, not absolute times)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
