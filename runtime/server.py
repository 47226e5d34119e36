"""`onegraph serve`: an OpenAI-compatible HTTP server over one Engine.

    python -m onegraph.server --model path/to/model [--tokenizer PATH] [--port 8000] [--api-key KEY]

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health and
GET /metrics (Prometheus text). Needs the `serve` extra (uvicorn, starlette).

Threads: the HTTP side runs on uvicorn's event loop; one worker thread (Scheduler) owns the
engine, which is single-threaded. A request becomes a Job: it waits in a bounded queue until
one of `max_active` slots is free, then gets its own engine sequence. The worker goes round
the active jobs, one step each (a prompt's prefill counts as one step), so concurrent clients
share the engine fairly. Each step's token is turned into text on the worker (the tokenizer's
StreamDecoder, then the stop-string matcher, which holds back text that could still become a
stop string) and handed to the job's asyncio queue; the HTTP side writes it out as an SSE
chunk at once. A client that goes away marks its job cancelled; the worker frees its sequence
at the job's next turn.

Prefix cache: a finished job's sequence (prompt + generated tokens fed to the engine) is kept
in a small LRU keyed by its token ids instead of being freed. A new prompt that shares a
prefix of at least `prefix_min_tokens` with a cached sequence forks it (copy-on-write, only
its first `lcp` rows) and prefills only the rest: a second turn of a conversation reuses the
first turn's KV.

Speculative decoding (speculative="ngram", `--speculative ngram`): a greedy request without
logprobs decodes with drafts from its own prompt and output (speculative.NgramDrafter, sized
by its own AdaptiveK over the engine's measured step costs): its turn is then one verify step
(Engine.step_speculative), which gives 1..k + 1 tokens, exactly the ones its plain greedy steps
would. One engine pass per turn either way, so the round-robin stays fair. A turn without drafts
(nothing to look up, none expected to pay, the context or max_tokens too close) or whose verify
step the engine refuses for want of room is a plain step. /metrics counts verify_steps,
drafted_tokens and accepted_tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from . import capi
from .engine import EngineError
from .eval import log_softmax
from .sampling import SamplingParams, sample_step
from .speculative import SPECULATIVE_MODES, AdaptiveK, accepted_drafts, make_drafter

log = logging.getLogger("onegraph.server")

DEFAULT_MAX_BODY = 1 << 20        # bytes of a request body
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
COUNTERS = ("requests", "requests_completed", "requests_failed", "requests_cancelled", "requests_rejected",
            "prompt_tokens", "completion_tokens", "prefix_cache_hits", "prefix_cache_tokens",
            "verify_steps", "drafted_tokens", "accepted_tokens")


# ---- errors --------------------------------------------------------------------------------

class APIError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request parsing -----------------------------------------------------------------------

@dataclasses.dataclass
class GenerationRequest:
    """What one request asks the engine for, checked."""
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


# Parameters accepted whatever their value (they do not change the tokens).
_IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
             "n", "logit_bias", "presence_penalty", "frequency_penalty"}
_CHAT_KEYS = _SAMPLING | _IGNORED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                     "tools", "tool_choice", "response_format"}
_COMPLETION_KEYS = _SAMPLING | _IGNORED | {"prompt", "logprobs", "echo", "suffix", "best_of"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get(body: dict, name: str, check, what: str, default=None):
    """body[name] if present and not null, checked by check(value) -> bool."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise _bad(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name, "invalid_type")
    return value


