"""Every rank's random state in a ``torch.distributed.checkpoint``, under its own key.

:class:`RngState` is a ``Stateful``: put it beside the model and the optimizer
and ``dcp.save`` stores the whole random state of every rank (what a
:class:`~deterministic_ctx.Snapshot` holds, registered RNGs included), each
under its own key, and ``dcp.load`` gives each rank back its own.

Why per-rank keys: DCP treats a plain tensor or object that every rank puts
under the same key as *replicated* and writes one rank's copy
(``_dedup_save_plans``); a per-rank state under one key would come back as
that rank's state on every rank.

Why tensors only: DCP writes every value that is not a tensor with
``torch.save`` and reads it back with ``torch.load(weights_only=False)``,
which runs whatever the file's pickle says.  Tensors it reads with
``weights_only=True``.  (DCP's own ``.metadata`` file is a pickle that
``dcp.load`` unpickles whatever the state dict holds: a DCP checkpoint from
someone you do not trust is unsafe to load in any case.)

Why a fixed size: DCP loads in place, into tensors of the saved shape made
before it reads anything, and ``state_dict()`` is called for saving and
loading alike.  So each rank's entry is a ``uint8`` tensor of ``capacity``
bytes (256 KiB by default; a snapshot is about 20 KB, plus 5 KB per
registered ``torch.Generator`` and 7 KB per Mersenne-Twister RNG), whatever
it holds.

The entries, under the ``Stateful``'s key (``"rng"`` below)::

    rng.meta     int64 [4]: a tag, the format version (1), the world size, 0
                 (the same on every rank: written once)
    rng.rank{r}  uint8 [capacity], rank r's own:
        offset  size  field
        0       8     signature  b"\\x89DCR\\r\\n\\x1a\\n"
        8       4     u32  format version (1)
        12      4     u32  rank
        16      4     u32  world size
        20      4     u32  reserved, 0
        24      8     u64  n, the snapshot file's length
        32      n     a snapshot file (see deterministic_ctx.state.checkpoint: its own
                      signature and SHA-256)
        32+n    ...   zeros

Loading checks every field, then the snapshot file as
:meth:`Snapshot.load <deterministic_ctx.Snapshot.load>` does: a changed byte
anywhere in an entry raises :class:`~deterministic_ctx.InvalidSnapshotError`.

**World size.**  Each rank restores the state saved by the rank of the same
number in a world of the same size, and never another's.  If the
checkpoint's world size differs from this run's, ``RngState()`` raises a
``ValueError`` naming both sizes on every rank;
``RngState(on_world_size_change="keep")`` keeps every rank's current state
instead (to reseed, seed first, e.g. ``seed_everything(seed, rank="auto")``,
then load).  A *larger* world meets DCP's own check first: the new ranks
have no entry, and ``dcp.load`` raises ``CheckpointException`` ("Missing key
in checkpoint state_dict: rng.rank2") on every rank before ``RngState`` sees
anything.  Load with ``planner=DefaultLoadPlanner(allow_partial_load=True)``
(which lets every missing key pass, the model's too) to have the policy
apply, or leave ``"rng"`` out of the state dict.

**torch 2.1.**  ``RngState`` needs DCP's ``Stateful`` protocol (``dcp.save``,
``dcp.load`` and ``torch.distributed.checkpoint.stateful``, torch 2.2 and
later): torch 2.1's ``save_state_dict`` would pickle the object instead of
calling its ``state_dict()``, and its ``load_state_dict`` would never restore
anything.  There ``RngState()`` raises ``TorchFeatureError`` (a
``RuntimeError``) naming the torch version it needs; save
``Snapshot.capture().state_dict()`` beside the model instead.

**Collectives.**  With an initialized default process group of several
ranks, ``state_dict()`` and ``load_state_dict()`` are collectives over it:
the ranks agree that every rank could save (or restore) its state before any
rank goes on, so a failure on one rank (a state larger than ``capacity``, a
corrupted entry, a registered RNG missing) raises
:class:`~deterministic_ctx.RngStateError` on every rank, instead of one
rank failing while the others wait in DCP's or the training's next
collective.  Nothing is restored anywhere unless every rank can restore its
own.  As ``dcp.save`` and ``dcp.load`` themselves, every rank must call them.
"""

