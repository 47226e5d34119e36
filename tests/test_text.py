"""onegraph.text against Hugging Face transformers' tokenizer for the same SmolLM2 GGUF.

The reference is transformers reading the same file (AutoTokenizer with gguf_file=), and, for
the folder case, transformers reading the folder it saved. One deliberate difference: the GGUF
says tokenizer.ggml.pre = "smollm", which llama.cpp splits with "\\p{N}" first (every digit
isolated) and then GPT-2's regex, exactly like the Digits(individual_digits=True) + ByteLevel
pre-tokenizer in SmolLM2's published tokenizer.json. transformers' GGUF converter has no entry for
"smollm" and falls back to plain GPT-2 splitting, which differs on whitespace before a digit
("a  1"). So the encode reference is transformers' tokenizer with that published pre-tokenizer put
back; everything else (vocabulary, merges, added tokens, decoder, template) is transformers' own.
"""
import copy
import json
import os
import random
import sys

import pytest

from onegraph.text import StreamDecoder, TextError, Tokenizer
from real_model import smollm2_gguf

# Spaces, runs of spaces, newlines, tabs, punctuation, digits (after runs of spaces too),
# accents, CJK, Hangul, emoji (with a skin-tone modifier: several code points), and special
# tokens written in the text.
MIXED_TEXT = (
    "Hello  world!\n\n\tTabs\t\there;   runs of spaces   and 12345 digits, 3.14159 -- a  1 x   22.\n"
    "Café naïve façade, Ærøskøbing, señor — “curly quotes” «guillemets» 'it's' we'll they'd\r\n"
    "日本語のテキストです。中文文本，标点！한국어 텍스트 🙂👍🏽🚀 emoji🎉mid-word\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>"
    "  code: def f(x):\n    return x**2  # ü\n\n\n   trailing   "
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Bonjour, ça va ?"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And  3 × 3?  🙂"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語で"},
     {"role": "assistant", "content": "はい。"}, {"role": "user", "content": "\tTabs\nand lines\n"}],
]


def reference_transformers():
    """transformers, the reference tokenizer. Its GGUF reader before 5.24 is not one: 5.17 gives
    SmolLM2's GGUF eos id 1 (the file says 2) and leaves out the BOS of add_bos_token."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 24):
        pytest.skip(f"transformers {transformers.__version__} misreads GGUF tokenizers; the reference needs >= 5.24")
    return transformers


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return Tokenizer.from_model(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    return reference_transformers().AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                                  gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def hf_published(hf):
    """transformers' tokenizer of the GGUF with SmolLM2's published pre-tokenizer (module docstring)."""
    from tokenizers import pre_tokenizers
    tokenizer = copy.deepcopy(hf)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert tokenizer.backend_tokenizer is not hf.backend_tokenizer
    return tokenizer


def hf_chat_ids(hf_tokenizer, messages, add_generation_prompt):
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- GGUF: encode / decode / special ids ------------------------------------------------------

def test_gguf_encode_matches_transformers(ours, hf_published):
    for text in [MIXED_TEXT, MIXED_TEXT[:37], " leading space", "", "\n", "<|im_end|>", "a  1  22   333"]:
        for add_special in (True, False):
            assert ours.encode(text, add_special) == hf_published.encode(text, add_special_tokens=add_special), text


def test_gguf_decode_matches_transformers(ours, hf):
    ids = hf.encode(MIXED_TEXT)
    assert ours.decode(ids) == hf.decode(ids) == MIXED_TEXT
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    scattered = [rng.randrange(ours.vocab_size) for _ in range(300)]  # partial UTF-8 included
    assert ours.decode(scattered) == hf.decode(scattered)


def test_gguf_special_ids(ours, hf):
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert 2 in ours.stop_token_ids


def test_gguf_chat_template_matches_transformers(ours, hf, hf_published):
    assert ours.has_chat_template
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.encode_chat(messages, add_generation_prompt) == \
                hf_chat_ids(hf_published, messages, add_generation_prompt)


@pytest.fixture(scope="module")
def smollm2_tokenizer_metadata(gguf_path):
    import gguf
    reader = gguf.GGUFReader(gguf_path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def write_gguf_tokenizer(path, metadata, pre, eot_token_id=None):
    """SmolLM2's vocabulary and merges under another tokenizer.ggml.pre (None: the key left out)."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", None])
def test_gguf_pre_tokenizers_match_transformers(smollm2_tokenizer_metadata, tmp_path, pre):
    """The split regexes of the Llama 3 and Qwen2 families (and plain GPT-2), with add_bos_token,
    against transformers' GGUF converter, which maps these names to the same splits."""
    transformers = reference_transformers()
    path = write_gguf_tokenizer(tmp_path / "tokenizer.gguf", smollm2_tokenizer_metadata, pre)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tokenizer = Tokenizer.from_model(path)
    for text in (MIXED_TEXT, "a  1  22   333\n\n\n x"):
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer.encode(text)[0] == 1  # add_bos_token


