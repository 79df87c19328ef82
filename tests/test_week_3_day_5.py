"""Week 3 Day 5: serving the engine over HTTP (book/src/week3-05-serving.md).

Everything past tasks 1-3 runs over real HTTP: uvicorn in a thread on a free port, the engine in the
server's own engine thread, the official `openai` client and httpx as clients. Outputs are checked
against in-process generation with the same engine, never against themselves. Task 4's server is the
student's engine thread with the reference's Tasks 1-3 (`solution(week=3, day=5, task=4)`), so a bug in
the stop strings or the detokenizer costs those tasks' points, not Task 4's.
"""

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import actor_fakes, fetch, reference, solution, stack
from tests.sampling_oracles import penalized, raw_logprobs
from tests.serve_fakes import parse_prometheus, running_server, wait_until
from tests.week3_fakes import PLAIN_ENGINE, run_until_done
from tests.week3_stack import check_stack

sol = solution(week=3, day=5, reads_text=True)  # Tasks 1-3: the student's pure functions
served = solution(week=3, day=5, task=4, reads_text=True)  # Task 4's server: the student's Task 4 alone
STACK = stack(week=3, day=5, reads_text=True)  # "your stack so far": started now, its tokenizer too
ref = reference()

MODEL = "tiny-test-model"


def serving(package):
    """tests/actor_fakes/serving where `package` runs: the fakes a server test puts into the student's code."""
    return actor_fakes(package, "serving")


@pytest.fixture(scope="module")
def model(model32):
    """(week-3 model, tokenizer, week-3 model of Task 4's package) on the embedded model's weights, float32: the
    first is the oracles' (the reference's, here), the last the served engines' (while grading, in the sandbox
    beside the server's engine thread, so a step never crosses the pipe)."""
    mlx_model, tokenizer = model32
    week3_model = ref.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    served_model = served.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    # MLX streams are thread-local: arrays the model left lazy on this thread cannot be evaluated on the
    # server's engine thread. One tiny generation here materializes them.
    ref.engine.generate(week3_model, tokenizer, [[1]], ref.sequence.SamplingParams(max_tokens=1))
    served.engine.generate(served_model, tokenizer, [[1]], served.sequence.SamplingParams(max_tokens=1))
    return week3_model, tokenizer, served_model


@pytest.fixture(scope="module")
def tokenizer(model):
    return model[1]


def make_engine(model, **options):
    """An engine for the server under test, of Task 4's package (the reference's engine) on its own model."""
    config = served.engine.EngineConfig(**{**PLAIN_ENGINE, "token_budget": 64, "max_num_seqs": 16, "block_size": 8,
                                           **options})
    return served.engine.LLMEngine(model[2], model[1], config)


def in_process(model, prompt_text: str, max_tokens: int) -> str:
    """What the engine alone generates for this prompt (greedy): the oracle for the server's text."""
    prompt = model[1].encode(prompt_text, add_special_tokens=False)
    return ref.engine.generate(model[0], model[1], [prompt], ref.sequence.SamplingParams(max_tokens=max_tokens))[0]


def in_process_tokens(model, prompt_text: str, max_tokens: int) -> list[int]:
    """The token ids the engine alone generates for this prompt (greedy), EOS excluded."""
    engine = ref.engine.LLMEngine(model[0], model[1], ref.engine.EngineConfig(**PLAIN_ENGINE, token_budget=64,
                                                                               max_num_seqs=16, block_size=8))
    seq = engine.add_request(prompt_text, ref.sequence.SamplingParams(max_tokens=max_tokens))
    run_until_done(engine, rule="a request ends at EOS or max_tokens")
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
    # find_stop on each prefix, driven where it runs (one round trip while grading); checked here.
    answers = serving(sol).find_stops(sol.server.find_stop, "".join(chars), stops)
    for n, (end, stopped) in enumerate(answers, 1):
        text = "".join(chars[:n])
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


# ---------------------------------------------------------------- task 3: incremental detokenization


