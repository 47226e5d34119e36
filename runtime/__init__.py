"""onegraph: a batch-1 decode runtime whose whole per-token layer loop is one CUDA graph."""
__version__ = "0.2.0"
