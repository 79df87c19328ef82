"""Push day 3.5's server to its edges and say what happened (by hand; timings need a quiet machine).

    pdm run python -m maint.serve_stress                    # all three checks on the embedded model
    pdm run python -m maint.serve_stress --check streams    # one of: body, streams, soak

Starts `scripts/serve.py` (the reference) in a process of its own on a free port and reads its memory
from /proc (Linux). Three checks, each a line of figures and a verdict:

- body: a 50 MB request body must get a 413 and leave the server's RSS within 100 MB of where it was
  (the limit is checked before the body is parsed, and the body is read and dropped, never kept).
- streams: 200 streaming requests at once; each must get its first byte (a token or a keep-alive comment)
  within 15 s, or a 429/503 (the admission limit), never silence; each client hangs up after its first byte.
- soak: mixed requests (streaming or not, several choices, stop strings, bad ones, clients that hang up
  mid-stream) at a fixed concurrency; afterwards no request runs or waits, no KV block is held, and the
  server's RSS is within 5% of where it was after a warm-up burst of the same traffic.

Exits 1 if any verdict fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL = "stress"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) memory of process `pid` in MB, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "scripts.serve", "--port", str(port), "--served-model-name", MODEL,
               "--log-level", "warning", "--max-model-len", "512", *extra]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start within 300 s")


def engine_gauges(url: str) -> dict[str, float]:
    """/metrics' running, waiting and KV usage gauges."""
    gauges = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"tiny_llm:{name}{{"):
                gauges[name] = float(line.rsplit(" ", 1)[1])
    return gauges


def check_body(url: str, pid: int) -> bool:
    before, _ = rss_mb(pid)
    body = b'{"model": "stress", "prompt": "' + b"x " * (25 * 2**20) + b'", "max_tokens": 1}'
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", content=body, timeout=600,
                          headers={"content-type": "application/json"})
    after, peak = rss_mb(pid)
    ok = response.status_code == 413 and after - before < 100 and peak - before < 100
    print(f"body: {len(body) / 2**20:.0f} MiB -> {response.status_code} in {time.perf_counter() - start:.1f} s; "
          f"RSS {before:.0f} MB before, {after:.0f} MB after, peak {peak:.0f} MB: {'OK' if ok else 'FAILED'}")
    return ok


async def first_byte(client: httpx.AsyncClient, url: str, index: int) -> tuple[str, float]:
    """('byte', seconds) when the stream's first body byte came, or (status, seconds) for a refusal."""
    body = {"model": MODEL, "prompt": f"stream {index} " * 8, "max_tokens": 64, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return str(response.status_code), time.perf_counter() - start
        async for _ in response.aiter_raw():
            return "byte", time.perf_counter() - start  # and hang up: the server aborts the request
        return "byte", float("inf")


async def check_streams(url: str, count: int) -> bool:
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        results = await asyncio.gather(*(first_byte(client, url, i) for i in range(count)))
    waits = sorted(seconds for kind, seconds in results if kind == "byte")
    refused = [kind for kind, _ in results if kind != "byte"]
    ok = all(kind in ("byte", "429", "503") for kind, _ in results) and (not waits or waits[-1] <= 15)
    print(f"streams: {count} at once: {len(waits)} streamed (first byte p50 {waits[len(waits) // 2]:.2f} s, "
          f"max {waits[-1]:.2f} s), {len(refused)} refused ({', '.join(sorted(set(refused))) or '-'}): "
          f"{'OK' if ok else 'FAILED'}" if waits else f"streams: none streamed, refused {refused}: FAILED")
    return ok


async def one_mixed(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    kind = rng.choice(["stream", "whole", "choices", "stop", "bad", "leave", "leave"])
    body = {"model": MODEL, "prompt": " ".join(rng.choice(["a", "bb", "ccc", "dd"]) for _ in range(rng.randint(1, 60))),
            "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.8]), "stream": kind in ("stream", "leave")}
    if kind == "choices":
        body["n"] = 3
    if kind == "stop":
        body["stop"] = ["a", "e"]
    if kind == "bad":
        body["temperature"] = -1
    if not body["stream"]:
        return str((await client.post(f"{url}/v1/completions", json=body)).status_code)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        seen = 0
        async for _ in response.aiter_lines():
            seen += 1
            if kind == "leave" and seen >= 2:
                return "left"  # leaving the block closes the connection mid-stream
    return str(response.status_code)


async def mixed_burst(url: str, total: int, concurrency: int, seed: int) -> dict[str, int]:
    """Send `total` mixed requests, `concurrency` at once; count their outcomes (status codes, "left")."""
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}

    async def run(client):
        async with semaphore:
            outcome = await one_mixed(client, url, rng)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        await asyncio.gather(*(run(client) for _ in range(total)))
    return outcomes


async def check_soak(url: str, pid: int, total: int, concurrency: int, warm_up: int) -> bool:
    started, _ = rss_mb(pid)
    # A fresh server grows while its first requests compile kernels and fill MLX's buffer cache; the soak
    # asks whether memory keeps growing after that, so "before" is taken once a warm-up burst has run.
    await mixed_burst(url, warm_up, concurrency, seed=1)
    before, _ = rss_mb(pid)
    start = time.perf_counter()
    outcomes = await mixed_burst(url, total, concurrency, seed=0)
    idle = False
    for _ in range(100):  # the engine thread applies the last aborts at its next turn
        gauges = engine_gauges(url)
        if gauges == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}:
            idle = True
            break
        await asyncio.sleep(0.1)
    after, _ = rss_mb(pid)
    ok = idle and outcomes.get("500", 0) == 0 and after <= before * 1.05
    print(f"soak: {total} requests, {concurrency} at once, {time.perf_counter() - start:.0f} s: "
          f"{json.dumps(dict(sorted(outcomes.items())))}; afterwards {gauges}; RSS {started:.0f} MB at start, "
          f"{before:.0f} MB after {warm_up} warm-up requests, {after:.0f} MB after the soak "
          f"({(after / before - 1) * 100:+.1f}%, limit +5%): {'OK' if ok else 'FAILED'}")
    return ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", choices=("body", "streams", "soak"), action="append",
                        help="one check (repeatable; default: all three)")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams (default 200)")
    parser.add_argument("--soak-requests", type=int, default=600, help="requests in the soak (default 600)")
    parser.add_argument("--soak-concurrency", type=int, default=16, help="soak requests at once (default 16)")
    parser.add_argument("--soak-warm-up", type=int, default=100,
                        help="mixed requests sent before the soak's memory baseline is read (default 100)")
    parser.add_argument("--server-args", default="", help="more arguments for scripts/serve.py")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    checks = args.check or ["body", "streams", "soak"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (timings on a loaded machine "
          f"say little)")
    server = start_server(port, args.server_args.split())
    try:
        results = []
        if "body" in checks:
            results.append(check_body(url, server.pid))
        if "streams" in checks:
            results.append(asyncio.run(check_streams(url, args.streams)))
        if "soak" in checks:
            results.append(asyncio.run(check_soak(url, server.pid, args.soak_requests, args.soak_concurrency,
                                                    args.soak_warm_up)))
    finally:
        server.terminate()
        server.wait(60)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
