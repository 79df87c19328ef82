"""Week 3 Day 5: serving the engine over HTTP (book/src/week3-05-serving.md).

Everything past tasks 1-3 runs over real HTTP: uvicorn in a thread on a free port, the engine in the
server's own engine thread, the official `openai` client and httpx as clients. Outputs are checked
against in-process generation with the same engine, never against themselves.
"""

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import reference, solution
from tests.serve_fakes import parse_prometheus, running_server, wait_until

sol = solution(week=3, day=5)
ref = reference()

MODEL = "tiny-test-model"


@pytest.fixture(scope="module")
def model(model32):
    """(week-3 model, tokenizer) on the embedded model's weights, float32."""
    mlx_model, tokenizer = model32
    week3_model = ref.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    # MLX streams are thread-local: arrays the model left lazy on this thread cannot be evaluated on the
    # server's engine thread. One tiny generation here materializes them.
    ref.engine.generate(week3_model, tokenizer, [[1]], ref.sequence.SamplingParams(max_tokens=1))
    return week3_model, tokenizer


@pytest.fixture
def tokenizer(model):
    return model[1]


def make_engine(model):
    return ref.engine.LLMEngine(model[0], model[1], ref.engine.EngineConfig(token_budget=64, max_num_seqs=16, block_size=8))


def in_process(model, prompt_text: str, max_tokens: int) -> str:
    """What the engine alone generates for this prompt (greedy): the oracle for the server's text."""
    prompt = model[1].encode(prompt_text, add_special_tokens=False)
    return ref.engine.generate(model[0], model[1], [prompt], ref.sequence.SamplingParams(max_tokens=max_tokens))[0]


def in_process_tokens(model, prompt_text: str, max_tokens: int) -> list[int]:
    """The token ids the engine alone generates for this prompt (greedy), EOS excluded."""
    engine = make_engine(model)
    seq = engine.add_request(prompt_text, ref.sequence.SamplingParams(max_tokens=max_tokens))
    while engine.has_work():
        engine.step()
    return seq.output_token_ids


