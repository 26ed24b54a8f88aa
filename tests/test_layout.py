"""Where public names live and where the code's prose sends its readers, whichever module the code
is in (issue 26: modules split by concern keep every public name where users find it)."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensormp as mp

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "tensormp"


def test_spawn_names_live_in_tensormp_spawn_for_users_and_pickles():
    module = importlib.import_module("tensormp.spawn")
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


# -- the import graph (issue 26) ------------------------------------------------------------------
# Layers import downward (STYLE.md, habit 16). The one circle allowed is the stdlib's own: a
# context's Pool() imports the pool lazily, and the pool asks the context for processes.
_ALLOWED_LAZY = {("tensormp.context", "tensormp.pool")}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, dict[str, str]]:
    """``{module: {imported module: where}}`` for every module under ``src``, from the source
    (nothing is imported): every ``import`` and ``from ... import`` of a tensormp module, at the
    top, inside functions (``where="function"``) and under ``if TYPE_CHECKING:`` (``"typing"``:
    a type-only edge is still a layer looking up). ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg``. Modules loaded by name from a table
    (``importlib.import_module``: strategies, engines, array libraries) are plug-ins, not edges."""
    import ast

    files = {_module_name(p, src): p for p in src.rglob("*.py")}
    graph: dict[str, dict[str, str]] = {}

    def visit(node: ast.AST, module: str, package: list[str], where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "typing" if where == "top" else where
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target
                           for a in child.names]
            else:
                visit(child, module, package, inner)
                continue
            for target in targets:
                if target in files and target != module:
                    edges = graph[module]
                    # the strongest kind wins: top > typing > function
                    if edges.get(target) != "top" and not (edges.get(target) == "typing"
                                                           and inner == "function"):
                        edges[target] = inner

    for module, path in files.items():
        graph[module] = {}
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        visit(ast.parse(path.read_text()), module, package, "top")
    return graph


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_no_import_circle_but_the_lazy_context_pool_one():
    graph = import_graph()
    for a, b in _ALLOWED_LAZY:
        assert graph[a].get(b) in (None, "function"), f"{a} must import {b} lazily (in a function)"
        graph[a].pop(b, None)
    lines = [
        "  " + "; ".join(
            f"{m} -> " + ", ".join(f"{t} ({graph[m][t]})" for t in sorted(graph[m]) if t in cycle)
            for m in cycle
        )
        for cycle in import_cycles(graph)
    ]
    assert not lines, "import circles (module -> what it imports in the circle, and where):\n" + (
        "\n".join(lines)
    )


def test_import_graph_sees_the_circles_it_must_refuse(tmp_path):
    """The graph is read from the source: a circle made of a lazy import and a type-only one is
    found (the check above would pass vacuously if imports were missed)."""
    pkg = tmp_path / "tensormp"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .low import thing\n")
    (pkg / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import High\n"
        "thing = 1\n"
    )
    (pkg / "high.py").write_text("def f():\n    from .sub import low\n")
    (pkg / "alone.py").write_text("import tensormp.sub.low\n")
    graph = import_graph(pkg)
    assert graph["tensormp.sub.low"] == {"tensormp.high": "typing"}
    assert graph["tensormp.high"] == {"tensormp.sub.low": "function"}
    assert graph["tensormp.alone"] == {"tensormp.sub.low": "top"}
    assert import_cycles(graph) == [["tensormp.high", "tensormp.sub.low"]]


# -- what a child imports (issue 25: per-process start) ------------------------------------------
_CHILD_SCRIPT = """
import json, sys
import tensormp

def report(*args):
    with open(sys.argv[1] + "." + str(len(args)), "w") as f:
        json.dump(sorted(sys.modules), f)

if __name__ == "__main__":
    assert "tensormp.spawn" not in sys.modules, "import tensormp loaded spawn()"
    p = tensormp.get_context("spawn").Process(target=report)
    p.start(); p.join(); assert p.exitcode == 0
    tensormp.spawn(report, nprocs=1)  # a rank: report(0)