# Rare scripts and emoji: byte-level BPE splits their characters across tokens.
MULTIBYTE_TEXT = "héllo wörld, 世界 and 🙂🚀 ünïcödé — “quotes”, 𒀀𒀁𒀂 ሰላም ᚠᚢᚦ 🫠🪬 ok"


def stream_text(tokenizer, tokens: list[int]) -> list[str]:
    """The pieces the student's detokenizer gives, a token at a time, and its flush (driven where it runs: one
    round trip while grading)."""
    return serving(sol).stream_text(sol.server.IncrementalDetokenizer, tokenizer, tokens)


def test_task_3_pieces_add_up_to_decode(tokenizer):
    tokens = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in tokens), "the text must split a character"
    pieces = stream_text(tokenizer, tokens)
    assert "".join(pieces) == tokenizer.decode(tokens) == MULTIBYTE_TEXT
    # A token that ends inside a character is held back until the character is complete.
    assert not any("\ufffd" in piece for piece in pieces), pieces
    assert sum(1 for piece in pieces[:-1] if piece) > len(tokens) // 2, "text must come out as tokens arrive"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_task_3_random_text_and_tokens_add_up(tokenizer, data):
    """The tokens of any text (rare characters split across tokens), with any token ids mixed in (byte
    pieces that never form a character): the pieces, the remainder included, are exactly what decoding
    all the tokens at once gives."""
    text = data.draw(st.text(alphabet=st.sampled_from(MULTIBYTE_TEXT), max_size=24))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    junk = data.draw(st.lists(st.tuples(st.integers(0, len(tokens)), st.integers(0, tokenizer.vocab_size - 1)),
                              max_size=3))
    for position, token in junk:
        tokens.insert(position, token)
    assert "".join(stream_text(tokenizer, tokens)) == tokenizer.decode(tokens)


def test_task_3_decodes_a_window_not_everything(tokenizer):
    """A long stream decodes a few tokens per call: re-decoding the whole output each token is quadratic."""
    tokens = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    counting = serving(sol).CountingTokenizer(tokenizer)
    pieces = stream_text(counting, tokens)
    assert "".join(pieces) == tokenizer.decode(tokens)
    [[windows]] = fetch([counting], "windows")
    # The record is the submission's to write while grading: it must at least be one a detokenizer could have made,
    # every call a run of the stream's own tokens and every token in some call (a record emptied, or made up of a
    # few short calls, fails); a lying one has to invent the decode calls a windowed detokenizer would make.
    covered = set()
    for window in filter(None, windows):
        starts = [i for i in range(len(tokens) - len(window) + 1) if tokens[i:i + len(window)] == window]
        assert starts, f"a decode call of {window} was recorded: not a run of the stream's tokens"
        covered.update(start + i for start in starts for i in range(len(window)))
    assert covered == set(range(len(tokens))), "the decode calls recorded never took some of the stream's tokens"
    longest = max(map(len, windows))
    assert longest <= 8, f"a decode call took {longest} of {len(tokens)} tokens: decode a window, not all"


# ---------------------------------------------------------------- task 4: the engine thread, over HTTP


# vLLM's own histogram buckets (vllm/v1/metrics/loggers.py), written out here as the oracle.
VLLM_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0],
    **{name: VLLM_REQUEST_BUCKETS for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                               "request_prefill_time_seconds", "request_decode_time_seconds",
                                               "request_inference_time_seconds")},
}


