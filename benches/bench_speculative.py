"""Day 4.1's lab: speculative decoding with prompt lookup, on text that copies from its prompt and text that does not.

    pdm run bench-speculative                      # SmolLM2-135M once fetched: 4 prompts per workload, k = 2, 4, 6
    pdm run bench-speculative --quick              # 2 prompts per workload, 64 tokens, k = 4
    pdm run bench-speculative --solution student   # your src/tiny_llm (the reference where unwritten)
    pdm run bench-speculative --model embedded     # the tiny embedded model (seconds; figures mean nothing)
    pdm run bench-speculative --fixed              # also each k without the back-off: what adapting is worth

Two workloads of chat prompts, each request alone (batch 1, greedy): "copy" asks for text that is in
the prompt (repeat, correct, annotate), "fresh" for new text (a story, an explanation, tips, a
description). Every prompt runs through week 3's engine without speculation, through day 4.1's
engine with n-gram prompt lookup at each k, and through mlx-lm's `BatchGenerator` on the same
weights, one after the other, prompt by prompt, in this one run. Figures: decode tokens/s (tokens
after the first over the time after the first), ITL mean and p99, tokens per model call (the same on
any machine, however loaded: what the guesses gain before their cost), the acceptance rate, and whether
the text is identical to the engine's without speculation; then what one model call costs for a
chunk of k + 1 tokens against a decode step (speculation pays only when that ratio is well below the
tokens a verify chunk gains). `--clock cpu` measures CPU seconds, steadier than wall time on a busy
shared machine.
"""

from course import fast_mlx

fast_mlx.setup()

import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches import lab, runner  # noqa: E402
from benches.engines import MlxLm, Speculative, Week3  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from benches.workloads import Arrival  # noqa: E402
from course.models import default_model  # noqa: E402
from course.user_errors import user_error  # noqa: E402

PROG = "pdm run bench-speculative"
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
WORKLOADS = {
    "copy": [
        "Repeat this code exactly, without any comment:\n\n" + CODE,
        "Repeat this paragraph word for word:\n\n" + PARAGRAPH,
        "Fix the spelling in this text and write it out in full: "
        + PARAGRAPH.replace("discussion", "discusion").replace("committee", "comittee"),
        "Add a docstring to each function and write out the whole code:\n\n" + CODE,
    ],
    "fresh": [
        "Write a short story about a lighthouse keeper who finds a strange bottle.",
        "Explain how a refrigerator works to a ten-year-old.",
        "Give three tips for learning a new language, with a sentence on each.",
        "Describe a walk through a busy market in the morning.",
    ],
}
COLUMNS = [lab.Column("configuration", "label", "{}"), lab.Column("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
           lab.Column("vs engine", "vs_engine", "{:.2f}x"), lab.Column("vs mlx-lm", "vs_mlx_lm", "{:.2f}x"),
           lab.Column("ITL mean ms", "itl_mean_ms", "{:.1f}"), lab.Column("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
           lab.Column("tokens/step", "tokens_per_step", "{:.2f}"), lab.Column("accepted", "acceptance_rate", "{:.0%}"),
           lab.Column("same text", "identical_to_engine", "{}")]


def build_parser():
    parser = lab.parser(PROG, __doc__, out="speculative.json")
    parser.set_defaults(model=default_model())
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6], help="speculative tokens to sweep (default 2 4 6)")
    lab.options(parser, max_tokens=(128, "output tokens per request"), prompts=(4, "prompts per workload, 1 .. 4"))
    parser.add_argument("--fixed", action="store_true",
                        help="also run each k with no back-off (every decode always guesses k tokens)")
    parser.add_argument("--clock", choices=sorted(runner.CLOCKS), default="wall",
                        help="wall (default) or cpu: this process's CPU seconds, steadier on a busy machine")
    return parser


def encode(tokenizer, text: str) -> list[int]:
    """A chat prompt where the tokenizer has a chat template (instruct models), the plain text otherwise."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def figures(label: str, runs: list, baseline: list | None) -> dict:
    """One configuration over a workload's prompts: decode tokens/s, ITLs, acceptance, identical text."""
    times = [run.metrics.requests[0].token_times for run in runs]
    tokens = sum(len(t) - 1 for t in times)
    seconds = sum(t[-1] - t[0] for t in times if len(t) > 1)
    itls = [b - a for t in times for a, b in zip(t, t[1:])]
    proposed = sum(run.counters.get("speculative_proposed", 0) for run in runs)
    accepted = sum(run.counters.get("speculative_accepted", 0) for run in runs)
    same = None if baseline is None else all(r.outputs[0] == b.outputs[0] for r, b in zip(runs, baseline))
    generated = sum(len(run.outputs[0]) for run in runs)
    return {"label": label, "decode_tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_step": generated / sum(run.steps for run in runs),  # whatever the load: the method's gain
            "itl_mean_ms": 1000 * sum(itls) / len(itls) if itls else None,
            "itl_p99_ms": 1000 * runner.percentile(itls, 99) if itls else None,
            "proposed": proposed, "acceptance_rate": accepted / proposed if proposed else None,
            "identical_to_engine": None if same is None else ("yes" if same else "NO"),
            "outputs": [run.outputs[0] for run in runs]}


