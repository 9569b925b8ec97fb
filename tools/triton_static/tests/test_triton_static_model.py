"""The time model's rules and the pieces they stand on, each against figures computed by hand."""
import inspect

import numpy as np
import pytest

from triton_static import model
from triton_static.counts import _Counter
from triton_static.sass import Instr, source_key

HBM, L2 = 4.3e12, 10e12  # bytes per second the model assumes


def test_re_reads_far_apart_in_launch_order_go_to_hbm_in_proportion():
    """100 programs move 100 MB once (1 MB each): "far" is re-read 3 more times by programs 80
    apart (80 MB enter L2 between reuses: half of its 40 MB stays), "near" by programs 10 apart
    (10 MB: all hit), "inside" within a program."""
    mb = 1e6
    storages = {"far": {"loaded": 4 * 60 * mb, "size": 60 * mb, "reuse_stride": 80},
                "near": {"loaded": 2 * 20 * mb, "size": 20 * mb, "reuse_stride": 10},
                "inside": {"loaded": 3 * 10 * mb, "stored": 10 * mb, "size": 10 * mb}}
    t = model.traffic(storages, programs=100)
    assert (t.requested, t.unique, t.reread_far) == (320 * mb, 100 * mb, 180 * mb)
    assert t.hbm == pytest.approx(100 * mb + 180 * mb / 2)
    assert t.l2_hit == pytest.approx(1 - 90 / 220)
    assert t.memory_ms == pytest.approx(max(190 * mb / HBM, 320 * mb / L2) * 1e3)


def test_an_address_reads_its_own_registers_not_the_width_of_the_data():
    _registers = model._registers
    load = Instr(0, "", "LDG.E.128", ["R4", "desc[UR6][R38.64+0x80]"], ())
    assert _registers(load) == (["R4", "R5", "R6", "R7"], ["UR6", "R38", "R39"])
    shared = Instr(0, "@!P1", "LDS.64", ["R12", "[R3+0x10]"], ())
    assert _registers(shared) == (["R12", "R13"], ["P1", "R3"])
    store = Instr(0, "", "STG.E.128", ["desc[UR4][R2.64]", "R8"], ())
    assert _registers(store) == ([], ["UR4", "R2", "R3", "R8", "R9", "R10", "R11"])


def test_straight_line_code_counts_for_the_programs_that_run_it():
    """A branch taken by some programs counts for those only: by the programs the interpreter saw
    reach each line; 0 for code no program reached, 1 for a function header's (argument set-up,
    which the interpreter does not report)."""
    import toy_kernels

    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.clamp_low.fn)  # from the decorator
    body = header + next(i for i, text in enumerate(lines) if text.lstrip().startswith("if "))

    def share(*chain):
        instr = Instr(0, "", "FADD", ["R1", "R2", "R3"], tuple((path, line) for line in chain))
        return model._straight_share(instr, reached, programs=100)

    key = lambda *chain: "<".join(source_key(path, line) for line in chain)  # noqa: E731
    reached = {key(body): 100, key(body + 1): 25, key(body + 2, body + 3): 50}
    assert share(body) == 1 and share(body + 1) == 0.25 and share(body + 2, body + 3) == 0.5
    assert share(body + 2) == 0.5  # a chain recorded without its call site: the counted chains under it
    assert share(body + 4, body + 5) == 0  # a helper whose call site no program reached
    assert share(body + 5) == 0  # a body line no program reached
    assert share(header) == share(header + 1) == 1  # the decorator and the signature
    assert model._straight_share(Instr(0, "", "FADD", [], ()), reached, 100) == 1  # no source line