def scrape(url: str) -> tuple[dict, dict]:
    """/metrics parsed: (samples of this model without bucket or reason labels, each histogram's bucket bounds)."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = parse_prometheus(response.text)
    samples = {name: value for family in families.values() for name, labels, value in family["samples"]
               if labels.get("model_name") == MODEL and "le" not in labels and "finished_reason" not in labels}
    bounds = {name: [float(labels["le"]) for sample, labels, _ in family["samples"]
                     if sample == f"{name}_bucket" and labels["le"] != "+Inf"]
              for name, family in families.items() if family["type"] == "histogram"}
    return samples, bounds


def test_task_4_metrics_endpoint(model, tokenizer):
    """/metrics through prometheus_client, vLLM's names after `tiny_llm:`, every sample labelled with the model."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        for max_tokens in (3, 5):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        samples, bounds = scrape(url)
        families = parse_prometheus(httpx.get(f"{url}/metrics").text)
    lengths = [len(in_process_tokens(model, "hi", n)) for n in (3, 5)]
    assert samples["tiny_llm:generation_tokens_total"] == sum(lengths)
    assert samples["tiny_llm:prompt_tokens_total"] == 2 * len(tokenizer.encode("hi", add_special_tokens=False))
    assert samples["tiny_llm:num_requests_running"] == 0 and samples["tiny_llm:num_requests_waiting"] == 0
    assert samples["tiny_llm:kv_cache_usage_perc"] == 0 and samples["tiny_llm:num_preemptions_total"] == 0
    assert samples["tiny_llm:prefix_cache_queries_total"] == samples["tiny_llm:prefix_cache_hits_total"] == 0
    finished = {labels["finished_reason"]: value for family in families.values()
                for name, labels, value in family["samples"] if name == "tiny_llm:request_success_total"}
    assert sum(finished.values()) == 2
    assert samples["tiny_llm:inter_token_latency_seconds_count"] == sum(n - 1 for n in lengths)  # n - 1 gaps each
    for name, buckets in VLLM_BUCKETS.items():
        assert bounds.get(f"tiny_llm:{name}") == buckets, f"tiny_llm:{name} must have vLLM's buckets"
        if name != "inter_token_latency_seconds":
            assert samples[f"tiny_llm:{name}_count"] == 2, f"tiny_llm:{name}: one observation per request"


def test_task_4_latency_phases_add_up(model, tokenizer):
    """vLLM's request phases: queue, prefill and decode follow each other inside the end-to-end latency; a
    request that leaves while it waits in the engine's queue counts in none of them."""
    engine = make_engine(model, max_num_seqs=1)
    serving(served).Patched(engine, "step", pause=0.02)  # 400 tokens take 8 s: time to queue the second request
    app = served.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        with httpx.Client(timeout=60) as client:
            # One sequence at a time: the first request runs, the second waits in the engine's queue and leaves.
            body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            with client.stream("POST", f"{url}/v1/completions", json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                assert next(lines).startswith("data: ")
                waiting_body = {**body, "max_tokens": 5}
                with client.stream("POST", f"{url}/v1/completions", json=waiting_body) as waiting:
                    assert waiting.status_code == 200
                    assert wait_until(lambda: engine.num_waiting == 1)
                assert wait_until(lambda: engine.num_waiting == 0), "the waiting request must be aborted"
            assert wait_until(lambda: not engine.has_work())
            response = client.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 6})
            assert response.status_code == 200
        samples, _ = scrape(url)

    def total(name):
        return samples[f"tiny_llm:{name}_sum"]

    assert samples["tiny_llm:e2e_request_latency_seconds_count"] == 3
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "time_to_first_token_seconds"):
        assert samples[f"tiny_llm:{name}_count"] == 2, f"tiny_llm:{name}: only the two requests that ran count"
    assert total("request_inference_time_seconds") == pytest.approx(
        total("request_prefill_time_seconds") + total("request_decode_time_seconds"))
    assert total("request_queue_time_seconds") + total("request_inference_time_seconds") <= \
        total("e2e_request_latency_seconds")
    assert total("request_prefill_time_seconds") <= total("time_to_first_token_seconds")
    assert total("request_decode_time_seconds") > 0


def test_task_4_openai_client_streams_chat(model, tokenizer):
    from openai import OpenAI

    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
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
    app = served.server.create_app(engine, tokenizer, MODEL)
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
    app = served.server.create_app(engine, tokenizer, MODEL)
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
    app = served.server.create_app(engine, tokenizer, MODEL)
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


