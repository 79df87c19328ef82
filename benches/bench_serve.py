"""Load-test any OpenAI-compatible server: ours, `mlx_lm.server`, vLLM. Day 3.5's serving benchmark.

    pdm run bench-serve --base-url http://localhost:8000                 # a server that is already running
    pdm run bench-serve --base-url http://gpu-box:8000 --model Qwen/Qwen2-0.5B-Instruct   # vLLM, for one
    pdm run bench-serve --launch --model bench-0.5b --quick              # start ours and mlx_lm.server, compare
    pdm run bench-serve --launch --quick --solution student               # the same, with your server and engine
    pdm run bench-serve --base-url URL --workload mixed --request-rate 0.5 --num-requests 20
    pdm run bench-serve --base-url URL --workload shared-prefix --concurrency 2

Workloads (prompts are random words; every request streams /v1/completions at temperature 0):
  head-of-line   a few short requests stream; once each has a few tokens, one long prompt arrives.
                 A server that prefills it in one go stalls every short request's next token.
  mixed          20% long prompts and 80% short ones, sent at a fixed concurrency or a Poisson rate.
  shared-prefix  every prompt starts with the same long prefix (a system prompt, a document) and ends
                 with a short question of its own: a prefix cache skips the shared part's prefill.
For each server and workload: TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99, request and
token throughput, and goodput: the requests meeting both targets (TTFT <= --slo-ttft and
TPOT <= --slo-tpot) with no chunk later than a reader at that pace would reach it (benches/runner.py's
`good_request`, as in every lab), as a share of all requests and per second; and the share by TTFT
and TPOT alone (DistServe's and vLLM's goodput, which a stall hidden in the mean passes). ITL is the gap between two streamed chunks that carry text; TPOT is
(e2e - TTFT) / (output tokens - 1), output tokens as the server's `usage` reports them.

--launch starts our server (`pdm run serve`) and `mlx_lm.server` on the same model and machine, runs
each workload on one, then the other (only one is ever busy; with --rounds, alternating), and prints
ours / theirs. Results: benches/results/serve.json (serve_quick.json with --quick)
and one plot per workload, benches/results/serve_<workload>.png.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from benches.runner import good_request, meets_targets, percentile  # day 2.2's percentile: linear interpolation, as numpy
from course import selector
from course.user_errors import OneLineParser

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORKLOADS = ("head-of-line", "mixed", "shared-prefix")
PERCENTILES = (50, 90, 99)
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="pdm run bench-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://localhost:8000")
    target.add_argument("--launch", action="store_true",
                        help="start our server and mlx_lm.server on --model, measure both, print ratios")
    parser.add_argument("--model", default=None,
                        help="with --launch: the model both servers load (default bench-0.5b); with --base-url: "
                             "the model id to send (default: the first one /v1/models lists)")
    parser.add_argument("--workload", choices=WORKLOADS, action="append",
                        help="run this workload (repeatable; default: all three)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (mixed, shared-prefix)")
    load.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals, requests per second (mixed, shared-prefix; default: concurrency 4)")
    parser.add_argument("--num-requests", type=int, default=10, help="requests in mixed and shared-prefix (default 10)")
    parser.add_argument("--shorts", type=int, default=4, help="short requests in head-of-line (default 4)")
    parser.add_argument("--short-tokens", type=int, default=64, help="short prompts, in tokens (default 64)")
    parser.add_argument("--long-tokens", type=int, default=1024, help="long prompts, in tokens (default 1024)")
    parser.add_argument("--output-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    parser.add_argument("--prefix-tokens", type=int, default=512, help="shared-prefix's common prefix (default 512)")
    parser.add_argument("--slo-ttft", type=float, default=10.0, help="goodput SLO on TTFT, seconds (default 10)")
    parser.add_argument("--slo-tpot", type=float, default=1.0, help="goodput SLO on TPOT, seconds (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each workload this many times per server, servers alternating (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: head-of-line only, 2 shorts of 32 tokens, a 512-token long prompt, 16 outputs")
    parser.add_argument("--our-args", default="",
                        help="with --launch: extra arguments for `pdm run serve` (default: none, its defaults)")
    parser.add_argument("--their-args", default="",
                        help="with --launch: extra arguments for mlx_lm.server (default: none, its defaults)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take (default 900)")
    selector.add_arguments(parser)  # with --launch: whose server and engine `pdm run serve` runs
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"where results go (default {RESULTS_DIR})")
    return parser


# ---------------------------------------------------------------- workloads


@dataclass
class Planned:
    """One request of a workload: its prompt, its output budget, and when it may start."""

    prompt: str
    max_tokens: int
    kind: str  # "short", "long", "shared"
    delay: float = 0.0  # seconds after the run starts (Poisson arrivals)
    after_tokens: int = 0  # head-of-line: start once every earlier request streamed this many chunks


def words(rng: random.Random, num_tokens: int) -> str:
    # Each " word" of the list is one token in Qwen's (and most) BPE vocabularies.
    return "".join(" " + rng.choice(WORDS) for _ in range(num_tokens))


def plan_workload(name: str, args, rng: random.Random) -> list[Planned]:
    if name == "head-of-line":
        plan = [Planned(words(rng, args.short_tokens), args.output_tokens, "short") for _ in range(args.shorts)]
        return plan + [Planned(words(rng, args.long_tokens), args.output_tokens, "long", after_tokens=4)]
    if name == "mixed":
        kinds = ["long" if i % 5 == 0 else "short" for i in range(args.num_requests)]  # 20% long
        rng.shuffle(kinds)
        plan = [Planned(words(rng, args.long_tokens if k == "long" else args.short_tokens), args.output_tokens, k)
                for k in kinds]
    else:
        prefix = words(rng, args.prefix_tokens)
        plan = [Planned(prefix + " question:" + words(rng, 16), args.output_tokens, "shared")
                for _ in range(args.num_requests)]
    if args.request_rate:
        clock = 0.0
        for request in plan:
            clock += rng.expovariate(args.request_rate)
            request.delay = clock
    return plan


# ---------------------------------------------------------------- the client


@dataclass
class Result:
    kind: str
    start: float
    chunk_times: list[float] = field(default_factory=list)  # each streamed chunk that carried text
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self):
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self):
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self):
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self):
        if self.end is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def stream_one(client: httpx.AsyncClient, base_url: str, model: str | None, request: Planned,
                     result: Result) -> None:
    body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    chunks = 0
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        result.chunk_times.append(time.perf_counter())
                        chunks += 1
        result.end = time.perf_counter()
        result.output_tokens = result.output_tokens or chunks
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"


async def run_workload(base_url: str, model: str | None, plan: list[Planned], concurrency: int | None,
                       timeout: float, label: str) -> tuple[list[Result], float]:
    """Send every planned request; returns the results (in plan order) and the run's duration."""
    slots = asyncio.Semaphore(concurrency or len(plan))
    results: list[Result | None] = [None] * len(plan)
    progress = tqdm(total=len(plan), desc=label, unit="req", leave=False)
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        began = time.perf_counter()

        async def one(i: int, request: Planned):
            await asyncio.sleep(request.delay)
            while request.after_tokens and any(r is None or len(r.chunk_times) < request.after_tokens
                                               and r.end is None for r in results[:i]):
                await asyncio.sleep(0.01)
            async with slots:
                results[i] = Result(request.kind, time.perf_counter())
                await stream_one(client, base_url, model, request, results[i])
            progress.update()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(plan)))
        duration = time.perf_counter() - began
    progress.close()
    return results, duration


