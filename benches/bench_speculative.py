"""Day 4.1's lab: speculative decoding with prompt lookup, on text that copies from its prompt and text that does not.

    pdm run bench-speculative                      # SmolLM2-135M (fetched), k = 2, 4, 6
    pdm run bench-speculative --quick              # fewer prompts and tokens, k = 4
    pdm run bench-speculative --solution student   # your src/tiny_llm (the reference where unwritten)
    pdm run bench-speculative --model embedded     # the tiny embedded model (seconds; figures mean nothing)

Two workloads of chat prompts, each request run alone (batch 1, greedy): "copy" asks for text that is
in the prompt (repeat, fix, extract), "fresh" for new text (stories, explanations). Every prompt runs
through week 3's engine without speculation, through day 4.1's engine with n-gram prompt lookup at
each k, and through mlx-lm's own `stream_generate` on the same weights, in this one run. Figures:
decode tokens/s (tokens after the first over the time after the first), ITL mean and p99, the
acceptance rate, and whether the text is identical to the engine's without speculation (`--clock cpu`
measures CPU seconds instead of wall time, steadier on a busy shared machine). Results:
benches/results/speculative.json (speculative_quick.json with --quick).
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402

from course import selector  # noqa: E402
from course.models import MEANINGLESS_NOTE, default_model, is_embedded, load_model, resolve_model  # noqa: E402
from tiny_llm_ref.metrics import percentile  # noqa: E402
from tiny_llm_ref.sequence import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((value - m) ** 2 for value in values) / len(values)
'''
PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long "
             "discussion, the members agreed to fund the reading room, the children's corner and the "
             "archive, but postponed the decision on the cafe until the next meeting in March.")
COPY_PROMPTS = [
    "Repeat this code exactly, without any comment:\n\n" + CODE,
    "Repeat this paragraph word for word:\n\n" + PARAGRAPH,
    "Fix the spelling in this text and write it out in full: " + PARAGRAPH.replace("discussion", "discusion")
    .replace("committee", "comittee"),
    "Add a docstring to each function and write out the whole code:\n\n" + CODE,
]
FRESH_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a strange bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Give three tips for learning a new language, with a sentence on each.",
    "Describe a walk through a busy market in the morning.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M once fetched)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6], help="speculative tokens to sweep")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload (at most 4)")
    parser.add_argument("--quick", action="store_true", help="2 prompts per workload, 64 tokens, k = 4")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU seconds, steadier than wall time on a shared, busy machine")
    selector.add_arguments(parser)
    return parser


def encode(tokenizer, text: str) -> list[int]:
    """A chat prompt where the tokenizer has a chat template (instruct models), the plain text otherwise."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def decode_figures(times: list[float]) -> dict:
    """From the times every token arrived: decode tokens/s after the first token, ITLs."""
    itls = [b - a for a, b in zip(times, times[1:])]
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"decode_tokens": len(times) - 1, "decode_s": decode_s, "itls_s": itls}


def run_engine(make_engine, prompt: list[int], max_tokens: int, clock) -> dict:
    """One request alone through a fresh engine; its tokens, their arrival times and the engine's summary."""
    engine = make_engine()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    times = []
    for _ in range(4 * max_tokens + len(prompt)):  # every step moves the request: this is far more than enough
        if not engine.has_work():
            break
        outputs = engine.step()
        now = clock()
        times += [now for o in outputs if o.token is not None]
    return {"tokens": seq.output_token_ids, **decode_figures(times), "summary": engine.summary()}


