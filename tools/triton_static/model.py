"""The time model of the static report: every figure it gives is modelled, not measured.

For one kernel launch on an H200:

    time >= max(memory, tensor, issue, latency)

    memory  = max(HBM bytes / HBM bandwidth, requested bytes / L2 bandwidth), two levels:
              requested bytes are what the loads, stores and atomics ask for (each read counted,
              a tile re-read per program counted per program; counted by the interpreter,
              triton_static.counts), and every one of them passes through L2. HBM bytes are the unique
              bytes (each storage loaded at most once and stored at most once: its size caps
              each) plus the re-reads that miss L2. Whether a re-read hits depends on what enters
              L2 between two reads of the same data: programs run in launch order (grid axis 0
              fastest), the programs that share a storage's data are `reuse_stride` apart (the
              fastest axis along which they share, triton_static.counts), and each program brings about
              the kernel's unique bytes / programs into L2; so reuse distance = stride x that,
              and the storage's re-reads hit L2 in the fraction min(1, L2_REUSE_BYTES / reuse
              distance) (all of them when the data is re-read inside a program or no sharing
              axis was seen). A footprint that does not fit between reuses thus goes to HBM in
              proportion. L1 is not modelled: every request is served by L2 at best. The same
              rule (`traffic`) serves every kernel, ours and the peers', counted or modelled
              from an algorithm.
    tensor  = dot FLOPs / the rate of the MMA form the SASS uses (wgmma, mma.sync, or FFMA
              when the dot compiles to no MMA instruction, e.g. fp32 ieee dots).
    issue   = the busiest scheduler's issue slots / clock: ceil(ceil(programs / SMs) x warps per
              program / 4) warps on it, each issuing a program's average stream. Slots of a
              stream: max(instructions, 2 x ALU-pipe instructions, 8 x MUFU instructions) (the ALU
              pipe is 16 lanes and the MUFU pipe 4 lanes per scheduler); instructions =
              straight-line SASS x the programs that run it + each loop's SASS x its
              executions (both from the interpreter's line counts, per chain of inlined call
              sites: a branch that only some programs take, such as the chunked state
              kernel's capture programs, counts for those programs only; in a loop, the body
              of an `if` inside the loop in the source counts for the iterations that ran it,
              bar predicated instructions, which issue either way, unless the SASS jumps over
              them; code a helper inlines there counts 0 where the branch never ran; outside
              loops, code some path through the SASS passes by, in a helper's run-time `if`
              that never ran at its call site, counts 0 too, and so does a loop there).
    latency = waves x one program's dependent time: the straight-line code (the path most
              programs take) and each loop iteration replayed in order for one warp as the
              hardware schedules it, by the bits ptxas encodes in each instruction
              (sass.Control): an instruction issues its predecessor's stall count after it, or
              later when it waits on a scoreboard barrier, which releases only when every
              variable-latency result on it (loads, shuffles, MUFU) has landed (a loop's
              instructions that run in under half its iterations left out, as the
              straight-line path leaves out the branches most programs skip); times the loop's
              iterations per program (the median count of its lines; 0 where its `for` line
              ran and no line of its body did, whose lines then count in no program's path
              wherever the compiler put them). Other warps on the scheduler hide this only
              through `issue`: the two are reported apart so that a reader sees which one
              wins. A global load's latency is the L2 hit's (a fitted figure, LATENCY), plus
              the HBM miss's extra for the fraction of the kernel's requested bytes that go to
              HBM (memory, above).

Waves = ceil(programs / (resident programs per SM x SMs)); resident programs per SM come from
registers (allocated per warp in units of 256, registers per thread rounded up to 8), shared
memory (+1 KB reserved per block), warps (64 per SM) and 32 blocks per SM.

A mixed kernel (the client names it: programs of several kinds in one launch, e.g. work handed
out by an atomic ticket, each kind waiting on flags that earlier kinds raise) has no path that
most programs take: its latency is programs / (resident programs per SM x SMs) x the average
program's dependent time, the whole straight-line code replayed in order with each
instruction's step (replay_steps) weighed by the fraction of programs that run it, plus the
loops as above. A wait on a flag is a spin loop that the interpreter runs once (its producer
ran first), so it counts as one poll: time spent waiting on work not yet done (a serial
chain's) is not modelled.

Launch overhead (a few microseconds per kernel) is not modelled.
"""
from __future__ import annotations