# ---------------------------------------------------------------- figures


def distribution(values: list[float]) -> dict:
    return {f"p{p}": percentile(values, p) for p in PERCENTILES}


def summarize(results: list[Result], duration: float, args) -> dict:
    done = [r for r in results if r.error is None and r.end is not None]
    shorts = [r for r in done if r.kind != "long"] or done
    good = [r for r in done if good_request(r.start, r.chunk_times, r.ttft, r.tpot, args.slo_ttft, args.slo_tpot)]
    good_tpot = [r for r in done if meets_targets(r.ttft, r.tpot, args.slo_ttft, args.slo_tpot)]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return {
        "requests": len(results), "completed": len(done),
        "errors": [r.error for r in results if r.error is not None],
        "duration_s": duration,
        "ttft": distribution([r.ttft for r in done if r.ttft is not None]),
        "ttft_short": distribution([r.ttft for r in shorts if r.ttft is not None]),
        "ttft_long": distribution([r.ttft for r in done if r.kind == "long" and r.ttft is not None]),
        "tpot": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl": distribution([gap for r in done for gap in r.itls]),
        "itl_short": distribution([gap for r in shorts for gap in r.itls]),
        "e2e": distribution([r.e2e for r in done]),
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "goodput": len(good) / duration,
        "goodput_share": len(good) / len(results) if results else None,
        "goodput_share_tpot_only": len(good_tpot) / len(results) if results else None,
        "output_tokens": output, "prompt_tokens": prompt,
        "timelines": [{"kind": r.kind, "start": r.start, "chunks": r.chunk_times} for r in done],
    }


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_summary(server: str, workload: str, s: dict, args) -> None:
    print(f"\n[{server}] {workload}: {s['completed']}/{s['requests']} requests in {s['duration_s']:.1f} s"
          + (f", errors: {s['errors'][:2]}" if s["errors"] else ""))
    print(f"  {'seconds':<14}{'p50':>9}{'p90':>9}{'p99':>9}")
    for key in ("ttft", "ttft_short", "ttft_long", "tpot", "itl", "itl_short", "e2e"):
        d = s[key]
        print(f"  {key:<14}{fmt(d['p50'], 3):>9}{fmt(d['p90'], 3):>9}{fmt(d['p99'], 3):>9}")
    print(f"  throughput: {s['request_throughput']:.3f} req/s, output {s['output_throughput']:.2f} tok/s, "
          f"prompt+output {s['total_token_throughput']:.1f} tok/s; goodput {s['goodput']:.3f} req/s "
          f"({fmt(s['goodput_share'] and 100 * s['goodput_share'], 0)}% of requests met TTFT <= {args.slo_ttft:g} s "
          f"and TPOT <= {args.slo_tpot:g} s with no chunk behind that pace; "
          f"{fmt(s['goodput_share_tpot_only'] and 100 * s['goodput_share_tpot_only'], 0)}% by TTFT and TPOT alone)")


