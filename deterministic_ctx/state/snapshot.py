"""Snapshot: an immutable capture of every source of global random state.

The public face of :class:`~deterministic_ctx.core.world.World` (what the engine
captures and restores) together with its persistence
(:mod:`~deterministic_ctx.state.checkpoint`): it sits above both.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.engine import opaque
from ..core.world import World
from ..internal import check_bool
from ..sources.accelerators import refuse_inside_graph_capture
from . import checkpoint as _checkpoint

__all__ = ["Snapshot"]


class Snapshot:
    """The state of every RNG and determinism flag at one moment.

    ``Snapshot.capture()`` records Python's ``random``, NumPy's global RNG,
    torch's CPU and accelerator generators (without initializing CUDA), the
    determinism and precision flags, the relevant environment variables,
    torch's defaults (dtype, default device, thread count, denormal mode) and
    every registered user RNG.  ``restore()`` puts all of it back, bit for
    bit, and can be called any number of times.  It knows nothing of seeds.

    If a source fails to restore, every other source is still restored, then
    :class:`RestoreError` names the ones that failed.

    Example:
        >>> import random
        >>> snap = Snapshot.capture()
        >>> first = random.random()
        >>> snap.restore()
        >>> random.random() == first
        True
    """

    __slots__ = ("_world",)
    _world: World

    def __init__(self) -> None:
        raise TypeError("use Snapshot.capture() to take a snapshot")

    @classmethod
    def capture(cls) -> Snapshot:
        """Capture the current state of every source.

        Example:
            >>> isinstance(Snapshot.capture(), Snapshot)
            True
        """
        return cls._of(World.capture())

    @classmethod
    def _of(cls, world: World) -> Snapshot:
        snap = object.__new__(cls)
        _SET_WORLD(snap, world)  # the slot's descriptor bypasses the guard in __setattr__
        return snap

    def restore(self) -> None:
        """Put every captured source back; raise :class:`RestoreError` on failure.

        Sources are restored in reverse capture order.  A ``KeyboardInterrupt``
        (or any exception a signal handler raises) while restoring does not
        leave a source half-restored or stop the others: the interrupted
        source is restored again, then the rest, and the interrupt is
        re-raised afterwards.  A source that fails twice in a row has failed.
        While a CUDA graph is being captured on the current stream, it raises
        ``GraphCaptureError`` (a ``RuntimeError``) and restores nothing.

        Example:
            >>> import numpy as np
            >>> snap = Snapshot.capture()
            >>> a = np.random.rand()
            >>> snap.restore()
            >>> float(np.random.rand()) == a
            True
        """
        # Checked for every device first: a source refusing on its own would
        # come after the sources restored before it.
        refuse_inside_graph_capture(self._world.sources)
        self._world.restore()

    @property
    def sources(self) -> tuple[str, ...]:
        """Names of the captured sources, in capture order.

        Example:
            >>> "random" in Snapshot.capture().sources
            True
        """
        return tuple(s.name for s in self._world.sources)

    def state_of(self, name: str) -> Any:
        """The captured state of the source called ``name`` (read-only use).

        Example:
            >>> Snapshot.capture().state_of("environ") is not None
            True
        """
        world = self._world
        for source, state in zip(world.sources, world.states, strict=True):
            if source.name == name:
                return state
        raise KeyError(f"no source named {name!r}; captured: {', '.join(self.sources)}")

    def state_dict(self) -> dict[str, Any]:
        """The snapshot as plain data, to put into any checkpoint.

        Only dicts, lists, strings, ints, floats and uint8 tensors: safe to
        ``torch.save`` beside a model and to read back with
        ``torch.load(..., weights_only=True)``.  Rebuild it with
        :meth:`from_state_dict`.  A device that was not initialized when the
        snapshot was taken is saved as such (queued lazy seeds are code, not
        data); see the README's "Checkpoints and resuming".  Raises
        ``ValueError`` if two registered RNGs share a key.

        Example:
            >>> import random
            >>> state = Snapshot.capture().state_dict()
            >>> first = random.random()
            >>> Snapshot.from_state_dict(state).restore()
            >>> random.random() == first
            True
        """
        return _checkpoint.to_state_dict(self._world)

    @classmethod
    def from_state_dict(cls, state_dict: object, *, strict_devices: bool = False) -> Snapshot:
        """Rebuild a snapshot from :meth:`state_dict`'s output, checking every field.

        Every registered RNG in the snapshot must be registered here under the
        same key (``register_rng(obj, key=...)``) before this is called, or
        :class:`~deterministic_ctx.UnregisteredRngError` names the missing key.
        A dict that is not a snapshot's (a model's ``state_dict``, a whole
        checkpoint) raises :class:`InvalidSnapshotError` saying so, and naming
        the key that holds the snapshot where there is one.
        Device generators are matched by type and index: where the snapshot
        holds N and this machine has M, the first min(N, M) are restored and a
        ``RuntimeWarning`` names the difference, or, with
        ``strict_devices=True``, :class:`InvalidSnapshotError` is raised.
        Any other problem raises :class:`InvalidSnapshotError` too.  The
        returned snapshot restores every source or raises.

        Example:
            >>> import numpy as np
            >>> state = Snapshot.capture().state_dict()
            >>> a = np.random.rand()
            >>> Snapshot.from_state_dict(state).restore()
            >>> float(np.random.rand()) == a
            True
        """
        check_bool(strict_devices, "strict_devices")
        return cls._of(
            _checkpoint.from_state_dict(state_dict, "state_dict", strict_devices=strict_devices)
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the snapshot to ``path`` atomically, in a format that never unpickles.

        The file is replaced by a rename once the new one is complete and
        flushed to disk: a crash leaves the previous file intact (and maybe a
        ``.NAME.*.tmp`` file beside it).  See :mod:`deterministic_ctx.state.checkpoint`
        for the format.

        Example:
            >>> import random, tempfile
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     Snapshot.capture().save(f"{tmp}/rng.snapshot")
            ...     first = random.random()
            ...     Snapshot.load(f"{tmp}/rng.snapshot").restore()
            >>> random.random() == first
            True
        """
        _checkpoint.write(path, _checkpoint.encode(self.state_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, strict_devices: bool = False) -> Snapshot:
        """Read a snapshot written by :meth:`save`; nothing in the file is executed.

        A file that is truncated, corrupted, of another kind, of a newer
        format version, or that holds a bad field raises
        :class:`InvalidSnapshotError` naming the file and the problem; a
        ``torch.save`` checkpoint that holds a snapshot's state dict is read with
        ``Snapshot.from_state_dict(torch.load(path, weights_only=True)[key])``,
        as the message says.  Device
        generators follow the same policy as :meth:`from_state_dict`.  A
        missing file raises ``FileNotFoundError``, as ``open`` does.

        Example:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     Snapshot.capture().save(f"{tmp}/rng.snapshot")
            ...     "torch.cpu" in Snapshot.load(f"{tmp}/rng.snapshot").sources
            True
        """
        check_bool(strict_devices, "strict_devices")
        origin = _checkpoint.origin_of(path)
        state = _checkpoint.decode(_checkpoint.read(path), origin)
        return cls._of(_checkpoint.from_state_dict(state, origin, strict_devices=strict_devices))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Snapshot is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Snapshot is immutable")

    def __repr__(self) -> str:
        return f"Snapshot(sources={list(self.sources)})"


_SET_WORLD = Snapshot._world.__set__  # type: ignore[attr-defined,misc]

#: Dynamo's message when compiled code captures or restores a snapshot.
_IN_COMPILED_CODE = (
    "deterministic-ctx: Snapshot.capture() / restore() read and write process-global RNG "
    "state and flags, which cannot be part of a graph; dynamo calls them eagerly, outside the "
    "graph. Under fullgraph=True, capture or restore around the compiled call instead."
)
# Called from compiled code: one graph break, the call eager (see _torch/compiler.py).
opaque(Snapshot.capture.__func__, _IN_COMPILED_CODE, recursive=True)  # type: ignore[attr-defined]
opaque(Snapshot.restore, _IN_COMPILED_CODE, recursive=True)
