"""Every ```python block of README.md and of the documentation pages (docs/**/*.md) runs as
written, each as a script in its own process; the README stays a front page with one copy of
the prose.

A plain ``pip install tensormp`` must run them all (cloudpickle and tqdm are dependencies).
Blocks that import an optional extra (torch; joblib and scikit-learn for the joblib backend)
run where it is installed and are skipped elsewhere. A fragment that cannot run alone is not
a ```python block (its fence says ```text or nothing).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_OPTIONAL = {"torch": "torch", "joblib": "joblib", "sklearn": "scikit-learn"}
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(1) == "python":
            out.append((text.count("\n", 0, m.start()) + 1, m.group(2)))
    return out


BLOCKS = [(_name(page), line, code) for page in PAGES for line, code in _blocks(page)]


def test_the_pages_have_their_examples():
    in_readme = [b for b in BLOCKS if b[0] == "README.md"]
    in_docs = [b for b in BLOCKS if b[0] != "README.md"]
    # the README's one example; the docs' examples of every page that had one when the prose
    # moved there (getting started, sharing strategies, torch x2, spawn, Pool, joblib x2)
    assert len(in_readme) >= 1, f"no ```python block found in {README}"
    assert len(in_docs) >= 8, f"only {len(in_docs)} ```python blocks found in docs/"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_fence_is_closed(page: Path) -> None:
    # an odd count means a block swallowed the prose after it
    assert len(re.findall(r"^```", page.read_text(), re.M)) % 2 == 0, _name(page)


def test_each_example_is_written_once():
    seen: dict[str, str] = {}
    for name, line, code in BLOCKS:
        key = "\n".join(ln.strip() for ln in code.strip().splitlines())
        assert key not in seen, f"the ```python block at {name}:{line} repeats {seen[key]}"
        seen[key] = f"{name}:{line}"


def test_the_readme_is_a_front_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: its details belong in docs/"
    # its first lines are the two commands a newcomer runs, and both are Makefile targets
    commands = _FENCE.search(text)
    assert commands is not None and text.startswith("# tensormp\n\n```\n")
    first = [ln.split()[:2] for ln in commands.group(2).splitlines()[:2]]
    assert first == [["make", "demo"], ["make", "test"]], first
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_docs_do_not_repeat_the_readme():
    # One copy of the prose: no line of the README of 60 characters or more (its sentences,
    # table rows, code) stands again in a documentation page.
    readme = {ln.strip() for ln in README.read_text().splitlines() if len(ln.strip()) >= 60}
    for page in PAGES[1:]:
        repeated = [ln for ln in page.read_text().splitlines() if ln.strip() in readme]
        assert not repeated, f"{_name(page)} repeats README.md: {repeated[:3]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, line, code", BLOCKS, ids=[f"{n}:{ln}" for n, ln, _ in BLOCKS])
def test_block_runs(name: str, line: int, code: str, tmp_path: Path) -> None:
    for module in set(_IMPORT.findall(code)) & set(_OPTIONAL):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {_OPTIONAL[module]} (an optional extra)")
    script = tmp_path / f"{Path(name).stem}_line_{line}.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=240, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"the ```python block at {name} line {line} failed (exit {proc.returncode}):\n"
        f"{code}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )


def test_version_from_the_package_metadata():
    import tensormp

    assert tensormp.__version__ == importlib.metadata.version("tensormp")
    out = subprocess.run(
        [sys.executable, "-m", "tensormp", "--version"], capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout
    assert out.strip() == f"tensormp {tensormp.__version__}"