"""
# What a child of a trivial function must not import: the parent side of spawn() (its context,
# exceptions and argument checks), numpy, the pools, the file_system strategy.
_NOT_IN_A_CHILD = (
    "tensormp.spawn", "tensormp._spawn_context", "tensormp._spawn_errors", "tensormp.elastic",
    "tensormp.pool", "tensormp.futures", "tensormp.connection", "tensormp.queues",
    "tensormp.strategies.file_system", "numpy", "dataclasses",
)
# ... and a Process child whose arguments carry no array, nothing of the reducers either.
_NOT_IN_A_PROCESS_CHILD = ("tensormp.reducers", "tensormp.memory", "tensormp.memory.release")


@pytest.mark.timeout(60)
def test_a_child_of_a_trivial_function_imports_only_what_it_runs(tmp_path):
    script = tmp_path / "child_modules.py"
    script.write_text(_CHILD_SCRIPT)
    out = tmp_path / "modules"
    # stderr kept from pytest's capture: a spawn() rank of a script leaves its report socket to
    # the collector at exit (a ResourceWarning, also before this change; not what this checks).
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr
    process_child = set(json.loads(Path(f"{out}.0").read_text()))
    rank = set(json.loads(Path(f"{out}.1").read_text()))
    assert "tensormp.context" in process_child and "tensormp._spawn_rank" in rank
    for loaded, who, avoid in ((process_child, "a Process child", _NOT_IN_A_PROCESS_CHILD),
                               (rank, "a spawn() rank", ())):
        heavy = sorted(m for m in _NOT_IN_A_CHILD + avoid if m in loaded)
        assert not heavy, f"{who} of a trivial function imported {heavy}"


_NUMPY_SCRIPT = """
import sys
import numpy as np
import tensormp

def report(path, array=None):
    with open(path, "w") as f:
        f.write(" ".join(sorted(sys.modules)))
    assert array is None or array.sum() == 3

if __name__ == "__main__":
    ctx = tensormp.get_context("spawn")
    for args in ((sys.argv[1] + ".plain",), (sys.argv[1] + ".array", np.ones(3))):
        p = ctx.Process(target=report, args=args)
        p.start(); p.join(); assert p.exitcode == 0
"""


@pytest.mark.timeout(60)
def test_a_child_whose_program_imports_an_array_library_has_its_support_before_the_target(
    tmp_path,
):
    """Arguments without arrays skip tensormp's reducers in the child, but a child whose main
    module imported numpy (or torch) loads tensormp's support for it before the target runs,
    as when its arguments carry arrays."""
    script = tmp_path / "numpy_child.py"
    script.write_text(_NUMPY_SCRIPT)
    out = tmp_path / "modules"
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=50)
    for case in ("plain", "array"):
        loaded = Path(f"{out}.{case}").read_text().split()
        assert "tensormp.reducers.numpy" in loaded, case


def test_the_process_child_knows_the_array_libraries_of_the_reducer_table():
    from tensormp import context, reducers

    assert set(context._ARRAY_LIBRARIES) == {lib.module for lib in reducers.LIBRARIES}


def test_spawn_stays_the_function_when_its_module_loads_first():
    """``tensormp.spawn`` is loaded on first use; a module that imports ``tensormp.spawn`` (or
    unpickles a spawn exception) before anyone used the name must not turn it into the module."""
    code = (
        "import pickle, sys, tensormp\n"
        "assert 'tensormp.spawn' not in sys.modules\n"
        "from tensormp.spawn import ProcessExitedException\n"
        "assert callable(tensormp.spawn), tensormp.spawn\n"
        "assert tensormp.spawn.__module__ == 'tensormp.spawn'\n"
        "assert tensormp.ProcessExitedException is ProcessExitedException\n"
        "assert 'spawn' in dir(tensormp) and 'spawn' in tensormp.__all__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_a_function_pickled_by_value_may_use_the_package():
    """The package's module object is a subclass (above); cloudpickle, which knows modules by
    their exact type, still pickles a reference to it by name (a lambda sent to a pool or to
    ``spawn()`` that calls ``mp.share``...)."""
    import cloudpickle

    uses_the_package = lambda a: mp.is_shared(a)  # noqa: E731 - a lambda goes by value
    back = cloudpickle.loads(cloudpickle.dumps(uses_the_package))
    assert back.__globals__["mp"] is mp
    assert pickle.loads(pickle.dumps(mp)) is mp
