"""The server's load test on the real model on the GPU: 16 streaming clients x 8 requests
each, greedy, every answer equal to the same request served alone; aggregate tok/s, time to
first chunk and time between chunks (p50 / p90), printed and written to $OUT/server_load.json
when $OUT is set. Skipped without a usable GPU and library."""
import concurrent.futures
import json
import os
import time

import numpy as np
import pytest

from gpu_support import require_gpu
from real_model import smollm2_gguf

pytestmark = pytest.mark.gpu
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("onegraph.text")

CLIENTS, REQUESTS, MAX_TOKENS, MAX_ACTIVE = 16, 8, 32, 8


def test_load_on_the_real_model():
    require_gpu()
    from onegraph.loader import load_model
    from onegraph.server import ServerThread, engine_for_serving, make_app
    from onegraph.text import Tokenizer
    gguf = smollm2_gguf()
    tokenizer = Tokenizer.from_model(gguf)
    # No prefix cache: every prompt is prefilled whole, as when served alone, so the greedy
    # answers can be compared exactly (a fork changes how the prompt's rows are batched).
    engine = engine_for_serving(load_model(gguf), max_active=MAX_ACTIVE, prefix_cache_size=0, max_seq_len=1024, device="gpu")
    app = make_app(engine, tokenizer, "smollm2", max_active=MAX_ACTIVE, max_queue=CLIENTS, prefix_cache_size=0)
    questions = [[{"role": "user", "content": f"Write one sentence about the number {i}."}] for i in range(8)]
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(q):
            """(text, completion tokens, [time to first chunk, gaps between chunks...])."""
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model="smollm2", messages=questions[q], max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, stream_options={"include_usage": True})
            texts, times, tokens = [], [], 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts.append(chunk.choices[0].delta.content)
                    times.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return "".join(texts), tokens, [times[0] - t0] + list(np.diff(times)) if times else []

        alone = [ask(q)[0] for q in range(len(questions))]

        def worker(c):
            return [(q, *ask(q)) for q in ((c + k) % len(questions) for k in range(REQUESTS))]

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            results = [r for rs in pool.map(worker, range(CLIENTS), timeout=600) for r in rs]
        wall = time.perf_counter() - t0
        m = app.scheduler.metrics()
    engine.close()
    for q, text, _, _ in results:
        assert text == alone[q], f"question {q}"
    assert m["active_sequences"] == 0 and m["queue_depth"] == 0
    first = [t[0] for _, _, _, t in results if t]
    gaps = [g for _, _, _, t in results for g in t[1:]]
    tokens = sum(n for _, _, n, _ in results)
    report = {"model": os.path.basename(gguf), "clients": CLIENTS, "requests": len(results),
              "max_tokens": MAX_TOKENS, "max_active": MAX_ACTIVE, "completion_tokens": tokens,
              "wall_s": wall, "aggregate_tok_s": tokens / wall,
              "first_chunk_ms": {"p50": 1e3 * float(np.percentile(first, 50)),
                                 "p90": 1e3 * float(np.percentile(first, 90))},
              "between_chunks_ms": {"p50": 1e3 * float(np.percentile(gaps, 50)),
                                    "p90": 1e3 * float(np.percentile(gaps, 90))}}
    print(json.dumps(report, indent=2))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "server_load.json"), "w") as f:
            json.dump(report, f, indent=2)
