"""Every ```python block of README.md runs as written, each as a script in its own process.

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

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_OPTIONAL = {"torch": "torch", "joblib": "joblib", "sklearn": "scikit-learn"}
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(1) == "python":
            out.append((text.count("\n", 0, m.start()) + 1, m.group(2)))
    return out


BLOCKS = _blocks()


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 7, f"only {len(BLOCKS)} ```python blocks found in {README}"
    text = README.read_text()
    # every fence is closed: an odd count means a block swallowed the prose after it
    assert len(re.findall(r"^```", text, re.M)) % 2 == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs(line: int, code: str, tmp_path: Path) -> None:
    for module in set(_IMPORT.findall(code)) & set(_OPTIONAL):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {_OPTIONAL[module]} (an optional extra)")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=240, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"the ```python block at README.md line {line} failed (exit {proc.returncode}):\n"
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