def test_task_4_shutdown_drains_then_aborts(model, tokenizer):
    """Ctrl-C or SIGTERM (`pdm run serve`'s DrainingServer): a running stream gets the drain time, then ends
    with finish reason "abort" and [DONE], its blocks are freed, and the server stops without an error."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    servers = serving(served)
    port = servers.serve(app, drain=0.2)  # stopped as `pdm run serve` stops: the app drains, then uvicorn
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1000, "temperature": 1, "seed": 1, "stream": True}
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                servers.stop(port, timeout=0)  # what uvicorn's signal handler does on Ctrl-C or SIGTERM
                events = [line for line in lines if line.startswith("data: ")]
    except BaseException:
        servers.raise_engine_error(app)  # the real cause (on a skeleton: its NotImplementedError)
        raise
    finally:
        stopped = servers.stop(port, timeout=30)
    assert stopped, "the server did not stop"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert engine.generation_tokens_total < 1000, "the request ran to the end: it was never aborted"
    assert free_blocks(engine) == all_blocks(engine) and app.state.engine_thread.error is None


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
DEEP = b'{"model": "tiny-test-model", "prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BAD_REQUESTS = [
    # (path, body: a dict sent as JSON or raw bytes, status, the `param` the error must name)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-nothing"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),  # answers no call
    ("/v1/chat/completions", {**CHAT, "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": True}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_k": -5}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT, "priority": "high"}, 400, "priority"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools"),  # day 4.5 serves functions
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format"),  # day 4.5 serves JSON
    # The served sampling extensions, outside the engine's ranges (sequence.py; the chapter's table).
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": NaN}', 400,
     "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 2.5}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", {**CHAT, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "no_such_field": 1}, 400, "no_such_field"),
    # The table: each of these used to kill the engine thread or answer 500.
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400, "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', 400,
     "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc80"}]}', 400, None),
    ("/v1/completions", DEEP, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", 3]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 65, "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x", 5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    # Too long to ever fit in the engine's KV cache: refused before it reaches the engine.
    ("/v1/completions", {"model": MODEL, "prompt": [100] * 200_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 12_000}]}, 400,
     "max_tokens"),
]


def send(url: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{url}{path}", json=body, timeout=60, **kwargs)
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60,
                      **kwargs)


def assert_still_serving(url: str, model, engine) -> None:
    """After whatever came before: healthy, every KV block free, and a normal request answered correctly."""
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert wait_until(lambda: not engine.has_work() and free_blocks(engine) == all_blocks(engine)), \
        "KV blocks leaked"
    body = {"model": MODEL, "prompt": "fine", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == in_process(model, "fine", 4)


def test_task_4_bad_requests_get_4xx(model, tokenizer):
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        for path, body, status, param in BAD_REQUESTS:
            for stream in (False, True):
                if isinstance(body, dict):
                    body = {**body, "stream": body.get("stream", stream)}
                response = send(url, path, body)
                assert response.status_code == status, (str(body)[:200], response.text[:500])
                error = response.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error"
                assert error["param"] == param, (str(body)[:200], error)
                assert len(response.content) < 2000, "an error must not echo the request back"
        assert_still_serving(url, model, engine)


def test_task_4_failed_step_fails_its_requests_only(model, tokenizer):
    """A step that raises fails the requests in it; the engine thread logs it and keeps serving."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    fault = serving(served).Patched(engine.runner, "run", fail_first="injected fault in the model call")
    with running_server(app) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 3},
                              timeout=60)
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert fault.calls, "the fault was never reached"
        assert app.state.engine_thread.running, "the engine thread must survive a failed step"
        assert_still_serving(url, model, engine)


