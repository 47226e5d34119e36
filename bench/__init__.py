"""`python -m bench` (and `onegraph bench`): the benchmark, run from the source tree.

bench/benchmark.py times onegraph's decode (graph one step at a time, graph pipelined,
non-graph), the bandwidth floor, the context sweep and the time to first token; bench/peers.py
runs Hugging Face peers (torch + transformers) and bench/plot.py draws the chart (matplotlib),
imported only when --peers / --plot ask for them. The runtime (runtime/, `onegraph`) never
imports this package.
"""
