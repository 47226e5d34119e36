"""onegraph.server over real sockets on 127.0.0.1, with the official openai client.

The model is a tiny synthetic one (tiny-dense with SmolLM2's vocabulary of 49152) on the CPU
path, the tokenizer SmolLM2's (from the GGUF). Expected answers come from a second Engine of
the same weights driven directly (the numpy reference decoder, which is also the engine's CPU
path, and sampling.sample): the server must give what one sequence decoded alone gives,
whatever else it interleaves or reuses from its prefix cache."""
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("onegraph.text")

from real_model import smollm2_gguf  # noqa: E402
from onegraph.engine import Engine  # noqa: E402
from onegraph.reference import ReferenceDecoder  # noqa: E402
from onegraph.sampling import SamplingParams, sample  # noqa: E402
from onegraph.server import ServerThread, StopMatcher, make_app  # noqa: E402
from onegraph.synth import iter_tensors, preset_config  # noqa: E402
from speculative_support import PinnedCosts  # noqa: E402

MODEL = "tiny-smol"
KEY = "test-key-123"
CONTEXT = 256
MAX_ACTIVE = 4
CACHE = 8
POISON = "POISONED-PROMPT"  # a prompt the test engine fails on (an engine failure)


def tiny_config(layers=2):
    return preset_config("tiny-dense", num_hidden_layers=layers, vocab_size=49152)


class CountingEngine(Engine):
    """Counts the sequences alive in the engine, and fails a prefill that holds poison_ids."""
    poison_ids = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live = {self.sequence}

    def new_sequence(self):
        seq = super().new_sequence()
        self.live.add(seq)
        return seq

    def fork(self, seq=None, length=None):
        new = super().fork(seq, length)
        self.live.add(new)
        return new

    def free_sequence(self, seq):
        super().free_sequence(seq)
        self.live.discard(seq)

    def prefill(self, tokens, mode=None):
        p = self.poison_ids
        if p and any(list(tokens[i:i + len(p)]) == p for i in range(len(tokens))):
            raise RuntimeError("injected failure")
        return super().prefill(tokens, mode)


@pytest.fixture(scope="module")
def tokenizer():
    from onegraph.text import Tokenizer
    return Tokenizer.from_model(smollm2_gguf())


@pytest.fixture(scope="module")
def reference():
    """The numpy reference decoder of the same weights (and the engine's default int8 KV),
    driven directly."""
    config = tiny_config()
    return ReferenceDecoder(config, dict(iter_tensors(config)), kv_dtype="int8", max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def server(tokenizer):
    config = tiny_config()
    engine = CountingEngine.from_tensors(config, lambda: iter_tensors(config), device="cpu", max_seq_len=CONTEXT)
    engine.poison_ids = tokenizer.encode(POISON, add_special_tokens=False)
    app = make_app(engine, tokenizer, MODEL, api_key=KEY, max_active=MAX_ACTIVE, max_queue=16,
                   prefix_cache_size=CACHE, max_body=64 * 1024)
    with ServerThread(app) as running:
        running.engine, running.app = engine, app
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def decode_alone(ref, prompt, max_tokens, sampling=SamplingParams(), stop_ids=(), want_logits=False):
    """(tokens, logits of each) of one request decoded alone from scratch on the reference."""
    ref.reset()
    logits = ref.prefill(list(prompt))
    tokens, all_logits = [], []
    while True:   # the sampler keyed by the row of the logits, over the tokens generated so far
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=logits.size)
        token = sample(logits, sampling, len(prompt) + len(tokens) - 1, counts)
        tokens.append(token)
        all_logits.append(logits)
        if token in stop_ids or len(tokens) == max_tokens:
            return (tokens, all_logits) if want_logits else tokens
        logits = ref.step(token)


def expected_text(tokenizer, tokens):
    stops = set(tokenizer.stop_token_ids)
    return tokenizer.decode([t for t in tokens if t not in stops], skip_special_tokens=True)


def metrics(server):
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            out[name.removeprefix("onegraph_").removesuffix("_total")] = float(value)
    return out


