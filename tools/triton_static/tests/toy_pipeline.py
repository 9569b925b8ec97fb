"""The toy row sum through the whole tool, as `python -m bench.static` runs a call: recorded and
compiled for sm_90a in a process that does not interpret (compile_launch refuses one that does),
counted in an interpreter subprocess at two sizes, extrapolated and modelled. Run as a script,
it prints what the pipeline test checks, as JSON."""
import json
from pathlib import Path

import torch

import toy_kernels
from triton_static import calls, counts, sass
from triton_static.launches import compile_launch, recording

HERE = Path(__file__).resolve().parent
ROWS, SIZES, SIZE = 8, (256, 512), 1024


def run() -> dict:
    launches = []
    with recording(launches):
        toy_kernels.row_sum(torch.zeros(ROWS, SIZE))
    (launch,) = launches
    code = sass.read(compile_launch(launch))
    (counted,) = counts.count([{"rows": ROWS, "sizes": list(SIZES)}], "toy_kernels:run", cwd=HERE)
    extrapolated = counts.extrapolate(counted, SIZE)
    model = calls.model_call([launch], extrapolated, SIZE, per_token=False)
    try:
        calls.model_call([launch, launch], extrapolated, SIZE, per_token=False)
        launched_twice = None
    except RuntimeError as e:
        launched_twice = str(e)
    divisible = sorted(launch.fn.arg_names[path[0]] for path, attrs in launch.source.attrs.items()
                       if ["tt.divisibility", 16] in [list(a) for a in attrs])
    return {
        "launch": {"kernel": launch.kernel, "grid": list(launch.grid), "config": launch.config,
                   "constexprs": launch.constexprs, "args": launch.args, "divisible": divisible},
        "code": {"registers": code.registers, "ptxas_registers": code.ptxas_registers,
                 "spill_stores": code.spill_stores, "spill_loads": code.spill_loads, "mma_form": code.mma_form,
                 "global_loads": sass.mix(code.instrs)["global load"],
                 "loop_loads": sum(i.base == "LDG" for loop in code.loops for i in loop.instrs)},
        "counted": counted, "extrapolated": extrapolated, "model": model, "launched_twice": launched_twice,
    }


if __name__ == "__main__":
    print(json.dumps(run()))
