"""scripts/sass_loops.py on a disassembly written by hand in nvdisasm -g's format: which loop is
the hot one, and what it counts."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "sass_loops.py"
spec = importlib.util.spec_from_file_location("sass_loops", SCRIPT)
sass_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loops)


def disassembly(lines):
    """A function `k` of the given (label or None, instruction, source line) rows."""
    out = ["\t.section\t.text.k,\"ax\",@progbits", "k:"]
    for address, (label, instr, line) in enumerate(lines):
        if label:
            out.append(f"{label}:")
        out.append(f'\t//## File "/src/k.cu", line {line}')
        out.append(f"        /*{address * 16:04x}*/                   {instr} ;")
    return "\n".join(out)


def test_the_hot_loop_is_the_smallest_holding_half_the_math():
    rows = [(None, "MOV R1, c[0x0][0x28]", 1)]
    # An outer loop (a rotated copy of the inner one) around an inner loop of 6 FFMA and a
    # small epilogue loop of 2 FFMA: the inner one is hot.
    rows += [(".L_x_0", "IMAD R2, R2, 0x2, RZ", 2)]
    rows += [(".L_x_1" if i == 0 else None, "FFMA R3, R4, R5, R3", 3) for i in range(6)]
    rows += [(None, "SHFL.BFLY PT, R6, R3, 0x1, 0x1f", 4), (None, "@P0 BRA `(.L_x_1)", 5)]
    rows += [(None, "FFMA R7, R4, R5, R7", 6), (None, "@P1 BRA `(.L_x_0)", 7)]
    rows += [(".L_x_2", "FFMA R8, R4, R5, R8", 8), (None, "FADD R8, R8, R9", 8), (None, "@P2 BRA `(.L_x_2)", 9)]
    rows += [(None, "EXIT", 10)]
    body = sass_loops.parse_disassembly(disassembly(rows))["k"]
    loop, fewest = sass_loops.hot_loop(body, min_math=1)
    trip = [body[i] for i in loop]
    assert [sass_loops.opcode(x[1]) for x in trip] == ["FFMA"] * 6 + ["SHFL", "BRA"]
    assert trip[0][2] == ("k.cu", 3)
    assert fewest == 8  # no branch to skip
    # Demanding more math than any loop holds: none.
    assert sass_loops.hot_loop(body, min_math=100) is None


def test_code_laid_out_inside_a_loop_that_leaves_it_is_not_counted():
    # The loop's header, a rarely taken rescale branch (back into the loop), then an epilogue
    # the compiler placed before the back edge, reached only by leaving the loop: the loop is
    # the header, the body, the rescale and the back edge, not the epilogue.
    rows = [(None, "MOV R1, c[0x0][0x28]", 1)]
    rows += [(".L_x_0", "HMMA.16816.F32 R4, R8, R12, R4", 2), (None, "FFMA R3, R4, R5, R3", 2)]
    rows += [(None, "@P0 BRA `(.L_x_1)", 3)]                       # to the rescale
    rows += [(".L_x_2", "FADD R6, R6, R7", 4), (None, "@P1 BRA `(.L_x_3)", 4)]   # exit to epilogue
    rows += [(None, "BRA `(.L_x_4)", 5)]                           # to the back edge
    rows += [(".L_x_3", "FFMA R9, R9, R9, R9", 6), (None, "FFMA R9, R9, R9, R9", 6),
             (None, "FFMA R9, R9, R9, R9", 6), (None, "EXIT", 6)]  # the epilogue
    rows += [(".L_x_1", "FMUL R4, R4, R2", 7), (None, "BRA `(.L_x_2)", 7)]      # the rescale
    rows += [(".L_x_4", "IADD3 R0, R0, 0x1, RZ", 8), (None, "@P2 BRA `(.L_x_0)", 8)]
    rows += [(None, "EXIT", 9)]
    body = sass_loops.parse_disassembly(disassembly(rows))["k"]
    loop, fewest = sass_loops.hot_loop(body, min_math=1)
    trip = [body[i] for i in loop]
    assert [sass_loops.opcode(x[1]) for x in trip] == [
        "HMMA", "FFMA", "BRA", "FADD", "BRA", "BRA", "FMUL", "BRA", "IADD3", "BRA"]
    # The fewest a trip takes: past the rescale (FMUL, BRA), straight to the back edge.
    assert fewest == 8


def test_the_hot_loop_holds_the_most_multiply_adds_not_the_most_math_instructions():
    # A loop of 40 FFMA (40 multiply-adds a lane) and a smaller one of 4 HMMA and 2 FFMA (4 x 64
    # + 2): the second holds the kernel's arithmetic; the first is not within half of it.
    rows = [(None, "MOV R1, c[0x0][0x28]", 1)]
    rows += [(".L_x_0" if i == 0 else None, "FFMA R3, R4, R5, R3", 2) for i in range(40)]
    rows += [(None, "@P0 BRA `(.L_x_0)", 3)]
    rows += [(".L_x_1", "HMMA.16816.F32 R4, R8, R12, R4", 4)] + [(None, "HMMA.16816.F32 R4, R8, R12, R4", 4)] * 3
    rows += [(None, "FFMA R3, R4, R5, R3", 5)] * 2 + [(None, "@P1 BRA `(.L_x_1)", 6), (None, "EXIT", 7)]
    body = sass_loops.parse_disassembly(disassembly(rows))["k"]
    loop, fewest = sass_loops.hot_loop(body, min_math=1)
    assert [sass_loops.opcode(body[i][1]) for i in loop] == ["HMMA"] * 4 + ["FFMA"] * 2 + ["BRA"]
    assert fewest == 7


def test_predicates_and_modifiers_do_not_change_the_opcode():
    assert sass_loops.opcode("@!P3 LDG.E.128.CONSTANT R4, desc[UR6][R2.64]") == "LDG"
    assert sass_loops.opcode("@UPT HMMA.16816.F32 R0, R4, R8, R0") == "HMMA"
    assert sass_loops.opcode("FFMA R3, R4, R5, R3") == "FFMA"


def test_resources_and_the_warps_registers_allow():
    text = """
Resource usage:
 Common:
  GLOBAL:24 CONSTANT[4]:8
 Function _Z1kv:
  REG:128 STACK:608 SHARED:1152 LOCAL:0 CONSTANT[0]:664 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z1jv:
  REG:250 STACK:32 SHARED:1040 LOCAL:0 CONSTANT[0]:752 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    res = sass_loops.parse_resources(text)
    assert res == {"_Z1kv": {"REG": 128, "STACK": 608, "SHARED": 1152},
                   "_Z1jv": {"REG": 250, "STACK": 32, "SHARED": 1040}}
    # 65,536 registers an SM: two blocks of 256 threads at 128 a thread, one at 250 (256 after
    # rounding to 8), four at 64, and never more than 2,048 threads.
    assert sass_loops.resident_warps(128, 256) == 16
    assert sass_loops.resident_warps(250, 256) == 8
    assert sass_loops.resident_warps(129, 256) == 8
    assert sass_loops.resident_warps(64, 256) == 32
    assert sass_loops.resident_warps(16, 256) == 64