def test_task_4_unexpected_add_request_error_fails_that_request_only(model, tokenizer):
    """`add_request` raising something other than ValueError/TypeError: that request gets a 500, not a hang."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    fault = serving(served).Patched(engine, "add_request", fail_first="injected fault in add_request")
    with running_server(app) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 3},
                              timeout=60)
        assert response.status_code == 500 and fault.calls
        assert_still_serving(url, model, engine)


def test_task_4_non_streaming_client_that_leaves_is_aborted(model, tokenizer):
    """A non-streaming client that disconnects is aborted within a step or two, not after all its tokens."""
    import socket

    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    serving(served).Patched(engine.runner, "run", pause=0.1)  # steps longer than a busy server's reaction
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 400, "temperature": 1,
                       "seed": 3}).encode()
    with running_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_until(lambda: engine.generation_tokens_total >= 3)
            steps_when_left = engine.num_steps
        assert wait_until(lambda: not engine.has_work() and free_blocks(engine) == all_blocks(engine)), \
            "a non-streaming client that leaves must have its request aborted"
        assert engine.num_steps - steps_when_left <= 3, \
            f"{engine.num_steps - steps_when_left} steps ran after the client left"
        assert engine.generation_tokens_total < 400
        assert_still_serving(url, model, engine)


def test_task_4_streaming_client_that_leaves_before_the_body_is_aborted_and_counted(model, tokenizer):
    """A streaming client that leaves before the first byte of the response: the response is cancelled
    before its body is read, yet the request is aborted and counted (e2e latency, finish reason abort)."""
    import socket

    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    serving(served).Patched(engine.runner, "run", pause=0.02)  # 400 tokens would take 8 s
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    # The app's first message of each response held back 0.5 s: the client leaves before the body is ever read.
    with running_server(serving(served).HeldStart(app, hold=0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_until(lambda: engine.generation_tokens_total > 0), "the request never ran"
        assert wait_until(lambda: not engine.has_work() and free_blocks(engine) == all_blocks(engine)), \
            "a client that leaves must have its request aborted"
        assert engine.generation_tokens_total < 400, "the request ran to max_tokens for nobody: never aborted"
        assert wait_until(lambda: scrape(url)[0].get("tiny_llm:e2e_request_latency_seconds_count") == 1), \
            "the request that left was never counted in e2e_request_latency_seconds"
        assert_still_serving(url, model, engine)


def test_task_4_several_choices(model, tokenizer):
    """A list of prompts and n > 1: one choice per prompt and sample, each the engine's own text."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    prompts = ["first prompt", "the second one"]
    expected = [in_process(model, p, 5) for p in prompts for _ in range(2)]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0}
    with running_server(app) as url:
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in whole["choices"]] == expected
        prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
        assert whole["usage"]["prompt_tokens"] == prompt_tokens
        streamed = {i: "" for i in range(4)}
        finished = {}
        response = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]
                streamed[chunk["index"]] += chunk["text"]
                if chunk["finish_reason"]:
                    finished[chunk["index"]] = chunk["finish_reason"]
        assert [streamed[i] for i in range(4)] == expected and len(finished) == 4
        sampled = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 8, "seed": 5})
        first, second = [c["message"]["content"] for c in sampled.json()["choices"]]
        assert first != second, "two sampled choices with one seed must still differ"
        assert_still_serving(url, model, engine)