def wait_idle(server, timeout=20.0):
    """Metrics once no request is active or queued (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["active_sequences"] == 0 and m["queue_depth"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server is not idle after {timeout} s: {m}"
        time.sleep(0.05)


def assert_nothing_leaked(server):
    m = wait_idle(server)
    # The engine holds exactly the prefix cache's sequences (counted by the engine wrapper).
    assert len(server.engine.live) == m["cached_sequences"] <= CACHE
    return m


def chat(messages):
    return [{"role": r, "content": c} for r, c in messages]


HELLO = chat([("user", "Hello, who are you?")])


# ---- the endpoints -------------------------------------------------------------------------

def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    m = metrics(server)
    for key in ("requests", "prompt_tokens", "completion_tokens", "prefix_cache_hits", "queue_depth",
                "active_sequences", "kv_tokens"):
        assert key in m


def test_chat_matches_engine(server, client, tokenizer, reference):
    prompt = tokenizer.encode_chat(HELLO)
    tokens = decode_alone(reference, prompt, 8, stop_ids=tokenizer.stop_token_ids)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(tokenizer, tokens)
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in tokenizer.stop_token_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(tokens))
    assert r.usage.total_tokens == len(prompt) + len(tokens)


def test_chat_streaming(server, client, tokenizer, reference):
    messages = chat([("system", "Be brief."), ("user", "Tell me a story")])
    prompt = tokenizer.encode_chat(messages)
    tokens = decode_alone(reference, prompt, 10, stop_ids=tokenizer.stop_token_ids)
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    pieces = [decoder.push(t) for t in tokens if t not in tokenizer.stop_token_ids] + [decoder.flush()]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert content == [p for p in pieces if p]  # one chunk per decoded text piece
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_completions(server, client, tokenizer, reference):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    tokens = decode_alone(reference, ids, 6, stop_ids=tokenizer.stop_token_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].text == expected_text(tokenizer, tokens)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)  # token ids
    assert r2.choices[0].text == r.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


# ---- stop strings --------------------------------------------------------------------------

def test_stop_matcher():
    m = StopMatcher(["END", "xy"])
    assert m.push("abcE") == ("abc", False)      # "E" could start "END": held back
    assert m.push("N") == ("", False)
    assert m.push("Dtail") == ("", True)         # "END" completed across three pushes
    m = StopMatcher(["END"])
    assert m.push("abEN") == ("ab", False)
    assert m.push("x") == ("ENx", False)         # not a stop after all: released
    assert m.flush() == ""
    m = StopMatcher(["aab"])
    assert m.push("aa") == ("", False)
    assert m.push("aab") == ("aa", True)         # "aaaab": the stop starts at index 2
    m = StopMatcher([])
    assert m.push("text") == ("text", False)


def test_stop_string_across_tokens(server, client, tokenizer, reference):
    prompt = tokenizer.encode_chat(HELLO)
    tokens = decode_alone(reference, prompt, 16, stop_ids=tokenizer.stop_token_ids)
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    pieces = [decoder.push(t) for t in tokens]
    full = "".join(pieces)
    # a stop string made of the end of one piece and the start of the next (after the first)
    i = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    want = full[:full.find(stop)]
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0, stop=[stop, "@@@@"])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0, stop=stop,
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- logprobs and sampling -----------------------------------------------------------------

def log_softmax(logits):
    z = np.asarray(logits, dtype=np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_chat_logprobs(server, client, tokenizer, reference):
    prompt = tokenizer.encode_chat(HELLO)
    tokens, logits = decode_alone(reference, prompt, 5, stop_ids=tokenizer.stop_token_ids, want_logits=True)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens)
    for entry, token, step_logits in zip(content, tokens, logits):
        lp = log_softmax(step_logits)
        assert entry.logprob == pytest.approx(lp[token], abs=1e-9)
        top = np.argsort(-lp, kind="stable")[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp[top].tolist(), abs=1e-9)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(t)]) for t in top]
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(server, client, tokenizer, reference):
    ids = tokenizer.encode("Once upon a time")
    tokens, logits = decode_alone(reference, ids, 4, stop_ids=tokenizer.stop_token_ids, want_logits=True)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([log_softmax(l)[t] for t, l in zip(tokens, logits)], abs=1e-9)
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_seed_reproduces(server, client, tokenizer, reference):
    prompt = tokenizer.encode_chat(HELLO)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    want = expected_text(tokenizer, decode_alone(reference, prompt, 8, params, tokenizer.stop_token_ids))

    def ask(seed):
        return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0.9,
                                              top_p=0.95, seed=seed, extra_body={"top_k": 50}).choices[0].message.content
    assert ask(1234) == want
    assert ask(1234) == want
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert ask(99) == expected_text(tokenizer, decode_alone(reference, prompt, 8, other, tokenizer.stop_token_ids))


# ---- security and bad input ----------------------------------------------------------------

def post(server, path, body=None, raw=None, key=KEY, headers=None):
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {}) | (headers or {})
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers=h, timeout=30)


def test_auth(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    for key in (None, "wrong-key", KEY + "x"):
        r = post(server, "/v1/chat/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert post(server, "/v1/chat/completions", body).status_code == 200


C, P = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
BAD = [
    (C, {**OK_CHAT, "model": "gpt-4"}, 404, "model"),
    (C, {**OK_CHAT, "model": 5}, 400, "model"),
    (C, {k: v for k, v in OK_CHAT.items() if k != "messages"}, 400, "messages"),
    (C, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    (C, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (C, {**OK_CHAT, "messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    (C, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages"),
    (C, {**OK_CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    (C, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**OK_CHAT, "max_tokens": CONTEXT}, 400, "max_tokens"),
    (C, {**OK_CHAT, "max_completion_tokens": CONTEXT * 4}, 400, "max_completion_tokens"),
    (C, {**OK_CHAT, "temperature": -0.5}, 400, "temperature"),
    (C, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    (C, {**OK_CHAT, "top_p": 0}, 400, "top_p"),
    (C, {**OK_CHAT, "top_k": -1}, 400, "top_k"),
    (C, {**OK_CHAT, "seed": 1.5}, 400, "seed"),
    (C, {**OK_CHAT, "stop": [1, 2]}, 400, "stop"),
    (C, {**OK_CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {**OK_CHAT, "stream": "yes"}, 400, "stream"),
    (C, {**OK_CHAT, "n": 2}, 400, "n"),
    (C, {**OK_CHAT, "logit_bias": {"50": 10}}, 400, "logit_bias"),
    (C, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (C, {**OK_CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (C, {**OK_CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    (C, {**OK_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    (C, {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (C, {**OK_CHAT, "mirostat": 2}, 400, "mirostat"),
    (C, {**OK_CHAT, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    (C, [1, 2, 3], 400, None),
    (P, {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    (P, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    (P, {"model": MODEL, "prompt": [1, 49152]}, 400, "prompt"),
    (P, {"model": MODEL, "prompt": ""}, 400, None),
    (P, {"model": MODEL, "prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    (P, {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and "\n" not in error["message"]


def test_bad_bodies_and_still_serving(server, client):
    r = post(server, C, raw=b'{"model": "tiny-smol", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": "x" * (80 * 1024)}]}).encode()
    r = post(server, C, raw=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert post(server, "/v1/nowhere", OK_CHAT).status_code == 404
    assert httpx.get(server.url + C, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 405
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, n=3)
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_engine_failure_fails_one_request(server, client):
    before = metrics(server)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=chat([("user", POISON)]), max_tokens=4)
    assert "injected failure" in str(info.value)
    stream = client.chat.completions.create(model=MODEL, messages=chat([("user", POISON)]), max_tokens=4,
                                            stream=True)
    with pytest.raises(openai.APIError, match="injected failure"):
        list(stream)
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices[0].message.content
    m = assert_nothing_leaked(server)
    assert m["requests_failed"] == before.get("requests_failed", 0) + 2


# ---- sequences: disconnects, prefix reuse, queueing, load ------------------------------------

def test_disconnect_frees_sequence(server):
    before = wait_idle(server)
    body = {**OK_CHAT, "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + C, json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(3)) if line]
            assert got and got[0].startswith("data: ")
            assert metrics(server)["active_sequences"] == 1
    m = assert_nothing_leaked(server)
    assert m["requests_cancelled"] == before.get("requests_cancelled", 0) + 1
    assert m["completion_tokens"] - before["completion_tokens"] < 200


def test_prefix_reuse_second_turn(server, client, tokenizer, reference):
    turn1 = chat([("system", "You answer in one word."), ("user", "Name a colour of the sea")])
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=6, temperature=0)
    before = metrics(server)
    turn2 = turn1 + chat([("assistant", r1.choices[0].message.content), ("user", "And of the sky?")])
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    after = metrics(server)
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
    # the whole first prompt (and more) came from the cache
    assert after["prefix_cache_tokens"] - before["prefix_cache_tokens"] >= len(tokenizer.encode_chat(turn1))
    prompt2 = tokenizer.encode_chat(turn2)
    alone = decode_alone(reference, prompt2, 6, stop_ids=tokenizer.stop_token_ids)
    assert r2.choices[0].message.content == expected_text(tokenizer, alone)
    assert r2.usage.prompt_tokens == len(prompt2)
    assert_nothing_leaked(server)


def test_queue_full_gets_429(tokenizer):
    config = tiny_config(layers=1)
    engine = Engine.from_tensors(config, lambda: iter_tensors(config), device="cpu", max_seq_len=CONTEXT)
    app = make_app(engine, tokenizer, MODEL, max_active=1, max_queue=1, prefix_cache_size=0)
    body = {**OK_CHAT, "max_tokens": 200, "stream": True}
    with ServerThread(app) as running, httpx.Client(timeout=30) as http:
        with http.stream("POST", running.url + C, json=body) as first, \
                http.stream("POST", running.url + C, json=body) as second:
            assert first.status_code == 200 and second.status_code == 200
            r = http.post(running.url + C, json=body)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        deadline = time.monotonic() + 20
        while app.scheduler.metrics()["active_sequences"] or app.scheduler.metrics()["queue_depth"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.post(running.url + C, json={**OK_CHAT, "max_tokens": 2}).status_code == 200
    engine.close()


def test_load_concurrent_streams(server, tokenizer, reference):
    """16 streaming clients x 8 requests each, greedy: every answer equals the request alone.
    Eight questions, as many as the prefix cache holds: after its first time a question is
    mostly forked from the cache, which keeps the CPU run short."""
    questions = [chat([("user", f"What is {i} plus {i}?")]) for i in range(CACHE)]
    want = [expected_text(tokenizer, decode_alone(reference, tokenizer.encode_chat(q), 4,
                                                  stop_ids=tokenizer.stop_token_ids)) for q in questions]
    before = wait_idle(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    peak = []

    def worker(c):
        answers = []
        for k in range(8):
            q = (c + k) % len(questions)
            stream = client.chat.completions.create(model=MODEL, messages=questions[q], max_tokens=4, temperature=0,
                                                    stream=True)
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            answers.append((q, text))
        return answers

    def watch(stop):
        while not stop.is_set():
            peak.append(metrics(server)["active_sequences"])
            stop.wait(0.2)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(worker, range(16), timeout=120))
    finally:
        stop.set()
        watcher.join(10)
    for answers in results:
        for q, text in answers:
            assert text == want[q], f"question {q}"
    m = assert_nothing_leaked(server)
    assert m["requests"] - before["requests"] == 128
    assert m["requests_completed"] - before["requests_completed"] == 128
    assert max(peak) <= MAX_ACTIVE


# ---- speculative decoding ------------------------------------------------------------------

PARAGRAPH = ("The lighthouse on the northern cape was built in 1871 from granite quarried on the island "
             "itself. The light was automated in 1989.")
REPEAT = chat([("user", f"Repeat this paragraph twice: {PARAGRAPH} {PARAGRAPH}")])


@pytest.fixture(scope="module")
def spec_server(tokenizer):
    """The server of the same weights with speculative="ngram"."""
    config = tiny_config()
    engine = CountingEngine.from_tensors(config, lambda: iter_tensors(config), device="cpu", max_seq_len=CONTEXT)
    engine.step_costs = PinnedCosts()   # draft whenever the drafter has drafts
    app = make_app(engine, tokenizer, MODEL, api_key=KEY, max_active=MAX_ACTIVE, max_queue=16,
                   prefix_cache_size=CACHE, max_body=64 * 1024, speculative="ngram")
    with ServerThread(app) as running:
        running.engine, running.app = engine, app
        yield running


def spec_client(running):
    return openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def cached_rows_match_keys(running):
    """Every cached sequence holds exactly the rows of the tokens it is cached under."""
    scheduler, engine = running.app.scheduler, running.engine
    with scheduler.lock:
        cache = dict(scheduler.cache)
    for seq, tokens in cache.items():
        assert engine._seqs[seq].history == list(tokens)


def test_speculative_server_answers_as_plain_greedy(server, client, spec_server, tokenizer, reference):
    """A prompt that repeats a paragraph, greedy: the same completion text with and without
    --speculative ngram, the reference's; /metrics counts the verify steps."""
    prompt = tokenizer.encode_chat(REPEAT)
    tokens = decode_alone(reference, prompt, 40, stop_ids=tokenizer.stop_token_ids)
    before = wait_idle(spec_server)
    plain = client.chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=40, temperature=0)
    spec = spec_client(spec_server).chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=40,
                                                            temperature=0)
    assert spec.choices[0].message.content == plain.choices[0].message.content == expected_text(tokenizer, tokens)
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == len(tokens)
    after = assert_nothing_leaked(spec_server)
    assert after["verify_steps"] > before["verify_steps"]
    assert after["drafted_tokens"] - before["drafted_tokens"] >= after["verify_steps"] - before["verify_steps"]
    assert after["accepted_tokens"] <= after["drafted_tokens"]
    assert after["completion_tokens"] - before["completion_tokens"] == len(tokens)
    cached_rows_match_keys(spec_server)


