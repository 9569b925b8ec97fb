"""Every kernel variant the public functions launch compiles for a Hopper GPU (sm_90a), bound as a
real launch binds it, and keeps its tiles in registers.

The interpreter tests check what the kernels compute; this checks that Triton's real compiler
(down to a cubin, through ptxas) accepts them, which the interpreter never exercises, and that
no variant spills or computes a scan or reduction twice (see compile_for_gpu.py)."""
import os
import subprocess
import sys

from bench.common import REPO_ROOT


MATMUL_STAGES = ("_chunk_cb_kernel", "_chunk_state_kernel", "_chunk_output_kernel", "_nonfinite_output_kernel",
                 "_fused_pass_kernel")


def _tile_rows(line: str) -> int:
    """The rows of a matmul stage's tile, from its printed constexprs: headdim rows (BLOCK_P) for the
    chunk state, chunk rows (BLOCK_M) for C B^T and the output."""
    flags = dict(item.split("=") for item in line[line.index("(") + 1:line.rindex(")")].split(", "))
    return int(flags["BLOCK_P" if line.split()[1] == "_chunk_state_kernel:" else "BLOCK_M"])


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default today, stated so newer Triton does not warn
    run = subprocess.run([sys.executable, "-m", "bench.tests.compile_for_gpu"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1].split()[1:4] == ["kernel", "variants", "compiled"], lines[-1]
    assert lines[-1].endswith("0 differ from the cubin's registers; 0 spill more than 64 B; "
                              "0 compute a scan or reduction twice"), lines[-1]
    kernels = {line.split()[1].rstrip(":") for line in lines if line.startswith("ok ")}
    # the chunked Mamba-2 matmul stages on 16-bit operands (bfloat16, or float16 for C B^T) at a full
    # 256-token chunk, in tiles of at least 64 rows (a warpgroup's): Hopper's wgmma
    matmuls = [line for line in lines if line.split()[1].rstrip(":") in MATMUL_STAGES and "CHUNK=256" in line
               and ("DOT_DTYPE=bf16" in line or "DOT_DTYPE=fp16" in line) and _tile_rows(line) >= 64]
    assert any("CB_DOT_DTYPE=fp16" in line for line in matmuls), "no float16 C B^T compiled"
    assert matmuls and all(", MMA wgmma " in line for line in matmuls), [m for m in matmuls if "wgmma" not in m]
    assert kernels == {"_scan_kernel", "_dt_table_kernel", "_mamba1_chunk_kernel", "_stage_bc_kernel", "_conv_kernel",
                       "_dt_cumsum_kernel", "_chunk_cb_kernel", "_chunk_state_kernel", "_state_passing_kernel",
                       "_chunk_output_kernel", "_nonfinite_output_kernel", "_fused_pass_kernel"}, kernels