def test_task_4_http_extras(model, tokenizer):
    """API key, CORS, request id, GET /v1/models/{id}, OpenAI's max_tokens precedence, priorities."""
    engine = make_engine(model, scheduling_policy="priority")
    # While grading, the record is the submission's to write; a lying one must know this fake and write into it.
    add_request = serving(served).Patched(engine, "add_request", keys=("priority",))
    app = served.server.create_app(engine, tokenizer, MODEL, api_key="sesame", cors_origins=("*",), max_model_len=64)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    with running_server(app) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 401
        assert httpx.post(f"{url}/v1/chat/completions", json=chat,
                          headers={"authorization": "Bearer wrong"}).status_code == 401
        auth = {"authorization": "Bearer sesame"}
        assert httpx.get(f"{url}/v1/models/{MODEL}", headers=auth).json()["id"] == MODEL
        assert httpx.get(f"{url}/v1/models/other", headers=auth).status_code == 404
        preflight = httpx.options(f"{url}/v1/chat/completions", headers={
            "origin": "http://example.com", "access-control-request-method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://example.com")
        response = httpx.post(f"{url}/v1/chat/completions", headers={**auth, "x-request-id": "abc"},
                              json={**chat, "max_tokens": 9, "max_completion_tokens": 2, "priority": 3}, timeout=60)
        assert response.headers["x-request-id"] == "abc"
        assert response.json()["usage"]["completion_tokens"] <= 2, "max_completion_tokens wins over max_tokens"
        assert add_request.calls == [{"priority": 3}], "the request's priority must reach engine.add_request"
        prompt_tokens = len(tokenizer.encode(chat_text(tokenizer, "hi"), add_special_tokens=False))
        expected = in_process_tokens(model, chat_text(tokenizer, "hi"), 64 - prompt_tokens + 1)
        response = httpx.post(f"{url}/v1/chat/completions", headers=auth, json=chat, timeout=60)
        # No max_tokens on chat: up to the context (max_model_len), not 16.
        assert response.json()["usage"]["completion_tokens"] == len(expected)


def test_task_4_langchain_clients(model, tokenizer):
    """LangChain's OpenAI clients, as users point them at the server: chat (invoke, stream), completions (a list
    of prompts). (Tools and structured output are day 4.5's: its tests run LangChain's `bind_tools` and
    `with_structured_output`.)"""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI, OpenAI

    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    content = "Tell me about the sea."
    expected = in_process(model, chat_text(tokenizer, content), max_tokens=6)
    prompts = ["Once upon a time", "The sea is"]
    with running_server(app) as url:
        options = {"model": MODEL, "base_url": f"{url}/v1", "api_key": "unused", "temperature": 0,
                   "max_retries": 0, "timeout": 60}
        chat = ChatOpenAI(max_completion_tokens=6, **options)
        assert chat.invoke([HumanMessage(content)]).content == expected
        assert "".join(chunk.content for chunk in chat.stream([HumanMessage(content)])) == expected
        completions = OpenAI(max_tokens=5, **options).generate(prompts)
        assert [g[0].text for g in completions.generations] == [in_process(model, p, 5) for p in prompts]
        assert wait_until(lambda: not engine.has_work())
    assert free_blocks(engine) == all_blocks(engine)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)
FIELDS = ["temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "priority", "logprobs", "user",
          "stream_options", "presence_penalty", "min_p", "response_format", "max_completion_tokens"]


def test_task_4_fuzzed_requests_never_500(model):
    """Any JSON in any field (small outputs): a 200 or a 4xx, never a 500, and the engine lives on."""
    engine = make_engine(model)
    app = served.server.create_app(engine, model[1], MODEL, max_model_len=48)  # a chat without max_tokens stays short

    @settings(max_examples=40, deadline=None)
    @given(data=st.data())
    def one_request(data):
        serving(served).raise_engine_error(app)  # the real cause (on a skeleton: its NotImplementedError)
        chat = data.draw(st.booleans())
        body = {name: data.draw(JSON_VALUES) for name in data.draw(st.lists(st.sampled_from(FIELDS), max_size=4))}
        body["max_tokens"] = data.draw(st.integers(1, 3) | JSON_VALUES)
        body["max_completion_tokens"] = data.draw(st.none() | st.integers(1, 3))
        body[("messages" if chat else "prompt")] = data.draw(
            st.just([{"role": "user", "content": "x"}]) if chat else st.just("x") | JSON_VALUES)
        raw = json.dumps(body, allow_nan=True).encode()
        response = send(url, "/v1/chat/completions" if chat else "/v1/completions", raw)
        assert response.status_code < 500, (body, response.text[:300])
        assert httpx.get(f"{url}/health").status_code == 200

    with running_server(app) as url:
        one_request()
        assert_still_serving(url, model, engine)


# ---------------------------------------------------------------- the sampling extensions, over HTTP
#
# The logits processing itself (logits_processors.py) is provided and tested in test_logits_processors.py;
# these check that the server (the engine thread, the stream, the responses) carries each field end to
# end, against mlx-lm's own model and logits processors.


