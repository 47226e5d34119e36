#!/usr/bin/env bash
# Builds the llama.cpp peer of `python -m bench --peers llama.cpp` (llama-cpp-python with every
# layer on the GPU) and packs it for a GPU machine that cannot reach PyPI:
#   bash scripts/build_llamacpp_peer.sh [WORKDIR]      # default ./build/llamacpp-peer
# Needs nvcc (CUDA 13), cmake, a C++ compiler and pip with PyPI; no GPU. cuBLAS comes from the
# nvidia-cublas wheel and the driver library from an empty stub with the driver's soname, both
# kept in WORKDIR (the toolkit is not touched). On 2 cores the build takes 20-40 minutes.
# Output: WORKDIR/llamacpp-peer.tar.xz, the llama_cpp package (each shared library once) and the
# pure-Python packages its runs import: diskcache (llama_cpp), gguf and PyYAML (the bench writes a
# preset as a GGUF file with them; PyYAML runs without its C extension). On the GPU machine:
#   mkdir -p /tmp/llama && tar -xJf llamacpp-peer.tar.xz -C /tmp/llama
#   LLAMA_CPP_PEER=/tmp/llama bash scripts/bench_suite.sh table-smollm2-llamacpp
# (bench_suite.sh puts the packages on the paths and preloads the driver library, which the
# stub-linked libraries do not name.)
# Environment: LLAMA_CPP_PYTHON_VERSION (0.3.36), CUDA_ARCH (90-real: sm_90 machine code without
# the PTX, which doubled the archive: 41 MB against 21), CMAKE_BUILD_PARALLEL_LEVEL.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$(mkdir -p "${1:-build/llamacpp-peer}" && cd "${1:-build/llamacpp-peer}" && pwd)
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
pip_get() { python3 -m pip download -q --no-deps -d "$WORK/dl" "$@"; }

# cuBLAS of the toolkit's release (headers and libraries) from its wheel; the driver library as
# a stub.
release=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
pip_get "nvidia-cublas==$release.*"
rm -rf "$WORK/cublas" && mkdir -p "$WORK/cublas"
python3 -m zipfile -e "$(ls "$WORK"/dl/nvidia_cublas-"$release".*.whl | head -n 1)" "$WORK/cublas"
CUBLAS=$(dirname "$(find "$WORK/cublas" -name cublas_v2.h | head -n 1)")/..
for lib in cublas cublasLt; do
  ln -sfn "$(ls "$CUBLAS"/lib/lib$lib.so.* | head -n 1)" "$CUBLAS/lib/lib$lib.so"
done
echo 'void og_driver_stub(void) {}' > "$WORK/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/libcuda.so" "$WORK/stub.c"

# The sdist vendors llama.cpp; --no-binary for it alone keeps its build tools as wheels.
pip_get --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
pip_get diskcache "gguf>=0.10" pyyaml
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90-real} \
-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DCUDA_cublas_LIBRARY=$CUBLAS/lib/libcublas.so -DCUDA_cublasLt_LIBRARY=$CUBLAS/lib/libcublasLt.so \
-DCUDA_cuda_driver_LIBRARY=$WORK/libcuda.so -DCMAKE_CUDA_FLAGS=-I$CUBLAS/include \
-DCMAKE_CXX_FLAGS=-I$CUBLAS/include"
rm -rf "$WORK/wheel"
python3 -m pip wheel -q --no-deps -w "$WORK/wheel" "$WORK/dl/llama_cpp_python-$VERSION.tar.gz"

# The wheel holds each library under three names (.so, .so.0, .so.0.x.y): keep the soname's
# file, link the plain name to it, drop the multimodal library the bench does not load.
rm -rf "$WORK/pack" && mkdir -p "$WORK/pack"
python3 -m zipfile -e "$WORK"/wheel/llama_cpp_python-*.whl "$WORK/pack"
(
  cd "$WORK/pack/llama_cpp/lib"
  rm -f libmtmd.*
  for f in *.so; do rm -f "$f".0.* "$f" && ln -s "$f.0" "$f"; done
)
for wheel in diskcache gguf pyyaml; do
  python3 -m zipfile -e "$(ls "$WORK"/dl/$wheel-*.whl | head -n 1)" "$WORK/pack"
done
tar -cJf "$WORK/llamacpp-peer.tar.xz" -C "$WORK/pack" llama_cpp diskcache gguf yaml
echo "$WORK/llamacpp-peer.tar.xz ($(du -m "$WORK/llamacpp-peer.tar.xz" | cut -f1) MB)"
