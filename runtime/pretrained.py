"""Open a model and its tokenizer from one path, for whatever runs text through the model
(chat, generate, eval, serve).

A GGUF file holds both the weights and the tokenizer, and parsing its header (the gguf
package's GGUFReader: every metadata field, the whole vocabulary and merge list as numpy
views) is most of what opening it costs. Here the header is parsed once and handed to both
readers; nothing keeps the parsed header after the call, so a loaded engine holds only the
mapped tensors and the tokenizer it built.
"""
from __future__ import annotations

import os

from .gguf_model import is_gguf_file, load_gguf, open_gguf
from .loader import LoadedModel, load_model
from .text import Tokenizer


def open_pretrained(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, *,
                    progress: bool = False) -> tuple[LoadedModel, Tokenizer]:
    """The model at `path` (a Hugging Face folder or a GGUF file; loader.load_model) and the
    tokenizer at `tokenizer` (default: the same path; text.Tokenizer.from_model).

    Raises LoaderError / ConfigError for the model, TextError for the tokenizer."""
    path = os.fspath(path)
    tokenizer = path if tokenizer is None else os.fspath(tokenizer)
    if tokenizer == path and os.path.isfile(path) and is_gguf_file(path):
        reader = open_gguf(path)
        return load_gguf(path, reader), Tokenizer.from_model(path, gguf_reader=reader)
    return load_model(path, progress=progress), Tokenizer.from_model(tokenizer)