import ast
import functools
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass

from .sass import Code, Instr, Loop, local_source

# H200 (shared/docs/gpu.md).
SMS = 132
SCHEDULERS_PER_SM = 4
CLOCK_HZ = 1.9e9
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy; the HBM3e peak is ~4.8e12
# L2, an assumption from a public microbenchmark (github.com/te42kyfo/gpu-benches, gpu-l2-cache,
# h200.txt: every SM reads a shared data set over and over): 9.5-11 TB/s from 3 to 40 MB (13.5
# at 1.5 MB), falling from 44 MB on to HBM's 3.9 TB/s (read-only) by 76 MB. So 10 TB/s, for
# stores and atomics as for loads, and 40 MB of the 50 MB L2 hold data for reuse.
L2_BYTES_PER_S = 10e12
L2_REUSE_BYTES = 40e6
TENSOR_FLOPS = {
    "wgmma": 790e12,  # bf16 dense, measured through PyTorch (peak 990e12)
    # mma.sync does not use Hopper's asynchronous warpgroup path; public microbenchmarks put it
    # at about two thirds of wgmma. An assumption, not a measurement.
    "mma.sync": 790e12 * 2 / 3,
    "none": 67e12,  # fp32 FMA peak: a dot without MMA instructions runs on the FMA pipe
}
REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_RESERVED_PER_BLOCK = 1024
WARPS_PER_SM = 64
BLOCKS_PER_SM = 32

# Latencies in cycles: assumptions from public Hopper microbenchmarks (round numbers), but for
# a global load, fitted: 1100 cycles as a waiting warp sees a load that hits L2 (HBM misses 240
# more), fitted to the H200 run at 1680d6f (bench/results/2026-11-30-gpu-2): its recurrent
# Mamba-2 scan (4.52 ms at 8192 tokens, one warp per scheduler whose token loop waits on a load
# every iteration) models 3.59 ms with it, and the chunked scans' ratio to mamba_ssm's match that
# run's within 2% (bench/README.md, calibration). An idle L2 hit is ~260 cycles in public
# pointer-chasing microbenchmarks: the fit holds whatever else such a wait includes.
LATENCY = {
    "alu": 4,  # FFMA, FADD, IADD3, ... fixed-latency pipes
    "MUFU": 18,
    "SHFL": 24,
    "shared": 30,  # LDS, LDSM
    "L2": 1100,  # a global load that hits L2 (fitted, above)
    "HBM": 1340,  # a global load that misses L2
    "BAR": 20,
    "MMA": 32,  # HMMA
    "operand_read": 20,  # until a store or load has read its source registers (its read barrier)
}
PIPE_SLOTS = {"alu": 2, "MUFU": 8}  # issue slots per warp instruction beyond 1
ALU_PIPE = {"IADD3", "LOP3", "SHF", "ISETP", "SEL", "FSEL", "FSETP", "FMNMX", "PRMT", "LEA", "PLOP3", "IMNMX",
            "I2F", "F2I", "I2FP", "F2FP", "FRND", "POPC", "FLO", "BREV", "IABS", "LOP", "SGXT", "BMSK"}
STORE_LIKE = ("ST", "STG", "STS", "STL", "RED", "BAR", "BRA", "EXIT", "BSYNC", "BSSY", "WARPSYNC", "NOP", "RET",
              "CALL", "MEMBAR", "FENCE", "LDGDEPBAR", "DEPBAR", "ERRBAR", "CCTL", "ARRIVES", "SYNCS", "UTMACCTL")


