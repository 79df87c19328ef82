"""Continuous batching throughput at batch sizes 1, 2, 4, 8, against mlx-lm's BatchGenerator (day 2.6).

    pdm run bench-batching                     # the Qwen2-0.5B-shape model: 8 requests, 32-token prompts, 16 tokens each
    pdm run bench-batching --quick             # 8 requests of 8 tokens out: about half the time
    pdm run bench-batching --model embedded    # the tiny embedded model (seconds)
    pdm run bench-batching --solution student  # your src/tiny_llm/batch.py schedules

The same workload (every request arrives at the start, greedy, the same token budget) runs through
our day 2.6 scheduler (reference Qwen2ModelWeek2 + batch.Scheduler), week 3's engine (LLMEngine with
at most `batch` sequences running, one model call per step) and mlx-lm's BatchGenerator on the same
weights, at each batch size, in the same process. Throughput is generated tokens per second
of the whole run (prefill included). Ours is written from mlx.core operations for teaching; mlx-lm
uses fused kernels (mx.fast.*), so the ratio ours / mlx-lm shows what those are worth.
Results: benches/results/batching.json.
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

from benches.scheduler_driver import Arrival, random_prompt, run_workload  # noqa: E402
from course import selector  # noqa: E402
from course.models import BENCH, MEANINGLESS_NOTE, is_embedded, load_model, resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "batching.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-batching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH, help=f"'{BENCH}' (default), 'embedded', a path or a Hugging Face id")
    selector.add_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    parser.add_argument("--requests", type=int, default=8, help="requests in the workload (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    parser.add_argument("--prefill-step", type=int, default=128, help="our chunk size (default 128)")
    parser.add_argument("--quick", action="store_true", help="8 output tokens per request")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    return parser


def run_ours(batch_module, model, tokenizer, prompts, batch_size, args) -> dict:
    arrivals = [Arrival("short", p, args.output_tokens) for p in prompts]
    max_seq_len = args.prompt_tokens + args.output_tokens + 1
    result = run_workload(batch_module, model, tokenizer, arrivals, label=f"ours-{batch_size}",
                          batch_size=batch_size, max_seq_len=max_seq_len, prefill_step=args.prefill_step)
    tokens = sum(len(t) for t in result.outputs.values())
    return {"seconds": result.wall_s, "tokens": tokens, "tokens_per_s": tokens / result.wall_s,
            "outputs": [result.outputs[i] for i in range(len(prompts))]}


def run_week3(model3, tokenizer, prompts, batch_size, args) -> dict:
    from tiny_llm_ref.engine import EngineConfig, LLMEngine
    from tiny_llm_ref.sequence import SamplingParams

    engine = LLMEngine(model3, tokenizer, EngineConfig(token_budget=max(256, batch_size), max_num_seqs=batch_size))
    start = time.perf_counter()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=args.output_tokens)) for p in prompts]
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output_token_ids) for s in seqs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "outputs": [s.output_token_ids for s in seqs]}


def run_mlx_lm(mlx_model, tokenizer, prompts, batch_size, args) -> dict:
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(mlx_model, max_tokens=args.output_tokens,
                               stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                               completion_batch_size=batch_size, prefill_batch_size=batch_size)
    start = time.perf_counter()
    uids = generator.insert(prompts, [args.output_tokens] * len(prompts))
    outputs = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            if response.finish_reason != "stop":
                outputs[response.uid].append(response.token)
    seconds = time.perf_counter() - start
    generator.close()
    tokens = sum(len(t) for t in outputs.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "outputs": [outputs[uid] for uid in uids]}


@selector.command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.output_tokens = min(args.output_tokens, 8)
    began = time.perf_counter()
    path = resolve_model(args.model)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    selection = selector.from_arguments(args)
    batch_module = selection.batch
    selector.announce(selection)
    package = selection.package
    mlx_model, tokenizer = load_model(str(path) if args.model not in ("embedded", BENCH) else args.model)
    model = selector.reference().qwen2_week2.Qwen2ModelWeek2(mlx_model)  # the reference model serves both
    model3 = selector.reference().qwen2_week3.Qwen2ModelWeek3(mlx_model)
    machine = (f"{platform.system()} {platform.machine()}, {mx.default_device()}, {os.cpu_count()} cores, "
               f"BLAS: {fast_mlx.blas_in_use()}")
    print(f"model {args.model}; scheduler {package}.batch; {machine}")
    prompts = [random_prompt(args.prompt_tokens, seed=i) for i in range(args.requests)]
    print(f"workload: {args.requests} requests, {args.prompt_tokens}-token prompts, {args.output_tokens} tokens each")

    # Warm up both paths once, so no first-call cost lands on the first batch size.
    run_ours(batch_module, model, tokenizer, prompts[:1], 1, argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    run_mlx_lm(mlx_model, tokenizer, prompts[:1], 1, argparse.Namespace(**{**vars(args), "output_tokens": 2}))
    run_week3(model3, tokenizer, prompts[:1], 1, argparse.Namespace(**{**vars(args), "output_tokens": 2}))

    rows = []
    print(f"\n{'batch':>5s} {'day2.6 tok/s':>12s} {'week3 tok/s':>12s} {'mlx-lm tok/s':>13s} {'day2.6/mlx':>11s} "
          f"{'week3/mlx':>10s} {'same tokens':>12s}")
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        # mlx-lm runs between our two engines, so a machine that gets busier or quieter hits all three alike.
        ours = run_ours(batch_module, model, tokenizer, prompts, batch_size, args)
        theirs = run_mlx_lm(mlx_model, tokenizer, prompts, batch_size, args)
        week3 = run_week3(model3, tokenizer, prompts, batch_size, args)
        same = sum(a == b for a, b in zip(week3["outputs"], theirs["outputs"]))
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        week3_ratio = week3["tokens_per_s"] / theirs["tokens_per_s"]
        rows.append({"batch_size": batch_size, "ours": {k: v for k, v in ours.items() if k != "outputs"},
                     "week3": {k: v for k, v in week3.items() if k != "outputs"},
                     "mlx_lm": {k: v for k, v in theirs.items() if k != "outputs"}, "ratio": ratio,
                     "week3_ratio": week3_ratio, "same_outputs": f"{same}/{len(prompts)}"})
        print(f"{batch_size:5d} {ours['tokens_per_s']:12.2f} {week3['tokens_per_s']:12.2f} {theirs['tokens_per_s']:13.2f} "
              f"{ratio:11.2f} {week3_ratio:10.2f} {same:>8d}/{len(prompts)}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "model": args.model, "solution": args.solution,
              "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "prefill_step": args.prefill_step},
              "rows": rows, "wall_s": time.perf_counter() - began}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n'same tokens': week 3's greedy outputs identical to mlx-lm's (float32 sums in another order may flip a near-tie).")
    print(f"wrote {args.out}; the whole run took {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