from __future__ import annotations

import struct
from typing import Any, Literal

import torch

from .._torch import DCP_STATEFUL
from ..internal import check_bool
from ..parallel.keyed import check_count
from ..parallel.ranks import ranks
from .checkpoint import MAX_FILE_BYTES, InvalidSnapshotError, check_version, encode
from .snapshot import Snapshot
from .sync import apply_everywhere, check_everywhere, received

__all__ = ["CAPACITY", "VERSION", "RngState"]

#: The default size of each rank's entry, in bytes.
CAPACITY = 256 << 10
VERSION = 1
_MAGIC = b"\x89DCR\r\n\x1a\n"  # like the snapshot file's: catches text-mode and 7-bit mangling
_HEADER = struct.Struct("<8sIIIIQ")
_META_TAG = int.from_bytes(b"DCR.meta", "little")
_MIN_CAPACITY = 4096
_MAX_CAPACITY = MAX_FILE_BYTES + _HEADER.size
_POLICIES = ("error", "keep")

WorldSizePolicy = Literal["error", "keep"]


class RngState:
    """The random state of every rank, as a ``torch.distributed.checkpoint`` ``Stateful``.

    ``dcp.save({"model": ..., "optimizer": ..., "rng": RngState()}, ...)``
    stores each rank's whole random state under its own key;
    ``dcp.load`` with an ``RngState()`` under the same key restores each
    rank's own, bit for bit, in ``load_state_dict`` (after DCP has read
    everything: call ``dcp.load`` last before the training loop, as nothing
    may draw from an RNG in between).  Register the same RNGs under the same
    keys (``register_rng(obj, key=...)``) before loading.  Tensors only:
    nothing is unpickled.  Works without a process group too (one process,
    rank 0).  See :mod:`deterministic_ctx.state.dcp` for the layout, the world size
    policy and the collectives.

    Args:
        on_world_size_change: ``"error"`` (the default): loading a checkpoint
            saved by a different number of ranks raises ``ValueError``,
            naming both; ``"keep"``: every rank keeps its current state.
        capacity: the size of each rank's entry in bytes (the same when
            saving and when loading: DCP refuses another size).
        strict_devices: as for :meth:`Snapshot.from_state_dict
            <deterministic_ctx.Snapshot.from_state_dict>`: whether device
            generators that do not match this machine raise (else they warn).

    Raises:
        TorchFeatureError: on a torch without DCP's ``Stateful`` protocol
            (torch < 2.2), naming the version it needs.

    Example:
        >>> import random, tempfile, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> from deterministic_ctx import RngState
        >>> with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # DCP: "no process group: one process"
        ...     _ = dcp.save({"rng": RngState()}, checkpoint_id=path)
        ...     first = random.random()
        ...     dcp.load({"rng": RngState()}, checkpoint_id=path)
        >>> random.random() == first
        True
    """

    __slots__ = ("_capacity", "_on_world_size_change", "_strict_devices")

    def __init__(
        self,
        *,
        on_world_size_change: WorldSizePolicy = "error",
        capacity: int = CAPACITY,
        strict_devices: bool = False,
    ) -> None:
        DCP_STATEFUL.require("deterministic_ctx.RngState")
        if not isinstance(on_world_size_change, str):
            raise TypeError(
                f"on_world_size_change must be 'error' or 'keep', got "
                f"{type(on_world_size_change).__name__} {on_world_size_change!r}"
            )
        if on_world_size_change not in _POLICIES:
            raise ValueError(
                f"on_world_size_change must be 'error' or 'keep', got {on_world_size_change!r}"
            )
        capacity = check_count(capacity, "capacity", "an int (bytes)", low=None)
        if not _MIN_CAPACITY <= capacity <= _MAX_CAPACITY:
            raise ValueError(
                f"capacity must be in [{_MIN_CAPACITY}, {_MAX_CAPACITY}] bytes, got {capacity}"
            )
        self._on_world_size_change = on_world_size_change
        self._capacity = capacity
        self._strict_devices = check_bool(strict_devices, "strict_devices")

    @property
    def on_world_size_change(self) -> WorldSizePolicy:
        """What loading does when the world size changed: ``"error"`` or ``"keep"``.

        Example:
            >>> RngState(on_world_size_change="keep").on_world_size_change
            'keep'
        """
        return self._on_world_size_change

    @property
    def capacity(self) -> int:
        """The size of each rank's entry, in bytes.

        Example:
            >>> RngState().capacity == CAPACITY
            True
        """
        return self._capacity

    @property
    def strict_devices(self) -> bool:
        """Whether device generators that do not match this machine raise.

        Example:
            >>> RngState().strict_devices
            False
        """
        return self._strict_devices

    def state_dict(self) -> dict[str, Any]:
        """This rank's entry (its state now) and the replicated ``meta``: tensors only.

        DCP calls it when saving, and when loading to get the tensors to load
        into.  A collective where a process group of several ranks is
        initialized: if any rank cannot encode its state (larger than
        ``capacity``, two registered RNGs sharing a key), every rank raises
        :class:`~deterministic_ctx.RngStateError`; in one process the
        error itself is raised.

        Example:
            >>> sorted(RngState().state_dict())  # one process: rank 0 of 1
            ['meta', 'rank0']
        """
        rank, world = ranks()[:2]
        entry: torch.Tensor | None = None
        problem: Exception | None = None
        try:
            entry = _pack(encode(Snapshot.capture().state_dict()), rank, world, self._capacity)
        except Exception as exc:
            problem = exc
        check_everywhere("RngState: saving the random state", problem)
        assert entry is not None  # else check_everywhere raised
        meta = torch.tensor([_META_TAG, VERSION, world, 0], dtype=torch.int64, device="cpu")
        return {"meta": meta, f"rank{rank}": entry}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's own state from what DCP loaded into :meth:`state_dict`'s tensors.

        Every field is checked (:class:`~deterministic_ctx.InvalidSnapshotError`
        on bad input), then every rank restores its own state, or, if any rank
        cannot, every rank raises :class:`~deterministic_ctx.RngStateError`
        and none restores anything (in one process, the error itself is
        raised).  A different world size follows ``on_world_size_change``.

        Example:
            >>> import random
            >>> rng = RngState()
            >>> saved = rng.state_dict()  # tensors only: torch.save takes it too
            >>> first = random.random()
            >>> rng.load_state_dict(saved)
            >>> random.random() == first
            True
        """
        rank, world = ranks()[:2]
        saved_world: int | None = None
        snapshot: Snapshot | None = None
        problem: Exception | None = None
        try:
            saved_world = _saved_world(state_dict)
            # "meta" is one entry read by every rank: they all take the same branch.
            if saved_world == world:
                snapshot = self._snapshot(state_dict, rank, world)
        except Exception as exc:
            problem = exc
        if saved_world is not None and saved_world != world:
            if self._on_world_size_change == "keep":
                return
            raise ValueError(
                f"RngState: the checkpoint holds the random state of {saved_world} rank"
                f"{'s' if saved_world > 1 else ''}, and this run has {world}: no rank may "
                f"restore a state saved for another rank.  Pass "
                f"RngState(on_world_size_change='keep') to keep each rank's current state "
                f"(seed it first, e.g. seed_everything(seed, rank='auto'))"
            )
        apply_everywhere(snapshot, problem, "RngState: restoring the random state")

    def _snapshot(self, state_dict: dict[str, Any], rank: int, world: int) -> Snapshot:
        key = f"rank{rank}"
        origin = f"of rank {rank} in the checkpoint (RngState entry {key!r})"
        if key not in state_dict:
            raise InvalidSnapshotError(origin, "there is no such entry")
        data = _unpack(state_dict[key], origin, rank, world, self._capacity)
        # This rank's own state, so rank-local RNGs stay; its setup (flags, managed
        # environment variables such as the NCCL recipe) stays this process's.
        return received(data, origin, keep_rank_local=False, strict_devices=self._strict_devices)

    def __repr__(self) -> str:
        return (
            f"RngState(on_world_size_change={self._on_world_size_change!r}, "
            f"capacity={self._capacity}, strict_devices={self._strict_devices})"
        )


def _pack(data: bytes, rank: int, world: int, capacity: int) -> torch.Tensor:
    """Rank ``rank``'s entry: the header, the snapshot file ``data``, zeros to ``capacity``."""
    room = capacity - _HEADER.size
    if len(data) > room:
        raise ValueError(
            f"this rank's random state takes {len(data)} bytes, more than an RngState entry "
            f"of capacity={capacity} holds ({room} after its {_HEADER.size}-byte header); "
            f"pass RngState(capacity=...) of at least {len(data) + _HEADER.size}, the same "
            f"when saving and when loading"
        )
    entry = bytearray(capacity)
    _HEADER.pack_into(entry, 0, _MAGIC, VERSION, rank, world, 0, len(data))
    entry[_HEADER.size : _HEADER.size + len(data)] = data
    return torch.frombuffer(entry, dtype=torch.uint8)


