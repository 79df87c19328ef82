"""Week 3's lab: one forward pass under a token budget against mlx-lm's BatchGenerator and day 2.7, side by side.

    pdm run bench-token-budget                   # the Qwen2-0.5B-shape model, float32 (the issue's full workload)
    pdm run bench-token-budget --quick           # shorter prompts and outputs
    pdm run bench-token-budget --quick --long-after-tokens 2 --clock cpu   # on a busy shared machine: CPU seconds
    pdm run bench-token-budget --model embedded  # the tiny embedded model (seconds; the figures mean nothing)
    pdm run bench-token-budget --skip mixed      # only the head-of-line workload

Workloads (random prompt token ids, greedy, every request runs to its token budget):
  hol:   4 short requests (64 prompt + 64 output tokens) at t=0; a 1,536-token prompt (16 output
         tokens) arrives at t=4 s. Its prefill is what stalls the short requests' tokens.
  mixed: 20% long prompts, 80% short ones, Poisson arrivals (mean gap 1 s), a fixed seed.
Engines, each on the same weights, run one after the other, mlx-lm and ours alternating so that a
busy machine slows both alike: mlx-lm's BatchGenerator at prefill_step_size 64, 256 and 2048; day
2.7's Scheduler (prefill_step 256); week 3's LLMEngine at a few fixed token budgets and with the
adaptive budget. For each: the short requests' TTFT and ITL percentiles, the long prompt's TTFT,
output tokens/s (output tokens over first arrival to last finish), and the ratios against mlx-lm's
best (lowest ITL p99 among its step sizes; highest throughput). Results: benches/results/week3_hol.json
(with every token's timestamp) and plots week3_hol_itl.png, week3_budget_sweep.png.
"""

from course import fast_mlx

fast_mlx.setup()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benches.scheduler_driver import percentile, random_prompt  # noqa: E402
from course.models import BENCH, MEANINGLESS_NOTE, is_embedded, load_model, resolve_model  # noqa: E402
from tiny_llm_ref import batch as day27  # noqa: E402
from tiny_llm_ref.engine import EngineConfig, LLMEngine  # noqa: E402
from tiny_llm_ref.metrics import MetricsRecorder  # noqa: E402
from tiny_llm_ref.qwen2_week2 import Qwen2ModelWeek2  # noqa: E402
from tiny_llm_ref.qwen2_week3 import Qwen2ModelWeek3  # noqa: E402
from tiny_llm_ref.sequence import SamplingParams  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RECOMMENDED = "week3 adaptive"


@dataclass
class Arrival:
    kind: str  # "short" or "long"
    prompt: list[int]
    max_tokens: int
    at: float  # seconds after the start
    after_tokens: int | None = None  # or: once every earlier request has this many tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run bench-token-budget", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH, help=f"'{BENCH}' (default), 'embedded', a path or a Hugging Face id")
    parser.add_argument("--quick", action="store_true", help="shorter prompts and outputs")
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--long-at", type=float, default=4.0, help="when the long prompt arrives (s, default 4)")
    parser.add_argument("--long-after-tokens", type=int, metavar="N",
                        help="instead: once every short request has N tokens (the same moment on a slow or busy machine)")
    parser.add_argument("--budgets", default="32,64,256", help="week 3's fixed token budgets (comma-separated)")
    parser.add_argument("--decode-multiple", type=float, default=2.5,
                        help="the adaptive budget's target: this many plain decode steps per step (default 2.5)")
    parser.add_argument("--mlx-steps", default="64,256,2048", help="mlx-lm's prefill_step_size values")
    parser.add_argument("--mixed-requests", type=int, default=10)
    parser.add_argument("--skip", default="", help="'mixed', 'hol' (workloads) or 'day27' (engine), comma-separated")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="'cpu': time in this process's CPU seconds (all threads), which other processes on a "
                             "busy shared machine do not inflate; use with --long-after-tokens")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plots of a saved results file")
    return parser


