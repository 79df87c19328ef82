"""`pdm run serve --tensor-parallel 2` (day 4.4), the reference solution, over HTTP.

One server for the module: the command itself, in a process group of its own, which starts two ranks
with mlx.launch on loopback; HTTP on rank 0. Oracle: the reference's single-process engine on the
whole model (what `pdm run serve` without the option runs), greedy. Bounded: every wait has a limit,
and the whole process group is killed at the end, whatever happened.
"""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest

from course import ranks
from tests.harness import reference
from tests.serve_fakes import parse_prometheus, wait_until

ref = reference()
MODEL = "embedded"
START_TIMEOUT = float(os.environ.get("TINY_LLM_RANKS_TIMEOUT", "55"))
PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 7, 300, 9001, 17, 5, 88, 3, 1000, 11], [151000, 12]]
MAX_TOKENS = 8


@contextlib.contextmanager
def serve_on_two_ranks():
    """(base URL, process, log file) of `serve --tensor-parallel 2`; the process group is killed afterwards."""
    port = ranks.free_ports(1)
    command = [sys.executable, "-m", "scripts.serve", "--tensor-parallel", "2", "--solution", "ref", "--model", MODEL,
               "--port", str(port), "--log-level", "warning", "--num-blocks", "64"]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            started = wait_until(lambda: process.poll() is not None or healthy(url), timeout=START_TIMEOUT, interval=0.2)
            if not started or process.poll() is not None:
                pytest.fail(f"serve --tensor-parallel 2 did not start: {output(log)}")
            yield url, process, log
        finally:
            ranks.kill_group(process)


@pytest.fixture(scope="module")
def launched():
    with serve_on_two_ranks() as running:
        yield running


@pytest.fixture(scope="module")
def server(launched):
    return launched[0]


def output(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-2000:]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def kv_cache_usage(url: str) -> float:
    families = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
    return families["tiny_llm:kv_cache_usage_perc"]["samples"][0][2]


def test_greedy_outputs_equal_the_single_process_engine(server, model32):
    mlx_model, tokenizer = model32
    expected = ref.engine.generate(ref.qwen2_week3.Qwen2ModelWeek3(mlx_model), tokenizer, PROMPTS,
                                   ref.sequence.SamplingParams(max_tokens=MAX_TOKENS))
    response = httpx.post(f"{server}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    got = [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]
    assert got == expected


def test_an_abort_frees_every_block(server):
    body = {"model": MODEL, "prompt": [8, 6, 7], "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server}/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line)
            # Read a few tokens while checking that the request holds blocks (the gauge follows each step).
            held = [kv_cache_usage(server) for _, event in zip(range(5), events) if '"finish_reason":null' in event]
            assert len(held) == 5 and max(held) > 0, f"the streaming request should hold blocks for its tokens: {held}"
        # Leaving the `with` closed the connection mid-stream: the server aborts the request.
    assert wait_until(lambda: kv_cache_usage(server) == 0, interval=0.1), "every block back in the pool after the abort"
    response = httpx.post(f"{server}/v1/completions", timeout=60, json={"model": MODEL, "prompt": [9, 9], "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, "the server keeps serving"
    assert wait_until(lambda: kv_cache_usage(server) == 0, interval=0.1)


def test_ctrl_c_stops_every_rank(launched):
    """Ctrl-C (SIGINT to the terminal's process group): rank 0 drains and stops the others; nothing is left."""
    url, process, log = launched
    os.killpg(process.pid, signal.SIGINT)
    try:
        status = process.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve --tensor-parallel 2 still runs after Ctrl-C: {output(log)}")
    text = output(log)
    assert status == 130 and "[tiny-llm] stopped" in text and "Traceback" not in text, text
    assert wait_until(lambda: not group_alive(process.pid), timeout=5), "a rank outlived the server"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def rank_pid(pgid: int, rank: int) -> int | None:
    """The process of rank `rank` (mlx.launch exports MLX_RANK to each) in process group `pgid`."""
    marker = f"MLX_RANK={rank}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid and marker in open(f"/proc/{entry}/environ", "rb").read().split(b"\0") \
                    and b"--as-rank" in open(f"/proc/{entry}/cmdline", "rb").read():
                return int(entry)
        except OSError:  # gone, or not ours
            continue
    return None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds rank 1's process through /proc (Linux, as CI)")
def test_a_dead_rank_stops_the_server_with_a_clear_error():
    with serve_on_two_ranks() as (url, process, log):
        follower = rank_pid(process.pid, 1)
        assert follower is not None, "found no rank 1 process"
        os.kill(follower, signal.SIGKILL)
        # The next step needs rank 1: the request fails, and the server stops.
        try:
            httpx.post(f"{url}/v1/completions", timeout=30, json={"model": MODEL, "prompt": [9, 9], "max_tokens": 3})
        except httpx.HTTPError:
            pass  # the server may already be gone
        try:
            process.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs after rank 1 died: {output(log)}")
        assert "another rank stopped answering" in output(log), output(log)
