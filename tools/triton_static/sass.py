"""What a compiled kernel is made of: resources (registers, spills, shared memory), its SASS, the
MMA form, the instruction mix, and its loops.

Tools are the ones Triton's wheel ships (triton/backends/nvidia/bin): `ptxas -v` on the PTX for
registers and spills (the ptxas and flags Triton uses for the target), `cuobjdump -res-usage` on
the cubin for the registers of the binary itself, and `nvdisasm -c -gi` on the cubin for the SASS
with source lines and inlining call sites (Triton assembles with -lineinfo).

Loops are found by backward branches: a `BRA` whose target label sits at or before it closes a
loop spanning [target, branch]. Each instruction belongs to the innermost loop that spans it;
a loop's instructions are those of its body that do not belong to a loop nested inside it.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from triton import knobs
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas

from .launches import TARGET


@dataclass(frozen=True)
class Control:
    """The scheduling bits ptxas encodes in each instruction (the top 23 bits of its 128-bit
    word, sm_70 on): cycles to wait before the warp's next instruction issues (`stall`), the
    scoreboard barrier (0-5) the instruction's result releases when it is written (`write`) or
    its source registers when they have been read (`read`; 7: none), and the barriers it waits on
    before it issues (`wait`, a 6-bit mask). Variable-latency results (global and shared memory,
    MUFU, shuffles) are waited for only through these barriers; fixed-latency ones through
    `stall`."""

    stall: int
    write: int
    read: int
    wait: int

    @classmethod
    def decode(cls, high: int) -> "Control":
        bits = high >> 41
        return cls(stall=bits & 0xF, write=(bits >> 5) & 7, read=(bits >> 8) & 7, wait=(bits >> 11) & 0x3F)


@dataclass
class Instr:
    address: int
    predicate: str
    opcode: str  # with modifiers, e.g. LDG.E.128
    operands: list[str]
    chain: tuple[tuple[str, int], ...]  # source (file, line), then each inlined call's call site
    control: Control | None = None  # None where the encoding was not read

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def source(self) -> tuple[str, int] | None:
        return self.chain[0] if self.chain else None

    @property
    def where(self) -> str:
        """'file:line<caller file:line<...', the key triton_static.counts counts lines by (source_key)."""
        return "<".join(source_key(file, line) for file, line in self.chain)


@lru_cache(maxsize=None)
def _package_root(name: str) -> str | None:
    """The folder holding importable top-level package `name` (one with an __init__.py), or None.
    A namespace package does not count: any folder on sys.path is one (the working folder's
    `tools`, say), so which name a path starts from would depend on where Python runs."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "namespace"):
        return None
    locations = list(spec.submodule_search_locations or [])
    return os.path.dirname(locations[0]) if locations else None


@lru_cache(maxsize=None)
def package_path(path: str) -> str:
    """A source file's path from its top-level package down ('mypackage/ops/kernel.py'),
    the same whichever checkout or install it came from: a cubin from Triton's cache keeps the
    path of the checkout that first compiled it, which may be gone (the source, and so the lines,
    are the same: the cache key holds both). The first folder of the path that names a package
    importable here, with the rest of the path inside it, starts it; else the path itself."""
    parts = path.split(os.sep)
    for i, part in enumerate(parts[:-1]):
        root = _package_root(part) if part.isidentifier() else None
        if root and os.path.exists(os.path.join(root, *parts[i:])):
            return os.path.join(*parts[i:])
    return path


def source_key(path: str, line: int) -> str:
    return f"{package_path(path)}:{line}"


def local_source(key: str) -> tuple[str, int]:
    """(path in this interpreter's import of the package, line) of a 'package/file.py:line' key."""
    path, _, line = key.rpartition(":")
    root = _package_root(path.split(os.sep)[0])
    return (os.path.join(root, path) if root else path), int(line)


@dataclass
class Loop:
    start: int  # address of the first instruction (the branch target)
    end: int  # address of the backward branch
    depth: int = 0  # 0 for an outermost loop
    instrs: list[Instr] = field(default_factory=list)  # its own, nested loops' excluded
    # [from, to) address ranges that a conditional forward branch in the loop jumps over: code
    # in them runs only in the iterations that take that path
    jumped: list[tuple[int, int]] = field(default_factory=list)

    def contains(self, address: int) -> bool:
        return self.start <= address <= self.end


@dataclass
class Code:
    """The compiled kernel, read back."""

    registers: int  # from the cubin
    ptxas_registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int  # bytes of shared memory the launch allocates (Triton's metadata)
    instrs: list[Instr]
    loops: list[Loop]
    # addresses of the instructions that some path from the entry to an EXIT does not pass (skippable)
    skippable: frozenset[int] = frozenset()

    @property
    def straight(self) -> list[Instr]:
        """Instructions outside every loop."""
        inside = {i.address for loop in self.loops for i in loop.instrs}
        return [i for i in self.instrs if i.address not in inside]

    @property
    def innermost(self) -> list[Loop]:
        nested = {id(outer) for outer in self.loops for inner in self.loops
                  if inner is not outer and outer.start <= inner.start and inner.end <= outer.end}
        return [loop for loop in self.loops if id(loop) not in nested]

    @property
    def hot_loop(self) -> Loop | None:
        """The innermost loop with the most instructions (the one the model weighs most is
        chosen by the model, from execution counts; this is what the SASS alone says)."""
        loops = self.innermost
        return max(loops, key=lambda loop: len(loop.instrs)) if loops else None

    @property
    def mma_form(self) -> str:
        bases = {i.base for i in self.instrs}
        if "HGMMA" in bases:
            return "wgmma"
        if "HMMA" in bases:
            return "mma.sync"
        return "none"