def test_a_skippable_instruction_in_a_helper_s_untaken_branch_counts_for_no_program():
    """clamp_low_scaled's branch (`if low > 0`, decided at run time) inlined at a call site every
    program ran, its body never run: code that a path through the kernel skips
    (sass.Code.skippable) counts 0, though _line_count would lend it the call site's count;
    predicated code that every path issues counts as the call site. The branch nested in it is
    decided at compile time (constexpr SCALE): compiled whole or not at all, and the compiler may
    name its lines for code outside it, so its lines count as the call site either way."""
    import toy_kernels

    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.clamp_low_scaled.fn)
    test, clamp, scale = (header + next(i for i, text in enumerate(lines) if text.strip().startswith(start))
                          for start in ("if low", "x = tl.maximum", "x = x * k"))
    call = inspect.getsourcelines(toy_kernels.row_sum)[1] + 1  # any line of the file stands for the call site
    key = lambda *chain: "<".join(source_key(path, line) for line in chain)  # noqa: E731
    reached = {key(call): 100, key(test, call): 100}

    def share(line, skippable, counts=reached, chain=True):
        sites = ((path, line), (path, call)) if chain else ((path, line),)
        return model._straight_share(Instr(0, "", "FMUL", ["R1", "R2", "R3"], sites), counts, 100, skippable=skippable)

    assert share(clamp, skippable=True) == 0
    assert share(clamp, skippable=False) == 1
    assert share(scale, skippable=True) == share(scale, skippable=False) == 1
    ran = {**reached, key(clamp, call): 25}
    assert share(clamp, skippable=True, counts=ran) == 0.25
    assert share(clamp, skippable=True, counts=ran, chain=False) == 0.25  # recorded without its call site


def test_skippable_code_is_what_some_path_to_an_exit_passes_by():
    """A branch over code that rejoins, an arm placed after the EXIT that only a branch reaches, a
    predicated EXIT before a store, and a loop whose body runs at least once (the branch closing it
    sits at its end)."""
    from triton_static.sass import skippable

    def code(*ops):
        instrs = []
        for k, op in enumerate(ops):
            pred, _, rest = op.rpartition(" ") if op.startswith("@") else ("", "", op)
            opcode, _, label = rest.partition(">")
            instrs.append(Instr(16 * k, pred, opcode, [f"`(.L_x_{label})"] if label else ["R1"], ()))
        return instrs

    labels = {f".L_x_{k}": 16 * k for k in range(12)}
    arms = code("ISETP", "@P0 BRA>5", "FADD", "STG", "EXIT", "FMUL", "STG", "EXIT")
    assert skippable(arms, labels) == {32, 48, 64, 80, 96, 112}
    rejoin = code("@P0 BRA>3", "FADD", "FADD", "FMUL", "@P1 EXIT", "STG", "EXIT")
    assert skippable(rejoin, labels) == {16, 32, 80, 96}
    assert skippable(code("FADD", "@P0 BRA>0", "EXIT"), labels) == set()
    assert skippable(code("@!PT BRA>2", "FADD", "EXIT"), labels) == set()  # a branch never taken
    assert skippable(code("@P0 BRX", "FADD", "EXIT"), labels) == set()  # an indirect branch: unknown


def test_programs_share_a_line_only_from_the_storage_s_start():
    """Cache lines are counted from each storage's start, as on a GPU (allocations aligned to 256
    bytes), not from absolute CPU addresses, whose 64-byte alignment would vary from run to run."""
    from types import SimpleNamespace

    base = 1024 + 64  # a storage 64 bytes past a 128-byte line
    counter = _Counter({(base, base + 4096): "x"}, (1, 2, 1))
    for y in (0, 1):  # program y reads the storage's bytes [128 y, 128 y + 128): a line each
        counter.run_program(0, y, 0)
        addresses = np.arange(base + 128 * y, base + 128 * y + 128, 4)
        counter.add_access("loaded", SimpleNamespace(data=addresses), SimpleNamespace(data=np.ones(32, bool)), 4)
    assert counter.reuse_stride("x") is None


def test_scheduling_bits_decode_from_the_high_word():
    from triton_static.sass import Control

    assert Control.decode(0x000fe40000000f00) == Control(stall=2, write=7, read=7, wait=0)  # a MOV
    assert Control.decode(0x020fe40000000f00) == Control(stall=2, write=7, read=7, wait=0b100000)  # waits on 5