def ratio(ours, theirs):
    return None if ours is None or not theirs else ours / theirs


def compare(workload: str, ours: dict, theirs: dict) -> dict:
    rows = {
        "ITL p99 (shorts)": ratio(ours["itl_short"]["p99"], theirs["itl_short"]["p99"]),
        "ITL p50 (shorts)": ratio(ours["itl_short"]["p50"], theirs["itl_short"]["p50"]),
        "TTFT p50": ratio(ours["ttft"]["p50"], theirs["ttft"]["p50"]),
        "TTFT p99": ratio(ours["ttft"]["p99"], theirs["ttft"]["p99"]),
        "TPOT p50": ratio(ours["tpot"]["p50"], theirs["tpot"]["p50"]),
        "output tok/s": ratio(ours["output_throughput"], theirs["output_throughput"]),
        "goodput": ratio(ours["goodput"], theirs["goodput"]),
        "goodput share": ratio(ours["goodput_share"], theirs["goodput_share"]),
        "goodput share, TPOT only": ratio(ours["goodput_share_tpot_only"], theirs["goodput_share_tpot_only"]),
    }
    print(f"\n{workload}: ours / mlx_lm.server (below 1 is better for latencies, above 1 for throughput)")
    for name, value in rows.items():
        print(f"  {name:<26}{fmt(value):>8}x")
    return rows


def plot(workload: str, summaries: dict[str, dict], out_dir: Path, machine: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (server, s), color in zip(summaries.items(), ("tab:blue", "tab:orange", "tab:green")):
        t0 = min((t["start"] for t in s["timelines"]), default=0.0)
        first = True
        for timeline in s["timelines"]:
            times = timeline["chunks"]
            gaps = [b - a for a, b in zip(times, times[1:])]
            left.scatter([t - t0 for t in times[1:]], gaps, s=8, color=color, alpha=0.6,
                         label=server if first else None, marker="x" if timeline["kind"] == "long" else "o")
            first = False
        ttfts = sorted(t["chunks"][0] - t["start"] for t in s["timelines"] if t["chunks"])
        right.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", color=color, label=server)
    left.set(xlabel="time since the first request (s)", ylabel="gap before this chunk (s)",
             title=f"{workload}: inter-token latency over time")
    right.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT, cumulative")
    left.legend()
    right.legend()
    fig.suptitle(machine, fontsize=8)
    fig.tight_layout()
    path = out_dir / f"serve_{workload}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover_model(base_url: str) -> str | None:
    """The first model id the server lists, or None (then requests name no model)."""
    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=30).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return None
    return data[0]["id"] if data else None


def wait_ready(base_url: str, process: subprocess.Popen, name: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with code {process.returncode} before it was ready (see its log)")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} was not ready after {timeout:.0f} s")


def solution_arguments(args) -> list[str]:
    """`pdm run serve`'s options for the solution this bench was asked to launch."""
    return ["--solution", args.solution] + (["--strict"] if args.strict else [])