def test_gguf_eot_token_is_a_stop_token(smollm2_tokenizer_metadata, tmp_path):
    path = write_gguf_tokenizer(tmp_path / "tokenizer.gguf", smollm2_tokenizer_metadata, "smollm", eot_token_id=0)
    tokenizer = Tokenizer.from_model(path)
    assert tokenizer.eos_token_id == 2
    assert tokenizer.stop_token_ids == (2, 0)  # no template here, so no end-of-turn token from it


def test_gguf_unknown_pre_tokenizer(smollm2_tokenizer_metadata, tmp_path):
    path = write_gguf_tokenizer(tmp_path / "tokenizer.gguf", smollm2_tokenizer_metadata, "made-up")
    one_line_error(path, "pre-tokenizer 'made-up' .tokenizer.ggml.pre. is not supported")


# --- streaming ---------------------------------------------------------------------------------

def stream(tokenizer, ids, skip_special_tokens):
    decoder = tokenizer.stream_decoder(skip_special_tokens)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_decoder_adds_up_to_decode(ours, skip_special_tokens):
    ids = ours.encode(MIXED_TEXT)
    rng = random.Random(1)
    streams = [ids]
    for _ in range(40):  # windows of real text that start and end mid-character
        start = rng.randrange(len(ids))
        streams.append(ids[start:start + rng.randrange(1, 40)])
    for _ in range(10):  # arbitrary ids: invalid UTF-8 in the middle and at the end
        streams.append([rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))])
    for stream_ids in streams:
        pieces, rest = stream(ours, stream_ids, skip_special_tokens)
        whole = ours.decode(stream_ids, skip_special_tokens)
        assert "".join(pieces) + rest == whole
        if "\ufffd" not in whole:
            assert not any("\ufffd" in p for p in pieces + [rest])


def test_stream_decoder_holds_back_partial_characters(ours):
    # "🦩" is four UTF-8 bytes; this vocabulary spells it over several tokens.
    ids = ours.encode("ok 🦩")
    emoji_tokens = ours.encode(" 🦩")
    assert len(emoji_tokens) > 1, "the test needs a character split over tokens"
    pieces, rest = stream(ours, ids, True)
    assert pieces[-1] == " 🦩"
    assert all(p == "" for p in pieces[-len(emoji_tokens):-1])
    assert "".join(pieces) + rest == "ok 🦩"


def test_stream_decoder_rejects_bad_id_and_keeps_state(ours):
    decoder = ours.stream_decoder()
    assert decoder.push(ours.encode("Hi")[0]) == "Hi"
    with pytest.raises(TextError, match="outside the vocabulary"):
        decoder.push(ours.vocab_size)
    assert decoder.push(ours.encode(" there")[0]) == " there"
    assert isinstance(decoder, StreamDecoder)


# --- a model folder ----------------------------------------------------------------------------

