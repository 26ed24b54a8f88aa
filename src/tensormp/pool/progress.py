"""``progress=``: a tqdm bar (``progress=True``) or a callable ``progress(done, total)``, fed
from the thread that waits for a map's results. tqdm is imported only when a bar is asked for.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any


class _Progress:
    """``progress=True``: a tqdm bar; ``progress=callable``: ``callable(done, total)``."""

    def __init__(self, progress: Any, total: int | None, desc: str) -> None:
        self._fn: Callable[[int, int | None], Any] | None = None
        self._bar: Any = None
        self._total = total
        self._done = 0
        if progress is True:
            tqdm = _tqdm()
            self._bar = tqdm(total=total, desc=desc, unit="item")
        else:
            self._fn = progress
            progress(0, total)

    @staticmethod
    def check(progress: Any) -> bool:
        """Validate ``progress=``; True when a reporter is wanted.

        Raises:
            ImportError: ``progress=True`` and tqdm is not installed.
            TypeError: ``progress`` is neither a bool nor a callable.
        """
        if progress is None or progress is False:
            return False
        if progress is True:
            _tqdm()
            return True
        if callable(progress):
            return True
        raise TypeError(
            f"progress must be True (a tqdm bar), False, or a callable progress(done, total), "
            f"got {type(progress).__name__}: {reprlib.repr(progress)}"
        )

    def update(self, done: int) -> None:
        if done <= self._done:
            return
        if self._bar is not None:
            self._bar.update(done - self._done)
        elif self._fn is not None:
            self._fn(done, self._total)
        self._done = done

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError(
            "progress=True draws a progress bar with tqdm, which is not installed: "
            "pip install 'tensormp[progress]' (or pip install tqdm), or pass "
            "progress=a callable progress(done, total) instead"
        ) from None
    return tqdm
