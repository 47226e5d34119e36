"""Text in and out: the model's own tokenizer, chat template and stop tokens.

`Tokenizer.from_model(path)` reads them from where the model keeps them:
  - a folder: tokenizer.json (the `tokenizers` format), tokenizer_config.json (special tokens,
    add_bos_token, chat_template), chat_template.jinja, generation_config.json and config.json
    (eos_token_id, an int or a list);
  - a .gguf file: the tokenizer.* metadata llama.cpp writes (vocabulary, merges, token types,
    pre-tokenizer name, special token ids, chat template), rebuilt as a `tokenizers` Tokenizer.

Chat templates render the way Hugging Face transformers renders them (a sandboxed jinja2
environment with trim_blocks / lstrip_blocks, `raise_exception`, `strftime_now` and a `tojson`
that does not escape HTML), so `encode_chat` gives the ids the model was trained on.

`StreamDecoder` turns generated ids into text one token at a time without ever cutting a
multi-byte character: byte-level BPE spells a character like "é" or "🙂" over several tokens.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


class TextError(ValueError):
    """A tokenizer or chat template that cannot be read or used; one line naming the file."""


# Special tokens that close a turn in the chat templates of common model families: ChatML
# (Qwen, SmolLM), Llama 3, Gemma, Phi-3. The one a template writes is a stop token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4

# How llama.cpp splits text before BPE, by tokenizer.ggml.pre. Each entry is a list of regexes
# applied in turn (every match isolated), as llama.cpp's llm_tokenizer_bpe does; the final
# ByteLevel step maps bytes to the vocabulary's alphabet.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "mpt": [_GPT2_SPLIT],
    "olmo": [_GPT2_SPLIT],
    # StarCoder-style vocabularies isolate every digit first.
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT], "codeshell": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT], "dbrx": [_LLAMA3_SPLIT], "falcon3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT], "megrez": [_QWEN2_SPLIT],
}
# Pre-tokenizers whose vocabulary was trained with ignore_merges: a word that is itself a token
# is taken whole (llama.cpp sets this for the Llama 3 family, as its tokenizer.json does).
GGUF_PRE_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are spelled in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


class Tokenizer:
    """The model's tokenizer (a `tokenizers` Tokenizer) with its chat template and stop tokens."""

    def __init__(self, backend: BackendTokenizer, *, source: str, chat_template: str | None,
                 special_tokens: dict[str, str], eos_token_ids: list[int]):
        self._backend = backend
        self.source = source
        self.chat_template = chat_template
        self.has_chat_template = chat_template is not None
        # bos_token / eos_token / unk_token / pad_token as strings: chat templates read them.
        self.special_tokens = {name: text for name, text in special_tokens.items() if text is not None}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        eos = self._token_id(self.special_tokens.get("eos_token"))
        self.eos_token_id = eos if eos is not None else (eos_token_ids[0] if eos_token_ids else None)
        stops = ([eos] if eos is not None else []) + list(eos_token_ids) + self._end_of_turn_ids()
        self.stop_token_ids = tuple(dict.fromkeys(i for i in stops if 0 <= i < self.vocab_size))
        self._template = None  # compiled on first use: a broken template still lets encode() work

    @classmethod
    def from_model(cls, path, gguf_reader=None) -> "Tokenizer":
        """The tokenizer of a model folder or GGUF file. gguf_reader: the GGUF file's parsed
        header (a gguf.GGUFReader) when the caller has one, so the file is not parsed again."""
        path = os.fspath(path)
        if os.path.isdir(path):
            return _from_folder(path)
        if os.path.isfile(path):
            if not path.endswith(".gguf") and gguf_reader is None:
                raise TextError(f"{path}: no tokenizer: expected a model folder (tokenizer.json) or a .gguf file")
            return _from_gguf(path, gguf_reader)
        raise TextError(f"{path}: no tokenizer: no such file or folder")

    def _token_id(self, text: str | None) -> int | None:
        return None if text is None else self._backend.token_to_id(text)

    def _end_of_turn_ids(self) -> list[int]:
        if self.chat_template is None:
            return []
        special = {token.content: token_id for token_id, token
                   in self._backend.get_added_tokens_decoder().items() if token.special}
        return [special[token] for token in END_OF_TURN_TOKENS
                if token in special and token in self.chat_template]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TextError(f"{self.source}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise TextError(f"{self.source}: the model has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise TextError(f"{self.source}: chat messages must be a list of dicts, got {messages!r:.80}")
        if self._template is None:
            self._template = _compile_template(self.chat_template, self.source)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        # Templates index and concatenate message fields: a message without "content", or with a
        # None in it, fails inside the template as well as through raise_exception.
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            raise TextError(f"{self.source}: chat template: {type(e).__name__}: {_one_line(e)}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, so the post-processor adds nothing (as in HF).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization: push() returns the text a token completes.

    Decodes a short window ids[prefix:] and the window before the newest tokens, ids[prefix:read],
    and emits the difference once it does not end in U+FFFD (an incomplete UTF-8 character). The
    window starts one emission back so decoders that treat the first token specially (a leading
    space in SentencePiece) see the same context as a full decode. Windows always start where an
    emission ended, at a character boundary, so the pieces add up to decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0   # start of the decode window
        self._read = 0     # ids before this are emitted

    def _pending(self) -> str:
        done = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        return text[len(done):] if text.startswith(done) else text

    def push(self, token_id: int) -> str:
        if not 0 <= int(token_id) < self._tokenizer.vocab_size:
            raise TextError(f"{self._tokenizer.source}: token id {token_id} is outside the vocabulary "
                            f"[0, {self._tokenizer.vocab_size})")
        self._ids.append(int(token_id))
        piece = self._pending()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def flush(self) -> str:
        """Whatever is left, incomplete characters included (as U+FFFD, as decode gives them)."""
        piece = self._pending() if self._read < len(self._ids) else ""
        self._prefix = self._read = len(self._ids)
        return piece


def _one_line(error) -> str:
    return " ".join(str(error).split())


def _compile_template(template: str, source: str):
    """The environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes <, >, & for HTML, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TextError(f"{source}: chat template does not parse: {_one_line(e)}") from None


# --- a model folder ---------------------------------------------------------------------------

def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TextError(f"{path}: not readable JSON: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise TextError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TextError(f"{where}: expected a string or {{\"content\": ...}}, got {value!r}")


def _eos_ids(config: dict, path: str) -> list[int]:
    value = config.get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TextError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def _template_from_config(value, path: str) -> str | None:
    """chat_template: a string, or a list of {"name", "template"} of which "default" is the one."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TextError(f"{path}: chat_template is a list without a 'default' template (names: {sorted(map(str, named))})")
    raise TextError(f"{path}: chat_template must be a string or a list, got {type(value).__name__}")


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None,
                        add_bos: bool, add_eos: bool) -> None:
    """BOS / EOS around every encode, as transformers' update_post_processor does."""
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
              ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _from_folder(folder: str) -> Tokenizer:
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise TextError(f"{folder}: no tokenizer: looked for tokenizer.json in the folder")
    try:
        backend = BackendTokenizer.from_file(tokenizer_json)
    except Exception as e:  # the tokenizers package raises a bare Exception on a bad file
        raise TextError(f"{tokenizer_json}: not a tokenizers file: {_one_line(e)}") from None

    config_path = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_path)
    special = {name: _token_text(config.get(name), f"{config_path}: {name}")
               for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    template_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(template_file):
        try:
            with open(template_file, encoding="utf-8") as f:
                chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TextError(f"{template_file}: not readable: {_one_line(e)}") from None
        source = template_file
    else:
        chat_template = _template_from_config(config.get("chat_template"), config_path)
        source = config_path if chat_template is not None else tokenizer_json
    # tokenizer.json's post-processor decides what encode() adds (BOS for Llama folders), as in
    # transformers 5; add_bos_token / add_eos_token build one only when the file has none.
    if backend.post_processor is None:
        _set_post_processor(backend, special["bos_token"], special["eos_token"],
                            bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False)))

    generation_path = os.path.join(folder, "generation_config.json")
    model_config_path = os.path.join(folder, "config.json")
    eos_ids = _eos_ids(_read_json(generation_path), generation_path) + \
        _eos_ids(_read_json(model_config_path), model_config_path)
    return Tokenizer(backend, source=source, chat_template=chat_template, special_tokens=special,
                     eos_token_ids=eos_ids)