def _tool(name: str) -> str:
    return getattr(knobs.nvidia, name).path


def _run(cmd: list[str], data: bytes | str, suffix: str) -> str:
    mode = "wb" if isinstance(data, bytes) else "w"
    with tempfile.NamedTemporaryFile(mode, suffix=suffix, delete=False) as f:
        f.write(data)
        path = f.name
    try:
        proc = subprocess.run(cmd + [path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if proc.returncode:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed: {proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def ptxas_usage(ptx: str, enable_fp_fusion: bool = True) -> dict[str, int]:
    """Registers, stack frame and spill bytes of a PTX kernel from `ptxas -v`, run as Triton runs
    it for the target (its ptxas, -lineinfo, --fmad=false when fp fusion is off, and the register
    allocation level newer Tritons pass)."""
    cmd = [get_ptxas(TARGET.arch).path, "-lineinfo", "-v", f"--gpu-name=sm_{TARGET.arch}a"]
    if not enable_fp_fusion:
        cmd.append("--fmad=false")
    if "--regAllocOptLevel=2" in inspect.getsource(CUDABackend.make_cubin):
        cmd.append("--regAllocOptLevel=2")
    report = _run(cmd + ["-o", os.devnull], ptx, ".ptx")

    def number(pattern):
        return int(re.search(pattern, report).group(1))

    return dict(registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))


def cubin_registers(cubin: bytes) -> int:
    """Registers per thread of the binary, from `cuobjdump -res-usage`."""
    return int(re.search(r"REG:(\d+)", _run([_tool("cuobjdump"), "-res-usage"], cubin, ".cubin")).group(1))


_LINE = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)'
                   r'(?: inlined at "(?P<at_file>[^"]+)", line (?P<at_line>\d+))?')
_INSTR = re.compile(r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<pred>@!?U?P\w+\s+)?"
                    r"(?P<op>[A-Z][A-Z0-9_.]*)\s*(?P<rest>[^;]*);")
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_TARGET = re.compile(r"`\((?P<label>\.L_x_\d+)\)")
_HIGH_WORD = re.compile(r"^/\* (?P<word>0x[0-9a-f]{16}) \*/$")  # an instruction's second line under -hex


def disassemble(cubin: bytes) -> tuple[list[Instr], dict[str, int]]:
    """(instructions, {label: address}) of the cubin's one kernel, from `nvdisasm -c -gi -hex`:
    each instruction with its source line, the chain of call sites it was inlined at (nvdisasm
    prints the chain innermost first, one `//##` line per level, before the instruction) and its
    scheduling bits (Control, from the high word of its encoding, printed on the next line)."""
    text = _run([_tool("nvdisasm"), "-c", "-gi", "-hex"], cubin, ".cubin")
    instrs, labels, pending, chain, in_chain = [], [], [], (), False
    for raw in text.splitlines():
        line = raw.strip()
        if m := _LINE.search(line):
            if not in_chain:
                chain = ((m["file"], int(m["line"])),)
            if m["at_file"]:
                chain += ((m["at_file"], int(m["at_line"])),)
            in_chain = True
            continue
        in_chain = False
        if (m := _HIGH_WORD.match(line)) and instrs and instrs[-1].control is None:
            instrs[-1].control = Control.decode(int(m["word"], 16))
        elif m := _LABEL.match(line):
            pending.append(m["label"])
        elif m := _INSTR.search(line):
            address = int(m["addr"], 16)
            labels += [(label, address) for label in pending]
            pending = []
            operands = [op.strip() for op in m["rest"].split(",") if op.strip()]
            instrs.append(Instr(address, (m["pred"] or "").strip(), m["op"], operands, chain))
    end = instrs[-1].address + 16 if instrs else 0
    return instrs, {**{label: end for label in pending}, **dict(labels)}


def find_loops(instrs: list[Instr], labels: dict[str, int]) -> list[Loop]:
    loops = []
    for i in instrs:
        if i.base != "BRA":
            continue
        m = _TARGET.search(" ".join(i.operands))
        if m and labels.get(m["label"], i.address + 1) <= i.address:
            loops.append(Loop(labels[m["label"]], i.address))
    # one loop per range (two branches back to one label form one loop)
    loops = list({(loop.start, loop.end): loop for loop in loops}.values())
    loops.sort(key=lambda loop: (loop.start, -loop.end))
    for loop in loops:
        loop.depth = sum(1 for other in loops if other is not loop and other.start <= loop.start
                         and loop.end <= other.end)
    for i in instrs:
        spans = [loop for loop in loops if loop.contains(i.address)]
        if spans:
            loop = min(spans, key=lambda loop: loop.end - loop.start)
            loop.instrs.append(i)
            m = _TARGET.search(" ".join(i.operands)) if i.base == "BRA" and i.predicate else None
            if m and i.address < labels.get(m["label"], 0) <= loop.end:
                loop.jumped.append((i.address + 1, labels[m["label"]]))
    return loops


