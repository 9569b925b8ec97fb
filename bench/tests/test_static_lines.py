"""python -m bench.static_lines: a kernel's modelled latency per source line, at a tiny layer. Its
parts sum to the model's own replay of the same code, and a kernel the call does not launch is
named with the ones it does."""
import os
import subprocess
import sys

from bench.common import REPO_ROOT as ROOT

LAYER = "mamba2:nheads=4,headdim=16,dstate=32,ngroups=1"


def static_lines(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, "-m", "bench.static_lines", "mamba2_scan chunked", "--layer", LAYER,
                           "--size", "2048", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def parts(out: str) -> dict[str, tuple[float, list[tuple[float, str]]]]:
    """The printed parts: title -> (its total cycles, its rows as (cycles, source text))."""
    found, title = {}, None
    for line in out.splitlines():
        if line.endswith(" cycles") and ": " in line:
            title, total = line.rsplit(": ", 1)
            found[title] = (float(total.split()[0]), [])
        elif title and line.strip() and line.split()[0].isdigit():
            fields = line.split(None, 4)  # cycles, instructions, MUFU, where, the source (may be blank)
            found[title][1].append((float(fields[0]), fields[4] if len(fields) > 4 else ""))
    return found


def test_a_kernel_s_lines_add_up_to_each_part():
    proc = static_lines("--kernel", "_state_passing_kernel", "--top", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = parts(proc.stdout)
    assert "straight-line code, once" in found and len(found) >= 2
    for total, rows in found.values():
        assert rows and abs(sum(c for c, _ in rows) - total) <= len(rows) / 2 + 1  # each printed rounded
        assert [c for c, _ in rows] == sorted((c for c, _ in rows), reverse=True)
    walk = [title for title, (_, rows) in found.items()
            if title.startswith("loop at") and any("tl.store(start_ptr + o_ch" in t for _, t in rows)]
    assert len(walk) == 2  # the walk's loops (the plain walk's, the step table's), each storing chunks' starts


def test_the_command_prints_the_parts_and_names_what_is_launched():
    proc = static_lines("--kernel", "_chunk_output_kernel", "--top", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== _chunk_output_kernel" in proc.stdout and "straight-line code, once" in proc.stdout
    assert "static model, not measured" in proc.stdout
    proc = static_lines("--kernel", "_no_such_kernel")
    assert proc.returncode != 0 and "_chunk_output_kernel" in proc.stderr


def test_per_program_parts_add_up_to_the_report_s_latency():
    """--per-program: the parts as the report's latency term counts one program add up to the
    latency a program the model gives, and the output kernel's source-block loop runs 1.5 times a
    program (row blocks 0..3 of a 256-token chunk have 0..3 blocks below the diagonal)."""
    proc = static_lines("--kernel", "_chunk_output_kernel", "--per-program", "--top", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    latency = next(float(line.split(": ")[1].split()[0]) for line in proc.stdout.splitlines()
                   if line.startswith("the report's latency a program"))
    found = parts(proc.stdout)
    assert "straight-line code, a program" in found
    assert abs(sum(total for total, _ in found.values()) - latency) <= len(found)  # each printed rounded
    loops = [title for title in found if title.startswith("loop at")]
    assert any(title.endswith(", 1.5 iterations a program") for title in loops), loops
