"""`python -m bench` (and `onegraph bench`): the benchmark, run from the source tree.

The benchmark times onegraph's decode (graph one step at a time, graph pipelined, non-graph),
the bandwidth floor, the context sweep and the time to first token (what one run does:
bench/benchmark.py's docstring, also `python -m bench -h`). By concern:

- bench/benchmark.py: the command line (arguments, settings, main);
- bench/targets.py: the settings, the models (presets, folders, GGUF files) and prompts;
- bench/floor.py: the bytes one decode step reads, and the floor they set;
- bench/timing.py: the GPU (copy bandwidth, name) and the timed loops an engine runs;
- bench/measure.py: the engine runs (decode modes, context sweep, sampling, TTFT, peers) and the
  comparisons between their records;
- bench/report.py: the JSON document (its schema), the tables and the chart.

bench/peers.py runs Hugging Face peers (torch + transformers) and llama.cpp (bench/llamacpp.py),
bench/plot.py draws the chart (matplotlib), imported only when --peers / --plot ask for them.
The runtime (runtime/, `onegraph`) never imports this package.
"""