def step_costs(bench, model, lengths: list[int], offset: int = 150, repeats: int = 7) -> dict:
    """Median seconds of one model call running a chunk of each length at `offset` (every row sampled), one
    sequence alone: what a verify chunk of k + 1 tokens costs against a decode step (length 1)."""
    speculative, scheduler = bench.selection.speculative, bench.selection.scheduler
    runner_ = speculative.SpeculativeRunner(bench.selection.model_runner.ModelRunner(model, 64, 16))
    seq = bench.selection.sequence.Sequence("cost", list(range(100, 100 + offset + max(lengths))))
    seq.block_table = list(range(64))
    times = {n: [] for n in lengths}
    for _ in range(repeats):  # lengths interleaved: a busy spell hits them all
        for n in lengths:
            seq.num_computed_tokens = offset
            plan = scheduler.StepPlan()
            if n == 1:
                plan.decodes.append(scheduler.ScheduledChunk(seq, offset, 1))
            else:
                plan.prefills.append(speculative.VerifyChunk(seq, offset, n, seq.token_ids[offset + 1 : offset + n]))
            start = time.perf_counter()
            mx.eval(runner_.run(plan))
            times[n].append(time.perf_counter() - start)
    base = statistics.median(times[1])
    return {str(n): {"median_s": statistics.median(t), "vs_decode": statistics.median(t) / base} for n, t in times.items()}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.k = 2, 64, [4]
    if not 1 <= args.prompts <= 4:
        raise SystemExit(user_error(PROG, "--prompts must be 1 .. 4"))
    if args.max_tokens < 2 or any(k < 1 for k in args.k):
        raise SystemExit(user_error(PROG, "--max-tokens must be >= 2 and every --k >= 1"))
    bench = lab.start(args, ("engine", "speculative", "qwen2_week3"))
    model, tokenizer, selection = bench.week3_model(), bench.tokenizer, bench.selection
    config = dict(PLAIN_ENGINE, token_budget=256, max_num_seqs=4, block_size=16, num_blocks=64)
    makers = {"engine": lambda: Week3(selection, model, tokenizer, **config)}
    for k in args.k:
        makers[f"n-gram k={k}"] = lambda k=k: Speculative(selection, model, tokenizer, num_speculative_tokens=k,
                                                          **config)
        if args.fixed:
            makers[f"n-gram k={k} fixed"] = lambda k=k: Speculative(selection, model, tokenizer, num_speculative_tokens=k,
                                                                    adaptive=False, **config)
    makers["mlx-lm"] = lambda: MlxLm(bench.mlx_model, tokenizer, batch_size=1)
    clock = runner.CLOCKS[args.clock]
    print(f"{args.prompts} prompts per workload, {args.max_tokens} tokens each, batch 1, greedy, {args.clock} clock")
    warm = [Arrival("warm-up", encode(tokenizer, "Hello"), 4)]
    for label, make in makers.items():  # first calls pay for allocations and thread start-up
        runner.run(make(), warm, label, clock=clock)

    results = {}
    for workload, texts in WORKLOADS.items():
        runs = {label: [] for label in makers}
        for text in texts[: args.prompts]:  # every configuration on one prompt, then the next: a busy spell hits all
            arrival = Arrival(workload, encode(tokenizer, text), args.max_tokens)
            for label, make in makers.items():
                runs[label].append(runner.run(make(), [arrival], label, clock=clock, max_steps=4 * args.max_tokens))
        rows = [figures(label, r, None if label == "engine" else runs["engine"]) for label, r in runs.items()]
        engine_tps, mlx_lm_tps = rows[0]["decode_tokens_per_s"], rows[-1]["decode_tokens_per_s"]
        for row in rows:
            row["vs_engine"] = row["decode_tokens_per_s"] / engine_tps
            row["vs_mlx_lm"] = row["decode_tokens_per_s"] / mlx_lm_tps
        lab.print_table(f"workload {workload}", COLUMNS, rows)
        results[workload] = rows
    costs = step_costs(bench, model, [1] + [k + 1 for k in args.k])
    print("one sequence at offset 150, wall clock: " + ", ".join(
        f"{n} token{'s' * (n != '1')} {1000 * c['median_s']:.0f} ms ({c['vs_decode']:.2f}x)" for n, c in costs.items()))
    return bench.save({"clock": args.clock, "workloads": results, "step_costs": costs},
                      plots=[plot_speedups(bench, results, args)])


TARGETS = {"copy": 1.5, "fresh": 0.95}  # the course's goals: gain on copied text, lose little elsewhere


def plot_speedups(bench, results: dict, args):
    """Per workload, each configuration's decode tokens/s over the engine's without speculation, the goals dashed."""
    path = bench.figure_path("speedup")
    with lab.figure(path, bench.machine, ncols=len(results), figsize=(5 * len(results), 3.6), sharex=True) as (fig, axes):
        for ax, (workload, rows) in zip(axes, results.items()):
            ax.barh([row["label"] for row in rows], [row["vs_engine"] for row in rows],
                    color=["tab:gray" if row["label"] in ("engine", "mlx-lm") else "tab:blue" for row in rows])
            ax.axvline(1.0, color="black", linewidth=0.8)
            if workload in TARGETS:
                ax.axvline(TARGETS[workload], color="tab:red", linestyle="--", linewidth=1, label=f"goal {TARGETS[workload]}x")
                ax.legend(fontsize=8, loc="lower right")
            ax.invert_yaxis()
            ax.set(title=f"{workload}: {args.prompts} prompts x {args.max_tokens} tokens, batch 1",
                   xlabel="decode tokens/s vs engine without speculation")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