def apply_quick(args) -> None:
    args.short_tokens, args.short_output = min(args.short_tokens, 32), min(args.short_output, 24)
    args.long_tokens, args.long_output, args.long_at = min(args.long_tokens, 512), min(args.long_output, 8), 2.0
    args.mixed_requests = min(args.mixed_requests, 5)


def hol_workload(args) -> list[Arrival]:
    shorts = [Arrival("short", random_prompt(args.short_tokens, seed=i), args.short_output, 0.0) for i in range(4)]
    return shorts + [Arrival("long", random_prompt(args.long_tokens, seed=100), args.long_output, args.long_at,
                             args.long_after_tokens)]


def mixed_workload(args) -> list[Arrival]:
    rng, at, arrivals = random.Random(3), 0.0, []
    for i in range(args.mixed_requests):
        long = i % 5 == 1
        arrivals.append(Arrival("long" if long else "short",
                                random_prompt(args.long_tokens if long else args.short_tokens, seed=300 + i),
                                args.long_output if long else args.short_output, at))
        at += rng.expovariate(1.0)
    return arrivals


# ---------------------------------------------------------------- one driver loop, three engines


class Week3Adapter:
    def __init__(self, model, tokenizer, config):
        self.engine = LLMEngine(model, tokenizer, config)

    def add(self, idx, arrival):
        self.engine.add_request(arrival.prompt, SamplingParams(max_tokens=arrival.max_tokens), request_id=idx)

    def has_work(self):
        return self.engine.has_work()

    def step(self):
        return [(o.request_id, o.token, o.finished) for o in self.engine.step()]


class Day27Adapter:
    def __init__(self, model, tokenizer, prefill_step, max_seq_len):
        self.scheduler = day27.Scheduler(model, tokenizer, max_seq_len=max_seq_len, batch_size=5,
                                         prefill_step=prefill_step, log=lambda line: None)
        self.requests = {}

    def add(self, idx, arrival):
        self.requests[idx] = self.scheduler.add_request(arrival.prompt, idx, max_tokens=arrival.max_tokens)

    def has_work(self):
        return self.scheduler.has_work()

    def step(self):
        before = {i: len(r.output_tokens) for i, r in self.requests.items()}
        self.scheduler.step()
        events = []
        for i, r in self.requests.items():
            for token in r.output_tokens[before[i]:]:
                events.append((i, token, False))
            if r.is_done and before[i] is not None:
                events.append((i, None, True))
        for i, r in list(self.requests.items()):
            if r.is_done:
                del self.requests[i]
        return events


class MlxLmAdapter:
    def __init__(self, mlx_model, tokenizer, prefill_step):
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(mlx_model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                                        completion_batch_size=8, prefill_batch_size=8,
                                        prefill_step_size=prefill_step)
        self.uid_to_idx = {}

    def add(self, idx, arrival):
        (uid,) = self.generator.insert([arrival.prompt], [arrival.max_tokens])
        self.uid_to_idx[uid] = idx

    def has_work(self):
        return bool(self.uid_to_idx)

    def step(self):
        _, responses = self.generator.next()
        events = []
        for r in responses:
            idx = self.uid_to_idx[r.uid]
            finished = r.finish_reason is not None
            events.append((idx, r.token if r.finish_reason != "stop" else None, finished))
            if finished:
                del self.uid_to_idx[r.uid]
        return events

    def close(self):
        self.generator.close()


def due(arrival: Arrival, metrics: MetricsRecorder, elapsed: float) -> bool:
    if arrival.after_tokens is None:
        return arrival.at <= elapsed
    return all(r.output_tokens >= arrival.after_tokens or r.finish is not None for r in metrics.requests.values())


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = CLOCKS["wall"]


