"""onegraph: a batch-1 decode runtime whose whole per-token layer loop is one CUDA graph.

    from onegraph import Engine, Chat, SamplingParams, Tokenizer
"""
__version__ = "0.2.0"

# The public names, imported on first use so that `import onegraph` stays cheap.
_EXPORTS = {
    "Engine": "engine", "EngineError": "engine",
    "Chat": "chat", "ChatReply": "chat",
    "SamplingParams": "sampling",
    "Tokenizer": "text", "TextError": "text",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'onegraph' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{module}", __name__), name)
