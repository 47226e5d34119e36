#!/usr/bin/env python3
"""Build libonegraph.so from cuda/*.cu with nvcc (no CMake, no torch).

    python build.py [--arch sm_90|native|...] [--testing] [--debug] [--trace] [--out DIR] [--force] [--verbose]

Two libraries come from the same sources:
  libonegraph.so          the product: the public ABI of cuda/onegraph.h only. cuda/*testing*.cu
                          are left out and the OG_TESTING parts of the other files compile away.
  libonegraph_testing.so  (``--testing``) every file compiled with -DOG_TESTING: the product plus
                          the og_test_* entry points of cuda/onegraph_testing.h, the body's omit
                          switches, fault injection and (with ``--trace``) the trace hooks. The
                          tests and the diagnostic scripts load this one.

Importable: ``build_library(out_dir=None, arch=None, debug=False, testing=False) -> str | None``
returns the path of the library, or None when nvcc is not installed (the Python package then
falls back to the CPU path). A failed compile raises BuildError with nvcc's output.

Target GPU architecture, first match wins: the ``arch`` argument; ``$ONEGRAPH_CUDA_ARCH``;
the compute capability nvidia-smi reports for GPU 0; sm_90 (H100/H200). Machine code for
that architecture is embedded together with its PTX, so newer GPUs can JIT it.
``--debug`` (or ``$ONEGRAPH_DEBUG=1``) builds with ``-G -lineinfo`` for compute-sanitizer;
``--trace`` (implies ``--testing``) adds per-block timestamps to the q4 and bf16 GEMVs and the
attention kernel (``scripts/q4_trace.py``).
Never ``--use_fast_math``: the numerics contract relies on IEEE division and sqrt.

The .cu files (nvcc) and .c files (the host C compiler) compile in parallel and link into one shared library with the CUDA runtime
linked statically, so the library needs only the driver at run time. The build is skipped
when the library is newer than every source and was built with the same flags.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CUDA_DIR = ROOT / "cuda"
DEFAULT_OUT = ROOT / "runtime" / "_lib"
LIB_NAME = "libonegraph.so"
TESTING_LIB_NAME = "libonegraph_testing.so"
DEFAULT_ARCH = "sm_90"


class BuildError(RuntimeError):
    """nvcc failed; the message carries the command and its output."""


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def detect_gpu_arch() -> str | None:
    """sm_XY of GPU 0 from nvidia-smi, or None when there is no GPU / no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return normalize_arch(lines[0])
    except ValueError:
        return None


def normalize_arch(arch: str) -> str:
    """'sm_90', '90', '9.0', 'compute_90', 'sm_90a' -> 'sm_90' / 'sm_90a'."""
    a = arch.strip().lower()
    for prefix in ("sm_", "compute_"):
        if a.startswith(prefix):
            a = a[len(prefix):]
    if "." in a:
        major, minor = a.split(".", 1)
        a = major + minor
    suffix = ""
    if a and a[-1] in "af":
        a, suffix = a[:-1], a[-1]
    if not a.isdigit():
        raise ValueError(f"unrecognized CUDA architecture {arch!r} (expected e.g. sm_90, 90 or 9.0)")
    return f"sm_{a}{suffix}"


def resolve_arch(arch: str | None) -> str:
    if arch is None or arch == "":
        arch = os.environ.get("ONEGRAPH_CUDA_ARCH") or None
    if arch is None or arch == "native":
        detected = detect_gpu_arch()
        return detected or DEFAULT_ARCH
    return normalize_arch(arch)


def gencode_flags(arch: str) -> list[str]:
    number = arch[len("sm_"):]
    return ["-gencode", f"arch=compute_{number},code=sm_{number}",
            "-gencode", f"arch=compute_{number},code=compute_{number}"]


def compile_flags(arch: str, debug: bool, trace: bool = False, testing: bool = False) -> list[str]:
    flags = ["-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
             "-I", str(CUDA_DIR)]
    flags += ["-G", "-lineinfo", "-O0"] if debug else ["-O3", "-lineinfo"]
    if testing or trace:
        flags += ["-DOG_TESTING"]
    if trace:
        flags += ["-DOG_Q4_TRACE"]
    if os.environ.get("ONEGRAPH_PTXAS_VERBOSE") == "1":
        flags += ["-Xptxas", "-v"]
    return flags + gencode_flags(arch)


def is_testing_source(src: Path) -> bool:
    """The files that hold only test entry points (testing.cu, moe_testing.cu, ...)."""
    return "testing" in src.stem


def sources(testing: bool = False) -> list[Path]:
    """cuda/*.cu (nvcc) and cuda/*.c (plain C parts such as the packed-file parser); the
    testing files only in the testing library."""
    found = sorted(CUDA_DIR.glob("*.cu")) + sorted(CUDA_DIR.glob("*.c"))
    return [src for src in found if testing or not is_testing_source(src)]


def find_host_cc() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def c_flags(debug: bool, testing: bool = False) -> list[str]:
    flags = ["-std=c11", "-fPIC", "-fvisibility=hidden", "-Wall", "-I", str(CUDA_DIR)]
    flags += ["-DOG_TESTING"] if testing else []
    return flags + (["-g", "-O0"] if debug else ["-O2", "-g"])