def mlx_lm_greedy(model32, prompt: list[int], max_tokens: int, processors=None) -> list[tuple[int, "np.ndarray"]]:
    """mlx-lm's own greedy generation: (token, the raw log-probabilities it came from) per step, up to EOS."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    mlx_model, tokenizer = model32
    steps = []
    for (token, logprobs), _ in zip(generate_step(mx.array(prompt), mlx_model, max_tokens=max_tokens,
                                                  logits_processors=processors), range(max_tokens)):
        if int(token) in tokenizer.eos_token_ids:
            break
        steps.append((int(token), np.array(logprobs.astype(mx.float32)).reshape(-1)))
    return steps


def test_task_4_logprobs_match_mlx_lm(model, tokenizer, model32):
    """Completions' `logprobs` and chat's `logprobs`/`top_logprobs` (streamed, read by the openai client)
    are mlx-lm's log-softmax of the chosen token and of the most likely ones."""
    from openai import OpenAI

    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    prompt_text = "The capital of France is"
    content = "Name a colour."
    completion_oracle = mlx_lm_greedy(model32, tokenizer.encode(prompt_text, add_special_tokens=False), 6)
    chat_oracle = mlx_lm_greedy(model32, tokenizer.encode(chat_text(tokenizer, content), add_special_tokens=False), 6)
    with running_server(app) as url:
        body = {"model": MODEL, "prompt": prompt_text, "max_tokens": 6, "temperature": 0, "logprobs": 3}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                     max_tokens=6, temperature=0, stream=True, logprobs=True,
                                                     top_logprobs=2))
        plain = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    logprobs = whole["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == whole["usage"]["completion_tokens"] == len(completion_oracle)
    assert "".join(logprobs["tokens"]) == whole["choices"][0]["text"]
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    for (token, oracle), chosen, top in zip(completion_oracle, logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert chosen == pytest.approx(oracle[token], abs=2e-3)
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(oracle)[::-1][:3], abs=2e-3)
    assert plain["choices"][0]["logprobs"] is None, "a request that asks for none gets none"

    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    for chunk in chunks:  # a chunk carries the entries of its own tokens, not all of them at the end
        if chunk.choices and chunk.choices[0].delta.content:
            assert "".join(e.token for e in chunk.choices[0].logprobs.content) == chunk.choices[0].delta.content
    assert len(entries) == len(chat_oracle), "one logprobs entry per generated token, across the chunks"
    for (token, oracle), entry in zip(chat_oracle, entries):
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(oracle[token], abs=2e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(oracle)[::-1][:2], abs=2e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen one is the most likely


def test_task_4_penalties_and_logit_bias_match_mlx_lm(model, tokenizer, model32):
    """Greedy with a logit_bias that makes a token repeat: with repetition_penalty, mlx-lm's own processors give
    the same tokens; with presence and frequency penalties, mlx-lm's model with the penalties by definition does."""
    prompt_text = "one two one two one two"  # short: prompt and output stay within mlx-lm's 20-token window
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    # The runner-up of the first step, raised by 10: greedy then repeats it (this model never repeats by itself).
    bias = {int(raw_logprobs(model32, prompt)[-1].argsort()[-2]): 10.0}

    def by_definition(presence: float, frequency: float) -> list[int]:
        output: list[int] = []
        for _ in range(8):
            row = penalized(raw_logprobs(model32, prompt + output)[-1], prompt, output, presence, frequency, bias=bias)
            if int(row.argmax()) in tokenizer.eos_token_ids:
                break
            output.append(int(row.argmax()))
        return output

    from mlx_lm.sample_utils import make_logits_processors

    repeating = by_definition(0.0, 0.0)
    assert repeating[:3] == [next(iter(bias))] * 3, "the bias alone must make a token repeat"
    oracle_repetition = [t for t, _ in mlx_lm_greedy(model32, prompt, 8, make_logits_processors(
        logit_bias=bias, repetition_penalty=1.8))]
    oracle_counts = by_definition(presence=0.7, frequency=0.9)
    assert repeating != oracle_repetition and repeating != oracle_counts, "each penalty must change this output"
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    with running_server(app) as url:
        body = {"model": MODEL, "prompt": prompt_text, "max_tokens": 8, "temperature": 0,
                "logit_bias": {str(t): v for t, v in bias.items()}}
        biased = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        repetition = httpx.post(f"{url}/v1/completions", json={**body, "repetition_penalty": 1.8}, timeout=60).json()
        counted = httpx.post(f"{url}/v1/completions", timeout=60, json={
            **body, "presence_penalty": 0.7, "frequency_penalty": 0.9, "stream": True})
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in counted.text.splitlines()
                           if line.startswith("data: {"))
        assert_still_serving(url, model, engine)
    assert biased["choices"][0]["text"] == tokenizer.decode(repeating)
    assert repetition["choices"][0]["text"] == tokenizer.decode(oracle_repetition)
    assert streamed == tokenizer.decode(oracle_counts)


def test_task_4_ignore_eos_runs_to_max_tokens(model, tokenizer):
    """With EOS forced (logit_bias), a request ends at once with "stop"; with ignore_eos it runs to max_tokens."""
    engine = make_engine(model)
    app = served.server.create_app(engine, tokenizer, MODEL)
    eos = next(iter(tokenizer.eos_token_ids))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 100}}
    with running_server(app) as url:
        stops = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        runs_on = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
        assert_still_serving(url, model, engine)
    assert stops["choices"][0]["finish_reason"] == "stop" and stops["usage"]["completion_tokens"] == 0
    assert runs_on["choices"][0]["finish_reason"] == "length"
    assert runs_on["usage"]["completion_tokens"] == 5, "every EOS past the first is an output token"


