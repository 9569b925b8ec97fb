"""The documentation holds: every ```python block of the README, docs/*.md and CONTRIBUTING.md runs
as written (each file's blocks in one namespace, top to bottom), and every relative Markdown link
of the documents points at an existing file, and at an existing heading where it names one."""
import pathlib
import re
import urllib.parse

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ["README.md", "CONTRIBUTING.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LINKED = [*RUN, "CHANGELOG.md", "bench/README.md"]
# The README's blocks cover every public entry point (scans, decode, conv, layers, adapters, cache
# ops, planner): fewer means an example was dropped.
README_MIN_BLOCKS = 9


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("name", RUN)
def test_python_blocks_run(name):
    path = ROOT / name
    blocks = python_blocks(path.read_text())
    if name == "README.md":
        assert len(blocks) >= README_MIN_BLOCKS
    namespace = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for block in blocks:
            exec(compile(block, str(path), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than - and _ dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading's anchor in a Markdown file (repeats numbered -1, -2, ... as GitHub does);
    headings inside fenced code blocks are not headings."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"#{1,6} (.+)", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(text: str) -> list[str]:
    """Targets of inline Markdown links and images outside code, less web and mail addresses."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_anchor_rule():
    assert github_anchor("`mamba1_scan`: mamba_ssm's `selective_scan_fn` layout") == \
        "mamba1_scan-mamba_ssms-selective_scan_fn-layout"
    assert github_anchor("The static cost report (`python -m bench.static`): modelled, not measured") == \
        "the-static-cost-report-python--m-benchstatic-modelled-not-measured"


@pytest.mark.parametrize("name", LINKED)
def test_relative_links_resolve(name):
    path = ROOT / name
    assert path.is_file(), f"{name} is missing"
    broken = []
    for target in relative_links(path.read_text()):
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{name}: broken links:\n" + "\n".join(broken)
