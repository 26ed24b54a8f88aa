"""Pickling with file descriptors: the one registration point for tensormp's reducers.

Protocol
--------
``dumps(obj)`` pickles with a private pickler whose dispatch table is the stdlib's
``ForkingPickler`` table (whatever torch or others registered there) *plus* tensormp's reducers,
which win (an object of a type the C pickler writes itself, ``bytes``, ``str``, a number or
``None``, is pickled by ``pickle.dumps``: no reducer could take part). A reducer that needs an
fd on the other side (a shared-memory segment, a tensormp ``Connection``) calls
:meth:`Message.add_fd`, which appends the fd to the message's fd list (once per segment per
message) and returns its index; the pickle stores only the index. The
transport then carries the fds beside the bytes: ``SCM_RIGHTS`` on tensormp's sockets
(``connection.py``), or the start method's fd inheritance for ``Process`` arguments
(``context.py``). ``loads(data, fds)`` makes the fds available to rebuild functions, which
take an fd by index (and own it from then on); fds no rebuild took are closed afterwards.

The fds in ``Message.fds`` are *borrowed*: they belong to the segments or connections in
``Message.keepalive``, which the sender keeps alive until the message is sent (and, for a
copied array, until then the copy exists nowhere else).

Private memory: an array whose memory is not shared yet crosses as a copy for the receiver
(numpy), or has its storage moved into shared memory in place first, as torch.multiprocessing
does (torch). A message holding :func:`copy_private` (a wrapper the receiver never sees) copies
instead of moving from there on: the sender's objects stay as they were (the joblib backend
sends its arguments so, as loky leaves the caller's tensors alone). Memory shared on purpose
(``tensormp.share``, ``share_memory_()``, received) crosses as a handle either way.

Registration: tensormp does **not** register array reducers on the global stdlib pickler.
Numpy arrays put on a plain ``multiprocessing.Queue`` keep being pickled by value; tensormp's
own queues, pipes, pools and processes always use tensormp's reducers, whether torch (which
does patch the global pickler) was imported before or after tensormp. The only global
registrations are tensormp's own ``Connection`` type, which the stdlib could not pickle, and, once
``reducers/torch.py`` has loaded, torch's ``UntypedStorage``: a storage in tensormp memory then
crosses torch's own channels as a handle to its block (``reducers/torch_stdlib.py``).

The array libraries (:data:`LIBRARIES`, the one table of them): each maps to a reducer module
(``reducers/numpy.py``, ``reducers/torch.py``) that registers its reduce functions here
(:func:`register`) and its rebuild functions' extension codes, and to a helpers module with
``handles``/``share``/``is_shared`` for the public ``tensormp.share`` and ``is_shared``
(``arrays.py`` dispatches through :func:`helpers_for`). A library's modules are loaded the
first time tensormp pickles something while the library is in ``sys.modules``, or when a
process receives one of its arrays: tensormp never imports an array library itself, and a
process that never touches torch never imports it. A new array library (CuPy, JAX...) is one
reducer module plus one line in the table.
"""

from __future__ import annotations

import copyreg
import importlib
import os
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from ..errors import HandleError
from ..memory import release

if TYPE_CHECKING:
    from ..memory.blocks import Block

__all__ = [
    "Message", "dumps", "loads", "copy_private", "register", "current_message", "take_fd",
    "ArrayLibrary", "LIBRARIES", "helpers_for",
    "flush_release_records",
    "process_args_parent", "current_process_args_parent",
]

_reducers: dict[type, Callable[[Any], Any]] = {}
_PROTOCOL = pickle.HIGHEST_PROTOCOL

# copyreg extension codes of rebuild functions (PEP 307): a pickle names the function with a
# 5-byte code instead of its module and name, and the unpickler finds it in a dict instead of
# importing by name (about 0.9 us of each message's 1.4 us of unpickling, measured here). A
# receiver must have imported the function's module first: loads() does when the message holds
# the code. The codes are far from the ranges PEP 307 assigns; a clash raises at import.
NDARRAY_EXT = 0x746D7001
NDARRAY_COPY_EXT = 0x746D7002
# The most bytes of arrays one message carries by value (Message.take_by_value): its record
# stays under connection.INLINE_MAX, with room for the pickle around them.
BY_VALUE_MAX = 32 << 10


class ArrayHelpers(Protocol):
    """What a library's helpers module offers ``tensormp.share``/``is_shared``."""

    def handles(self, obj: object) -> bool: ...

    def share(self, obj: Any) -> Any: ...

    def is_shared(self, obj: Any) -> bool: ...


