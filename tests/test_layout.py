"""Where public names live and where the code's prose sends its readers, whichever module the code
is in (issue 26: modules split by concern keep every public name where users find it)."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import tensormp as mp

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "tensormp"


def test_spawn_names_live_in_tensormp_spawn_for_users_and_pickles():
    module = sys.modules["tensormp.spawn"]
    for name in module.__all__:
        obj = getattr(module, name)
        assert getattr(mp, name) is obj, name
        # Reprs, printed tracebacks and pickles name the module users import it from.
        assert obj.__module__ == "tensormp.spawn", (name, obj.__module__)
    failure = mp.ProcessFailure(1, 42, -11, "SIGSEGV", "", "", "stack")
    samples = [
        failure,
        mp.ProcessRaisedException("m", 1, 42, exc_type="ValueError", failures=[failure]),
        mp.ProcessExitedException("m", 1, 42, -11, "SIGSEGV"),
        mp.ProcessTimeoutError("m", 0, 7, running=[0]),
        mp.SpawnBootstrapError("m"),
    ]
    for obj in samples:
        data = pickle.dumps(obj)
        assert b"tensormp.spawn" in data and b"tensormp._spawn" not in data, type(obj)
        back = pickle.loads(data)
        assert type(back) is type(obj) and str(back) == str(obj)
    assert pickle.loads(pickle.dumps(samples[1])).failures == [failure]


def test_docstrings_point_at_pages_that_exist():
    readme_headings = {
        line.lstrip("#").strip().strip("`")
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("#")
    }
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        for section in re.findall(r"README,\s+\*([^*]+)\*", text):
            if " ".join(section.split()) not in readme_headings:
                missing.append(f"{where}: the README has no section {section!r}")
        for page in re.findall(r"\bdocs/[\w/-]+\.md\b", text):
            if not (ROOT / page).is_file():
                missing.append(f"{where}: {page} does not exist")
    assert not missing, "\n".join(missing)