def skippable(instrs: list[Instr], labels: dict[str, int]) -> frozenset[int]:
    """Addresses of the instructions that some path from the kernel's entry to an EXIT does not
    pass through: a branch's arms, code a branch jumps over, a loop that may run no iteration.
    By basic block: a block is skippable where an EXIT stays reachable from the entry without it.
    Code reached only by a CALL (a subroutine) is left out; nothing is, where an indirect branch
    leaves the graph unknown."""
    if any(i.base in ("BRX", "JMX") for i in instrs):
        return frozenset()
    index = {i.address: k for k, i in enumerate(instrs)}
    always = lambda i: i.predicate in ("", "@PT")  # noqa: E731
    target = {}
    for k, i in enumerate(instrs):
        m = _TARGET.search(" ".join(i.operands)) if i.base == "BRA" and i.predicate != "@!PT" else None
        if m and labels.get(m["label"]) in index:
            target[k] = index[labels[m["label"]]]
    ends = {k for k, i in enumerate(instrs) if i.base in ("BRA", "EXIT", "RET")}
    leaders = sorted({0, *target.values(), *(k + 1 for k in ends if k + 1 < len(instrs))})
    block_of = {start: b for b, start in enumerate(leaders)}
    bounds = list(zip(leaders, leaders[1:] + [len(instrs)]))
    succ, exits = [], set()
    for b, (start, stop) in enumerate(bounds):
        last, nxt = instrs[stop - 1], [block_of[stop]] if stop < len(instrs) else []
        if last.base in ("EXIT", "RET"):
            exits.add(b)
            succ.append([] if always(last) else nxt)
        elif stop - 1 in target:
            succ.append([block_of[target[stop - 1]]] + ([] if always(last) else nxt))
        else:
            succ.append(nxt)

    def reach(avoid: int | None) -> set[int]:
        seen, todo = set(), [0] if avoid != 0 else []
        while todo:
            b = todo.pop()
            if b not in seen:
                seen.add(b)
                todo += [s for s in succ[b] if s != avoid]
        return seen

    reachable = reach(None) if instrs else set()
    skipped = [b for b in reachable if b and exits & reach(b)]
    return frozenset(instrs[k].address for b in skipped for k in range(*bounds[b]))


@lru_cache(maxsize=None)
def _read(cubin: bytes, ptx: str, shared: int, enable_fp_fusion: bool) -> Code:
    usage = ptxas_usage(ptx, enable_fp_fusion)
    instrs, labels = disassemble(cubin)
    return Code(registers=cubin_registers(cubin), ptxas_registers=usage["registers"],
                spill_stores=usage["spill_stores"], spill_loads=usage["spill_loads"], stack=usage["stack"],
                shared=shared, instrs=instrs, loops=find_loops(instrs, labels), skippable=skippable(instrs, labels))


def read(kernel) -> Code:
    """Code of a CompiledKernel (cached per binary)."""
    fusion = getattr(kernel.metadata, "enable_fp_fusion", True)
    return _read(kernel.asm["cubin"], kernel.asm["ptx"], kernel.metadata.shared, fusion)


# Instruction classes of the mix, by opcode prefix (global loads are split by width below).
MIX_CLASSES = {
    "LDGSTS": "cp.async", "LDG": "global load", "STG": "global store", "LDS": "shared load",
    "LDSM": "shared load", "STS": "shared store", "HGMMA": "wgmma", "HMMA": "mma.sync", "MUFU": "MUFU",
    "SHFL": "SHFL", "BAR": "BAR", "FFMA": "fp32", "FADD": "fp32", "FMUL": "fp32", "FMNMX": "fp32",
    "FSETP": "fp32", "FSEL": "fp32", "RED": "atomic", "ATOM": "atomic", "ATOMG": "atomic",
}


def load_width(instr: Instr) -> int:
    """Bits per thread of a global load/store: from the .64/.128 modifier, 16 for .U16/.S16,
    8 for .U8/.S8, else 32."""
    mods = instr.opcode.split(".")[1:]
    for mod, bits in (("128", 128), ("64", 64), ("U16", 16), ("S16", 16), ("U8", 8), ("S8", 8)):
        if mod in mods:
            return bits
    return 32


def mix(instrs: list[Instr]) -> dict[str, int]:
    """Counts per class; global loads also per width ('LDG.128' ...), plus the total."""
    counts = Counter()
    for i in instrs:
        counts["total"] += 1
        name = MIX_CLASSES.get(i.base) or MIX_CLASSES.get(i.base.rstrip("0123456789"))
        if name:
            counts[name] += 1
        if i.base in ("LDG", "STG", "LDGSTS"):
            counts[f"{i.base}.{load_width(i)}"] += 1
    return dict(counts)