def _check_unsupported(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"unrecognized request argument: '{unknown[0]}'", unknown[0], "unknown_parameter")
    if _get(body, "n", _is_int, "an integer", 1) != 1:
        raise _bad("'n' > 1 is not supported: one choice per request", "n", "unsupported_parameter")
    if _get(body, "best_of", _is_int, "an integer", 1) != 1:
        raise _bad("'best_of' > 1 is not supported", "best_of", "unsupported_parameter")
    if _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object", {}):
        raise _bad("'logit_bias' is not supported", "logit_bias", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, _is_num, "a number", 0) != 0:
            raise _bad(f"'{name}' is not supported (only 0)", name, "unsupported_parameter")
    if _get(body, "tools", lambda v: isinstance(v, list), "an array", []):
        raise _bad("'tools' is not supported: this server does not call tools", "tools", "unsupported_parameter")
    if body.get("tool_choice") not in (None, "none"):
        raise _bad("'tool_choice' is not supported (only \"none\")", "tool_choice", "unsupported_parameter")
    fmt = _get(body, "response_format", lambda v: isinstance(v, dict), "an object", {"type": "text"})
    if fmt.get("type") != "text":
        raise _bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format",
                   "unsupported_parameter")
    if _get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False):
        raise _bad("'echo' is not supported", "echo", "unsupported_parameter")
    if _get(body, "suffix", lambda v: isinstance(v, str), "a string", ""):
        raise _bad("'suffix' is not supported", "suffix", "unsupported_parameter")