def compile_command(nvcc: str, cc: str | None, src: Path, obj: Path, flags: list[str],
                    debug: bool, testing: bool = False) -> list[str]:
    if src.suffix == ".c":
        if cc is None:
            raise BuildError(f"{src.name}: no C compiler found (cc, gcc or clang; or set CC)")
        return [cc, "-c", str(src), "-o", str(obj)] + c_flags(debug, testing)
    return [nvcc, "-c", str(src), "-o", str(obj)] + flags


def _dependencies() -> list[Path]:
    return sorted(p for p in CUDA_DIR.iterdir()
                  if p.suffix in (".cu", ".cuh", ".h", ".c")) + [Path(__file__).resolve()]


def _up_to_date(lib: Path, stamp: Path, flags_text: str) -> bool:
    if not lib.is_file() or not stamp.is_file():
        return False
    if stamp.read_text() != flags_text:
        return False
    built = lib.stat().st_mtime
    return all(dep.stat().st_mtime < built for dep in _dependencies())


def _run(cmd: list[str], verbose: bool) -> str:
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{output}")
    return output


def build_library(out_dir: str | os.PathLike | None = None, arch: str | None = None,
                  debug: bool = False, *, force: bool = False, verbose: bool = False,
                  jobs: int | None = None, trace: bool = False, testing: bool = False) -> str | None:
    """Compile cuda/*.cu into out_dir/libonegraph.so (testing: libonegraph_testing.so, with
    -DOG_TESTING and the testing files); return its path, or None without nvcc.
    trace: the diagnostic testing build with per-block timestamps in the q4 and bf16 GEMVs and
    the attention kernel (scripts/q4_trace.py)."""
    nvcc = find_nvcc()
    if nvcc is None:
        print("onegraph: nvcc not found (install the CUDA toolkit or set CUDA_HOME); "
              "the GPU library is not built and the runtime will use the CPU path.",
              file=sys.stderr)
        return None
    debug = debug or os.environ.get("ONEGRAPH_DEBUG") == "1"
    arch = resolve_arch(arch)
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    testing = testing or trace
    name = TESTING_LIB_NAME if testing else LIB_NAME
    lib = out / name
    stamp = out / (name + ".flags")
    flags = compile_flags(arch, debug, trace, testing)
    srcs = sources(testing)
    cc = find_host_cc() if any(src.suffix == ".c" for src in srcs) else None
    flags_text = " ".join([nvcc] + flags + [str(cc)] + c_flags(debug, testing) + [s.name for s in srcs])
    if not force and _up_to_date(lib, stamp, flags_text):
        return str(lib)

    obj_dir = out / ("obj" + ("-debug" if debug else "") + ("-trace" if trace else "-testing" if testing else ""))
    obj_dir.mkdir(parents=True, exist_ok=True)
    objects = [obj_dir / (src.name + ".o") for src in srcs]
    commands = [compile_command(nvcc, cc, src, obj, flags, debug, testing)
                for src, obj in zip(srcs, objects)]
    workers = jobs or max(1, min(len(srcs), os.cpu_count() or 1))
    if verbose:
        print(f"onegraph: compiling {len(srcs)} files for {arch}"
              f"{' (debug)' if debug else ''} with {workers} jobs", file=sys.stderr)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run, cmd, verbose) for cmd in commands]
        errors = []
        for future in concurrent.futures.as_completed(futures):
            try:
                output = future.result()
                if output and verbose:
                    print(output, file=sys.stderr)
            except BuildError as e:
                errors.append(str(e))
    if errors:
        raise BuildError("\n\n".join(errors))

    tmp = out / (name + f".tmp{os.getpid()}")
    link = [nvcc, "-shared", "-cudart", "static", "-o", str(tmp)] + [str(o) for o in objects] + \
        gencode_flags(arch)
    try:
        _run(link, verbose)
        os.replace(tmp, lib)  # atomic: a process loading the library never sees half a file
    finally:
        if tmp.exists():
            tmp.unlink()
    stamp.write_text(flags_text)
    return str(lib)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build libonegraph.so (or libonegraph_testing.so) with nvcc.")
    parser.add_argument("--arch", help="sm_90, 90, 9.0, native, ... (default: the GPU's own, else sm_90)")
    parser.add_argument("--testing", action="store_true",
                        help="build libonegraph_testing.so (-DOG_TESTING: the og_test_* entry points and hooks)")
    parser.add_argument("--debug", action="store_true", help="-G -lineinfo, for compute-sanitizer")
    parser.add_argument("--trace", action="store_true",
                        help="-DOG_Q4_TRACE (implies --testing): per-block timestamps in the q4 GEMV and attention "
                             "(scripts/q4_trace.py); use with --out")
    parser.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--verbose", "-v", action="store_true", help="print the nvcc commands")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compiles")
    args = parser.parse_args(argv)
    try:
        lib = build_library(args.out, args.arch, args.debug, force=args.force,
                            verbose=args.verbose, jobs=args.jobs, trace=args.trace,
                            testing=args.testing)
    except (BuildError, ValueError) as e:
        print(f"onegraph: build failed: {e}", file=sys.stderr)
        return 1
    if lib is None:
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
