"""The chunked Mamba-2 output kernel with parts taken out (bench.ablate times them on a GPU,
bench.static models them: its "ablation: ..." workloads).

Each VARIANTS entry is the kernel module's source with lines of `_chunk_output_program` replaced
(each edit must match there once), loaded as a module of its own, whose output kernel stands in
for the real one (stage 5 launches it; the other four stages are unchanged). A variant without a
part computes a wrong y: only its cost counts. One puts a part back: the non-finite handling that
the output kernel leaves to its fix-up, as every program ran it before. "unchanged" has no edit:
a copy of the kernel that must give the real one's bits. This module chooses no Triton mode: the
kernel module is imported when a variant is first made, under the importer's choice.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from unittest import mock

KERNEL = "_chunk_output_kernel"
PROGRAM = "_chunk_output_program"
INTER = ("for d0 in range(0, dstate, BLOCK_D):", "for d0 in range(0, 0, BLOCK_D):")
BELOW = ("for k0 in range(0, m0, BLOCK_M):", "for k0 in range(0, 0, BLOCK_M):")
DIAGONAL_EXP = ('exp2_flush(tl.where(causal, b_cs_m[:, None] - b_cs_m[None, :], -float("inf")))',
                "tl.where(causal, 1.0, 0.0)")
# A part put back: the diagonal block's non-finite handling, which only the fix-up's programs run
# (stage5_chunk_output), in every program as before the fix-up: the same y on finite inputs.
NONFINITE = ("        if NONFINITE_X:", "        if True:")
# name: (old, new) edits of _chunk_output_program's source
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "unchanged": [],
    "no inter-chunk term (C S0^T: its loads and matmul)": [INTER],
    "no blocks below the diagonal (their loads, weights and matmuls)": [BELOW],
    "no exp in the diagonal block's weights": [DIAGONAL_EXP],
    "only the diagonal block (all three out)": [INTER, BELOW, DIAGONAL_EXP],
    "with the non-finite handling in every block (as before its fix-up)": [NONFINITE],
}


def variant_source(edits: list[tuple[str, str]]) -> str:
    """The kernel module's source with `edits` applied inside _chunk_output_program, its relative
    imports made absolute (the copy is loaded from elsewhere)."""
    from ssm_kernels.scan.mamba2_chunked import triton_kernel
    source = Path(triton_kernel.__file__).read_text()
    start = source.index(f"def {PROGRAM}(")
    end = source.index("\n@triton.jit", start)
    program = source[start:end]
    for old, new in edits:
        if program.count(old) != 1:
            raise ValueError(f"{PROGRAM} holds {program.count(old)} copies of {old!r}, not one")
        program = program.replace(old, new)
    source = source[:start] + program + source[end:]
    package = triton_kernel.__package__
    return re.sub(r"^from (\.+\w*(?:\.\w+)*) import", lambda m: f"from {importlib.util.resolve_name(m[1], package)} "
                  "import", source, flags=re.M)


# The variant modules' files: named by their source's digest, so that every process (bench.static
# counts in a subprocess of its own) loads a variant from the same path, which the static model keys
# its per-line counts by. Written once, never removed (a few small files in the temp folder).
VARIANTS_DIR = Path(tempfile.gettempdir()) / "ssm-kernels-output-variants"
# Triton keys a kernel's binary by its source and first line, not by its file: the output kernel of
# each copy names the copy's source in a comment before this line, so that Triton's cache never
# hands a copy the binary of another (whose lines name that copy's file: the counts would miss
# them, and the report warns).
NAMED_BEFORE = "    pid_c = tl.program_id(2)\n"


@functools.cache
def variant(name: str):
    """VARIANTS[name] as a module of its own (a file, as Triton reads a kernel's source)."""
    slug = re.sub(r"\W+", "_", name).strip("_")
    source = variant_source(VARIANTS[name])
    if source.count(NAMED_BEFORE) != 1:
        raise ValueError(f"the kernel module holds {source.count(NAMED_BEFORE)} copies of {NAMED_BEFORE!r}, not one")
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    source = source.replace(NAMED_BEFORE, f"    # ablated_{slug}, source {digest(source)}\n{NAMED_BEFORE}")
    path = VARIANTS_DIR / f"ablated_{slug}_{digest(source)}.py"
    if not path.exists():
        VARIANTS_DIR.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(source)
        partial.replace(path)  # atomic: another process never reads a file half written
    spec = importlib.util.spec_from_file_location(f"ablated_{slug}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def ablated(name: str):
    """Within, stage 5 of every chunked Mamba-2 pass launches VARIANTS[name]'s output kernel. The
    recent passes' recorded launches are dropped on the way in and out, as bench.sweep's are."""
    from ssm_kernels.scan.mamba2_chunked import tables, triton_kernel
    kernel = getattr(variant(name), KERNEL)
    tables._recent_tables.cache_clear()
    try:
        with mock.patch.object(triton_kernel, KERNEL, kernel):
            yield
    finally:
        tables._recent_tables.cache_clear()