def test_a_warp_waits_on_a_barrier_until_every_result_on_it_has_landed():
    """Two loads on barrier 0 (the second issued 2 cycles later), an ALU instruction, then one
    that waits on barrier 0: it issues when the later load lands; stall counts space the rest."""
    from triton_static.sass import Control

    def instr(opcode, stall=1, write=7, read=7, wait=0):
        return Instr(0, "", opcode, ["R1", "R2"], (), Control(stall, write, read, wait))

    load = 500.0
    body = [instr("LDG.E", write=0), instr("LDG.E", stall=2, write=0), instr("FADD"), instr("FADD", stall=4, wait=1),
            instr("FADD")]
    # issues: 0, 1, 3, then max(4, 1 + 500) = 501, then 505; one warp's time: to the last one's stall
    assert model.replay_cycles(body, global_load=load) == 506
    assert model.replay_cycles(body[2:], global_load=load) == 1 + 4 + 1  # nothing pending: stalls only
    # a loop: the wait at the top of the next iteration is on the loads of this one
    loop = [instr("FADD", wait=1), instr("LDG.E", write=0), instr("FADD", stall=6)]
    assert model.replay_cycles(loop, iterations=3, global_load=load) == 1 + load


def test_a_mixed_kernel_s_latency_is_its_average_program_s():
    """1000 programs of two kinds in one launch: a quarter load and wait on the load (kind a),
    three quarters run three ALU instructions (kind b). Mixed, the latency is programs / resident
    programs x the average program's time, each instruction's step weighed by the programs that
    run it; otherwise one wave of the path most programs take (b's)."""
    import toy_kernels
    from triton_static.sass import Code, Control

    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.clamp_low.fn)
    a, b = header + 1, header + 2

    def instr(address, line, opcode, stall=1, write=7, wait=0):
        return Instr(address, "", opcode, ["R1", "R2"], ((path, line),), Control(stall, write, 7, wait))

    instrs = [instr(0, a, "LDG.E", write=0), instr(16, a, "FADD", wait=1)] + \
        [instr(32 + 16 * k, b, "FADD", stall=4) for k in range(3)]
    code = Code(registers=32, ptxas_registers=32, spill_stores=0, spill_loads=0, stack=0, shared=0, instrs=instrs,
                loops=[])
    counts = {"reached": {source_key(path, a): 250, source_key(path, b): 750}}
    load = model.LATENCY["HBM"]  # no bytes counted: every load misses L2
    assert model.replay_steps(instrs, load) == [1, load, 4, 4, 4]
    resident = 16 * model.SMS  # 32 registers, 4 warps: 16 programs an SM (warps)
    clock_ms = model.CLOCK_HZ / 1e3
    mixed = model.model_kernel(code, (1000, 1, 1), 4, "none", counts, mixed=True)
    assert mixed.latency_cycles_per_program == pytest.approx(0.25 * (1 + load) + 0.75 * 12)
    assert mixed.latency_ms == pytest.approx(1000 / resident * (0.25 * (1 + load) + 0.75 * 12) / clock_ms)
    plain = model.model_kernel(code, (1000, 1, 1), 4, "none", counts)
    assert plain.latency_ms == pytest.approx(12 / clock_ms)


def test_a_loop_whose_body_never_ran_runs_zero_times():
    """The row sum's loop (toy_kernels: `for` on line 19, body on lines 20-21), as if inlined at a
    call site on line 40 and with a helper's line 30 inlined at line 21, when every row is empty:
    the interpreter counts the `for` line and the call site once a program, no body line. A body
    instruction's count falls back to its call site's, which ran; the loop still runs 0 times.
    With its body counted, the median of the counts as before. The same for straight-line code."""
    import toy_kernels
    from triton_static.sass import Loop
    path = toy_kernels.__file__
    at = [(19, 40), (20, 40), (30, 21, 40)]
    instrs = [Instr(16 * k, "", "IADD3", ["R1", "R1", "0x1", "RZ"], tuple((path, line) for line in chain))
              for k, chain in enumerate(at)]
    loop = Loop(start=0, end=32, instrs=instrs)

    def key(*chain):
        return "<".join(source_key(path, line) for line in chain)
    empty = {key(19, 40): 8.0, key(40): 8.0}
    assert model._line_count(instrs[1], empty) == 8.0  # the call site's count
    assert model._executions(loop, empty)[0] == 0.0
    ran = {**empty, key(20, 40): 32.0, key(21, 40): 32.0}
    assert model._executions(loop, ran)[0] == 32.0
    # A body line the compiler placed outside the loop (a peeled first trip): in no program's path
    # when the body never ran, in every one's when it did.
    assert model._straight_share(instrs[1], empty, programs=8) == 0.0
    assert model._straight_share(instrs[2], empty, programs=8) == 0.0
    assert model._straight_share(instrs[1], {**ran, key(20, 40): 8.0}, programs=8) == 1.0