def test_speculative_server_completions_stream_and_stop_strings(spec_server, tokenizer, reference):
    """Streamed completions text, and a stop string that ends the answer inside a run of
    accepted drafts: the reference's text, the cached rows those of the tokens fed."""
    c = spec_client(spec_server)
    text = f"{PARAGRAPH} {PARAGRAPH} {PARAGRAPH}"
    ids = tokenizer.encode(text)
    tokens = decode_alone(reference, ids, 30, stop_ids=tokenizer.stop_token_ids)
    full = expected_text(tokenizer, tokens)
    stream = c.completions.create(model=MODEL, prompt=text, max_tokens=30, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == full
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    pieces = [decoder.push(t) for t in tokens]
    i = next(i for i in range(len(pieces) // 2, len(pieces) - 1) if len(pieces[i]) >= 2)
    stop = pieces[i][-2:]
    want = full[:full.find(stop)]
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert_nothing_leaked(spec_server)
    cached_rows_match_keys(spec_server)


class OracleDrafter:
    """Drafts the continuation decode_alone gave for a known prompt: every draft is accepted, so
    stop tokens, stop strings and max_tokens fall inside accepted runs."""

    def __init__(self, sequences):
        self.sequences = sequences      # prompt + expected tokens, per known prompt

    def propose(self, context, k):
        for full in self.sequences:
            if list(context) == full[:len(context)]:
                return full[len(context):len(context) + k]
        return []


def test_speculative_server_accepted_runs_cut_by_stops(spec_server, tokenizer, reference, monkeypatch):
    """Drafts that are all accepted (an oracle drafter): max_tokens and a stop string inside a
    run of accepted drafts end the answer where the reference's does; the cached sequence then
    holds only the rows of the tokens fed."""
    import onegraph.server
    prompt = tokenizer.encode_chat(HELLO)
    tokens = decode_alone(reference, prompt, 24, stop_ids=tokenizer.stop_token_ids)
    monkeypatch.setattr(onegraph.server, "make_drafter", lambda mode: OracleDrafter([prompt + tokens]))
    c = spec_client(spec_server)
    before = wait_idle(spec_server)
    r = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=len(tokens) - 3, temperature=0)
    assert r.choices[0].message.content == expected_text(tokenizer, tokens[:-3])
    assert r.usage.completion_tokens == len(tokens) - 3
    m = wait_idle(spec_server)
    assert m["accepted_tokens"] - before["accepted_tokens"] == m["drafted_tokens"] - before["drafted_tokens"] > 0
    cached_rows_match_keys(spec_server)
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    pieces = [decoder.push(t) for t in tokens]
    full = "".join(pieces)
    i = next(i for i in range(len(pieces) // 2, len(pieces) - 1) if len(pieces[i]) >= 3 and
             full.find(pieces[i][-3:]) >= len("".join(pieces[:i])))
    stop = pieces[i][-3:]
    r = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert_nothing_leaked(spec_server)
    cached_rows_match_keys(spec_server)


def test_speculative_server_sampled_and_logprob_requests_decode_as_before(server, client, spec_server):
    """A sampled request (seeded) and a greedy one with logprobs take plain steps: the plain
    server's answers, no verify step."""
    c = spec_client(spec_server)
    before = wait_idle(spec_server)
    args = dict(model=MODEL, messages=REPEAT, max_tokens=12, temperature=0.8, seed=7)
    assert c.chat.completions.create(**args).choices[0].message.content == \
        client.chat.completions.create(**args).choices[0].message.content
    args = dict(model=MODEL, messages=REPEAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    spec, plain = c.chat.completions.create(**args), client.chat.completions.create(**args)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert [t.logprob for t in spec.choices[0].logprobs.content] == \
        [t.logprob for t in plain.choices[0].logprobs.content]
    after = assert_nothing_leaked(spec_server)
    assert after["verify_steps"] == before["verify_steps"]


def test_speculative_server_concurrent_greedy_streams(spec_server, tokenizer, reference):
    """Four clients at once, greedy, round-robin with verify steps: each answer is the request
    decoded alone; a second turn forks the prefix cache."""
    questions = [chat([("user", f"Say {w}, then repeat twice: {PARAGRAPH} {PARAGRAPH}")]) for w in
                 ("apple", "river", "stone", "cloud")]
    want = [expected_text(tokenizer, decode_alone(reference, tokenizer.encode_chat(q), 40,
                                                  stop_ids=tokenizer.stop_token_ids)) for q in questions]
    c = spec_client(spec_server)
    before = wait_idle(spec_server)

    def ask(q):
        stream = c.chat.completions.create(model=MODEL, messages=questions[q], max_tokens=40, temperature=0,
                                           stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, [0, 1, 2, 3, 3, 2, 1, 0], timeout=120))
    assert got == want + want[::-1]
    after = assert_nothing_leaked(spec_server)
    assert after["verify_steps"] > before["verify_steps"]
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    cached_rows_match_keys(spec_server)


# ---- the command line ----------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_serves_a_model_folder(tmp_path):
    from onegraph.synth import write_model
    gguf = smollm2_gguf()
    write_model(tiny_config(layers=1), tmp_path / "model")
    port = free_port()
    cmd = [sys.executable, "-m", "onegraph.server", "--model", str(tmp_path / "model"), "--tokenizer", gguf,
           "--port", str(port), "--api-key", KEY, "--device", "cpu", "--max-seq-len", "128", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert [m.id for m in c.models.list().data] == ["model"]
        r = c.chat.completions.create(model="model", messages=HELLO, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_main_refuses_missing_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "onegraph.server", "--model", str(tmp_path / "nope"),
                           "--tokenizer", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "nope" in proc.stdout + proc.stderr
