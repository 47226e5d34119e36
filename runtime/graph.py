"""One captured decode step: capture the library's body once with cuda-python, replay it.

    cudaStreamBeginCapture(stream, mode)    # stream: the session's capture stream
    og_enqueue(engine, stream)              # the same body the non-graph path runs
    graph = cudaStreamEndCapture(stream)
    exec  = cudaGraphInstantiate(graph)
    per token: og_begin_step -> cudaGraphLaunch(exec, stream) -> cudaStreamSynchronize -> og_end_step

The streams, the events and the set of captured graphs belong to the session
(runtime/session.py, GpuSession); this module only captures, launches and inspects one graph.

Capture runs in thread-local mode by default: an unsafe CUDA call (an allocation, a
synchronization) made by the capturing thread, which is the thread running og_enqueue, fails
and invalidates the capture instead of silently escaping it, while other threads decoding
with their own engines are not disturbed. Global mode (mode="global") would also forbid
those calls on every other thread for as long as the capture lasts, so a second engine's
cudaStreamSynchronize in another thread would fail then; it is kept for tests.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable


class GraphError(RuntimeError):
    """A CUDA runtime call of the graph path failed; the message names the call."""


def cuda_runtime():
    """cuda-python's runtime module (cudart)."""
    try:
        from cuda.bindings import runtime
    except ImportError:  # older cuda-python layout
        from cuda import cudart as runtime  # type: ignore
    return runtime


def check_cuda(result, call: str):
    """cuda-python returns (err, *values); raise GraphError unless err is cudaSuccess, else
    return the values (None, one value, or a tuple)."""
    rt = cuda_runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        name = rt.cudaGetErrorName(err)[1]
        text = rt.cudaGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise GraphError(f"{call} failed: {name}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_count() -> int:
    """CUDA devices visible to cuda-python (0 when the driver is missing)."""
    rt = cuda_runtime()
    err, count = rt.cudaGetDeviceCount()
    return int(count) if err == rt.cudaError_t.cudaSuccess else 0


CAPTURE_MODES = ("thread_local", "global", "relaxed")


class DecodeGraph:
    """One captured decode step. `enqueue(stream_handle: int)` must enqueue the whole body;
    it is captured on `stream` (a cudaStream_t the caller owns and keeps alive while the graph
    lives). `mode`: the stream capture mode, one of CAPTURE_MODES (see the module docstring)."""

    def __init__(self, enqueue: Callable[[int], None], stream, mode: str = "thread_local"):
        if mode not in CAPTURE_MODES:
            raise ValueError(f"mode={mode!r} is not one of {CAPTURE_MODES}")
        rt = cuda_runtime()
        self._rt = rt
        self.mode = mode
        self.graph = None
        self.exec = None
        self.stream = stream
        try:
            self._capture(enqueue)
        except BaseException:
            self.close()
            raise

    def _capture(self, enqueue: Callable[[int], None]) -> None:
        rt = self._rt
        modes = {"global": rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
                 "thread_local": rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal,
                 "relaxed": rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed}
        check_cuda(rt.cudaStreamBeginCapture(self.stream, modes[self.mode]), "cudaStreamBeginCapture")
        try:
            enqueue(int(self.stream))
        except BaseException:
            # End the capture so the stream is usable again; the partial graph is discarded.
            err, graph = rt.cudaStreamEndCapture(self.stream)
            if err == rt.cudaError_t.cudaSuccess and graph is not None:
                rt.cudaGraphDestroy(graph)
            raise
        self.graph = check_cuda(rt.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
        self.exec = check_cuda(rt.cudaGraphInstantiate(self.graph, 0), "cudaGraphInstantiate")

    def launch(self, stream=None) -> None:
        """Launch on `stream` (a cudaStream_t; default: the stream it was captured on)."""
        check_cuda(self._rt.cudaGraphLaunch(self.exec, self.stream if stream is None else stream),
                   "cudaGraphLaunch")

    def synchronize(self) -> None:
        """Until everything on the capture stream has completed."""
        check_cuda(self._rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def replay(self) -> None:
        self.launch()
        self.synchronize()

    def _typed_nodes(self):
        """(node, cudaGraphNodeType) for every node of the captured graph."""
        rt = self._rt
        _, count = check_cuda(rt.cudaGraphGetNodes(self.graph, 0), "cudaGraphGetNodes")
        nodes, _ = check_cuda(rt.cudaGraphGetNodes(self.graph, count), "cudaGraphGetNodes")
        return [(node, check_cuda(rt.cudaGraphNodeGetType(node), "cudaGraphNodeGetType")) for node in nodes]

    def node_types(self) -> Counter:
        """How many nodes of each type the captured graph holds, e.g. {'Kernel': 170, 'Memcpy': 2}."""
        return Counter(kind.name.replace("cudaGraphNodeType", "") for _, kind in self._typed_nodes())

    def memcpy_nodes(self) -> list[tuple[str, int]]:
        """The captured memcpy nodes as (direction name, bytes), e.g. ('DeviceToHost', 8)."""
        rt = self._rt
        nodes = []
        for node, kind in self._typed_nodes():
            if kind == rt.cudaGraphNodeType.cudaGraphNodeTypeMemcpy:
                params = check_cuda(rt.cudaGraphMemcpyNodeGetParams(node), "cudaGraphMemcpyNodeGetParams")
                extent = params.extent
                nodes.append((params.kind.name.replace("cudaMemcpy", ""),
                              int(extent.width * extent.height * extent.depth)))
        return nodes

    def memcpy_directions(self) -> Counter:
        """The captured memcpy nodes by direction name (e.g. {'HostToDevice': 1, 'DeviceToHost': 1})."""
        return Counter(direction for direction, _ in self.memcpy_nodes())

    def close(self) -> None:
        """Free the graph and its executable (the stream is its owner's)."""
        rt = self._rt
        if self.exec is not None:
            rt.cudaGraphExecDestroy(self.exec)
            self.exec = None
        if self.graph is not None:
            rt.cudaGraphDestroy(self.graph)
            self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