def test_a_loop_in_a_helper_s_untaken_branch_runs_zero_times():
    """sum_if_positive's loop, in a branch decided at run time (`if flag > 0`), inlined at a call
    site every program ran, the branch never taken: the interpreter counts the call site and the
    test, no line of the loop, and a loop line's count falls back to the call site's
    (_line_count); the loop still runs 0 times. With the branch taken, its own lines' median."""
    import toy_kernels
    from triton_static.sass import Loop
    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.sum_if_positive.fn)
    test, head, body = (header + next(i for i, text in enumerate(lines) if text.strip().startswith(start))
                        for start in ("if flag", "for i", "total +="))
    call = inspect.getsourcelines(toy_kernels.row_sum)[1] + 1  # any line of the file stands for the call site
    instrs = [Instr(16 * k, "", "IADD3", ["R1", "R1", "0x1", "RZ"], ((path, line), (path, call)))
              for k, line in enumerate((head, body, body))]
    loop = Loop(start=0, end=32, instrs=instrs)

    def key(*chain):
        return "<".join(source_key(path, line) for line in chain)
    untaken = {key(call): 8.0, key(test, call): 8.0}
    assert model._line_count(instrs[1], untaken) == 8.0  # the call site's count
    assert model._executions(loop, untaken)[0] == 0.0
    taken = {**untaken, key(head, call): 4.0, key(body, call): 32.0}
    assert model._executions(loop, taken)[0] == 32.0


def test_a_pipelined_loop_in_an_untaken_copy_of_a_helper_runs_zero_times():
    """sum_if_positive inlined twice: at one call site its branch never ran, at another it did. A
    pipelined loop's instructions may carry no call site (body, below), and _line_count lends them
    the count of the copy that ran; the untaken copy's loop, whose instructions that do carry one
    all lie in its untaken branch, still runs 0 times, the other its own lines' median."""
    import toy_kernels
    from triton_static.sass import Loop
    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.sum_if_positive.fn)
    test, head, body = (header + next(i for i, text in enumerate(lines) if text.strip().startswith(start))
                        for start in ("if flag", "for i", "total +="))
    untaken_call = inspect.getsourcelines(toy_kernels.row_sum)[1] + 1  # lines standing for two call sites
    taken_call = untaken_call + 1

    def loop_at(call):
        chains = [((path, head), (path, call)), ((path, body),), ((path, body),)]
        return Loop(start=0, end=48, instrs=[Instr(16 * k, "", "IADD3", ["R1", "R1", "0x1", "RZ"], chain)
                                             for k, chain in enumerate(chains)])

    def key(*chain):
        return "<".join(source_key(path, line) for line in chain)
    counts = {key(untaken_call): 8.0, key(test, untaken_call): 8.0, key(taken_call): 8.0,
              key(test, taken_call): 8.0, key(head, taken_call): 4.0, key(body, taken_call): 32.0}
    assert model._line_count(loop_at(untaken_call).instrs[1], counts) == 32.0  # the copy that ran
    assert model._executions(loop_at(untaken_call), counts)[0] == 0.0
    assert model._executions(loop_at(taken_call), counts)[0] == 32.0


def test_code_after_a_skipped_loop_placed_in_its_range_does_not_lend_it_its_count():
    """The row sum's loop (toy_kernels: `for` on line 19, body 20-21, inlined at line 40) never
    entered, with two instructions of the store after it (line 22, run by every program) that the
    compiler placed inside the loop's address range: the loop runs 0 times, not the store's once a
    program; with its body counted, its own lines' median. A loop with no `for` holding half its
    instructions takes the median of all of them."""
    import toy_kernels
    from triton_static.sass import Loop
    path = toy_kernels.__file__
    at = [(19, 40), (20, 40), (21, 40), (22, 40), (22, 40)]
    instrs = [Instr(16 * k, "", "IADD3", ["R1", "R1", "0x1", "RZ"], tuple((path, line) for line in chain))
              for k, chain in enumerate(at)]
    loop = Loop(start=0, end=16 * len(at), instrs=instrs)

    def key(*chain):
        return "<".join(source_key(path, line) for line in chain)
    skipped = {key(19, 40): 8.0, key(22, 40): 8.0, key(40): 8.0}
    assert model._executions(loop, skipped)[0] == 0.0
    ran = {**skipped, key(20, 40): 32.0, key(21, 40): 32.0}
    assert model._executions(loop, ran)[0] == 32.0
    outside = Loop(start=0, end=48, instrs=[instrs[1], instrs[3], instrs[4]])  # 1 of 3 in the `for`
    assert model._executions(outside, ran)[0] == 8.0