@dataclass
class Traffic:
    """A launch's memory traffic in bytes (module doc, memory)."""

    requested: float  # what the loads, stores and atomics ask for: all through L2
    unique: float  # each storage loaded at most once and stored at most once
    reread_far: float  # re-reads whose reuse distance passes L2_REUSE_BYTES
    l2_hit: float  # the fraction of the re-reads (requested - unique) served by L2
    hbm: float  # unique + the re-reads that miss L2

    @property
    def hbm_ms(self) -> float:
        return self.hbm / HBM_BYTES_PER_S * 1e3

    @property
    def l2_ms(self) -> float:
        return self.requested / L2_BYTES_PER_S * 1e3

    @property
    def memory_ms(self) -> float:
        return max(self.hbm_ms, self.l2_ms)


def traffic(storages: dict[str, dict[str, float]], programs: int) -> Traffic:
    """Traffic of a launch of `programs` programs from its bytes per storage: {name: {"loaded",
    "stored", "atomic" (read + write, counted twice), "size", "reuse_stride"}} (triton_static.counts; a
    storage without a size is uncapped, one without a reuse stride is re-read close by)."""
    per_storage = []
    for s in storages.values():
        size = s.get("size")
        kinds = [(s.get("loaded", 0.0), 1), (s.get("stored", 0.0), 1), (s.get("atomic", 0.0), 2)]
        moved = sum(amount for amount, _ in kinds)
        once = sum(amount if size is None else min(amount, cap * size) for amount, cap in kinds)
        per_storage.append((moved, once, s.get("reuse_stride")))
    requested = sum(moved for moved, _, _ in per_storage)
    unique = sum(once for _, once, _ in per_storage)
    per_program = unique / max(programs, 1)
    far = missed = 0.0
    for moved, once, stride in per_storage:
        distance = (stride or 0.0) * per_program
        if distance > L2_REUSE_BYTES:
            far += moved - once
            missed += (moved - once) * (1 - L2_REUSE_BYTES / distance)
    reread = requested - unique
    return Traffic(requested=requested, unique=unique, reread_far=far,
                   l2_hit=1 - missed / reread if reread else 1.0, hbm=unique + missed)


def instruction_latency(instr: Instr, global_load: float = LATENCY["HBM"]) -> float:
    base = instr.base
    if base in ("LDG", "LD", "ATOMG", "ATOM", "LDL"):
        return global_load
    if base in ("LDS", "LDSM", "LDGSTS"):
        return LATENCY["shared"]
    if base == "MUFU":
        return LATENCY["MUFU"]
    if base == "SHFL":
        return LATENCY["SHFL"]
    if base in ("HMMA", "HGMMA"):
        return LATENCY["MMA"]
    if base == "BAR":
        return LATENCY["BAR"]
    return LATENCY["alu"]


def issue_slots(instrs: list[Instr], shares: list[float] | None = None) -> float:
    """Issue slots one warp needs for these instructions (module doc), each counted in full or,
    with `shares`, by the fraction of programs that run it."""
    shares = [1.0] * len(instrs) if shares is None else shares
    alu = sum(s for i, s in zip(instrs, shares) if i.base in ALU_PIPE)
    mufu = sum(s for i, s in zip(instrs, shares) if i.base == "MUFU")
    return max(sum(shares), PIPE_SLOTS["alu"] * alu, PIPE_SLOTS["MUFU"] * mufu)


REGISTER = re.compile(r"(?<![A-Za-z0-9_])(UR|UP|R|P)(\d+)((?:\.\w+)*)")  # RZ, PT, URZ, UPT: no number


def _registers(instr: Instr) -> tuple[list[str], list[str]]:
    """(written, read) register names of an instruction (R, P, UR, UP), approximately: the first
    operand is written unless the opcode only reads (stores, branches, barriers); vector
    operands (.64/.128 and MMA fragments) cover the following registers; an address operand
    reads one register, or two when marked .64, whatever the width of the data it moves."""
    width = 4 if instr.base in ("HMMA", "HGMMA") else 4 if ".128" in instr.opcode else 2 if ".64" in instr.opcode else 1

    def names(operand: str, wide: int) -> list[str]:
        address = "[" in operand  # [R2.64+0x80], desc[UR4][R2.64]: a register or a .64 pair
        out = []
        for prefix, number, suffix in REGISTER.findall(operand):
            span = (2 if ".64" in suffix else 1) if address else wide
            out += [f"{prefix}{int(number) + k}" for k in range(span)]
        return out

    ops = instr.operands
    reads = names(instr.predicate, 1)
    if not ops or instr.base in STORE_LIKE:
        return [], reads + [r for op in ops for r in names(op, width)]
    written = names(ops[0], width)
    rest = ops[1:]
    if rest and (instr.base.endswith("SETP") or (instr.base in ("IADD3", "LEA") and rest[0].startswith("P"))):
        written += names(rest[0], 1)
        rest = rest[1:]
    return written, reads + [r for op in rest for r in names(op, width)]