def launch(command: list[str], name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """Start a server on a free port, its output going to `log`; wait until it answers /v1/models."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", "src_ref", "."])}
    with log.open("w") as sink:
        process = subprocess.Popen([*command, "--port", str(port)], cwd=REPO_ROOT, env=env,
                                   stdout=sink, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, process, name)
    return process, base_url


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def warm_up(base_url: str, model: str | None, args) -> None:
    """One small request: the first call of a fresh server pays one-time costs."""
    asyncio.run(run_workload(base_url, model, [Planned(" hello", 2, "warm-up")], None, args.timeout, "warm-up"))


def run_once(server: str, base_url: str, model: str | None, workload: str, args) -> tuple[list[Result], float]:
    plan = plan_workload(workload, args, random.Random(args.seed))
    concurrency = None if args.request_rate else (args.concurrency or 4)
    if workload == "head-of-line":
        concurrency = None  # everybody at once; the long one waits for the shorts' first tokens
    return asyncio.run(run_workload(base_url, model, plan, concurrency, args.timeout, f"{server} {workload}"))


def measure(servers: dict[str, tuple[str, str | None]], args) -> dict[str, dict]:
    """Every workload on every server, `--rounds` times, servers alternating (so drift in the machine's
    load hits both alike); each server's results of all rounds are pooled into one summary per workload."""
    for base_url, model in servers.values():
        warm_up(base_url, model, args)
    summaries: dict[str, dict] = {name: {} for name in servers}
    for workload in args.workload:
        pooled = {name: ([], 0.0) for name in servers}
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for name in order:
                base_url, model = servers[name]
                results, duration = run_once(name, base_url, model, workload, args)
                pooled[name] = (pooled[name][0] + results, pooled[name][1] + duration)
        for name, (results, duration) in pooled.items():
            summaries[name][workload] = summarize(results, duration, args)
            print_summary(name, workload, summaries[name][workload], args)
    return summaries


def apply_quick(args) -> None:
    args.workload = args.workload or ["head-of-line"]
    args.shorts, args.short_tokens, args.long_tokens, args.output_tokens = 2, 32, 512, 16


def machine_line() -> str:
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f} at start")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("rounds", "num_requests", "shorts", "short_tokens", "long_tokens", "output_tokens", "prefix_tokens",
                 "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.request_rate is not None and args.request_rate <= 0:
        parser.error(f"--request-rate must be positive, got {args.request_rate}")
    if args.base_url and (args.solution != "ref" or args.strict):
        parser.error("--solution and --strict choose the server --launch starts; with --base-url the server is "
                     "whatever runs there (start yours with `pdm run serve --solution student`)")
    if args.quick:
        apply_quick(args)
    args.workload = args.workload or list(WORKLOADS)
    machine = machine_line()
    results: dict = {"machine": machine, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()}, "servers": {}}
    began = time.perf_counter()
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        try:
            httpx.get(f"{base_url}/v1/models", timeout=30)
        except httpx.HTTPError as error:
            print(f"error: no server answers at {base_url} ({type(error).__name__}); start one, e.g. `pdm run serve`",
                  file=sys.stderr)
            return 2
        results["servers"] = measure({base_url: (base_url, args.model or discover_model(base_url))}, args)
    else:
        from course.models import BENCH, resolve_model

        args.model = args.model or BENCH
        path = str(resolve_model(args.model))
        commands = {
            "tiny-llm": [sys.executable, "-m", "scripts.serve", "--model", args.model, *solution_arguments(args),
                         *args.our_args.split()],
            "mlx_lm.server": [sys.executable, "-m", "benches.mlx_lm_peer", "--model", path, *args.their_args.split()],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        processes, servers = [], {}
        try:
            # Both run at once, but only one is ever loaded: the other idles while it waits for requests.
            for name, command in commands.items():
                log = args.out / f"serve_{name}.log"
                print(f"[bench-serve] starting {name}: {' '.join(command[1:])} (log: {log})", file=sys.stderr)
                process, base_url = launch(command, name, log)
                processes.append(process)
                # mlx_lm.server's /v1/models lists the Hugging Face cache: name no model, so it uses its own.
                servers[name] = (base_url, discover_model(base_url) if name == "tiny-llm" else None)
            results["servers"] = measure(servers, args)
        finally:
            for process in processes:
                stop(process)
        results["ratios"] = {w: compare(w, results["servers"]["tiny-llm"][w], results["servers"]["mlx_lm.server"][w])
                             for w in args.workload}
    results["wall_s"] = time.perf_counter() - began
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / ("serve_quick.json" if args.quick else "serve.json")  # a quick run never replaces a full one
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written = [p for w in args.workload
               if (p := plot(w, {s: r[w] for s, r in results["servers"].items()}, args.out, machine))]
    print(f"\nwrote {json_path}" + "".join(f", {p}" for p in written) + f"; the run took {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
