"""The README's Python examples run as written (they share one namespace, top to bottom)."""
import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for block in blocks:
            if "cache.insert(tokens" in block:  # the planner sketch uses caller-owned names
                block = "tokens = list(range(32772)); handle_a, handle_b = object(), object()\n" + block
            exec(compile(block, str(README), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
