"""What a sharing strategy is: the interface every strategy implements.

A strategy decides how a segment is made, what a handle carries so that another process can
map it, and what happens to the segment's name (if any) when it is let go. It is chosen once
(``set_sharing_strategy``), asked to create each new segment, and recorded in the segment
(``Segment.strategy``) and in every handle to it (one byte of the segment's wire,
``Segment.wire``): a receiver rebuilds arrays made under any strategy, whatever it set itself.

Layering: this module and the strategies import ``memory.segment`` (the mapping of one fd) and
nothing above it; the allocator (``memory/``) asks ``strategies.current()`` for new segments;
reducers ask a segment's strategy what its handles carry. A new strategy is one module with a
subclass of :class:`Strategy` plus one line in the table of ``strategies/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from ..memory.segment import Segment

__all__ = ["Strategy", "TakeFd", "FdList"]

TakeFd = Callable[[int], int]
"""Inside a rebuild: takes ownership of the message's fd number ``index`` (``reducers.take_fd``)."""


class FdList(Protocol):
    """What :meth:`Strategy.reference` attaches fds to: the message being pickled
    (``reducers.Message``; the reducers build on the strategies, which do not import them)."""

    def add_fd(self, fd: int, key: object, owner: object) -> int: ...


class Strategy(ABC):
    """One way of making shared memory and of letting other processes map it.

    Attributes:
        name: the name users pass to ``set_sharing_strategy`` (torch's terms).
        code: the byte naming this strategy in every handle (unique in the table).
        keeps_fd: a process keeps the fd of each segment it maps (else it maps the segment and
            closes the fd at once, and handles carry a name).
    """

    name: ClassVar[str]
    code: ClassVar[int]
    keeps_fd: ClassVar[bool] = True

    @abstractmethod
    def create(self, size: int, kind: str) -> Segment:
        """A new segment of ``size`` bytes (a multiple of the page size), every page reserved.

        Args:
            size: bytes, already rounded up to whole pages.
            kind: ``"arena"`` (many small blocks) or ``"large"`` (one block).

        Raises:
            SharedMemoryError: the bytes cannot be reserved (``ENOSPC``/``ENOMEM``), with the
                numbers and the fix in the message.
        """

    @abstractmethod
    def reference(self, msg: FdList, seg: Segment) -> int | str:
        """What a handle to ``seg`` carries in message ``msg``: the index of an fd attached
        to the message (``Message.add_fd``), or a name another process can open.

        A segment that holds its fd (``keeps_fd``) must be referenced by that fd: the numpy
        reducer attaches it without calling this method (the per-array hot path)."""

    @abstractmethod
    def attach(
        self, seg_id: bytes, ref: int | str, size: int, creator_pid: int, kind: str,
        take_fd: TakeFd,
    ) -> Segment:
        """Map the segment a received handle refers to by ``ref`` (what :meth:`reference`
        returned in the sender).

        Raises:
            HandleError: the segment cannot be found or opened any more.
        """

    def remove(self, seg: Segment) -> None:  # noqa: B027 - most strategies have nothing to do
        """The creator lets ``seg`` go, and no handle to it is out: drop its name, if any."""

    def unmapped(self, seg: Segment) -> None:  # noqa: B027
        """``seg`` was unmapped in this process (any process, creator or not)."""

    def __repr__(self) -> str:
        return f"<sharing strategy {self.name}>"