def test_a_branch_inside_a_loop_counts_for_the_iterations_that_ran_it():
    """toy_kernels.double_every_eighth, 128 iterations in all: the add and the test run in every
    one, the doubling in 16. Its unpredicated instruction issues in 1/8 of them and leaves the
    path the latency replays; a predicated one issues in all."""
    import toy_kernels
    from triton_static.sass import Code, Control, Loop

    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.double_every_eighth.fn)
    add, test, double = (header + next(i for i, text in enumerate(lines) if text.strip().startswith(start))
                         for start in ("x = x + 1", "if ", "x = x * 2"))

    def instr(address, line, opcode, predicate="", stall=1):
        return Instr(address, predicate, opcode, ["R1", "R2"], ((path, line),), Control(stall, 7, 7, 0))

    body = [instr(0, add, "FADD"), instr(16, test, "ISETP"), instr(32, double, "FMUL", stall=10),
            instr(48, double, "FMUL", "@P0")]
    loop = Loop(start=0, end=48, instrs=body)
    counts = {"lines": {source_key(path, add): 128.0, source_key(path, test): 128.0, source_key(path, double): 16.0}}
    assert model._loop_shares(loop, counts["lines"], 128.0) == [1, 1, 0.125, 1]
    code = Code(registers=32, ptxas_registers=32, spill_stores=0, spill_loads=0, stack=0, shared=0, instrs=body,
                loops=[loop])
    km = model.model_kernel(code, (1, 1, 1), 1, "none", counts)
    assert km.loops[0].issue_slots_per_iteration == pytest.approx(3.125)  # the ALU pipe (ISETP: 2 slots) does not bind
    assert km.loops[0].cycles_per_iteration == 3  # the unpredicated FMUL's 10-cycle stall left out
    assert km.issue_slots == pytest.approx(128 * 3.125)


def test_code_the_sass_jumps_over_counts_for_the_iterations_that_ran_its_branch():
    """toy_kernels.double_every_eighth again, its doubling now behind a branch the SASS jumps over
    (Loop.jumped): a predicated instruction there (a masked load or store in the branch) issues
    in the iterations that took the branch, not in all; and where no iteration took it, code the
    branch's line inlines from a helper counts 0, though the helper's own chain was never counted
    and its caller (the kernel's call of the loop) ran."""
    import toy_kernels
    from triton_static.sass import Control, Loop

    path = toy_kernels.__file__
    lines, header = inspect.getsourcelines(toy_kernels.double_every_eighth.fn)
    add, test, double = (header + next(i for i, text in enumerate(lines) if text.strip().startswith(start))
                         for start in ("x = x + 1", "if ", "x = x * 2"))
    helper = (path, header)  # stands for a helper's line, inlined at the branch's line

    def instr(address, chain, opcode, predicate=""):
        return Instr(address, predicate, opcode, ["R1", "R2"], chain, Control(1, 7, 7, 0))

    body = [instr(0, ((path, add),), "FADD"), instr(16, ((path, test),), "BRA", "@!P0"),
            instr(32, ((path, double),), "FMUL", "@P1"), instr(48, (helper, (path, double)), "LDG", "@P1"),
            instr(64, ((path, add),), "BRA")]
    loop = Loop(start=0, end=64, instrs=body, jumped=[(17, 64)])
    taken = {source_key(path, add): 128.0, source_key(path, test): 128.0, source_key(path, double): 16.0,
             f"{source_key(*helper)}<{source_key(path, double)}": 16.0}
    assert model._loop_shares(loop, taken, 128.0) == [1, 1, 0.125, 0.125, 1]
    never = {source_key(path, add): 128.0, source_key(path, test): 128.0}
    assert model._loop_shares(loop, never, 128.0) == [1, 1, 0, 0, 1]
    # Not jumped over (the compiler predicated the branch): the predicated instructions issue in all.
    assert model._loop_shares(Loop(start=0, end=64, instrs=body), taken, 128.0) == [1, 1, 1, 1, 1]