class ArrayLibrary(NamedTuple):  # not a dataclass: `dataclasses` costs a child ~10 ms to import
    """One array library whose arrays tensormp moves through shared memory.

    Attributes:
        module: the library's top-level module (``"numpy"``).
        reducers: tensormp's module that registers the library's reduce functions
            (:func:`register`) and rebuild extension codes, and calls :func:`mark_loaded` last.
        helpers: the module with ``handles``, ``share`` and ``is_shared`` (:class:`ArrayHelpers`).
        extensions: the extension codes of its rebuild functions (see above).
    """

    module: str
    reducers: str
    helpers: str
    extensions: tuple[int, ...] = ()


# The table, in dispatch order.
LIBRARIES: tuple[ArrayLibrary, ...] = (
    ArrayLibrary("numpy", "tensormp.reducers.numpy", "tensormp.reducers.numpy",
                 (NDARRAY_EXT, NDARRAY_COPY_EXT)),
    ArrayLibrary("torch", "tensormp.reducers.torch", "tensormp.torch_utils"),
)
# (pickle bytes naming a rebuild function's extension code, its reducer module), of those
# modules not loaded yet: loads() imports one when a message holds its code.
_ext_waiting = [
    (b"\x84" + code.to_bytes(4, "little"), lib.reducers)
    for lib in LIBRARIES for code in lib.extensions
]


def register_extension(fn: Callable[..., Any], code: int) -> None:
    """Give rebuild function ``fn`` the copyreg extension ``code`` (see above)."""
    try:
        copyreg.add_extension(fn.__module__, fn.__qualname__, code)
    except ValueError as e:
        raise ImportError(
            f"tensormp cannot register pickle extension code {code:#x} for "
            f"{fn.__module__}.{fn.__qualname__}: {e} (another library registered it)"
        ) from None
_table_cache: tuple[tuple[int, int, int], dict[type, Any]] | None = None
_tls = threading.local()