# --- a GGUF file ------------------------------------------------------------------------------

def _gguf_fields(path: str, reader) -> dict:
    """The tokenizer.* metadata of a GGUF file (parsed by `reader` when given) as plain Python values."""
    if reader is None:
        try:
            import gguf  # only needed for .gguf files
        except ImportError:
            raise TextError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # GGUFReader raises ValueError / struct.error / OSError on a bad file
            raise TextError(f"{path}: not a readable GGUF file: {_one_line(e)}") from None
    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.")}


def _from_gguf(path: str, reader) -> Tokenizer:
    meta = _gguf_fields(path, reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise TextError(f"{path}: no tokenizer: the GGUF has no tokenizer.ggml.model / tokenizer.ggml.tokens metadata")
    if kind != "gpt2":
        raise TextError(f"{path}: tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise TextError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries, tokens has {len(tokens)}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_SPLITS:
        raise TextError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                        f"(supported: {', '.join(sorted(GGUF_PRE_SPLITS))})")

    # Vocabulary tokens are spelled in the byte alphabet already; a control token spelled
    # otherwise (e.g. "<｜begin▁of▁sentence｜>") is kept as written, and matched whole below.
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= letters and token_types[index] not in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED):
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise TextError(f"{path}: tokenizer.ggml.merges has an entry that is not two tokens separated by a space")
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in GGUF_PRE_IGNORE_MERGES)
    except Exception as e:
        raise TextError(f"{path}: tokenizer.ggml.merges: {_one_line(e)}") from None
    backend = BackendTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind_ in
                                zip(tokens, token_types) if kind_ == GGUF_TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind_ in
                        zip(tokens, token_types) if kind_ == GGUF_TOKEN_USER_DEFINED])

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        if index is None:
            return None
        if not 0 <= index < len(tokens):
            raise TextError(f"{path}: {key} = {index} is outside the vocabulary of {len(tokens)} tokens")
        return tokens[index]

    special = {"bos_token": token_at("tokenizer.ggml.bos_token_id"),
               "eos_token": token_at("tokenizer.ggml.eos_token_id"),
               "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
               "pad_token": token_at("tokenizer.ggml.padding_token_id")}
    _set_post_processor(backend, special["bos_token"], special["eos_token"],
                        bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                        bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    # eot (end of turn) and eom (end of message, Llama 3.1 tool calls) end a reply as eos does.
    eos_ids = [meta[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if key in meta]
    return Tokenizer(backend, source=path, chat_template=meta.get("tokenizer.chat_template"),
                     special_tokens=special, eos_token_ids=eos_ids)
