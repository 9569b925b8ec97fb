"""Dependencies go one way, folder by folder: ssm_kernels and planner know nothing of each other,
ssm_serving sits above both, planner imports no torch, and no two subpackages import each other;
bench uses the product and the static tool (triton_static, in tools/); the tool knows nothing of
the product or of bench; the product's tests, examples and vLLM tests import the product (the vLLM
tests also bench's vLLM harness), never the tool. Every top-level folder of Python files is
listed here, so that a new one states what it may import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ssm_kernels", "planner", "ssm_serving")
PRODUCT = {"ssm_kernels", "planner", "ssm_serving", "torch"}
# What the files of each top-level folder may import of the first-party names (and of torch).
ALLOWED = {
    "ssm_kernels": {"ssm_kernels", "torch"},
    "planner": {"planner"},
    "ssm_serving": {"ssm_kernels", "planner", "ssm_serving", "torch"},
    "bench": PRODUCT | {"bench", "triton_static"},
    "tools": {"triton_static", "torch"},
    "tests": PRODUCT,
    "tests_vllm": PRODUCT | {"bench"},
    "examples": PRODUCT,
}
WATCHED = set().union(*ALLOWED.values()) | set(ALLOWED)
# Where a folder's modules are importable from: tools/triton_static installs as triton_static.
IMPORT_ROOT = {"tools": ROOT / "tools"}


def module_name(path: Path) -> str:
    parts = path.relative_to(IMPORT_ROOT.get(path.relative_to(ROOT).parts[0], ROOT)).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
                # `from . import x` imports the submodule x
                names.update(f"{target}.{alias.name}" if not node.module else target for alias in node.names)
            else:
                names.add(node.module)
    return names


def sources(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_every_top_level_folder_of_python_files_is_listed():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
               and p.name not in ("build", "dist") and not p.name.endswith(".egg-info") and any(p.rglob("*.py"))}
    assert folders == set(ALLOWED), f"folders without a rule: {folders - set(ALLOWED)}"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_it_may(folder):
    for path in sources(folder):
        for name in imports(path):
            top = name.split(".")[0]
            if top in WATCHED:
                assert top in ALLOWED[folder], f"{path.relative_to(ROOT)} imports {name}"


def test_no_two_subpackages_import_each_other():
    """Between sibling subpackages of one package (e.g. ssm_kernels.scan and ssm_kernels.conv),
    imports go one way."""
    edges = set()
    for package in (*PACKAGES, "tools"):
        for path in sources(package):
            here = module_name(path).split(".")
            for name in imports(path):
                there = name.split(".")
                if there[0] != here[0] or len(here) < 2 or len(there) < 2:
                    continue
                # the first level where the two modules part
                depth = next((i for i in range(1, min(len(here), len(there))) if here[i] != there[i]), None)
                if depth is not None:
                    edges.add((".".join(here[: depth + 1]), ".".join(there[: depth + 1])))
    cycles = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not cycles, f"subpackages that import each other: {cycles}"
