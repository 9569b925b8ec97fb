"""bench's tests: the benchmarks, the static cost report, and the cost claims about the kernels
that the static tool (triton_static) checks. Triton runs through its interpreter without a GPU,
chosen before any kernel is imported, as in tests/."""
from bench import use_triton_interpreter

use_triton_interpreter()