def replay_cycles(instrs: list[Instr], iterations: int = 1, global_load: float = LATENCY["HBM"]) -> float:
    """Cycles one warp takes to issue `instrs` in order (module doc); with iterations > 1, the
    steady-state cycles of one more iteration of a loop body. With the instructions' scheduling
    bits (sass.Control, as the hardware runs one warp): each issues `stall` cycles after the
    previous one, or later when it waits on a scoreboard barrier, which releases when every
    variable-latency result (or source read) on it has landed, so one late load holds up every
    instruction waiting on its barrier. Without them, by register dependencies alone."""
    ends = list(_replay(instrs, iterations, global_load))[len(instrs) - 1::len(instrs) or 1]
    return ends[-1] - ends[-2] if iterations > 1 else ends[-1] if ends else 0.0


def replay_steps(instrs: list[Instr], global_load: float = LATENCY["HBM"]) -> list[float]:
    """What each instruction adds to replay_cycles(instrs), in order (their sum is it): the
    cycles from the previous instruction's point in the replay to its own."""
    points = list(_replay(instrs, 1, global_load))
    return [b - a for a, b in zip([0.0] + points, points)]


def _replay(instrs: list[Instr], iterations: int, global_load: float):
    """replay_cycles' point after each instruction, over `iterations` passes of instrs."""
    if instrs and all(i.control is not None for i in instrs):
        yield from _replay_scoreboards(instrs, iterations, global_load)
        return
    ready: dict[str, float] = {}
    t = 0.0
    decoded = [(_registers(i), instruction_latency(i, global_load)) for i in instrs]
    for _ in range(iterations):
        for (written, read), latency in decoded:
            t = max([t + 1] + [ready.get(r, 0.0) for r in read])
            for r in written:
                ready[r] = t + latency
            yield t


def _replay_scoreboards(instrs: list[Instr], iterations: int, global_load: float):
    released = [0.0] * 6  # when each barrier's pending results have all landed
    t = 0.0  # the earliest cycle the next instruction may issue
    decoded = [(i.control, instruction_latency(i, global_load)) for i in instrs]
    for _ in range(iterations):
        for c, latency in decoded:
            issue = max([t] + [released[b] for b in range(6) if c.wait >> b & 1])
            if c.write < 6:
                released[c.write] = max(released[c.write], issue + latency)
            if c.read < 6:
                released[c.read] = max(released[c.read], issue + LATENCY["operand_read"])
            t = issue + max(c.stall, 1)
            yield t


def resident_programs(registers: int, shared: int, num_warps: int) -> dict:
    """Programs (blocks) resident per SM and what limits them."""
    warp_registers = math.ceil(max(registers, 1) / 8) * 8 * 32
    warp_registers = math.ceil(warp_registers / 256) * 256
    limits = {
        "registers": REGISTERS_PER_SM // (warp_registers * num_warps),
        "shared": SHARED_BYTES_PER_SM // (shared + SHARED_RESERVED_PER_BLOCK) if shared else BLOCKS_PER_SM,
        "warps": WARPS_PER_SM // num_warps,
        "blocks": BLOCKS_PER_SM,
    }
    limiter = min(limits, key=limits.get)
    return {"programs": limits[limiter], "limited_by": limiter, **{f"by_{k}": v for k, v in limits.items()}}


@dataclass
class LoopReport:
    """One SASS loop: its instructions per iteration and how often it runs."""

    start: int
    depth: int
    instructions: int
    issue_slots_per_iteration: float
    cycles_per_iteration: float  # one warp alone, in order (replay_cycles)
    iterations_per_program: float | None  # None: no source line of the loop was counted
    lines: list[str]  # its most frequent source lines, package/file.py:line