def test_task_4_cached_tokens_in_usage(model, tokenizer):
    """`usage.prompt_tokens_details.cached_tokens`: 0 the first time, the shared full blocks the second."""
    engine = make_engine(model, enable_prefix_caching=True)
    app = served.server.create_app(engine, tokenizer, MODEL)
    prompt = "a shared beginning that is long enough to fill a few blocks of eight tokens each, and then some"
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    with running_server(app) as url:
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        stream = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    cached = (prompt_tokens - 1) // 8 * 8  # every full block but one that holds the last prompt token
    assert cached >= 16
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_task_4_huge_prompt_does_not_stall_the_server(model, tokenizer):
    """A ~2 MB prompt: while it is tokenized, /health and another request are served; then it gets a 400."""
    import threading

    engine = make_engine(model)
    slow = serving(served).SlowTokenizer(tokenizer)  # encoding the huge prompt waits until the test says go
    app = served.server.create_app(engine, slow, MODEL)
    huge = {"model": MODEL, "prompt": "word " * 400_000, "max_tokens": 2}
    answers = {}
    with running_server(app) as url:
        sender = threading.Thread(target=lambda: answers.update(huge=send(url, "/v1/completions", huge)))
        sender.start()
        assert wait_until(lambda: slow.started.is_set() or not sender.is_alive(), timeout=60) \
            and slow.started.is_set(), "the huge prompt never reached the tokenizer"
        try:
            answers["health"] = httpx.get(f"{url}/health", timeout=10)
            answers["small"] = send(url, "/v1/completions", {"model": MODEL, "prompt": "fine", "max_tokens": 4,
                                                             "temperature": 0})
        except httpx.TimeoutException:
            pytest.fail("the server did not answer while a prompt was being tokenized: tokenize off the event loop")
        finally:
            slow.release.set()
            sender.join(timeout=120)
        assert answers["health"].json() == {"status": "ok"}
        assert answers["small"].json()["choices"][0]["text"] == in_process(model, "fine", 4)
        error = answers["huge"].json()["error"]
        assert answers["huge"].status_code == 400 and error["code"] == "context_length_exceeded", error
        assert_still_serving(url, model, engine)


# ---------------------------------------------------------------- Task 5: your stack so far


def test_task_5_your_stack_so_far():
    """Your week-3 engine behind your server, over real HTTP, on the workloads a server meets (tests/week3_stack.py)."""
    check_stack(STACK, day=5)
