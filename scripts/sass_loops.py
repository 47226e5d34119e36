"""The hot loop of each kernel in a CUDA binary, as the compiler wrote it: its instructions by
class and by source line, and how long one trip takes if issue alone bound it; and the kernel's
size (an SM's instruction cache holds about 32 KB: scripts/icache_probe.cu).

    python3 scripts/sass_loops.py BINARY [--kernel REGEX] [--warps-per-sm N] [--lines K] [--code-lines K] [--json PATH]

BINARY is a cubin, or an executable / shared library with sm_90 code in it (build with -lineinfo
for the source lines). The hot loop of a function is its innermost loop (a backward branch's
natural loop: its target and every instruction that can reach the branch without passing the
target) with at least half the arithmetic work (multiply-adds a lane of FFMA, HFMA2, HMMA, IMMA,
IDP.4A, ...) of the function's loop with the most, and at least --min-math math instructions.
Issue-bound time of one trip = instructions x warps an SM / (4 schedulers x 1 instruction a
cycle) / the clock: what the loop costs if nothing but issue slots held it, to set against a
measured time (a loop much slower than that waits on latency). The warps an SM are those its
registers allow in blocks of --block-threads (or --warps-per-sm). The counts are static: every
instruction of the loop counts once, including branches a trip may skip (a task's final
reduction in a loop over chunks, a rarely taken rescale, a general path beside a fast one).
"A trip takes at least" is the fewest instructions on a path from the loop's start to its back
edge: the common trip where the branches it skips are the rare ones.

Needs nvdisasm and cuobjdump: from $CUDA_BIN, the PATH, NVIDIA's wheels (`pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`: nvidia/cu*/bin), or Triton's package
(triton/backends/nvidia/bin), in that order. The wheels need no GPU, so the SASS of a build can be
read on any machine.
"""
from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MATH = {"FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "HMMA", "IMMA", "IDP", "DFMA"}  # IDP: IDP.4A (dp4a)
# A math instruction's multiply-adds a lane (an m16n8k16 mma: 2,048 a warp): which loop holds the
# kernel's arithmetic.
MATH_WORK = {"HFMA2": 2, "HMUL2": 2, "HADD2": 2, "HMMA": 64, "IMMA": 64, "IDP": 4}
CLASSES = {
    "fp32 math": {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK"},
    "fp16 pairs": {"HFMA2", "HMUL2", "HADD2", "HMNMX2", "HSETP2"},
    "tensor core": {"HMMA", "IMMA", "HGMMA", "IGMMA"},
    "int dot": {"IDP"},
    "sfu": {"MUFU"},
    "conversion": {"I2F", "F2I", "F2F", "I2FP", "F2FP", "PRMT"},
    "shuffle": {"SHFL", "VOTE", "REDUX", "MATCH"},
    "load/store": {"LDG", "STG", "LDS", "STS", "LDSM", "LD", "ST", "LDL", "STL", "LDGSTS", "LDGDEPBAR",
                   "UBLKCP", "UTMALDG", "SYNCS", "RED", "ATOM", "ATOMS", "CCTL"},
    "control": {"BRA", "BSSY", "BSYNC", "WARPSYNC", "BAR", "EXIT", "NOP", "YIELD", "DEPBAR", "BREAK"},
}


def find_tool(name: str) -> str:
    candidates = []
    if os.environ.get("CUDA_BIN"):
        candidates.append(Path(os.environ["CUDA_BIN"]) / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    try:
        import nvidia  # the namespace package NVIDIA's wheels install their binaries under
        for root in nvidia.__path__:
            candidates.extend(sorted(Path(root).glob(f"cu*/bin/{name}"), reverse=True))
    except ImportError:
        pass
    try:
        import triton  # noqa: F401  (only its bundled binaries are used)
        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    sys.exit(f"sass_loops: {name} not found (set CUDA_BIN, put it on the PATH, or pip install "
             "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def cubins(binary: Path, workdir: Path) -> list[Path]:
    """The binary itself when it is a cubin (an ELF for EM_CUDA, 190), else the sm_90 cubins
    cuobjdump extracts from it."""
    head = binary.read_bytes()[:20]
    if head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 190:
        return [binary]
    subprocess.run([find_tool("cuobjdump"), "-xelf", "all", str(binary.resolve())], cwd=workdir,
                   check=True, capture_output=True, text=True)
    found = sorted(p for p in workdir.glob("*.cubin") if "sm_90" in p.name)
    if not found:
        sys.exit(f"sass_loops: no sm_90 code in {binary}")
    return found


def functions(cubin: Path) -> dict[str, list[tuple[int, str, tuple[str, int] | None, list[str]]]]:
    """Mangled name -> [(address, instruction, (file, line) or None, labels at it)]."""
    return parse_disassembly(subprocess.run([find_tool("nvdisasm"), "-g", str(cubin)], check=True,
                                            capture_output=True, text=True).stdout)


def parse_disassembly(text: str) -> dict[str, list[tuple[int, str, tuple[str, int] | None, list[str]]]]:
    """nvdisasm -g's text -> functions() (a section .text.NAME a function)."""
    out: dict[str, list] = {}
    body = None
    src = None
    labels: list[str] = []
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            body = out.setdefault(m.group(1), [])
            src, labels = None, []
            continue
        if body is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            src = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            body.append((int(m.group(1), 16), m.group(2), src, labels))
            labels = []
    return out


def resources(cubin: Path) -> dict[str, dict[str, int]]:
    """Mangled name -> {"REG": registers a thread, "STACK": stack frame bytes (spills live there),
    "SHARED": static shared bytes}, from cuobjdump -res-usage."""
    text = subprocess.run([find_tool("cuobjdump"), "-res-usage", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    return parse_resources(text)


def parse_resources(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", line)}
            name = None
    return out


def resident_warps(registers: int, block_threads: int) -> int:
    """Warps an SM holds when registers limit it (65,536 a multiprocessor, allocated in units of
    256 a warp, i.e. 8 a thread; at most 2,048 threads): whole blocks of block_threads."""
    per_thread = max(8, (registers + 7) // 8 * 8)
    blocks = min(65536 // (per_thread * block_threads), 2048 // block_threads)
    return blocks * block_threads // 32


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P[0-9T]\s+", "", instr).split()[0].split(".")[0]


def successors(body) -> list[list[int]]:
    """Per instruction, the instructions control may pass to next: a branch's target label (BRA
    predicated, with a predicate operand, or .U), and the following one unless the instruction
    is a plain `BRA` or an unpredicated EXIT, RET or BRX. BRA.DIV (taken only when the warp has
    diverged, to the compiler's out-of-line copy of a warp-synchronous sequence) counts as
    falling through: the copies are not the loop's work."""
    where = {label: i for i, (_, _, _, labels) in enumerate(body) for label in labels}
    out = []
    for i, (_, instr, _, _) in enumerate(body):
        nxt = []
        op = opcode(instr)
        ends = re.match(r"BRA\s+`\(", instr) or (op in ("EXIT", "RET", "BRX", "JMX") and not instr.startswith("@"))
        if not ends and i + 1 < len(body):
            nxt.append(i + 1)
        m = re.search(r"`\((\.L_x_\d+)\)", instr) if op == "BRA" and "BRA.DIV" not in instr else None
        if m and m.group(1) in where:
            nxt.append(where[m.group(1)])
        out.append(nxt)
    return out


def natural_loop(succ: list[list[int]], header: int, latch: int) -> list[int]:
    """The instructions of the loop whose back edge goes from latch to header: the header and
    every instruction that reaches the latch without passing the header (code the compiler laid
    out between the two that leaves the loop for good, e.g. an epilogue, is not in it)."""
    pred: dict[int, list[int]] = collections.defaultdict(list)
    for i, nxt in enumerate(succ):
        for j in nxt:
            pred[j].append(i)
    seen = {header, latch}
    stack = [latch] if latch != header else []
    while stack:
        for p in pred[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return sorted(seen)


def hot_loop(body, min_math: int):
    """The innermost loop with at least half the arithmetic work (MATH_WORK) of the loop with the
    most, and at least min_math math instructions: (its instructions' indices, the fewest
    instructions a trip can take), or None. A loop is a backward branch's natural loop
    (natural_loop); the compiler's rotated and duplicated paths make loops that nest or
    overlap, and the hot one is the smallest of those that hold most of the work."""
    succ = successors(body)
    loops = []
    for i, nxt in enumerate(succ):
        for j in nxt:
            if j <= i and opcode(body[i][1]) == "BRA":
                members = natural_loop(succ, j, i)
                ops = [opcode(body[k][1]) for k in members]
                work = sum(MATH_WORK.get(op, 1) for op in ops if op in MATH)
                loops.append((members, sum(op in MATH for op in ops), work, j, i))
    if not loops:
        return None
    need = max(w for _, _, w, _, _ in loops) // 2
    hot = [(len(m), m[0], m, j, i) for m, n, w, j, i in loops if w >= need and n >= min_math]
    if not hot:
        return None
    _, _, members, header, latch = min(hot)
    return members, shortest_trip(succ, set(members), header, latch)


def shortest_trip(succ, members: set[int], header: int, latch: int) -> int:
    """The fewest instructions from the loop's header to its back edge: a trip that skips every
    branch it can (a rescale when the running max grows, a general path beside a fast one). The
    common trip where the skipped branches are the rare ones; a lower bound otherwise."""
    best = {header: 1}
    heap = [(1, header)]
    while heap:
        cost, i = heapq.heappop(heap)
        if i == latch:
            return cost
        if cost > best.get(i, cost):
            continue
        for j in succ[i]:
            if j in members and j != header and cost + 1 < best.get(j, 1 << 30):
                best[j] = cost + 1
                heapq.heappush(heap, (cost + 1, j))
    return len(members)


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    res = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, res)) if len(res) == len(names) else {n: n for n in names}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", type=Path)
    ap.add_argument("--kernel", default="", help="a regular expression on the demangled name")
    ap.add_argument("--min-math", type=int, default=64)
    ap.add_argument("--block-threads", type=int, default=256,
                    help="threads a block: with the registers, how many warps an SM holds (the issue-bound time)")
    ap.add_argument("--warps-per-sm", type=int, default=0, help="resident warps an SM, instead of the above")
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--lines", type=int, default=0, help="also the K source lines with the most instructions")
    ap.add_argument("--code-lines", type=int, default=0,
                    help="also the K source lines with the most code in the whole kernel (bytes)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.binary.is_file():
        sys.exit(f"sass_loops: {args.binary}: no such file")
    try:
        re.compile(args.kernel)
    except re.error as e:
        sys.exit(f"sass_loops: --kernel {args.kernel!r}: {e}")
    try:
        records = hot_loops(args)
    except subprocess.CalledProcessError as e:
        sys.exit(f"sass_loops: {Path(e.cmd[0]).name} failed on {args.binary}: {(e.stderr or '').strip()[:300]}")
    if not records:
        print(f"sass_loops: no kernel matching '{args.kernel}' has a loop with {args.min_math}+ math instructions")
        return 1
    for rec in sorted(records, key=lambda r: r["kernel"]):
        print(f"{rec['kernel']}\n  {rec['registers']} registers, {rec['stack_bytes']} bytes of stack, "
              f"{rec['code_bytes'] / 1024:.1f} KB of code; hot loop: "
              f"{rec['instructions']} instructions (a trip takes at least {rec['fewest_a_trip']}), issue-bound "
              f"{rec['issue_bound_us']:.2f} us at {rec['warps_per_sm']} warps an SM")
        print("  " + ", ".join(f"{c} {n}" for c, n in rec["classes"].items()))
        for where, n in rec["lines"]:
            print(f"    {where:>24}  {n}")
        if rec["code_lines"]:
            print("  code by source line (bytes):")
        for where, n in rec["code_lines"]:
            print(f"    {where:>24}  {n}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


def hot_loops(args) -> list[dict]:
    """One record a kernel of args.binary matching args.kernel that has a hot loop."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for cubin in cubins(args.binary, Path(tmp)):
            funcs = functions(cubin)
            res = resources(cubin)
            names = demangle(list(funcs))
            for mangled, body in funcs.items():
                name = names[mangled]
                if not re.search(args.kernel, name):
                    continue
                found = hot_loop(body, args.min_math)
                if found is None:
                    continue
                loop, fewest = found
                trip = [body[i] for i in loop]
                ops = collections.Counter(opcode(x[1]) for x in trip)
                classes = collections.Counter()
                for op, n in ops.items():
                    classes[next((c for c, s in CLASSES.items() if op in s), "integer/address/other")] += n
                r = res.get(mangled, {})
                warps = args.warps_per_sm or resident_warps(r.get("REG", 255), args.block_threads)
                cycles = len(trip) * warps / 4
                rec = {"kernel": name, "instructions": len(trip), "fewest_a_trip": fewest,
                       "code_bytes": 16 * len(body),  # sm_90: 16 bytes an instruction
                       "classes": dict(classes.most_common()),
                       "registers": r.get("REG"), "stack_bytes": r.get("STACK"),
                       "issue_bound_us": cycles / (args.clock_ghz * 1e3), "warps_per_sm": warps,
                       "lines": [[f"{s[0]}:{s[1]}" if s else "?", n] for s, n in
                                 collections.Counter(x[2] for x in trip).most_common(args.lines)],
                       "code_lines": [[f"{s[0]}:{s[1]}" if s else "?", 16 * n] for s, n in
                                      collections.Counter(x[2] for x in body).most_common(args.code_lines)]}
                records.append(rec)
    return records


if __name__ == "__main__":
    sys.exit(main())