@dataclass
class KernelModel:
    """Every modelled figure of one launch (times in milliseconds)."""

    programs: int
    num_warps: int
    occupancy: dict
    waves: int
    bytes: float  # requested
    unique_bytes: float
    hbm_bytes: float
    reread_far_bytes: float
    l2_hit: float
    dot_flops: float
    warp_instructions: float
    issue_slots: float
    busiest_scheduler_warps: int
    global_load_cycles: float
    latency_cycles_per_program: float
    hbm_ms: float
    l2_ms: float
    memory_ms: float  # max(hbm_ms, l2_ms)
    tensor_ms: float
    issue_ms: float
    latency_ms: float
    time_ms: float
    bound: str
    loops: list[LoopReport]

    def record(self) -> dict:
        return asdict(self)


def _line_count(instr: Instr, lines: dict[str, float]) -> float | None:
    """How many times the instruction's source line ran, by its chain of call sites; a helper the
    interpreter does not trace (its chain is longer than the counted ones) counts as its caller,
    and a chain that the compiler recorded without its call sites (the pipelined prologue of a
    tl.range loop in a helper) as the counted chains that start with it (the largest)."""
    chain = instr.where.split("<")
    for start in range(len(chain)):
        count = lines.get("<".join(chain[start:]))
        if count:
            return count
    prefix = instr.where + "<"
    return max((count for key, count in lines.items() if key.startswith(prefix)), default=None)


@functools.lru_cache(maxsize=None)
def _tree(path: str) -> ast.Module:
    """A source file's syntax tree; an empty one where it cannot be read or parsed."""
    try:
        return ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return ast.Module(body=[], type_ignores=[])


def _counted_files(lines: dict[str, float]) -> set[str]:
    """The source files whose lines were counted (any site of any counted chain)."""
    return {site.rsplit(":", 1)[0] for key in lines for site in key.split("<")}


@functools.lru_cache(maxsize=None)
def _signature_lines(path: str) -> frozenset[int]:
    """The lines of a source file's function headers (decorators and signatures): code placed
    there (argument set-up) runs in every program, but the interpreter reports no line of it."""
    lines = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.FunctionDef) and node.body:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines.update(range(first, node.body[0].lineno))
    return frozenset(lines)


@functools.lru_cache(maxsize=None)
def _loops_of(path: str) -> tuple[tuple[int, int, int], ...]:
    """A source file's `for` statements: (header line, first and last body line). (A `while`
    loop's header is its work: a flag's spin loop polls there once when its body never runs.)"""
    return tuple((node.lineno, node.body[0].lineno, node.end_lineno) for node in ast.walk(_tree(path))
                 if isinstance(node, ast.For))


def _ran_suffixes(lines: dict[str, float]) -> frozenset[str]:
    """Every call-site chain that ran: each counted key and each of its tails (a line's callers)."""
    ran = set()
    for key, count in lines.items():
        if count:
            chain = key.split("<")
            ran.update("<".join(chain[i:]) for i in range(len(chain)))
    return frozenset(ran)


def _on_for_line(where: str) -> bool:
    path, line = local_source(where.split("<")[0])
    return any(header == line for header, _, _ in _loops_of(path))


def _in_unentered_loop(where: str, lines: dict[str, float], ran: frozenset[str]) -> bool:
    """Whether an instruction (its chain of call sites, sass.Instr.where) sits in the body of a loop
    whose `for` line ran, at that chain's call sites, while no line of its body did (every trip count
    0). _line_count cannot tell: it counts an uncounted line as its caller, which ran."""
    chain = where.split("<")
    for i, key in enumerate(chain):
        path, line = local_source(key)
        rest = "".join("<" + k for k in chain[i + 1:])
        for header, first, last in _loops_of(path):
            if first <= line <= last and lines.get(f"{key.rsplit(':', 1)[0]}:{header}{rest}") \
                    and not any(f"{key.rsplit(':', 1)[0]}:{n}{rest}" in ran for n in range(first, last + 1)):
                return True
    return False