def _common(body: dict, prompt_ids: list[int], context: int, max_tokens_keys: tuple[str, ...]) -> dict:
    """The checked fields every generation request shares."""
    if len(prompt_ids) == 0:
        raise _bad("the prompt is empty: at least one token is needed", None)
    if len(prompt_ids) >= context:
        raise _bad(f"the prompt has {len(prompt_ids)} tokens; this model's context is {context} "
                   f"(room is needed for at least one new token)", "messages" if "messages" in body else "prompt",
                   "context_length_exceeded")
    room = context - len(prompt_ids)
    max_tokens = None
    for key in max_tokens_keys:
        value = _get(body, key, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if value is not None:
            if value > room:
                raise _bad(f"'{key}' = {value} does not fit: the prompt has {len(prompt_ids)} tokens and the "
                           f"context is {context} (at most {room})", key, "context_length_exceeded")
            max_tokens = value
    temperature = _get(body, "temperature", _is_num, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise _bad(f"'temperature' = {temperature} must be in [0, 2]", "temperature")
    top_p = _get(body, "top_p", _is_num, "a number", 1.0)
    if not 0 < top_p <= 1:
        raise _bad(f"'top_p' = {top_p} must be in (0, 1]", "top_p")
    top_k = _get(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0", 0)
    seed = _get(body, "seed", _is_int, "an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                   "stop", "invalid_type")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
    return dict(prompt_ids=prompt_ids, max_tokens=room if max_tokens is None else max_tokens,
                sampling=SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                                        seed=None if seed is None else seed % (1 << 64)),
                stop=tuple(stop), stream=stream, include_usage=stream and include_usage)


def _message_text(message: Any, index: int) -> dict:
    """One chat message as {"role", "content": str} for the chat template."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"'{where}' must be an object", "messages", "invalid_type")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise _bad(f"'{where}.role' = {json.dumps(role)[:40]} is not one of system, developer, user, assistant",
                   "messages")
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{where}.content': only parts of type 'text' are supported", "messages",
                           "unsupported_parameter")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise _bad(f"'{where}.content' must be a string or a list of text parts", "messages", "invalid_type")
    if message.get("tool_calls"):
        raise _bad(f"'{where}.tool_calls' is not supported", "messages", "unsupported_parameter")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: Any, tokenizer, context: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    _check_unsupported(body, _CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages", "invalid_type")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        prompt_ids = [int(t) for t in tokenizer.encode_chat(messages, add_generation_prompt=True)]
    except ValueError as e:  # the tokenizer's TextError: no chat template, a template error, ...
        raise _bad(f"the messages cannot be rendered with this model's chat template: {e}", "messages") from None
    fields = _common(body, prompt_ids, context, ("max_tokens", "max_completion_tokens"))
    logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    top = _get(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
               f"an integer in 0..{MAX_TOP_LOGPROBS}", 0)
    if top and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return GenerationRequest(logprobs=logprobs, top_logprobs=top, **fields)


def parse_completion(body: Any, tokenizer, context: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    _check_unsupported(body, _COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = [int(t) for t in tokenizer.encode(prompt)]
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _bad(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", "prompt")
        prompt_ids = list(prompt)
    else:
        raise _bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt",
                   "invalid_type")
    fields = _common(body, prompt_ids, context, ("max_tokens",))
    top = _get(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= 5, "an integer in 0..5")
    return GenerationRequest(logprobs=top is not None, top_logprobs=top or 0, **fields)


# ---- text: stop strings and logprobs -------------------------------------------------------

class StopMatcher:
    """Cuts generated text at the first stop string, matched across pushes (token boundaries).
    push(text) -> (text to emit now, stopped). Text that could be the start of a stop string is
    held back until the next pushes decide it."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = 0  # the longest tail of buf that starts some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


# ---- the scheduler -------------------------------------------------------------------------

class QueueFull(Exception):
    pass


class Job:
    """One generation request as the worker sees it. Events go to the HTTP side through
    `emit` (thread-safe): ("chunk", text, [logprob entries]), ("done", finish_reason, usage),
    ("error", status, message)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.loop = loop
        self.events: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.cancelled = False
        self.finished = False
        # worker state
        self.seq: int | None = None
        self.fed: list[int] = []           # tokens in the sequence's KV (prompt + fed new tokens)
        self.generated: list[int] = []
        self.logits: np.ndarray | None = None
        self.next_token: int | None = None  # chosen by the last step, not fed yet
        self.seed: int | None = None  # the sampler's (sampling.sample_step)
        self.decoder = None
        self.matcher = StopMatcher(request.stop)
        self.pending: list[dict] = []      # logprob entries of tokens whose text is not out yet
        self.text_len = 0                  # characters of decoded text so far
        self.emitted_len = 0               # characters handed out so far
        self.prefix_hit = 0                # prompt tokens reused from the prefix cache
        self.drafter = None                # speculative decoding: its drafter and draft length
        self.adaptive: AdaptiveK | None = None

    def emit(self, *event) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """The worker thread that owns the engine (module docstring).

    max_active: sequences decoding at once; max_queue: requests waiting beyond those (more get
    QueueFull, HTTP 429); prefix_cache_size: finished sequences kept for prefix reuse;
    speculative: None or a drafter mode (speculative.SPECULATIVE_MODES) for greedy requests."""

    def __init__(self, engine, tokenizer, *, max_active: int = 4, max_queue: int = 64,
                 prefix_cache_size: int = 4, prefix_min_tokens: int = 8, speculative: str | None = None):
        if max_active < 1 or max_queue < 0 or prefix_cache_size < 0:
            raise ValueError(f"max_active={max_active} must be >= 1, max_queue={max_queue} and "
                             f"prefix_cache_size={prefix_cache_size} >= 0")
        if speculative is not None and speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative={speculative!r} is not one of {SPECULATIVE_MODES} (or None)")
        self.speculative = speculative
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_active, self.max_queue = max_active, max_queue
        self.prefix_cache_size, self.prefix_min_tokens = prefix_cache_size, max(1, prefix_min_tokens)
        self.stop_token_ids = frozenset(int(t) for t in tokenizer.stop_token_ids)
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.cache: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()  # seq -> tokens
        self.lock = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.counters = collections.Counter({name: 0 for name in COUNTERS})

    # -- the HTTP side ---------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.lock:
            if not self.running:
                raise APIError(503, "the server is shutting down", "server_error", code="unavailable")
            if len(self.active) + len(self.waiting) >= self.max_active + self.max_queue:
                self.counters["requests_rejected"] += 1
                raise QueueFull()
            self.waiting.append(job)
            self.counters["requests"] += 1
            self.lock.notify()

    def metrics(self) -> dict:
        with self.lock:
            m = dict(self.counters)
            m.update(queue_depth=len(self.waiting), active_sequences=len(self.active),
                     cached_sequences=len(self.cache),
                     kv_tokens=sum(len(j.fed) for j in self.active) + sum(len(t) for t in self.cache.values()),
                     max_active=self.max_active, max_queue=self.max_queue)
        return m

    def start(self) -> None:
        with self.lock:
            self.running = True
        self.thread = threading.Thread(target=self._run, name="onegraph-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.running = False
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None

    # -- the worker ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                while self.running and not self.active and not self.waiting:
                    self.lock.wait(1.0)
                if not self.running:
                    break
                while self.waiting and len(self.active) < self.max_active:
                    self.active.append(self.waiting.popleft())
                jobs = list(self.active)
            for job in jobs:  # one step each: round-robin
                self._turn(job)
        with self.lock:
            left = list(self.active) + list(self.waiting)
            self.active.clear()
            self.waiting.clear()
        for job in left:
            self._release(job, cache=False)
            job.emit("error", 503, "the server is shutting down")
        for seq in list(self.cache):
            self._free(seq)
        self.cache.clear()

    def _turn(self, job: Job) -> None:
        try:
            if job.cancelled:
                self.counters["requests_cancelled"] += 1
                self._finish(job, None)
            elif job.seq is None:
                self._start(job)
            else:
                self._advance(job)
        except Exception as e:  # an engine failure fails this request, not the server
            log.exception("onegraph: request %s failed in the engine", job.id)
            self.counters["requests_failed"] += 1
            self._finish(job, None)
            job.emit("error", 500, f"the engine failed on this request: {type(e).__name__}: {e}")

    def _start(self, job: Job) -> None:
        """Give the job a sequence (forked from the prefix cache when it can), prefill its prompt
        and choose the first token."""
        req, engine = job.request, self.engine
        prompt = req.prompt_ids
        seq, reused = self._sequence_for(prompt)
        job.seq, job.fed = seq, list(prompt[:reused])
        engine.use(seq)
        job.logits = self._with_room(lambda: engine.prefill(prompt[reused:]))
        job.fed = list(prompt)
        job.prefix_hit = reused
        self.counters["prompt_tokens"] += len(prompt)
        if reused:
            self.counters["prefix_cache_hits"] += 1
            self.counters["prefix_cache_tokens"] += reused
            log.info("onegraph: request %s reuses %d of %d prompt tokens from the prefix cache", job.id, reused,
                     len(prompt))
        job.seed = req.sampling.seed if req.sampling.seed is not None else \
            int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        job.decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        if self.speculative is not None and self._plain_greedy(req):
            job.drafter, job.adaptive = make_drafter(self.speculative), AdaptiveK(costs=self.engine.step_costs)
        self._choose(job, job.logits)

    @staticmethod
    def _plain_greedy(req: GenerationRequest) -> bool:
        """Each token the argmax, nothing else read from the logits."""
        return not req.logprobs and req.sampling.greedy and not req.sampling.penalized

    def _sequence_for(self, prompt: list[int]) -> tuple[int, int]:
        """(a new sequence, how many of the prompt's first tokens it already holds)."""
        best, best_len = None, 0
        for seq, tokens in self.cache.items():
            n = min(len(tokens), len(prompt) - 1)  # at least one token is left to prefill
            a, b = np.asarray(tokens[:n]), np.asarray(prompt[:n])
            diff = np.flatnonzero(a != b)
            lcp = int(diff[0]) if diff.size else n
            if lcp > best_len:
                best, best_len = seq, lcp
        if best is not None and best_len >= self.prefix_min_tokens:
            self.cache.move_to_end(best)
            return self._with_room(lambda: self.engine.fork(best, best_len)), best_len
        return self._with_room(self.engine.new_sequence), 0

    def _with_room(self, call):
        """call() (a new sequence, a prefill, a step); while the engine refuses it (out of
        sequences or KV blocks: EngineError, nothing changed), free cached sequences and retry."""
        while True:
            try:
                return call()
            except EngineError:
                if not self.cache:
                    raise
                seq, _ = self.cache.popitem(last=False)
                self._free(seq)

    def _advance(self, job: Job) -> None:
        token = job.next_token
        self.engine.use(job.seq)
        if not self._plain_greedy(job.request):
            logits = self._with_room(lambda: self.engine.step(token))
            job.fed.append(token)
            self._choose(job, logits)
        elif job.drafter is None or not self._speculative_step(job, token):
            nxt = self._with_room(lambda: self.engine.step_greedy(token))
            job.fed.append(token)
            self._take(job, int(nxt), None)

    def _speculative_step(self, job: Job, token: int) -> bool:
        """One verify step for the job's next token and its drafts; False (nothing changed) when
        it takes a plain step instead: no drafts, none expected to pay, or no room for the verify
        step's rows."""
        engine, adaptive = self.engine, job.adaptive
        remaining = job.request.max_tokens - len(job.generated)
        room = engine.max_seq_len - len(job.fed) - 1      # rows past the one `token` takes
        limit = min(remaining - 1, room, capi.MAX_VERIFY - 1)
        drafts = adaptive.drafts(job.drafter, job.fed + [token], limit)
        if not drafts:
            adaptive.plain_steps(1)
            return False
        try:
            new = self._with_room(lambda: engine.step_speculative(token, drafts, self.stop_token_ids, remaining))
        except EngineError as e:
            log.info("onegraph: request %s takes a plain step: %s", job.id, e)
            return False
        accepted = accepted_drafts(drafts, new)
        adaptive.update(len(drafts), accepted)
        self.counters["verify_steps"] += 1
        self.counters["drafted_tokens"] += len(drafts)
        self.counters["accepted_tokens"] += accepted
        seq, feed = job.seq, [token] + drafts
        for i, t in enumerate(new):
            job.fed.append(feed[i])
            self._take(job, t, None)
            if job.finished:
                break
        if seq in self.cache and len(job.fed) < engine.position:
            # A stop string ended the job inside the run: the cached sequence keeps only the
            # rows of the tokens it is cached under.
            engine.truncate(len(job.fed))
        return True

    def _choose(self, job: Job, logits: np.ndarray) -> None:
        req = job.request
        # The row whose logits these are (the last fed token's), the tokens generated so far.
        counts = np.bincount(np.asarray(job.generated, np.int64), minlength=logits.size).astype(np.int32)
        token = sample_step(logits, req.sampling, len(job.fed) - 1, counts, job.seed).token
        self._take(job, token, logits if req.logprobs else None)

    def _take(self, job: Job, token: int, logits: np.ndarray | None) -> None:
        """The step chose `token`: decode it, match stops, emit text; finish or queue it to feed."""
        req = job.request
        job.generated.append(token)
        self.counters["completion_tokens"] += 1
        if token in self.stop_token_ids:
            self._drain_text(job, job.decoder.flush(), final=True)
            self._finish(job, "stop")
            return
        piece = job.decoder.push(token)
        if logits is not None:
            lp = log_softmax(logits)
            entry = {"id": token, "logprob": float(lp[token]), "text": piece, "start": job.text_len}
            if req.top_logprobs:
                top = np.argsort(-lp, kind="stable")[:req.top_logprobs]
                entry["top"] = [(int(t), float(lp[t])) for t in top]
            job.pending.append(entry)
        job.text_len += len(piece)
        length = len(job.generated) >= req.max_tokens
        if self._drain_text(job, piece + (job.decoder.flush() if length else ""), final=length):
            self._finish(job, "stop")
        elif length:
            self._finish(job, "length")
        else:
            job.next_token = token

    def _drain_text(self, job: Job, piece: str, final: bool) -> bool:
        """Pass text through the stop matcher and emit what it lets out; True if a stop string
        was met."""
        text, stopped = job.matcher.push(piece)
        if final and not stopped:
            text += job.matcher.flush()
        job.emitted_len += len(text)
        # A token's logprob goes out with the first chunk that carries the start of its text;
        # at the end all go out, except those that begin inside a cut stop string.
        if final and not stopped:
            out, job.pending = job.pending, []
        else:
            out = [e for e in job.pending if e["start"] < job.emitted_len]
            job.pending = [] if stopped else job.pending[len(out):]
        if text or out:
            job.emit("chunk", text, out)
        return stopped

    def _finish(self, job: Job, reason: str | None) -> None:
        """End the job: its sequence goes to the prefix cache (finished) or is freed (cancelled,
        failed); reason None emits nothing (the caller reports the error)."""
        with self.lock:
            if job in self.active:
                self.active.remove(job)
            elif job in self.waiting:
                self.waiting.remove(job)
        self._release(job, cache=reason is not None)
        job.finished = True
        if reason is not None:
            self.counters["requests_completed"] += 1
            usage = {"prompt_tokens": len(job.request.prompt_ids), "completion_tokens": len(job.generated),
                     "total_tokens": len(job.request.prompt_ids) + len(job.generated)}
            job.emit("done", reason, usage)

    def _release(self, job: Job, cache: bool) -> None:
        seq, job.seq = job.seq, None
        if seq is None:
            return
        if cache and self.prefix_cache_size and len(job.fed) >= self.prefix_min_tokens:
            tokens = tuple(job.fed)
            with self.lock:
                # Entries the new one extends are subsumed by it.
                for old, old_tokens in list(self.cache.items()):
                    if tokens[:len(old_tokens)] == old_tokens:
                        del self.cache[old]
                        self._free(old)
                self.cache[seq] = tokens
                while len(self.cache) > self.prefix_cache_size:
                    old, _ = self.cache.popitem(last=False)
                    self._free(old)
            return
        self._free(seq)

    def _free(self, seq: int) -> None:
        try:
            self.engine.free_sequence(seq)
        except Exception as e:  # the sequence is gone either way; keep serving
            log.warning("onegraph: freeing sequence %s failed: %s", seq, e)


# ---- the HTTP side -------------------------------------------------------------------------

def _error_response(e: APIError):
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_json(request, max_body: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise APIError(413, f"the request body has {length} bytes; the limit is {max_body}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise APIError(413, f"the request body exceeds the limit of {max_body} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def _chat_logprobs(tokenizer, entries: list[dict]) -> dict:
    def item(token_id, logprob, text=None):
        text = tokenizer.decode([token_id]) if text is None else text
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    content = []
    for e in entries:
        d = item(e["id"], e["logprob"], e["text"])
        d["top_logprobs"] = [item(t, lp) for t, lp in e.get("top", ())]
        content.append(d)
    return {"content": content}


def _completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    return {"tokens": [e["text"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.get("top", ())} for e in entries],
            "text_offset": [e["start"] for e in entries]}


class App:
    """The Starlette application around a Scheduler."""

    def __init__(self, engine, tokenizer, model_name: str, *, api_key: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY, retry_after: int = 1, **scheduler_args):
        from starlette.applications import Starlette
        from starlette.routing import Route
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_body, self.retry_after = api_key, max_body, retry_after
        self.context = int(engine.max_seq_len)
        self.scheduler = Scheduler(engine, tokenizer, **scheduler_args)
        self.created = int(time.time())
        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        self.starlette = Starlette(routes=routes, lifespan=self._lifespan,
                                   exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api_key is not None:
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.api_key.encode()):
                e = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             "authentication_error", code="invalid_api_key")
                return await _error_response(e)(scope, receive, send)
        await self.starlette(scope, receive, send)

    def _lifespan(self, app):
        import contextlib

        @contextlib.asynccontextmanager
        async def span():
            self.scheduler.start()
            try:
                yield
            finally:
                self.scheduler.stop()
        return span()

    async def _not_found(self, request, exc):
        return _error_response(APIError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request, exc):
        return _error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                        code="method_not_allowed"))

    # -- endpoints -------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"status": "ok" if self.scheduler.running else "stopping"})

    async def models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "onegraph"}]})

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse
        lines = []
        for key, value in sorted(self.scheduler.metrics().items()):
            kind = "gauge" if key in ("queue_depth", "active_sequences", "cached_sequences", "kv_tokens",
                                      "max_active", "max_queue") else "counter"
            name = f"onegraph_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _generate(self, request, chat: bool):
        try:
            body = await _read_json(request, self.max_body)
            if isinstance(body, dict):
                model = body.get("model")
                if not isinstance(model, str):
                    raise _bad("'model' must be a string", "model", "invalid_type")
                if model != self.model_name:
                    raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves "
                                        f"'{self.model_name}'", param="model", code="model_not_found")
            parse = parse_chat if chat else parse_completion
            req = parse(body, self.tokenizer, self.context)
            job = Job(req, asyncio.get_running_loop())
            try:
                self.scheduler.submit(job)
            except QueueFull:
                raise APIError(429, "the server is busy: every slot and the queue are taken; retry later",
                               "rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(self.retry_after)}) from None
        except APIError as e:
            return _error_response(e)
        except Exception as e:  # a bug, not the client's fault: an OpenAI-shaped 500, still serving
            log.exception("onegraph: request failed before reaching the engine")
            return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
        if req.stream:
            return self._stream(request, job, chat)
        return await self._collect(request, job, chat)

    def _chunk_body(self, job: Job, chat: bool, text: str | None, entries, reason) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            if entries:
                choice["logprobs"] = _chat_logprobs(self.tokenizer, entries)
            return {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                    "model": self.model_name, "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if entries:
            choice["logprobs"] = _completion_logprobs(self.tokenizer, entries)
        return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                "model": self.model_name, "choices": [choice]}

    def _stream(self, request, job: Job, chat: bool):
        from starlette.responses import StreamingResponse

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            try:
                if chat:
                    first = self._chunk_body(job, chat, "", None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield sse(first)
                while True:
                    event = await job.events.get()
                    if event[0] == "chunk":
                        yield sse(self._chunk_body(job, chat, event[1], event[2], None))
                    elif event[0] == "done":
                        yield sse(self._chunk_body(job, chat, None if chat else "", None, event[1]))
                        if job.request.include_usage:
                            last = self._chunk_body(job, chat, None, None, None)
                            last["choices"], last["usage"] = [], event[2]
                            yield sse(last)
                        break
                    else:
                        yield sse(APIError(event[1], event[2], "server_error").body())
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not job.finished:
                    job.cancel()  # the client went away: the worker frees the sequence

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _collect(self, request, job: Job, chat: bool):
        from starlette.responses import JSONResponse
        texts, entries = [], []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "chunk":
                    texts.append(event[1])
                    entries += event[2]
                elif event[0] == "error":
                    return _error_response(APIError(event[1], event[2], "server_error",
                                                    code="engine_error" if event[1] == 500 else None))
                else:
                    reason, usage = event[1], event[2]
                    break
        finally:
            if not job.finished:
                job.cancel()
        text = "".join(texts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            if job.request.logprobs:
                choice["logprobs"] = _chat_logprobs(self.tokenizer, entries)
            body = {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created,
                    "model": self.model_name, "choices": [choice], "usage": usage}
        else:
            body = self._chunk_body(job, chat, text, entries if job.request.logprobs else None, reason)
            body["usage"] = usage
        return JSONResponse(body)


# ---- running it ----------------------------------------------------------------------------

class ServerThread:
    """uvicorn serving an App in a background thread (tests, embedding):

        with ServerThread(app, port=0) as server: ... server.url ..."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket
        import uvicorn
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_for_serving(model, *, max_active: int, prefix_cache_size: int, max_seq_len: int = 4096,
                       kv: str = "int8", device: str = "auto", **kwargs):
    """Engine.from_model (`model`: a loader.LoadedModel) with a KV pool sized for the server:
    room for every active and cached sequence at full context."""
    from .engine import Engine
    from .kvpool import DEFAULT_PAGE_SIZE
    sequences = max_active + prefix_cache_size + 1
    blocks = sequences * -(-max_seq_len // DEFAULT_PAGE_SIZE)
    return Engine.from_model(model, kv=kv, max_seq_len=max_seq_len, device=device,
                             kv_max_sequences=sequences, kv_pool_blocks=blocks, **kwargs)


def make_app(engine, tokenizer, model_name: str, **kwargs) -> App:
    """The App for an engine; the engine's sequence 0 (idle) is released first."""
    if engine.sequence is not None:
        engine.free_sequence(engine.sequence)
    return App(engine, tokenizer, model_name, **kwargs)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          tokenizer: str | None = None, model_name: str | None = None, max_active: int = 4,
          max_queue: int = 64, prefix_cache_size: int = 4, max_seq_len: int = 4096, kv: str = "int8",
          device: str = "auto", max_body: int = DEFAULT_MAX_BODY, log_level: str = "info",
          speculative: str | None = None) -> None:
    """Load `model` and serve it until interrupted (Ctrl-C)."""
    import uvicorn
    from .pretrained import open_pretrained
    loaded, tok = open_pretrained(model, tokenizer)
    engine = engine_for_serving(loaded, max_active=max_active, prefix_cache_size=prefix_cache_size,
                                max_seq_len=max_seq_len, kv=kv, device=device)
    try:
        if tok.vocab_size > engine.config.vocab_size:
            raise SystemExit(f"onegraph serve: the tokenizer ({tokenizer or model}) has {tok.vocab_size} tokens, "
                             f"more than the model's vocabulary of {engine.config.vocab_size}")
        name = model_name or os.path.basename(os.path.normpath(model))
        app = make_app(engine, tok, name, api_key=api_key, max_body=max_body, max_active=max_active,
                       max_queue=max_queue, prefix_cache_size=prefix_cache_size, speculative=speculative)
        log.info("onegraph: serving %s on http://%s:%d (backend %s, context %d)", name, host, port,
                 engine.backend, engine.max_seq_len)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onegraph serve", description="An OpenAI-compatible HTTP server.")
    p.add_argument("--model", required=True, help="model folder or .gguf file")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model path)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the model's file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("ONEGRAPH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $ONEGRAPH_API_KEY, else none)")
    p.add_argument("--max-active", type=int, default=4, help="sequences decoding at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those (more get 429)")
    p.add_argument("--prefix-cache", type=int, default=4, help="finished conversations kept for KV reuse")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length (capped by the model's)")
    p.add_argument("--kv", default="int8", choices=["int8", "bf16", "fp32"])
    p.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu"])
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, help="largest request body in bytes")
    p.add_argument("--speculative", choices=list(SPECULATIVE_MODES), default=None,
                   help="greedy requests (temperature 0, no logprobs) decode with drafts verified several at "
                        "a time: 'ngram' looks the last tokens up in the prompt and output (same text)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"onegraph serve: {e.name} is not installed: pip install 'onegraph[serve]'")
        return 2
    try:
        serve(args.model, args.host, args.port, args.api_key, tokenizer=args.tokenizer, model_name=args.model_name,
              max_active=args.max_active, max_queue=args.max_queue, prefix_cache_size=args.prefix_cache,
              max_seq_len=args.max_seq_len, kv=args.kv, device=args.device, max_body=args.max_body,
              log_level=args.log_level, speculative=args.speculative)
    except (OSError, ValueError) as e:  # a missing file, a bad model or tokenizer: one line
        print(f"onegraph serve: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