def run_mlx_lm(mlx_model, tokenizer, prompt: list[int], max_tokens: int, clock) -> dict:
    """mlx-lm's own generation on the same weights (greedy: its default sampler)."""
    tokens, times = [], []
    for response in stream_generate(mlx_model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        if response.finish_reason == "stop":
            break  # the end-of-sequence token: not part of the output
        tokens.append(response.token)
        times.append(clock())
    return {"tokens": tokens, **decode_figures(times)}


def aggregate(label: str, runs: list[dict], baseline: list[dict] | None) -> dict:
    """One row of the table: decode tokens/s over all prompts, ITLs, acceptance, identical text."""
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    itls = [x for r in runs for x in r["itls_s"]]
    proposed = sum(r.get("summary", {}).get("speculative_proposed", 0) for r in runs)
    accepted = sum(r.get("summary", {}).get("speculative_accepted", 0) for r in runs)
    return {"label": label, "decode_tokens_per_s": tokens / seconds if seconds else None,
            "itl_mean_s": sum(itls) / len(itls) if itls else None, "itl_p99_s": percentile(itls, 99),
            "acceptance_rate": accepted / proposed if proposed else None, "proposed": proposed,
            "identical_to_engine": None if baseline is None else
            all(r["tokens"] == b["tokens"] for r, b in zip(runs, baseline))}


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.k = 2, 64, [4]
    if not 1 <= args.prompts <= 4:
        raise SystemExit("--prompts must be 1 .. 4")
    if args.max_tokens < 2 or any(k < 1 for k in args.k):
        raise SystemExit("--max-tokens must be >= 2 and every --k >= 1")
    name = args.model or default_model()
    path = resolve_model(name)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    selection = selector.from_arguments(args)
    engine_module, speculative, qwen2_week3 = selection.engine, selection.speculative, selection.qwen2_week3
    selector.announce(selection)
    mlx_model, tokenizer = load_model(name)
    model = qwen2_week3.Qwen2ModelWeek3(mlx_model)
    common = dict(max_num_batched_tokens=256, max_num_seqs=4, block_size=16, num_blocks=64)

    configs = {"engine": lambda: engine_module.LLMEngine(model, tokenizer, **common)}
    for k in args.k:
        configs[f"n-gram k={k}"] = (lambda k=k: speculative.SpeculativeEngine(
            model, tokenizer, proposer=speculative.NgramProposer(), num_speculative_tokens=k, **common))
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, device {mx.default_device()}, " \
              f"BLAS {fast_mlx.blas_in_use()}"
    print(f"model {name} ({path.name}), {args.solution} solution, {machine}")
    print(f"{args.prompts} prompts per workload, {args.max_tokens} tokens each, batch 1, greedy")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"clock: {args.clock} seconds")
    warm = encode(tokenizer, "Hello")
    for make in configs.values():
        run_engine(make, warm, 4, clock)
    run_mlx_lm(mlx_model, tokenizer, warm, 4, clock)

    results = {}
    for workload, texts in (("copy", COPY_PROMPTS), ("fresh", FRESH_PROMPTS)):
        prompts = [encode(tokenizer, text) for text in texts[: args.prompts]]
        runs = {label: [] for label in [*configs, "mlx-lm"]}
        for prompt in prompts:  # every configuration on one prompt, then the next: a busy spell hits all alike
            for label, make in configs.items():
                runs[label].append(run_engine(make, prompt, args.max_tokens, clock))
            runs["mlx-lm"].append(run_mlx_lm(mlx_model, tokenizer, prompt, args.max_tokens, clock))
        rows = [aggregate(label, r, None if label == "engine" else runs["engine"]) for label, r in runs.items()]
        base = rows[0]["decode_tokens_per_s"]
        mlx_lm_tps = rows[-1]["decode_tokens_per_s"]
        print(f"\nworkload {workload}:")
        print(f"{'':14s} {'tokens/s':>9s} {'vs engine':>10s} {'vs mlx-lm':>10s} {'ITL mean ms':>12s} "
              f"{'ITL p99 ms':>11s} {'accepted':>9s} {'same text':>10s}")
        for row in rows:
            row["vs_engine"] = row["decode_tokens_per_s"] / base
            row["vs_mlx_lm"] = row["decode_tokens_per_s"] / mlx_lm_tps
            accepted = "" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f}%"
            same = "" if row["identical_to_engine"] is None else ("yes" if row["identical_to_engine"] else "NO")
            print(f"{row['label']:14s} {row['decode_tokens_per_s']:9.1f} {row['vs_engine']:9.2f}x "
                  f"{row['vs_mlx_lm']:9.2f}x {1000 * row['itl_mean_s']:12.1f} {1000 * row['itl_p99_s']:11.1f} "
                  f"{accepted:>9s} {same:>10s}")
        results[workload] = {"rows": rows, "outputs": {label: [r["tokens"] for r in rs] for label, rs in runs.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("speculative_quick.json" if args.quick else "speculative.json")
    out.write_text(json.dumps({"args": vars(args), "model": name, "machine": machine, "results": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
