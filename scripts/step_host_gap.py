"""How much of a greedy step's wall time is outside the GPU: the captured step timed with CUDA
events around the graph launch, against the wall time of the whole step (begin, launch,
synchronize, end), for each step output, at a pinned context.

    python3 scripts/step_host_gap.py --preset qwen3-8b --weights q4 --quantize-lm-head --context 64
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graph_ablation import add_engine_args, open_engine  # noqa: E402  (scripts/, beside this file)
from step_timing import warm_up  # noqa: E402


def main(argv=None) -> int:
    from cuda.bindings import runtime as rt
    from bench import targets, timing
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, "qwen3-8b")
    p.add_argument("--context", type=int, default=64, help="KV rows a step attends over")
    p.add_argument("--steps", type=int, default=200, help="timed steps per output")
    args = p.parse_args(argv)
    target, engine = open_engine(args, args.context + 16)
    with engine:
        gpu = engine.session
        engine.prefill(targets.make_prompt(target.config, args.context - 1, 0))
        for output in ("next_token", "logits"):
            gpu.set_output(output)
            with timing.pinned_position(engine, args.context - 1):
                warm_up(gpu)
                graph = gpu.capture()
                start, stop = rt.cudaEventCreate()[1], rt.cudaEventCreate()[1]
                wall, device = [], []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    gpu.begin(0)
                    rt.cudaEventRecord(start, graph.stream)
                    graph.launch()
                    rt.cudaEventRecord(stop, graph.stream)
                    graph.synchronize()
                    gpu.end()
                    wall.append((time.perf_counter() - t0) * 1e3)
                    device.append(rt.cudaEventElapsedTime(start, stop)[1])
                rt.cudaEventDestroy(start)
                rt.cudaEventDestroy(stop)
            w, d = statistics.median(wall), statistics.median(device)
            print(f"{output:>10}: step {w:.4f} ms, graph on the GPU {d:.4f} ms, outside it {1e3 * (w - d):.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