@pytest.fixture()
def saved_folder(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_folder_matches_transformers(saved_folder, hf):
    folder_tokenizer = Tokenizer.from_model(saved_folder)
    assert folder_tokenizer.encode(MIXED_TEXT) == hf.encode(MIXED_TEXT)
    ids = hf.encode(MIXED_TEXT)
    assert folder_tokenizer.decode(ids) == hf.decode(ids)
    assert folder_tokenizer.bos_token_id == hf.bos_token_id and folder_tokenizer.eos_token_id == hf.eos_token_id
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert folder_tokenizer.apply_chat_template(messages, add_generation_prompt) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert folder_tokenizer.encode_chat(messages, add_generation_prompt) == \
                hf_chat_ids(hf, messages, add_generation_prompt)
    assert folder_tokenizer.stop_token_ids == (hf.eos_token_id,)


def test_folder_eos_from_generation_config_and_config(saved_folder, hf):
    (saved_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, hf.eos_token_id, 5]}))
    (saved_folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    tokenizer = Tokenizer.from_model(saved_folder)
    # tokenizer eos first, then generation_config's list in order, then config.json; no repeats
    assert tokenizer.stop_token_ids == (hf.eos_token_id, 0, 5, 7)


def test_folder_template_list_and_config_tokens(saved_folder, hf):
    """tokenizer_config.json's chat_template as a list of named templates, a special token as an
    AddedToken dict, and a tokenizer.json post-processor that adds BOS (as Llama folders have):
    transformers reads the same folder."""
    transformers = reference_transformers()
    from tokenizers import Tokenizer as Backend, processors
    template = (saved_folder / "chat_template.jinja").read_text()
    os.remove(saved_folder / "chat_template.jinja")
    config_path = saved_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                               {"name": "default", "template": template}]
    bos = config["bos_token"]
    config["bos_token"] = {"__type": "AddedToken", "content": bos, "lstrip": False,
                           "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config_path.write_text(json.dumps(config))
    backend = Backend.from_file(str(saved_folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, hf.bos_token_id)])
    backend.save(str(saved_folder / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(saved_folder)
    tokenizer = Tokenizer.from_model(saved_folder)
    assert tokenizer.encode("Hi there") == reference.encode("Hi there")
    assert tokenizer.encode("Hi there")[0] == hf.bos_token_id == tokenizer.bos_token_id
    assert tokenizer.encode("Hi there", add_special_tokens=False) == reference.encode("Hi there", add_special_tokens=False)
    for messages in CONVERSATIONS:
        assert tokenizer.apply_chat_template(messages) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.encode_chat(messages) == hf_chat_ids(reference, messages, True)


def test_template_environment_matches_transformers(saved_folder):
    """tojson without HTML escaping, loop controls, bos/eos variables, raise_exception."""
    transformers = reference_transformers()
    (saved_folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "  {{ m.role }}: {{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>>{% endif %}{{ eos_token }}")
    messages = [{"role": "user", "content": "<b>&\"é\"</b>"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok 🙂"}]
    reference = transformers.AutoTokenizer.from_pretrained(saved_folder)
    tokenizer = Tokenizer.from_model(saved_folder)
    for add_generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(messages, add_generation_prompt) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_end_of_turn_token_from_template(saved_folder, hf):
    """A Llama-3-style template: its <|eot_id|> (a special token here) joins the stop tokens."""
    from tokenizers import Tokenizer as Backend, AddedToken
    backend = Backend.from_file(str(saved_folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    backend.save(str(saved_folder / "tokenizer.json"))
    (saved_folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot_id|>{% endfor %}")
    tokenizer = Tokenizer.from_model(saved_folder)
    assert tokenizer.stop_token_ids == (hf.eos_token_id, backend.token_to_id("<|eot_id|>"))


# --- bad input: one-line TextErrors ------------------------------------------------------------

def one_line_error(path, match):
    with pytest.raises(TextError, match=match) as info:
        Tokenizer.from_model(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)
    return str(info.value)


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one_line_error(tmp_path, "no tokenizer: looked for tokenizer.json")


def test_missing_path_and_wrong_file(tmp_path):
    one_line_error(tmp_path / "nothing", "no such file")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    one_line_error(tmp_path / "weights.bin", "no tokenizer")


def test_bad_json_files(saved_folder):
    (saved_folder / "generation_config.json").write_text("{not json")
    one_line_error(saved_folder, "generation_config.json: not readable JSON")
    os.remove(saved_folder / "generation_config.json")
    (saved_folder / "tokenizer.json").write_text("{}")
    one_line_error(saved_folder, "tokenizer.json: not a tokenizers file")


def write_gguf(path, **tokenizer):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if "model" in tokenizer:
        writer.add_tokenizer_model(tokenizer["model"])
    if "tokens" in tokenizer:
        writer.add_token_list(tokenizer["tokens"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_without_tokenizer(tmp_path):
    one_line_error(write_gguf(tmp_path / "bare.gguf"), "no tokenizer: the GGUF has no tokenizer.ggml.model")


def test_gguf_unsupported_tokenizer_model(tmp_path):
    path = write_gguf(tmp_path / "sp.gguf", model="bert", tokens=["[PAD]", "a"])
    one_line_error(path, "tokenizer model 'bert' is not supported")


def test_not_a_gguf(tmp_path):
    pytest.importorskip("gguf")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF-but-not-really")
    one_line_error(tmp_path / "fake.gguf", "not a readable GGUF file")


def test_gguf_without_the_gguf_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    one_line_error(tmp_path / "model.gguf", "reading GGUF files needs the 'gguf' package")


def test_broken_templates(saved_folder, hf):
    (saved_folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    tokenizer = Tokenizer.from_model(saved_folder)
    assert tokenizer.encode("still works") == hf.encode("still works")  # encode needs no template
    with pytest.raises(TextError, match="chat_template.jinja: chat template does not parse") as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)

    (saved_folder / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}")
    with pytest.raises(TextError, match="chat template: TemplateError: first message must be system"):
        Tokenizer.from_model(saved_folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_template(saved_folder):
    os.remove(saved_folder / "chat_template.jinja")
    tokenizer = Tokenizer.from_model(saved_folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(TextError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_bad_messages(ours):
    with pytest.raises(TextError, match="chat template: TypeError") as info:
        ours.apply_chat_template([{"role": "user", "content": None}])  # the template adds strings to it
    assert "\n" not in str(info.value) and ours.source in str(info.value)
    with pytest.raises(TextError, match="must be a list of dicts"):
        ours.apply_chat_template("hello")
