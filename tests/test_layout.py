"""Dependencies go one way: ssm_kernels and planner know nothing of each other, ssm_serving sits
above both, planner imports no torch, and no two subpackages import each other."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ssm_kernels", "planner", "ssm_serving")
# What each package may import of the others (and of torch).
ALLOWED = {
    "ssm_kernels": {"ssm_kernels", "torch"},
    "planner": {"planner"},
    "ssm_serving": {"ssm_kernels", "planner", "ssm_serving", "torch"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
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


def sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_sits_below_it(package):
    watched = set(PACKAGES) | {"torch"}
    for path in sources(package):
        for name in imports(path):
            top = name.split(".")[0]
            if top in watched:
                assert top in ALLOWED[package], f"{path.relative_to(ROOT)} imports {name}"


def test_no_two_subpackages_import_each_other():
    """Between sibling subpackages of one package (e.g. ssm_kernels.scan and ssm_kernels.conv),
    imports go one way."""
    edges = set()
    for package in PACKAGES:
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
