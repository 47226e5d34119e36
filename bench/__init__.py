"""Benchmark helpers that need packages the runtime never imports: Hugging Face peers
(torch + transformers, bench/peers.py) and the chart (matplotlib, bench/plot.py).
runtime/bench.py imports them lazily, only when --peers / --plot ask for them."""