def register(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Use ``reducer`` for exact type ``cls`` in tensormp channels (not in the global pickler)."""
    global _table_cache
    _reducers[cls] = reducer
    _table_cache = None


# Reducer modules whose registrations are complete. Not ``sys.modules``: a module is there as
# soon as its import starts, so a second thread would skip the import and pickle (or fail to
# unpickle) before the first thread has registered anything. ``import_module`` of a module
# that another thread is importing waits for it.
_loaded: set[str] = set()


def mark_loaded(module: str) -> None:
    """Called last by a reducer module: its reducers and extension codes are registered."""
    global _ext_waiting
    _loaded.add(module)
    _ext_waiting = [w for w in _ext_waiting if w[1] not in _loaded]


def _load_extensions(data: bytes | bytearray | memoryview) -> None:
    for marker, module in _ext_waiting:
        if module not in _loaded and marker in data:
            importlib.import_module(module)


# (library module, reducer module) of the libraries whose reducers are not loaded yet: checked
# on every dumps() and after every loads(), so that a library's reducers are registered once the
# program has imported it, whichever of it and tensormp was imported first.
_waiting: tuple[tuple[str, str], ...] = tuple((lib.module, lib.reducers) for lib in LIBRARIES)


def _load_libraries() -> None:
    global _waiting
    modules = sys.modules
    for module, reducer in _waiting:
        if module in modules:
            importlib.import_module(reducer)  # waits for another thread importing it
            _waiting = tuple(w for w in _waiting if w[1] not in _loaded)


_helpers: dict[str, ArrayHelpers] = {}


def helpers_for(obj: object) -> ArrayHelpers | None:
    """The helpers module of the first library in :data:`LIBRARIES` (among those the program
    has imported) whose ``handles(obj)`` is true, or None."""
    modules = sys.modules
    for lib in LIBRARIES:
        if lib.module in modules:
            helpers = _helpers.get(lib.helpers)
            if helpers is None:
                helpers = _helpers[lib.helpers] = cast(
                    ArrayHelpers, importlib.import_module(lib.helpers)
                )
            if helpers.handles(obj):
                return helpers
    return None


_copyreg_table = copyreg.dispatch_table
_extra_reducers: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]


def _refresh_table() -> tuple[tuple[int, int, int], dict[type, Any]]:
    """The dispatch table of this process's tensormp pickler (see the module notes), rebuilt
    when a registration added an entry to one of its three sources (their sizes are the key:
    no registry tells of changes); :func:`dumps` checks the key without a call."""
    global _table_cache
    key = (len(_copyreg_table), len(_extra_reducers), len(_reducers))
    cached = _table_cache
    if cached is None or cached[0] != key:
        table = dict(_copyreg_table)
        table.update(_extra_reducers)
        table.update(_reducers)
        cached = _table_cache = (key, table)
        _Pickler.dispatch_table = table  # read by each new pickler (in C, at creation)
    return cached


class _Undo(list[tuple[Callable[..., None], tuple[Any, ...]]]):
    """What to give back if a message is never sent: runs when dropped unless emptied. Apart
    from :class:`Message` so that a message with nothing to undo (no shared memory) has no
    finalizer to run (its ``__del__`` would cost every small message a call)."""

    __slots__ = ()

    def run(self) -> None:
        undo = self[::-1]
        self.clear()
        for fn, args in undo:
            fn(*args)

    def __del__(self) -> None:
        if self:
            self.run()


class Message:
    """One pickled object and the fds that travel with it.

    Attributes:
        data: the pickle bytes.
        fds: borrowed fds, in the order the pickle refers to them (index = position).
        keepalive: objects that own those fds (and copies made for the message); keep the
            message alive until it is sent.
        noted: this process's own blocks a handle was counted for.
        by_value: an array crosses by value in it (no fd, no block), rebuilt by tensormp's
            reducers all the same.
    """

    __slots__ = (
        "data", "fds", "keepalive", "noted", "copy_private", "by_value", "_room", "_left",
        "_index", "_undo",
    )

    def __init__(self, room: Callable[[], int] | None = None) -> None:
        self.data = b""
        self.copy_private = False  # set by a copy_private() wrapper: see the module notes
        self.by_value = False  # an array crossed by value: its rebuild needs tensormp's reducers
        self._room = room  # the channel's by-value room (see take_by_value), asked once
        self._left = -1  # by-value bytes this message may still carry (-1: not asked yet)
        self.fds: list[int] = []
        self.keepalive: list[object] = []
        self.noted: list[Block] = []
        self._index: dict[object, int] | None = None
        self._undo: _Undo | None = None

    def take_by_value(self, nbytes: int) -> bool:
        """Whether an array of ``nbytes`` may cross by value in this message (its bytes in the
        record: ``reducers.numpy``), counting it if so. A message carries at most
        ``BY_VALUE_MAX`` bytes so; on a channel, at most the room it reports (half its send
        buffer less what waits in it), so that by-value records never fill a socket that
        nobody reads yet: the messages after them cross as handles, as small as ever."""
        left = self._left
        if left < 0:
            room = self._room
            left = BY_VALUE_MAX if room is None else min(BY_VALUE_MAX, room())
        if nbytes > left:
            self._left = max(left, 0)
            return False
        self._left = left - nbytes
        self.by_value = True
        return True

    def on_abandon(self, undo: Callable[..., None], *args: Any) -> None:
        """Register ``undo(*args)`` to run if this message is never sent (see :meth:`abandon`)."""
        pending = self._undo
        if pending is None:
            pending = self._undo = _Undo()
        pending.append((undo, args))

    def abandon(self) -> None:
        """The message will not be sent: give back what pickling it reserved (idempotent).

        Also runs when a message that was never marked :meth:`sent` is garbage collected.
        """
        pending, self._undo = self._undo, None
        if pending:
            pending.run()

    def sent(self) -> None:
        """The message left this process (its handles are now the receivers' to release)."""
        pending = self._undo
        if pending is not None:
            pending.clear()
            self._undo = None

    def add_fd(self, fd: int, key: object, owner: object) -> int:
        """Attach ``fd`` (owned by ``owner``; deduplicated by ``key``); returns its index."""
        if self._index is None:
            self._index = {}
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.fds)
            self.fds.append(fd)
            self.keepalive.append(owner)
        return index

    def __repr__(self) -> str:
        return f"<Message {len(self.data)} bytes, {len(self.fds)} fds>"


class _Pickler(pickle.Pickler):
    """The stdlib's C pickler with tensormp's dispatch table (a class attribute that
    :func:`_refresh_table` replaces when a registration changes)."""

    dispatch_table: dict[type, Any] = {}


# Send this process's queued hold/release records now (``memory/release.py``; nothing before
# the allocator is loaded). Called before sending a message, so creators learn who holds what
# before any reply can come back. The function itself, not a wrapper: it runs per message.
flush_release_records = release.flush


def _same(obj: Any) -> Any:
    return obj


class _CopyPrivate:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        msg = current_message()
        if msg is not None:
            msg.copy_private = True  # before ``obj`` is pickled (the pickler saves it next)
        return _same, (self.obj,)


def copy_private(obj: Any) -> Any:
    """``obj``, to be sent so that the sender's objects are left as they are: a torch tensor
    whose memory is not shared yet crosses as a copy, as a numpy array does, instead of having
    its storage moved into shared memory in place (which applies from this wrapper to the end
    of the message). The receiver gets ``obj`` itself."""
    return _CopyPrivate(obj)


def current_message() -> Message | None:
    """The message being pickled in this thread, or None outside :func:`dumps`."""
    stack = getattr(_tls, "dumping", None)
    return stack[-1] if stack else None


# Types the C pickler writes itself, before it would look at any dispatch table: a message
# that is one of them needs no reducer, no message stack and no pickler of ours.
_PLAIN = frozenset({bytes, str, int, float, bool, type(None), bytearray})
_plain_dumps = pickle.dumps


class _Chunks(list[bytes]):
    """Where a reused pickler writes: the C pickler hands its output buffer over whole (one
    chunk unless the pickle is over 64 KiB), so the bytes are taken without a copy."""

    __slots__ = ("write",)

    def __init__(self) -> None:
        super().__init__()
        self.write = self.append


def dumps(obj: object, room: Callable[[], int] | None = None) -> Message:
    """Pickle ``obj`` for a tensormp channel. Errors raise here, in the caller.

    ``room``: the channel's ``Connection.by_value_room`` (see :meth:`Message.take_by_value`).
    """
    msg = Message(room)
    if type(obj) in _PLAIN:  # the common small message: 0.6 us of the 1.4 us below
        msg.data = _plain_dumps(obj, _PROTOCOL)
        return msg
    local = _tls.__dict__
    stack = local.get("dumping")
    if stack is None:
        stack = local["dumping"] = []
    stack.append(msg)
    try:
        modules = sys.modules
        for module, _reducer in _waiting:  # as _load_libraries(), without a call per message
            if module in modules:
                _load_libraries()
                break
        cached_table = _table_cache
        if cached_table is None or cached_table[0] != (
            len(_copyreg_table), len(_extra_reducers), len(_reducers)
        ):
            cached_table = _refresh_table()
        table = cached_table[1]
        # One pickler per thread, reused (0.4 us of a 4 KiB array's ~6 us here); a fresh one
        # when the dispatch table changed or for a dumps() inside a reducer.
        cached = local.get("pickler")
        if cached is not None and cached[2] is table and len(stack) == 1:
            pickler, out, _ = cached
        else:
            out = _Chunks()
            pickler = _Pickler(out, _PROTOCOL)
            if len(stack) == 1:
                local["pickler"] = (pickler, out, table)
        try:
            pickler.dump(obj)
            msg.data = out[0] if len(out) == 1 else b"".join(out)
        finally:
            out.clear()
            pickler.clear_memo()  # the memo refers to what was pickled: keep nothing alive
    except BaseException:
        msg.abandon()
        raise
    finally:
        stack.pop()
    return msg


class _Received:
    __slots__ = ("fds", "taken")

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.taken = [False] * len(fds)

    def take(self, index: int) -> int:
        if not 0 <= index < len(self.fds) or self.taken[index]:
            raise HandleError(
                f"message refers to fd #{index} but carries {len(self.fds)} fds "
                "(corrupt or truncated message)"
            )
        self.taken[index] = True
        return self.fds[index]

    def close_untaken(self) -> None:
        for fd, taken in zip(self.fds, self.taken):
            if not taken:
                try:
                    os.close(fd)
                except OSError:
                    pass


_NO_FDS = _Received([])  # what a message without fds offers its rebuilds (stateless)


def process_args_parent(pid: int) -> None:
    """While a child rebuilds its ``Process`` arguments: the parent's pid (0 otherwise)."""
    _tls.process_args_parent = pid


def current_process_args_parent() -> int:
    return getattr(_tls, "process_args_parent", 0)


def take_fd(index: int) -> int:
    """Inside a rebuild function: take ownership of the message's fd number ``index``.

    Raises:
        HandleError: called outside :func:`loads` (the pickle did not come through a tensormp
            channel) or the index is not in the message.
    """
    stack = getattr(_tls, "loading", None)
    if not stack:
        raise HandleError(
            "a tensormp shared-memory handle was unpickled outside a tensormp channel, so its "
            "file descriptors are missing; send it through a tensormp Queue, Pipe or Process "
            "argument, or call tensormp.reducers.loads(data, fds)"
        )
    received: _Received = stack[-1]
    return received.take(index)


def loads(data: bytes | bytearray | memoryview, fds: list[int]) -> Any:
    """Unpickle a message; owns ``fds`` (each is taken by a rebuild or closed here)."""
    if _ext_waiting:
        _load_extensions(data)
    stack = _tls.__dict__.get("loading")
    if stack is None:
        stack = _tls.loading = []
    if fds:
        received = _Received(fds)
        stack.append(received)
        try:
            obj = pickle.loads(data)
        finally:
            stack.pop()
            received.close_untaken()
    else:
        stack.append(_NO_FDS)
        try:
            obj = pickle.loads(data)
        finally:
            stack.pop()
    # torch may have been imported by what we just loaded (a DataLoader worker's arguments):
    # load tensormp's support for it now, before the worker makes its first batch.
    modules = sys.modules
    for module, _reducer in _waiting:  # as _load_libraries(), without a call per message
        if module in modules:
            _load_libraries()
            break
    return obj
