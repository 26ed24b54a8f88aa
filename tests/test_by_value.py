"""How a callable travels (by reference or by value): one rule, ``tensormp._by_value``, for
``spawn()``, ``Pool``/the executor and the joblib backend (issue 26, part 2)."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tensormp import _by_value, reducers
from tensormp.pool.tasks import _prepare

SRC = Path(__file__).resolve().parent.parent / "src" / "tensormp"


def _module_function(x):
    return x


class _Holder:
    def __init__(self) -> None:
        self.a = np.arange(4)

    def method(self):
        return self.a


def test_callables_of_modules_travel_alike_everywhere():
    def local(x):
        return x

    cases = {
        "module function": (_module_function, False),
        "lambda": (lambda x: x, True),
        "local function": (local, True),
        "builtin": (len, False),
        "partial": (functools.partial(_module_function, 1), False),
        "bound method": (_Holder().method, False),
    }
    for what, (fn, by_value) in cases.items():
        assert _by_value.needs_value(fn) is by_value, what
        assert isinstance(_by_value.prepare(fn, "spawn"), _by_value.FnByValue) is by_value, what
        assert _prepare(fn).by_value is by_value, what
        # workers kept between calls (joblib): the same for callables of modules
        assert _by_value.needs_value(fn, foreign_workers=True) is by_value, what
    # a callable plain pickle refuses: by value at once for kept workers; the pool's engine
    # tries it by reference first (arrays it holds stay shared) and falls back on pickles()
    refused = functools.partial(_module_function, lambda: 0)
    assert _by_value.needs_value(refused, foreign_workers=True)
    assert not _by_value.needs_value(refused) and not _by_value.pickles(refused)


def test_functions_of_main_by_the_one_rule(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import json
        from tensormp import _by_value
        from tensormp.joblib import _ByValue, _wire_fn
        from tensormp.pool.tasks import _prepare

        def top(x):
            return x

        if __name__ == "__main__":
            def guarded(x):
                return x

            out = {}
            for fn in (top, guarded):
                out[fn.__name__] = [
                    isinstance(_by_value.prepare(fn, "spawn"), _by_value.FnByValue),
                    _prepare(fn).by_value,
                    isinstance(_wire_fn(fn), _ByValue),
                ]
            print(json.dumps(out))
    """))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    # spawn, Pool, joblib: a top-level function of the script goes by reference, except to
    # joblib's kept workers (they may be older than it); one under the guard by value
    assert json.loads(done.stdout) == {"top": [False, False, True], "guarded": [True, True, True]}


def test_the_probe_skips_what_the_reducer_table_sends():
    array = np.zeros((256, 1024))
    view = array[1:]
    assert _by_value.is_array(array) and _by_value.is_array(view)
    assert not _by_value.is_array([1, 2]) and not _by_value.is_array(_Holder())
    for lib in reducers.LIBRARIES:
        if lib.module == "torch" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            assert _by_value.is_array(torch.zeros(2))
            assert _by_value.is_array(torch.zeros(2).untyped_storage())
    holder = _Holder()
    assert _by_value.pickles(holder, skip_arrays=True) and _by_value.pickles(holder)
    holder.fn = lambda: 0  # plain pickle refuses it, arrays or not
    assert not _by_value.pickles(holder, skip_arrays=True)


@pytest.mark.parametrize("path", ["pool", "elastic.py"])
def test_no_private_import_of_spawn(path):
    """The pool asks ``_by_value`` (no pool -> spawn import); elastic.py takes spawn's pieces
    from the modules that own them."""
    files = sorted((SRC / path).rglob("*.py")) if (SRC / path).is_dir() else [SRC / path]
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "spawn":
                found.append(f"{file.relative_to(SRC)}:{node.lineno}")
    assert not found, found