def run(adapter, arrivals: list[Arrival], label: str) -> dict:
    """Feed arrivals when due, step while there is work; record every token's time."""
    clock = CLOCK
    metrics = MetricsRecorder(clock=clock)
    pending = list(enumerate(arrivals))
    steps = 0
    start = clock()
    while pending or adapter.has_work():
        while pending and due(pending[0][1], metrics, clock() - start):
            idx, arrival = pending.pop(0)
            metrics.arrive(idx, len(arrival.prompt))
            if arrival.after_tokens is None:
                metrics.requests[idx].arrival = start + arrival.at  # its due time, even if a step ran late
            adapter.add(idx, arrival)
        if adapter.has_work():
            for idx, token, finished in adapter.step():
                if token is not None:
                    metrics.token(idx)
                if finished:
                    metrics.finish(idx)
            steps += 1
        elif pending:
            time.sleep(0.01)
    if hasattr(adapter, "close"):
        adapter.close()
    return summarize(label, metrics, arrivals, start, steps)


def summarize(label: str, metrics: MetricsRecorder, arrivals: list[Arrival], start: float, steps: int) -> dict:
    timelines = metrics.requests
    shorts = [i for i, a in enumerate(arrivals) if a.kind == "short"]
    longs = [i for i, a in enumerate(arrivals) if a.kind == "long"]
    itls = [gap for i in shorts for gap in timelines[i].itls]
    ttfts = [timelines[i].ttft for i in shorts if timelines[i].ttft is not None]
    long_ttfts = [timelines[i].ttft for i in longs if timelines[i].ttft is not None]
    makespan = max(r.finish for r in timelines.values()) - min(r.arrival for r in timelines.values())
    output = sum(r.output_tokens for r in timelines.values())
    return {
        "label": label, "steps": steps,
        "short_itl_p50_s": percentile(itls, 50), "short_itl_p99_s": percentile(itls, 99),
        "short_ttft_p50_s": percentile(ttfts, 50), "short_ttft_p99_s": percentile(ttfts, 99),
        "long_ttft_mean_s": sum(long_ttfts) / len(long_ttfts) if long_ttfts else None,
        "longest_stall_s": max(itls) if itls else None,
        "makespan_s": makespan, "output_tokens": output, "output_tokens_per_s": output / makespan,
        "token_times": {str(i): [t - start for t in r.token_times] for i, r in timelines.items()},
        "kinds": {str(i): a.kind for i, a in enumerate(arrivals)},
    }


# ---------------------------------------------------------------- report


HEADER = (f"{'engine':<24s} {'ITL p50':>8s} {'ITL p99':>8s} {'TTFT p50':>9s} {'long TTFT':>9s} "
          f"{'out tok/s':>9s} {'ITL p99 / mlx best':>18s} {'tok/s / mlx best':>16s}")


def print_table(title: str, rows: list[dict]) -> None:
    mlx_rows = [r for r in rows if r["label"].startswith("mlx-lm")]
    best_itl = min(r["short_itl_p99_s"] for r in mlx_rows)
    best_tps = max(r["output_tokens_per_s"] for r in mlx_rows)
    print(f"\n{title}  (short requests' ITL and TTFT, seconds; output tokens/s over the whole run)")
    print(HEADER)
    for r in rows:
        long_ttft = "-" if r["long_ttft_mean_s"] is None else f"{r['long_ttft_mean_s']:.2f}"
        print(f"{r['label']:<24s} {r['short_itl_p50_s']:8.3f} {r['short_itl_p99_s']:8.3f} {r['short_ttft_p50_s']:9.2f} "
              f"{long_ttft:>9s} {r['output_tokens_per_s']:9.2f} {r['short_itl_p99_s'] / best_itl:18.2f} "
              f"{r['output_tokens_per_s'] / best_tps:16.2f}")


