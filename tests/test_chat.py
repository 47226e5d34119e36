"""Chat on the real model (CPU path): streamed text, the conversation kept in the KV cache,
interrupted answers. The reference for a cached turn is the same conversation decoded from
scratch by a fresh engine: the CPU path's arithmetic does not depend on how the prefix got
into the cache, so the tokens must be identical."""
import pytest

from real_model import smollm2_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model():
    from onegraph.text import Tokenizer
    path = smollm2_gguf()
    return path, Tokenizer.from_model(path)


def new_chat(model, **kwargs):
    from onegraph.chat import Chat
    from onegraph.engine import Engine
    path, tokenizer = model
    engine = Engine.from_pretrained(path, device="cpu", kv="fp32", max_seq_len=kwargs.pop("max_seq_len", 512))
    return Chat(engine, tokenizer, max_new_tokens=kwargs.pop("max_new_tokens", 20), **kwargs)


def test_streamed_pieces_make_the_reply(model):
    with new_chat(model) as chat:
        pieces = list(chat.send("What is the capital of France?"))
        reply = chat.last_reply
    assert "".join(pieces) == reply.text
    assert "Paris" in reply.text
    assert reply.finish_reason in ("stop", "length")
    ids = reply.token_ids[:-1] if reply.finish_reason == "stop" else reply.token_ids
    assert reply.text == model[1].decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_a_follow_up_is_prefilled_after_the_cached_conversation(model):
    with new_chat(model) as chat:
        chat.ask("What is the capital of France?")
        second = chat.ask("And of Italy?")
        conversation = chat.conversation()
        reused, prefilled = chat.reused_tokens, chat.prefilled_tokens
    prompt = model[1].encode_chat(conversation[:-1])
    assert reused > 0 and reused + prefilled == len(prompt)
    # Everything of the first turn up to its answer is reused: at least the first prompt.
    first_prompt = model[1].encode_chat(conversation[:1])
    assert reused >= len(first_prompt) - 1
    with new_chat(model) as fresh:
        fresh.messages.extend(conversation[:2])
        again = fresh.ask("And of Italy?")
        assert fresh.reused_tokens == 0
    assert second.token_ids == again.token_ids


def test_an_interrupted_answer_keeps_the_session(model):
    with new_chat(model) as chat:
        stream = chat.send("Write a short poem about the sea.")
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        cut = chat.last_reply
        assert cut.finish_reason == "interrupted" and chat.messages[-1] == {"role": "assistant", "content": cut.text}
        assert chat.engine.position == len(chat.engine.history)
        follow = chat.ask("What is the capital of France?")
        conversation = chat.conversation()
    with new_chat(model) as fresh:
        fresh.messages.extend(conversation[:2])
        assert fresh.ask("What is the capital of France?").token_ids == follow.token_ids


def test_a_conversation_past_the_context_is_refused_and_unchanged(model):
    from onegraph.engine import EngineError
    with new_chat(model, max_seq_len=48) as chat:
        with pytest.raises(EngineError, match="no longer fits the context of 48 tokens"):
            list(chat.send("word " * 60))
        assert chat.messages == []
        assert "Paris" in chat.ask("What is the capital of France?").text or chat.last_reply.finish_reason == "length"


def test_reset_forgets_the_conversation(model):
    with new_chat(model) as chat:
        first = chat.ask("What is the capital of France?")
        chat.reset()
        assert chat.messages == [] and chat.engine.position == 0
        assert chat.ask("What is the capital of France?").token_ids == first.token_ids


def test_speculative_chat_answers_as_plain_chat(model):
    """Chat(speculative="ngram") gives the plain greedy answers, turn after turn, with drafts
    taken from the conversation (a paragraph to repeat: the drafts are accepted)."""
    paragraph = ("The lighthouse on the northern cape was built in 1871 from granite quarried on the "
                 "island itself. The light was automated in 1989.")
    turns = [f"Repeat this paragraph word for word: {paragraph}", "Now repeat its first sentence."]
    replies = {}
    for mode in (None, "ngram"):
        with new_chat(model, max_new_tokens=24, speculative=mode) as chat:
            replies[mode] = [chat.ask(t).token_ids for t in turns]
            stats = chat.engine.stats()
    assert replies["ngram"] == replies[None]
    assert stats["verify_steps"] > 0 and stats["accepted"] > 0


def test_opening_a_gguf_parses_it_once(model, monkeypatch, capsys):
    """Chat.from_pretrained and `onegraph generate --prompt` read the model and its tokenizer
    from one parse of the GGUF header (one GGUFReader), and get what opening each on its own
    gets: the same tokenizer, config and answer."""
    import gguf
    from onegraph.chat import Chat, stop_tokens
    from onegraph.cli import main
    from onegraph.engine import Engine
    from onegraph.loader import load_model
    path, tokenizer = model
    made = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            made.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    text = "Hello, world! <|im_start|>user 12345 ünïcödé"
    with Chat.from_pretrained(path, device="cpu", kv="fp32", max_seq_len=64) as chat:
        assert len(made) == 1
        assert chat.tokenizer.encode(text) == tokenizer.encode(text)
        assert chat.tokenizer.stop_token_ids == tokenizer.stop_token_ids
        assert chat.tokenizer.chat_template == tokenizer.chat_template
        assert chat.engine.config == load_model(path).config

    prompt = "What is the capital of France?"
    made.clear()
    assert main(["generate", "--model", path, "--prompt", prompt, "-n", "3", "--device", "cpu",
                 "--kv", "fp32", "--max-seq-len", "64"]) == 0
    assert len(made) == 1
    monkeypatch.undo()
    with Engine.from_pretrained(path, device="cpu", kv="fp32", max_seq_len=64) as engine:
        ids = list(engine.stream(tokenizer.encode(prompt), 3, stop_token_ids=stop_tokens(engine, tokenizer)))
    assert capsys.readouterr().out == tokenizer.decode(ids, skip_special_tokens=True) + "\n"


def test_chat_with_a_draft_model_answers_as_plain_chat(model):
    """Chat(speculative=draft_engine), the draft being the same model: the plain greedy answers
    turn after turn (the draft engine follows the conversation), every draft accepted (answers
    cut by max_new_tokens: a stop token would end a run of accepted drafts early)."""
    from onegraph.engine import Engine
    turns = ["Tell me a long story about a dragon.", "Continue the story."]
    with new_chat(model, max_new_tokens=12) as chat:
        expected = [chat.ask(t) for t in turns]
    assert [r.finish_reason for r in expected] == ["length", "length"]
    with Engine.from_pretrained(model[0], device="cpu", kv="fp32", max_seq_len=512) as draft, \
            new_chat(model, max_new_tokens=12, speculative=draft) as chat:
        got = [chat.ask(t).token_ids for t in turns]
        stats = chat.engine.stats()
    assert got == [r.token_ids for r in expected]
    assert stats["verify_steps"] > 0 and stats["accepted"] == stats["drafted"]
