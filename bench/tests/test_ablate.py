"""bench.ablate: every variant's edits apply where they are meant to, the unchanged copy gives the
real output kernel's bits, a variant reaches the pass, one built another way gives y to rounding
at its launch configuration, and its GPU bookkeeping (run here under the interpreter, with a
stand-in timer)."""
import json

import pytest
import torch

from bench import ablate, output_variants, sweep
from bench import workloads as wl
from bench.common import Budget
from ssm_kernels.scan.reference import rel_error

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton's tensors


def test_each_edit_applies_once_inside_the_output_program():
    real = output_variants.variant_source([])
    real_program = real[real.index(f"def {output_variants.PROGRAM}("):]
    for name, edits in ablate.VARIANTS.items():
        source = output_variants.variant_source(edits)
        program = source[source.index(f"def {output_variants.PROGRAM}("):]
        for old, new in edits:
            old = output_variants.edited_text(real_program, old)
            kept = old in new  # an insertion keeps its anchor
            assert new in program and (kept or old not in program[:program.index("\n@triton.jit")]), name
        assert "from ssm_kernels._triton import" in source and "from .." not in source
    with pytest.raises(ValueError, match="not one"):
        output_variants.variant_source([("acc", "acc")])  # many copies


def test_the_unchanged_copy_is_bitwise_and_an_ablation_reaches_the_pass(tmp_path):
    assert ablate.main(["--reduced", "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "ablate.json").read_text())["rows"]
    rows = {r["variant"]: r["bitwise"] for r in found}
    assert list(rows) == list(ablate.VARIANTS)
    assert all(rows[name] for name in output_variants.SAME_BITS)  # the copy, and the hints (none run here)
    assert not rows["no inter-chunk term (C S0^T: its loads and matmul)"]
    # the handling the fix-up runs changes no bit of a finite pass's y
    assert rows["with the non-finite handling in every block (as before its fix-up)"]


def test_a_variant_built_another_way_gives_y_to_rounding_at_its_launch_configuration(monkeypatch):
    from ssm_kernels.scan.mamba2_chunked import triton_kernel
    seen, real_workspace = [], triton_kernel.new_workspace

    def spy(p, tables):
        ws = real_workspace(p, tables)
        seen.append(ws.cfg)
        return ws
    monkeypatch.setattr(triton_kernel, "new_workspace", spy)
    inp = wl.mamba2_inputs(wl.REDUCED_SHAPES[0], sweep.REDUCED_NTOKENS, DEVICE)
    real = sweep._scan(inp)
    assert inp["x"].dtype == torch.bfloat16 and output_variants.LAUNCH
    for name in output_variants.LAUNCH:
        seen.clear()
        with ablate.ablated(name):
            got = sweep._scan(inp)
            kernel = triton_kernel._chunk_output_kernel  # what stage 5 launched
        assert kernel.fn.__module__.startswith("ablated_") and kernel.fn.__module__ != "ablated_unchanged"
        assert [(cfg["output"]["maxnreg"], cfg["BLOCK_D"]) for cfg in seen] == [(128, 64)], name
        assert rel_error(got.y, real.y) < 2 ** -8, name  # bfloat16's rounding (its sums may be grouped otherwise)
        assert torch.equal(got.final_states, real.final_states), name  # stages 1 to 4 as they were


def test_the_gpu_measurement_sets_each_variant_beside_the_unchanged_copy():
    def times(call):  # a stand-in for kernel_times: runs the pass, reports the swapped kernel's name
        call()
        from ssm_kernels.scan.mamba2_chunked import triton_kernel
        slow = triton_kernel._chunk_output_kernel.fn.__module__ == "ablated_unchanged"
        return {ablate.KERNEL: 2.0 if slow else 1.0, "_chunk_cb_kernel": 1.0}
    rows, names = [], ["unchanged", "no exp in the diagonal block's weights"]
    sweep.measure_gpu({n: n for n in names}, wl.REDUCED_SHAPES[:1], 300, Budget(None), rows, device=DEVICE,
                      times=times, within=ablate.ablated, outputs=lambda shape, name, got: {"seen": name})
    assert [(r["config"], r["seen"], r["kernels_ms"][ablate.KERNEL]) for r in rows] == [
        ("unchanged", "unchanged", 2.0), (names[1], names[1], 1.0)]


def test_the_suites_summary_lists_each_variant_against_the_unchanged_copy():
    from bench.summary import ablate_line
    rows = [{"shape": "A", "config": "unchanged", "output_vs_unchanged": 1.0},
            {"shape": "A", "config": "no inter-chunk term (C S0^T)", "output_vs_unchanged": 0.7},
            {"shape": "A", "config": "broken", "error": "OutOfResources"}]
    assert ablate_line({"rows": rows}).endswith("A: no inter-chunk term 0.70x")
    rows[1]["modelled_vs_unchanged"] = 0.87
    assert ablate_line({"rows": rows}).endswith("A: no inter-chunk term 0.70x (modelled 0.87x)")
    rows[1]["serial_vs_unchanged"] = 0.84
    assert ablate_line({"rows": rows}).endswith("A: no inter-chunk term 0.70x (modelled 0.87x, serial 0.84x)")


def test_the_modelled_ratios_name_every_variant():
    """The committed static report of the variants (ablate.MODELLED) has a row for each variant
    with an edit: a part taken out faster than the real kernel by the serial estimate and no slower
    by the model's time (the term that bounds the kernel may stay as it was), the part put back
    slower by the serial estimate and no faster by the model's time; the kernel built another way
    at four programs an SM, whatever the model makes of it."""
    for serial in (False, True):
        ratios = ablate.modelled_ratios(serial=serial)
        assert list(ratios) == list(ablate.VARIANTS)
        assert ratios.pop("unchanged") == 1
        put_back = ratios.pop("with the non-finite handling in every block (as before its fix-up)")
        assert put_back > 1 if serial else put_back >= 1
        assert all(ratios.pop(name) > 0 for name in output_variants.LAUNCH)
        assert all(0 < r < 1 if serial else 0 < r <= 1 for r in ratios.values())