def ratios(rows: list[dict], label: str) -> dict:
    mlx_rows = [r for r in rows if r["label"].startswith("mlx-lm")]
    best_itl = min(mlx_rows, key=lambda r: r["short_itl_p99_s"])
    best_tps = max(mlx_rows, key=lambda r: r["output_tokens_per_s"])
    ours = next(r for r in rows if r["label"] == label)
    best_ttft = min(r["short_ttft_p50_s"] for r in mlx_rows)
    return {
        "engine": label, "mlx_lm_best_itl": best_itl["label"], "mlx_lm_best_throughput": best_tps["label"],
        "itl_p99_ratio_vs_mlx_lm_best": ours["short_itl_p99_s"] / best_itl["short_itl_p99_s"],
        "throughput_ratio_vs_mlx_lm_best": ours["output_tokens_per_s"] / best_tps["output_tokens_per_s"],
        "ttft_p50_ratio_vs_mlx_lm_best": ours["short_ttft_p50_s"] / best_ttft,
    }


def plot(results: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = results["hol"]["rows"]
    shown = [r for r in rows if r["label"] in (RECOMMENDED, results["hol"]["ratios"]["mlx_lm_best_itl"],
                                               results["hol"]["ratios"]["mlx_lm_best_throughput"], "day2.7 step 256")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r, style in zip(shown, ("o", ".", "x", "+")):
        points = []
        for i, kind in r["kinds"].items():
            if kind == "short":
                times = r["token_times"][i]
                points += [(b, b - a) for a, b in zip(times, times[1:])]
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=r["label"], alpha=0.7)
    if results["args"].get("long_after_tokens") is None:
        ax.axvline(results["args"]["long_at"], color="gray", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("gap to the previous token (s)")
    ax.set_title("short requests' inter-token latency while a long prompt prefills")
    ax.legend(fontsize=8)
    fig.text(0.99, 0.01, results["machine"], ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out_dir / "week3_hol_itl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    sweep = [r for r in rows if r["label"].startswith("week3")]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(sweep))
    ax.plot(x, [r["short_itl_p99_s"] for r in sweep], "o-", label="week 3: short ITL p99 (s)")
    best = min(r["short_itl_p99_s"] for r in rows if r["label"].startswith("mlx-lm"))
    ax.axhline(best, color="C0", ls=":", label="mlx-lm best ITL p99")
    ax.set_xticks(list(x), [r["label"].replace("week3 ", "") for r in sweep])
    ax.set_ylabel("seconds")
    ax2 = ax.twinx()
    ax2.plot(x, [r["output_tokens_per_s"] for r in sweep], "^--", color="C1", label="week 3: output tokens/s")
    ax2.axhline(max(r["output_tokens_per_s"] for r in rows if r["label"].startswith("mlx-lm")), color="C1", ls=":",
                label="mlx-lm best tokens/s")
    ax2.set_ylim(bottom=0)
    lines, lines2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title("token budget sweep on the head-of-line workload")
    fig.text(0.99, 0.01, results["machine"], ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out_dir / "week3_budget_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


def configs(args, mlx_model, model2, model3, tokenizer, arrivals, workload: str):
    """(label, make_adapter) in run order: mlx-lm and ours alternating."""
    max_seq_len = max(len(a.prompt) + a.max_tokens for a in arrivals) + 1
    mlx = [(f"mlx-lm step {s}", lambda s=s: MlxLmAdapter(mlx_model, tokenizer, s)) for s in args.mlx_steps]
    adaptive = EngineConfig(token_budget=2048, adaptive_budget=True, decode_multiple=args.decode_multiple, max_num_seqs=8)
    ours = [(RECOMMENDED, lambda: Week3Adapter(model3, tokenizer, adaptive))]
    ours += [(f"week3 budget {b}", lambda b=b: Week3Adapter(model3, tokenizer, EngineConfig(token_budget=b, max_num_seqs=8)))
             for b in args.budgets]
    if workload == "mixed":
        mlx, ours = mlx[:2], ours[:2]
    elif "day27" not in args.skip:
        ours.append(("day2.7 step 256", lambda: Day27Adapter(model2, tokenizer, 256, max_seq_len)))
    order = []
    for i in range(max(len(mlx), len(ours))):
        order += mlx[i : i + 1] + ours[i : i + 1]
    return order


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads(args.replot.read_text())
        print("wrote", ", ".join(plot(results, args.out)))
        return 0
    if args.quick:
        apply_quick(args)
    if args.clock == "cpu" and args.long_after_tokens is None:
        print("--clock cpu needs --long-after-tokens (arrival times in wall seconds would mean nothing)")
        return 2
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    args.mlx_steps = [int(s) for s in args.mlx_steps.split(",") if s]
    began = time.perf_counter()
    path = resolve_model(args.model)
    if is_embedded(path):
        print(MEANINGLESS_NOTE)
    mlx_model, tokenizer = load_model(str(path) if args.model not in ("embedded", BENCH) else args.model)
    model2, model3 = Qwen2ModelWeek2(mlx_model), Qwen2ModelWeek3(mlx_model)
    blas = fast_mlx.blas_in_use().split(" (")[0]
    machine = (f"{platform.system()} {platform.machine()}, MLX {mx.__version__} on {mx.default_device()}, "
               f"{os.cpu_count()} cores, BLAS: {blas}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"model {args.model}; {machine}")
    # Warm-up: first-call costs must not land on whichever engine runs first.
    warm = [Arrival("short", random_prompt(8, 0), 2, 0.0)]
    run(Week3Adapter(model3, tokenizer, 64), warm, "warm")
    run(MlxLmAdapter(mlx_model, tokenizer, 64), warm, "warm")

    results = {"machine": machine, "model": args.model,
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    workloads = {} if "hol" in args.skip else {"hol": hol_workload(args)}
    if "mixed" not in args.skip:
        workloads["mixed"] = mixed_workload(args)
    plans = [(name, label, make) for name, arrivals in workloads.items()
             for label, make in configs(args, mlx_model, model2, model3, tokenizer, arrivals, name)]
    rows = {name: [] for name in workloads}
    for name, label, make in tqdm(plans, desc="runs", unit="run"):
        tqdm.write(f"  {name}: {label} ...")
        rows[name].append(run(make(), workloads[name], label))
    for name, arrivals in workloads.items():
        rows[name].sort(key=lambda r: (not r["label"].startswith("mlx"), r["label"]))
        longs = sum(a.kind == "long" for a in arrivals)
        title = (f"{name}: {len(arrivals) - longs} short requests ({args.short_tokens} + {args.short_output} tokens), "
                 f"{longs} long ({args.long_tokens} + {args.long_output})")
        print_table(title, rows[name])
        results[name] = {"rows": rows[name], "ratios": ratios(rows[name], RECOMMENDED)}
    results["wall_s"] = time.perf_counter() - began
    if "hol" not in results:  # the mixed workload alone: its own file, no plots
        json_path = args.out / "week3_mixed.json"
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {json_path}; the whole run took {results['wall_s']:.0f} s")
        return 0
    hol = results["hol"]["ratios"]
    results.update({k: v for k, v in hol.items() if k.endswith("_vs_mlx_lm_best")})
    results["targets"] = {"itl_p99_ratio_vs_mlx_lm_best": "<= 0.5", "throughput_ratio_vs_mlx_lm_best": ">= 1.0",
                          "ttft_p50_ratio_vs_mlx_lm_best": "<= 1.0"}
    print(f"\n{RECOMMENDED} on hol: ITL p99 {hol['itl_p99_ratio_vs_mlx_lm_best']:.2f}x mlx-lm's best (goal <= 0.5), "
          f"throughput {hol['throughput_ratio_vs_mlx_lm_best']:.2f}x (goal >= 1.0), "
          f"short TTFT p50 {hol['ttft_p50_ratio_vs_mlx_lm_best']:.2f}x (goal <= 1.0)")
    json_path = args.out / "week3_hol.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    written = plot(results, args.out)
    print(f"wrote {json_path}, " + ", ".join(written) + f"; the whole run took {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