def chat_text(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def free_blocks(engine) -> int:
    return engine.block_manager.num_free_blocks


def all_blocks(engine) -> int:
    return engine.block_manager.num_blocks


# ---------------------------------------------------------------- task 1: server-sent events


def test_task_1_sse_event():
    assert sol.server.sse_event("[DONE]") == "data: [DONE]\n\n"
    payload = {"id": "x", "choices": [{"delta": {"content": "line one\nline two"}}]}
    event = sol.server.sse_event(payload)
    assert event.startswith("data: ") and event.endswith("\n\n")
    # The JSON must sit on the one data line: a raw newline inside would end the event early.
    assert event.count("\n") == 2
    assert json.loads(event[len("data: "):]) == payload


# ---------------------------------------------------------------- task 2: stop strings


def test_task_2_find_stop_examples():
    find_stop = sol.server.find_stop
    assert find_stop("hello world", []) == (11, False)
    assert find_stop("hello world", ["wor"]) == (6, True)
    assert find_stop("hello wo", ["world"]) == (6, False)  # "wo" may become "world": held back
    assert find_stop("hello w", ["xyz", "wx"]) == (6, False)
    assert find_stop("abcab", ["abd"]) == (3, False)  # "ab" held back, not "abcab"
    assert find_stop("one. two. three", [". t", "two"]) == (3, True)  # the earliest stop wins
    assert find_stop("", ["x"]) == (0, False)


def _brute_force_stream(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the client must receive: `text` up to its first stop string."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


@settings(max_examples=200, deadline=None)
@given(chars=st.lists(st.sampled_from("ab c."), max_size=16),
       stops=st.lists(st.text(alphabet="ab c.", min_size=1, max_size=4), max_size=3))
def test_task_2_stop_strings_when_streaming(chars, stops):
    """Feeding text a character at a time: the pieces sent never include a stop string, never take back
    text, and add up to the text before the first stop string; nothing is held back that cannot be a stop."""
    sent, stopped = "", False
    for n in range(1, len(chars) + 1):
        text = "".join(chars[:n])
        end, stopped = sol.server.find_stop(text, stops)
        assert end >= len(sent) and text[:len(sent)] == sent
        sent = text[:end]
        if stopped:
            break
        held = text[end:]
        assert held == "" or any(s.startswith(held) for s in stops), f"held back {held!r} for no stop string"
    expected, expected_stopped = _brute_force_stream("".join(chars[:n]) if chars else "", stops)
    if not stopped:
        sent = "".join(chars)  # at the end of generation, held-back text is released
        expected, expected_stopped = _brute_force_stream(sent, stops)
    assert (sent, stopped) == (expected, expected_stopped)


# ---------------------------------------------------------------- task 3: Prometheus text


def test_task_3_render_prometheus():
    histogram = sol.server.Histogram("t_latency_seconds", "A latency.", buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    gauge = sol.server.Metric("t_running", "Running requests.", "gauge", 3)
    counter = sol.server.Metric("t_tokens_total", "Tokens.", "counter", 12.5)
    text = sol.server.render_prometheus([gauge, counter, histogram])
    families = parse_prometheus(text)
    assert families["t_running"]["type"] == "gauge" and families["t_running"]["samples"] == [("t_running", {}, 3)]
    assert families["t_tokens_total"]["type"] == "counter"
    assert families["t_tokens_total"]["samples"] == [("t_tokens_total", {}, 12.5)]
    samples = {(name, labels.get("le")): value for name, labels, value in families["t_latency_seconds"]["samples"]}
    # Cumulative: each bucket counts every observation at or below its bound (0.1 is in le="0.1").
    assert samples[("t_latency_seconds_bucket", "0.1")] == 2
    assert samples[("t_latency_seconds_bucket", "1")] == 3
    assert samples[("t_latency_seconds_bucket", "+Inf")] == 4
    assert samples[("t_latency_seconds_count", None)] == 4
    assert samples[("t_latency_seconds_sum", None)] == pytest.approx(3.65)


def test_task_3_metrics_endpoint(model, tokenizer):
    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        for max_tokens in (3, 5):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        response = httpx.get(f"{url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        families = parse_prometheus(response.text)
    lengths = [len(in_process_tokens(model, "hi", n)) for n in (3, 5)]
    value = {name: family["samples"][0][2] for name, family in families.items() if family["type"] != "histogram"}
    assert value["tiny_llm_generation_tokens_total"] == sum(lengths)
    assert value["tiny_llm_prompt_tokens_total"] == 2 * len(tokenizer.encode("hi", add_special_tokens=False))
    assert value["tiny_llm_num_requests_running"] == 0 and value["tiny_llm_num_requests_waiting"] == 0
    assert value["tiny_llm_kv_cache_usage_ratio"] == 0 and value["tiny_llm_requests_finished_total"] == 2
    counts = {name: next(s[2] for s in f["samples"] if s[0] == f"{name}_count")
              for name, f in families.items() if f["type"] == "histogram"}
    assert counts["tiny_llm_time_to_first_token_seconds"] == 2
    assert counts["tiny_llm_inter_token_latency_seconds"] == sum(n - 1 for n in lengths)  # n - 1 gaps per request
    assert counts["tiny_llm_e2e_request_latency_seconds"] == 2


# ---------------------------------------------------------------- task 4: the engine thread, over HTTP


def test_task_4_openai_client_streams_chat(model, tokenizer):
    from openai import OpenAI

    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    content = "Tell me about the sea."
    expected = in_process(model, chat_text(tokenizer, content), max_tokens=12)
    expected_tokens = in_process_tokens(model, chat_text(tokenizer, content), max_tokens=12)
    expected_finish = "length" if len(expected_tokens) == 12 else "stop"
    with running_server(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                               max_tokens=12, temperature=0)
    assert text == expected
    assert finish == [expected_finish]
    assert usage.completion_tokens == len(expected_tokens)
    assert usage.prompt_tokens == len(tokenizer.encode(chat_text(tokenizer, content), add_special_tokens=False))
    assert whole.choices[0].message.content == expected and whole.usage.completion_tokens == len(expected_tokens)


def test_task_4_concurrent_streams(model, tokenizer):
    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    prompts = [f"request number {i}: " + "word " * (i % 5) for i in range(32)]
    lengths = [4 + i % 7 for i in range(32)]
    expected = [in_process(model, p, n) for p, n in zip(prompts, lengths)]

    async def one(client, url, prompt, max_tokens):
        pieces = []
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                elif line == "data: [DONE]":
                    pieces.append(None)
        assert pieces[-1] is None, "the stream must end with [DONE]"
        return "".join(pieces[:-1])

    async def all_of_them(url):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, url, p, n) for p, n in zip(prompts, lengths)))

    with running_server(app) as url:
        texts = asyncio.run(all_of_them(url))
        assert wait_until(lambda: not engine.has_work())
    assert texts == expected
    assert free_blocks(engine) == all_blocks(engine)
    assert not app.state.engine_thread.handles, "finished requests must be forgotten by the engine thread"


def test_task_4_disconnect_frees_blocks(model, tokenizer):
    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True}
    with running_server(app) as url:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                assert wait_until(lambda: free_blocks(engine) < all_blocks(engine))
            # Leaving the `with` closed the connection mid-stream.
        assert wait_until(lambda: not engine.has_work() and free_blocks(engine) == all_blocks(engine)), \
            "a client that disconnects must have its request aborted and its blocks freed"
        assert engine.generation_tokens_total < 400, "the request ran to max_tokens: it was never aborted"
        # The server keeps serving.
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_task_4_stop_strings(model, tokenizer):
    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    prompt = "stop test"
    full = in_process(model, prompt, max_tokens=20)
    stop = full.split()[3]  # a word from the middle of the output
    expected = full[:full.find(stop)]
    with running_server(app) as url:
        for stream in (False, True):
            # A budget far beyond the stop string: the request must end at the stop, not at max_tokens.
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "stop": [stop], "stream": stream,
                    "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if stream:
                events = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events)
                finish = events[-1]["choices"][0]["finish_reason"]
            else:
                text, finish = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
            assert (text, finish) == (expected, "stop")
        assert wait_until(lambda: not engine.has_work() and free_blocks(engine) == all_blocks(engine))
    assert engine.generation_tokens_total < 300, "a request that hit a stop string must be aborted"


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "gpt-nothing", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1},
     400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0},
     400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": -5},
     400, "top_k"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", 3]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    # Too long to ever fit in the engine's KV cache: the engine refuses it, the server answers 400.
    ("/v1/completions", {"model": MODEL, "prompt": [100] * 200_000}, 400, None),
]


def test_task_4_bad_requests_get_4xx(model, tokenizer):
    engine = make_engine(model)
    app = sol.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        for path, body, status, param in BAD_REQUESTS:
            for stream in (False, True):
                if isinstance(body, dict):
                    response = httpx.post(f"{url}{path}", json={**body, "stream": body.get("stream", stream)})
                else:
                    response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
                assert response.status_code == status, (body, response.text)
                error = response.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error"
                assert error["param"] == param, (body, error)
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert free_blocks(engine) == all_blocks(engine)
