"""Chat with a model: messages in, streamed text out, the conversation kept in the KV cache.

    from onegraph.chat import Chat
    with Chat.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf") as chat:
        for piece in chat.send("What is the capital of France?"):
            print(piece, end="", flush=True)
        reply = chat.ask("And of Italy?")        # ChatReply(text, token_ids, finish_reason)

A Chat owns one Engine and one Tokenizer. Each turn renders the whole conversation with the
model's own chat template and feeds only what the engine's sequence does not hold yet: the
tokens shared with the cached history are kept (their KV rows stay), the rest is prefilled.
When the new rendering departs from the cache (re-tokenized answer text, an edited message),
the sequence is cut back to the shared prefix (a fork of that length, copy-on-write on the
GPU) before the rest is prefilled.

A turn interrupted while its answer streams (KeyboardInterrupt, or a consumer that stops
iterating) keeps the text decoded so far as the assistant's message: the session stays
usable, and the next turn starts from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .engine import Engine, EngineError
from .pretrained import open_pretrained
from .sampling import SamplingParams
from .text import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 512


def stop_tokens(engine: Engine, tokenizer: Tokenizer) -> set[int]:
    """The ids that end an answer: the tokenizer's (eos, end of turn) and the model config's eos."""
    return set(tokenizer.stop_token_ids) | set(engine.config.eos_token_ids)


@dataclass
class ChatReply:
    text: str
    token_ids: list[int]
    finish_reason: str     # "stop" (a stop token), "length" (max_new_tokens) or "interrupted"


@dataclass
class Chat:
    engine: Engine
    tokenizer: Tokenizer
    system: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # None, "ngram" or a draft model's Engine: greedy answers drafted and verified (Engine.stream)
    speculative: "str | Engine | None" = None
    messages: list[dict] = field(default_factory=list)
    last_reply: ChatReply | None = None
    reused_tokens: int = 0       # prompt tokens of the last turn found in the cache
    prefilled_tokens: int = 0    # prompt tokens of the last turn fed to the engine

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: str | None = None, system: str | None = None,
                        sampling: SamplingParams | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                        **engine_kwargs) -> "Chat":
        """A Chat on the model at `path` (a folder or a GGUF file), its tokenizer read from
        `tokenizer` (default: the same path). engine_kwargs go to Engine.from_pretrained."""
        model, tok = open_pretrained(path, tokenizer, progress=engine_kwargs.pop("progress", False))
        engine = Engine.from_model(model, **engine_kwargs)
        return cls(engine, tok, system=system, sampling=sampling or SamplingParams(),
                   max_new_tokens=max_new_tokens)

    # ---- the conversation -------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages.clear()
        self.last_reply = None
        self.engine.reset()

    def conversation(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def ask(self, text: str) -> ChatReply:
        """One turn, returned whole."""
        for _ in self.send(text):
            pass
        return self.last_reply

    def send(self, text: str) -> Iterator[str]:
        """One turn: add the user's message, then yield the answer's text as it is decoded
        (each piece whole characters). The reply is then in `last_reply` and in `messages`."""
        if not isinstance(text, str):
            raise TypeError(f"a chat message is text, got {type(text).__name__}")
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self.tokenizer.encode_chat(self.conversation(), add_generation_prompt=True)
            budget = self.engine.max_seq_len - len(prompt)
            if budget <= 0:
                raise EngineError(f"the conversation ({len(prompt)} tokens) no longer fits the context of "
                                  f"{self.engine.max_seq_len} tokens: /reset to start over")
            fresh = self._keep_cached_prefix(prompt)
        except BaseException:
            self.messages.pop()  # the turn never started: the conversation is as it was
            raise
        yield from self._answer(fresh, min(self.max_new_tokens, budget))

    def _keep_cached_prefix(self, prompt: list[int]) -> list[int]:
        """Cut the engine's sequence back to what it shares with `prompt`; the tokens to feed.
        At least the prompt's last token is fed: its logits choose the first answer token."""
        history = self.engine.history
        shared = 0
        limit = min(len(history), len(prompt) - 1)
        while shared < limit and history[shared] == prompt[shared]:
            shared += 1
        if shared < len(history):
            self._truncate(shared)
        self.reused_tokens, self.prefilled_tokens = shared, len(prompt) - shared
        return prompt[shared:]

    def _truncate(self, length: int) -> None:
        engine = self.engine
        if length == 0:
            engine.reset()
            return
        old = engine.sequence
        new = engine.fork(old, length=length)
        engine.use(new)
        engine.free_sequence(old)

    def _answer(self, fresh: list[int], max_new_tokens: int) -> Iterator[str]:
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        stops = stop_tokens(self.engine, self.tokenizer)
        tokens: list[int] = []
        pieces: list[str] = []
        finish = "interrupted"
        try:
            for token in self.engine.stream(fresh, max_new_tokens, self.sampling, stop_token_ids=stops,
                                            speculative=self.speculative):
                tokens.append(token)
                if token in stops:
                    finish = "stop"
                    break
                piece = decoder.push(token)
                if piece:
                    pieces.append(piece)
                    yield piece
            else:
                finish = "length"
            tail = decoder.flush()
            if tail:
                pieces.append(tail)
                yield tail
        finally:
            text = "".join(pieces)
            self.messages.append({"role": "assistant", "content": text})
            self.last_reply = ChatReply(text, tokens, finish)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