@functools.lru_cache(maxsize=None)
def _runtime_branch_lines(path: str) -> frozenset[int]:
    """The lines of a source file whose innermost enclosing `if` is decided at run time: its test
    reads a local or an argument not declared tl.constexpr, or calls a function. A test of
    constexpr arguments and module globals (INTERPRETED, a dtype) is decided at compile time: its
    branch is compiled whole or not at all, and the compiler may name its lines for code outside it
    (a load the other arm shares)."""
    arms = []  # (first line, last line, decided at run time)
    for fn in ast.walk(_tree(path)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        constexpr = {a.arg for a in args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
        local = {a.arg for a in args} - constexpr
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(fn):
            if isinstance(node, ast.If):
                runtime = any(isinstance(n, ast.Call) or (isinstance(n, ast.Name) and n.id in local)
                              for n in ast.walk(node.test))
                arms += [(arm[0].lineno, arm[-1].end_lineno, runtime) for arm in (node.body, node.orelse) if arm]
    lines = set()
    for line in {n for first, last, _ in arms for n in range(first, last + 1)}:
        if min((arm for arm in arms if arm[0] <= line <= arm[1]), key=lambda arm: arm[1] - arm[0])[2]:
            lines.add(line)
    return frozenset(lines)


def _in_untaken_branch(where: str, files: set[str], ran: frozenset[str]) -> bool:
    """Whether a line of an instruction's chain of call sites lies in a run-time branch (its
    innermost) and never ran at that chain's call sites (nor, for a chain the compiler recorded
    without its call sites, at any), in a file whose lines were counted (not one the interpreter
    runs natively, as Triton's reductions). _line_count cannot tell: it counts an uncounted line
    of a helper as the helper's call site, which ran."""
    chain = where.split("<")
    for i, key in enumerate(chain):
        path, line = local_source(key)
        if key.rsplit(":", 1)[0] in files and line in _runtime_branch_lines(path):
            tail = "<".join(chain[i:])
            if tail not in ran and not any(k.startswith(tail + "<") for k in ran):
                return True
    return False


def _straight_share(instr: Instr, reached: dict[str, float], programs: int,
                    ran: frozenset[str] | None = None, skippable: bool = False) -> float:
    """The fraction of programs that run a straight-line instruction: the programs that ran its
    source line (triton_static.counts "reached") / programs, 0 where no program ran it (a branch not
    taken, a loop body never entered); 1 where there is nothing to go by (no counts, no source line,
    or a function header, whose lines the interpreter does not report). ran: _ran_suffixes(reached),
    computed once a kernel. skippable: some path through the kernel passes the instruction by
    (sass.Code.skippable): then code that an inlined helper's untaken run-time branch holds counts
    0 (a predicated instruction that every path issues counts as its line)."""
    if not reached or not instr.chain:
        return 1.0
    ran = _ran_suffixes(reached) if ran is None else ran
    if _in_unentered_loop(instr.where, reached, ran):
        return 0.0
    if skippable and _in_untaken_branch(instr.where, _counted_files(reached), ran):
        return 0.0
    count = _line_count(instr, reached)
    if count is None:
        path, line = local_source(instr.where.split("<")[-1])
        return 1.0 if line in _signature_lines(path) else 0.0
    return min(count / max(programs, 1), 1.0)


def straight_shares(code: Code, reached: dict[str, float], programs: int) -> list[float]:
    """_straight_share of each of the code's straight-line instructions (Code.straight's order)."""
    ran = _ran_suffixes(reached)
    return [_straight_share(i, reached, programs, ran, i.address in code.skippable) for i in code.straight]


@functools.lru_cache(maxsize=None)
def _branch_lines_in_loops(path: str) -> frozenset[int]:
    """The lines of a source file inside an `if` statement's branches within a loop's body: code
    that an iteration may skip (a constexpr `if` compiles to all or nothing, and counts so)."""
    lines = set()
    for loop in ast.walk(_tree(path)):
        if isinstance(loop, (ast.For, ast.While)):
            for node in ast.walk(loop):
                if isinstance(node, ast.If):
                    for stmt in node.body + node.orelse:
                        lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return frozenset(lines)


def _loop_shares(loop: Loop, lines: dict[str, float], executions: float | None) -> list[float]:
    """The fraction of a loop's iterations that issue each of its instructions: 1, but for code in
    a branch inside a loop's body in the source, its line's count / the loop's executions (at most
    1). A predicated instruction counts 1: the compiler may have turned a short branch into
    predicated code, which issues whether or not its condition holds; but not where the SASS
    jumps over it (Loop.jumped), and 0 there where its branch, or the call of a helper there, never
    ran (_line_count would count that helper's lines as a caller further out, which ran)."""
    ran = _ran_suffixes(lines)
    files = _counted_files(lines)
    shares = []
    for instr in loop.instrs:
        share = 1.0
        chain = instr.where.split("<")
        in_branch = [i for i, key in enumerate(chain)
                     if local_source(key)[1] in _branch_lines_in_loops(local_source(key)[0])]
        jumped = any(a <= instr.address < b for a, b in loop.jumped)
        if executions and in_branch and jumped and any(
                chain[i].rsplit(":", 1)[0] in files and "<".join(chain[i:]) not in ran for i in in_branch):
            share = 0.0
        elif executions and instr.chain and (jumped or not instr.predicate) and in_branch:
            count = _line_count(instr, lines)
            share = 1.0 if count is None else min(count / executions, 1.0)
        shares.append(share)
    return shares


def _fors_around(where: str) -> set[tuple[str, int, int]]:
    """The `for` statements (file, header line, last line) whose header or body holds a line of an
    instruction's chain of call sites."""
    fors = set()
    for key in where.split("<"):
        path, line = local_source(key)
        fors.update((path, header, last) for header, _, last in _loops_of(path) if header <= line <= last)
    return fors


def _own_instrs(loop: Loop) -> list[Instr]:
    """The loop's instructions from the source `for` that most of them come from (the innermost
    where several hold as many): lines outside it that the compiler placed in the loop's address
    range (code after a branch that skips the loop) would otherwise lend it their counts. All of
    them where no `for` holds at least half (a `while` loop, code without source lines)."""
    chained = [i for i in loop.instrs if i.chain]
    around = [_fors_around(i.where) for i in chained]
    votes = Counter(f for fors in around for f in fors)
    if not votes or 2 * max(votes.values()) < len(chained):
        return loop.instrs
    home = max(votes, key=lambda f: (votes[f], f[1] - f[2]))  # most votes, then the shortest span
    return [i for i, fors in zip(chained, around) if home in fors]


def _executions(loop: Loop, lines: dict[str, float]) -> tuple[float | None, list[str]]:
    """How many times the loop body ran over the whole grid: the median, over the instructions of
    its source loop (_own_instrs), of how many times each one's source line ran (prologue copies do
    not move a median); 0 for a loop no line of which ran, nor any of its call sites, in a file
    whose lines were counted (a loop of inlined helpers whose
    call site never ran, see _straight_share, or one in a branch no program took; a binary whose
    lines name another copy of the source, which Triton's cache may hand out, stays uncounted),
    for one whose body never ran (_in_unentered_loop), and for one in a helper's run-time branch
    that never ran at its call site (_in_untaken_branch: _line_count lends its lines the call
    site's count)."""
    own = _own_instrs(loop)
    counted = sorted(c for c in (_line_count(i, lines) for i in own if i.chain) if c)
    files = _counted_files(lines)
    if not counted and any(i.chain and all(site.rsplit(":", 1)[0] in files for site in i.where.split("<"))
                           for i in own):
        return 0.0, []  # no program reached it
    ran = _ran_suffixes(lines)
    chained = [i for i in own if i.chain]
    if lines and chained and all(_in_untaken_branch(i.where, files, ran) for i in chained):
        return 0.0, []  # in a helper's run-time branch that never ran at its call site
    # A pipelined loop's instructions may carry no call sites (its line counts then lend it the
    # count of whichever copy of the helper ran): one whose instructions that do carry them all
    # lie in a run-time branch that never ran is that branch's copy.
    sited = [i for i in chained if "<" in i.where]
    if lines and sited and all(_in_untaken_branch(i.where, files, ran) for i in sited):
        return 0.0, []
    body = [i for i in own if i.chain and not _on_for_line(i.where)]
    if lines and body and all(_in_unentered_loop(i.where, lines, ran) for i in body):
        return 0.0, []  # its body never ran
    keys = {}
    for i in loop.instrs:
        if i.source:
            key = i.where.split("<")[0]
            keys[key] = keys.get(key, 0) + 1
    top = [k for k, _ in sorted(keys.items(), key=lambda kv: -kv[1])[:4]]
    if not counted:
        return None, top
    return counted[len(counted) // 2], top


def model_kernel(code: Code, grid: tuple[int, int, int], num_warps: int, mma_form: str, counts: dict,
                 mixed: bool = False) -> KernelModel:
    """The model of one launch from its compiled code, grid and (extrapolated) counts; mixed: its
    programs are of several kinds (module doc)."""
    programs = grid[0] * grid[1] * grid[2]
    occupancy = resident_programs(code.registers, code.shared, num_warps)
    per_wave = max(occupancy["programs"], 1) * SMS
    waves = math.ceil(programs / per_wave) if programs else 0

    memory = traffic(counts.get("storages", {}), programs)
    miss = memory.hbm / memory.requested if memory.requested else 1.0
    global_load = LATENCY["L2"] + miss * (LATENCY["HBM"] - LATENCY["L2"])

    lines = counts.get("lines", {})
    straight = code.straight
    reached = counts.get("reached", {})
    shares = straight_shares(code, reached, programs)
    slots = issue_slots(straight, shares) * programs
    instructions = sum(shares) * programs
    # One program's dependent time follows the straight-line path most programs take, or a mixed
    # kernel's average program's.
    if mixed:
        latency = sum(share * step for share, step in zip(shares, replay_steps(straight, global_load)))
    else:
        latency = replay_cycles([i for i, share in zip(straight, shares) if share >= 0.5], global_load=global_load)
    loops = []
    for loop in [lp for lp in code.loops if lp.instrs and lp.end > lp.start]:
        executions, top = _executions(loop, lines)
        loop_shares = _loop_shares(loop, lines, executions)
        per_iteration = replay_cycles([i for i, share in zip(loop.instrs, loop_shares) if share >= 0.5],
                                      iterations=3, global_load=global_load)
        slots_it = issue_slots(loop.instrs, loop_shares)
        runs = executions if executions is not None else programs  # uncounted: once per program
        slots += slots_it * runs
        instructions += sum(loop_shares) * runs
        latency += per_iteration * runs / max(programs, 1)
        loops.append(LoopReport(loop.start, loop.depth, len(loop.instrs), slots_it, per_iteration,
                                None if executions is None else executions / max(programs, 1), top))
    slots *= num_warps
    instructions *= num_warps

    flops = counts.get("dot_flops", 0.0)
    busiest = math.ceil(math.ceil(programs / SMS) * num_warps / SCHEDULERS_PER_SM)
    per_warp = slots / (programs * num_warps) if programs else 0.0
    terms = {
        "memory": memory.memory_ms,
        "tensor": flops / TENSOR_FLOPS[mma_form] * 1e3,
        "issue": busiest * per_warp / CLOCK_HZ * 1e3,
        "latency": (programs / per_wave if mixed else waves) * latency / CLOCK_HZ * 1e3,
    }
    bound = max(terms, key=terms.get)
    return KernelModel(
        programs=programs, num_warps=num_warps, occupancy=occupancy, waves=waves, bytes=memory.requested,
        unique_bytes=memory.unique, hbm_bytes=memory.hbm, reread_far_bytes=memory.reread_far,
        l2_hit=memory.l2_hit, dot_flops=flops, warp_instructions=instructions, issue_slots=slots,
        busiest_scheduler_warps=busiest, global_load_cycles=global_load, latency_cycles_per_program=latency,
        hbm_ms=memory.hbm_ms, l2_ms=memory.l2_ms, memory_ms=terms["memory"], tensor_ms=terms["tensor"],
        issue_ms=terms["issue"], latency_ms=terms["latency"], time_ms=terms[bound], bound=bound, loops=loops)