def _unpack(entry: object, origin: str, rank: int, world: int, capacity: int) -> bytes:
    """The snapshot file in rank ``rank``'s entry, every header field checked."""

    def bad(problem: str) -> InvalidSnapshotError:
        return InvalidSnapshotError(origin, problem)

    if not isinstance(entry, torch.Tensor) or entry.dtype != torch.uint8 or entry.dim() != 1:
        what = (
            f"a {entry.dtype} tensor" if isinstance(entry, torch.Tensor) else type(entry).__name__
        )
        raise bad(f"expected a 1-D uint8 tensor, got {what}")
    if entry.numel() != capacity:
        raise bad(
            f"it holds {entry.numel()} bytes, RngState(capacity={capacity}) expects {capacity}"
        )
    raw = entry.detach().cpu().contiguous().numpy().tobytes()
    magic, version, saved_rank, saved_world, reserved, length = _HEADER.unpack_from(raw)
    if magic != _MAGIC:
        raise bad(
            f"it does not start with the RngState signature {_MAGIC!r} (it starts with {magic!r})"
        )
    check_version(version, reserved, VERSION, origin)
    if saved_rank != rank:
        raise bad(f"it holds the state of rank {saved_rank}, not this rank's ({rank})")
    if saved_world != world:
        raise bad(f"it was saved in a world of {saved_world} ranks, the checkpoint's is {world}")
    end = _HEADER.size + length
    if end > capacity:
        raise bad(f"its header declares {length} bytes, more than the entry holds")
    if raw.count(0, end) != capacity - end:
        raise bad("corrupted: the bytes after the snapshot are not all zero")
    return raw[_HEADER.size : end]


def _saved_world(state_dict: object) -> int:
    """The world size in the checkpoint's ``meta`` entry, every field checked."""
    origin = "in the checkpoint (RngState entry 'meta')"
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    meta = state_dict.get("meta")
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int64 or tuple(meta.shape) != (4,):
        raise InvalidSnapshotError(origin, "expected an int64 tensor of shape [4]")
    tag, version, world, reserved = (int(v) for v in meta.tolist())
    if tag != _META_TAG:
        raise InvalidSnapshotError(origin, "it is not an RngState entry (its tag differs)")
    check_version(version, reserved, VERSION, origin)
    if not 1 <= world <= 1 << 31:
        raise InvalidSnapshotError(origin, f"world size {world} is out of range")
    return world
