"""`pdm run serve --tensor-parallel 2` and `--hostfile` (day 4.4), the reference solution, over HTTP.

One server for the module: the command itself, in a process group of its own, given a hostfile that
names 127.0.0.1 twice (mlx.launch starts both ranks here, as `-n 2` would; on two Macs it is the same
command with their addresses); HTTP on rank 0. Oracle: the reference's single-process engine on the
whole model (what `pdm run serve` without the option runs), greedy. A second server, `--tensor-parallel
2`, loses rank 1 on purpose; a third fails at start-up (a model whose one KV head does not divide
between two ranks). Bounded: every wait has a limit, and the whole process group is killed at the end,
whatever happened.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from course import ranks
from course.models import make_random_qwen2
from scripts import serve
from tests.harness import reference
from tests.serve_fakes import parse_prometheus, wait_until

ref = reference()
MODEL = "embedded"
START_TIMEOUT = float(os.environ.get("TINY_LLM_RANKS_TIMEOUT", "55"))
PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 7, 300, 9001, 17, 5, 88, 3, 1000, 11], [151000, 12]]
MAX_TOKENS = 8


LOOPBACK_TWICE = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2  # mlx.launch's hostfile format


def serve_command(*ranks_option: str, model: str = MODEL) -> list[str]:
    return [sys.executable, "-m", "scripts.serve", *ranks_option, "--solution", "ref", "--model", model,
            "--log-level", "warning", "--num-blocks", "64"]


@contextlib.contextmanager
def serve_on_two_ranks(*ranks_option: str):
    """(base URL, process, log file) of `serve` with `ranks_option`; the process group is killed afterwards."""
    port = ranks.free_ports(1)
    command = [*serve_command(*ranks_option), "--port", str(port)]
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
def launched(tmp_path_factory):
    hostfile = tmp_path_factory.mktemp("hosts") / "hosts.json"
    hostfile.write_text(json.dumps(LOOPBACK_TWICE))
    with serve_on_two_ranks("--hostfile", str(hostfile)) as running:
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
    with serve_on_two_ranks("--tensor-parallel", "2") as (url, process, log):
        follower = rank_pid(process.pid, 1)
        assert follower is not None, "found no rank 1 process"
        os.kill(follower, signal.SIGKILL)
        # The next step needs rank 1: the request fails, and the server stops.
        try:
            httpx.post(f"{url}/v1/completions", timeout=30, json={"model": MODEL, "prompt": [9, 9], "max_tokens": 3})
        except httpx.HTTPError:
            pass  # the server may already be gone
        try:
            status = process.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs after rank 1 died: {output(log)}")
        text = output(log)
        assert "another rank stopped answering" in text, text
        # mlx.launch itself exits 0 whatever its ranks did: the command must not.
        last = text.strip().splitlines()[-1]
        assert status == 1 and last == "pdm run serve: error: rank 1 was killed by SIGKILL (it wrote no error line); " \
                                        "every rank stopped", f"status {status}, last line {last!r}"


def test_a_rank_that_fails_at_start_up_ends_the_command(tmp_path):
    """Every rank raises while it shards a model with one KV head: one line naming a rank and its error, status 2."""
    model = make_random_qwen2(tmp_path / "one-kv-head", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                             num_key_value_heads=1, intermediate_size=128), seed=0)
    command = [*serve_command("--tensor-parallel", "2", model=str(model)), "--port", str(ranks.free_ports(1))]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            status = process.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still runs although its ranks failed at start-up: {output(log)}")
        finally:
            ranks.kill_group(process)
        text = output(log)
    last = text.strip().splitlines()[-1]
    assert status == 2, f"exit status {status} (mlx.launch's own is 0 whatever the ranks did): {text}"
    assert last.startswith("pdm run serve: error: rank ") and "exited with code 2: pdm run serve: error: rank " in last \
        and "KV heads (1) do not divide among 2 ranks" in last and last.endswith("every rank stopped"), last
    assert "Traceback" not in text, text


@pytest.mark.parametrize("content, why", [
    (None, "does not exist"),
    ("{not json", "is not a JSON file"),
    (json.dumps(LOOPBACK_TWICE[:1]), "at least 2 hosts"),
    (json.dumps([{"ssh": "mac1"}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]), "host 0 must be"),
    (json.dumps([{"ssh": "mac1", "ips": ["mac1.local"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]), "is not an IP address"),
])
def test_a_bad_hostfile_is_one_line_and_status_2(tmp_path, capsys, content, why):
    hostfile = tmp_path / "hosts.json"
    if content is not None:
        hostfile.write_text(content)
    with pytest.raises(SystemExit) as exited:
        serve.main(["--hostfile", str(hostfile), "--solution", "ref"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"pdm run serve: error: hostfile {hostfile}") and why in err, err


def test_a_hostfile_and_another_rank_count_is_refused(tmp_path, capsys):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(LOOPBACK_TWICE))
    with pytest.raises(SystemExit) as exited:
        serve.main(["--hostfile", str(hostfile), "--tensor-parallel", "4", "--solution", "ref"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--tensor-parallel 4 but the hostfile names 2 hosts" in err, err
