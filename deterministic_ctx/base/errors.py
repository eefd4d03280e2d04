"""Exceptions and warnings raised by deterministic-ctx."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import PUBLIC_MODULE, DeterministicCtxError, DeterministicCtxWarning

__all__ = [
    "AbandonedBlockWarning",
    "DeviceMismatchError",
    "GraphCaptureError",
    "InvalidSnapshotError",
    "LockWaitWarning",
    "RestoreError",
    "UnregisteredRngError",
]


class RestoreError(DeterministicCtxError, RuntimeError):
    """One or more sources of random state could not be put back.

    Every other source *was* restored before this is raised: a failure in one
    place never leaves the rest of the process half-restored.  ``failures``
    maps the name of each source that failed to the exception it raised.

    Example:
        >>> err = RestoreError({"numpy": ValueError("bad state")})
        >>> sorted(err.failures)
        ['numpy']
    """

    def __init__(self, failures: Mapping[str, BaseException]) -> None:
        self.failures: dict[str, BaseException] = dict(failures)
        detail = "; ".join(f"{name}: {exc!r}" for name, exc in self.failures.items())
        super().__init__(
            f"could not restore {len(self.failures)} source(s) of random state "
            f"(all others were restored): {detail}"
        )


class LockWaitWarning(DeterministicCtxWarning, RuntimeWarning):
    """A thread has waited a long time to enter a deterministic block.

    RNG state is process-global, so blocks in different threads run one after
    another.  When a thread waits longer than the configured time (see
    :func:`deterministic_ctx.set_lock_warning`), this warning names the thread
    that holds the block, then the thread keeps waiting.

    Example:
        >>> issubclass(LockWaitWarning, RuntimeWarning)
        True
    """


class AbandonedBlockWarning(DeterministicCtxWarning, RuntimeWarning):
    """A thread ended inside a deterministic block, and another thread took over.

    A thread that returns (or is killed by its pool) without leaving its
    block would otherwise hold the process-wide lock forever.  The next
    thread to enter a block notices within about a quarter of a second,
    puts back the state from before the dead thread's open blocks (as if
    they had been left), takes the lock and issues this warning once,
    naming the dead thread and the block it left open.  It usually points at
    a bug: an ``__enter__()`` without its ``__exit__()``.

    Example:
        >>> issubclass(AbandonedBlockWarning, RuntimeWarning)
        True
    """


class InvalidSnapshotError(DeterministicCtxError, ValueError):
    """A saved snapshot (a file or a ``state_dict``) cannot be loaded.

    Raised by :meth:`Snapshot.load <deterministic_ctx.Snapshot.load>` and
    :meth:`Snapshot.from_state_dict <deterministic_ctx.Snapshot.from_state_dict>`
    for every kind of bad input: a truncated or corrupted file, a file of
    another kind (a pickle, a ``torch.save`` archive), a format version newer
    than this library reads, a field of the wrong type or out of range, and,
    with ``strict_devices=True``, device generators that do not match this
    machine; a valid snapshot whose user RNG is not registered here raises
    the subclass :class:`UnregisteredRngError`.  Nothing from the input is ever
    executed.  ``origin`` names the
    file (or ``"state_dict"``) and ``problem`` says what is wrong.

    Example:
        >>> err = InvalidSnapshotError("file 'rng.snap'", "truncated")
        >>> str(err)
        "invalid snapshot file 'rng.snap': truncated"
        >>> isinstance(err, ValueError)
        True
    """

    def __init__(self, origin: str, problem: str) -> None:
        self.origin = origin
        self.problem = problem
        super().__init__(f"invalid snapshot {origin}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (multiprocessing) with its two fields intact.
        return type(self), (self.origin, self.problem)


class UnregisteredRngError(InvalidSnapshotError):
    """A valid snapshot holds a user RNG that is not registered in this process.

    Raised by :meth:`Snapshot.load <deterministic_ctx.Snapshot.load>` and
    :meth:`Snapshot.from_state_dict <deterministic_ctx.Snapshot.from_state_dict>`
    (and by the checkpoint helpers built on them) when the snapshot saved an
    RNG registered with ``register_rng(rng, key=...)`` and nothing is
    registered under that key here, so its state has nowhere to go.  The
    snapshot is fine: register the RNG under the same key, then load it
    again.  ``key`` is the key, ``origin`` names the file (or
    ``"state_dict"``).  A subclass of :class:`InvalidSnapshotError`, so code
    that handles every failed load keeps working.

    Example:
        >>> err = UnregisteredRngError("file 'rng.snap'", "augment", "random.Random")
        >>> print(err)  # doctest: +NORMALIZE_WHITESPACE
        cannot restore snapshot file 'rng.snap' here: it holds user RNG 'augment'
        (random.Random), and no RNG is registered with that key in this process:
        call register_rng(rng, key='augment') before loading it
        >>> err.key, isinstance(err, InvalidSnapshotError)
        ('augment', True)
    """

    def __init__(self, origin: str, key: str, kind: str) -> None:
        self.key = key
        self.kind = kind
        super().__init__(
            origin,
            f"it holds user RNG {key!r} ({kind}), and no RNG is registered with that key in "
            f"this process: call register_rng(rng, key={key!r}) before loading it",
        )
        self.args = (f"cannot restore snapshot {origin} here: {self.problem}",)

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (multiprocessing) with its fields intact.
        return type(self), (self.origin, self.key, self.kind)


class GraphCaptureError(DeterministicCtxError, RuntimeError):
    """A device's generators were to be read or set while a graph is being captured.

    Raised by a block's entry, :meth:`Snapshot.capture <deterministic_ctx.Snapshot.capture>`
    and :meth:`Snapshot.restore <deterministic_ctx.Snapshot.restore>` (before
    anything is changed) when the calling thread's current CUDA (or XPU)
    stream is capturing a graph; a block left during a capture raises
    :class:`~deterministic_ctx.RestoreError` with this as the device's failure.
    Enter the block before the capture and replay the graph inside it.

    Example:
        >>> issubclass(GraphCaptureError, RuntimeError)
        True
    """


class DeviceMismatchError(DeterministicCtxError, RuntimeError):
    """A device's generators here do not match the state to be put back.

    Raised while a state is restored (so it reaches you as the device's entry
    in :attr:`RestoreError.failures <deterministic_ctx.RestoreError>`, every
    other source restored): the number of device generators changed since the
    capture, or, with ``strict_devices=True``, a snapshot taken before the
    device was initialized is restored where the device is in use.

    Example:
        >>> issubclass(DeviceMismatchError, RuntimeError)
        True
    """


# Shown, pickled and documented where users import them from: every name above.
for _name in __all__:
    globals()[_name].__module__ = PUBLIC_MODULE
