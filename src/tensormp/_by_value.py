"""Functions sent by value: what a child could not import by name travels pickled by cloudpickle.

``spawn()`` and ``Pool`` send a function by reference (module and name, as the stdlib and torch
do) whenever the child can import it, and wrap anything else (a lambda, a local function, a
function defined under ``if __name__ == "__main__":``) in :class:`FnByValue`: the cloudpickle
bytes, made once in the parent, unpickled in the child only when the function is needed. The
child needs cloudpickle only to *load* the bytes, and imports it then.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["FnByValue"]


class FnByValue:
    """``fn`` pickled by value (cloudpickle) for a child that could not import it by name."""

    __slots__ = ("data", "name")

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.name = name

    def __reduce__(self) -> Any:
        return FnByValue, (self.data, self.name)

    def load(self) -> Any:
        return pickle.loads(self.data)  # imports cloudpickle here, in the child, if needed

    def __repr__(self) -> str:
        return f"<fn {self.name} by value, {len(self.data)} bytes>"
