"""Send one rank's whole random state to every rank of a process group, without pickle.

:func:`sync_rng_state` realigns the ranks of a process group, for instance
after a rank-local draw: every rank ends with the random state of rank
``src``, from every random source a :class:`~deterministic_ctx.Snapshot`
holds (Python ``random``, NumPy, torch's CPU and accelerator generators, the
registered user RNGs).  Two things stay each rank's own:

* the process's setup that a snapshot holds beside the random state (the
  determinism flags, managed environment variables such as the NCCL recipe
  set before ``init_process_group``, torch's defaults, torch.compile's
  config: :data:`SETUP_SOURCES`): a launcher or the script set them, and
  another rank's values must not replace them;
* registered RNGs that say they belong to their rank (``rank_local = True``:
  :class:`~deterministic_ctx.RngStreams`, whose streams vary along parallel
  dimensions and refuse another rank's state).

What travels is the snapshot file of :mod:`~deterministic_ctx.state.checkpoint`
(plain data and tensors, checked by a SHA-256), as a ``uint8`` tensor: its
length first, then its bytes, on the device the backend needs (CPU for gloo,
MPI and UCC; the current CUDA device for NCCL).  Nothing is pickled, so
nothing a rank receives is executed.

Nothing is half-applied, and no rank is left waiting: every rank decodes and
checks the state before anything is applied, then the ranks agree through
one small collective.  If any rank cannot apply it (a registered RNG missing
there, a different device count, ...), every rank raises
:class:`RngStateError`, which names each failing rank and its problem, and no
rank has changed anything.  If applying fails on a rank after that, every rank
goes back to the state it had before the call, then raises.

Per-rank state after a sync: none is left but ``RngStreams``.  The ranks
draw the same numbers from every other source, including those that ``deterministic(rank=...)``
and ``seed_everything(rank=...)`` seed per rank (``random``, NumPy, the
registered RNGs).  That is the point of a sync.  DataLoader workers seeded by
:data:`~deterministic_ctx.parallel.data.seed_worker` still differ per rank: it mixes
the rank into their seeds.  To split the other streams again, reseed them per
rank (``seed_everything(seed, rank="auto")``, or a
``deterministic(seed, rank="auto")`` block).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from .._errors import PUBLIC_MODULE, DeterministicCtxError
from .._torch import accelerator_type
from ..internal import registered_rngs
from ..parallel.keyed import check_count
from .checkpoint import InvalidSnapshotError, decode, encode, from_state_dict
from .snapshot import Snapshot

__all__ = [
    "RngStateError",
    "agree",
    "apply_everywhere",
    "check_everywhere",
    "collective_device",
    "received",
    "sync_rng_state",
]

#: Bytes of each rank's problem that the other ranks are told (the rest is cut).
MESSAGE_BYTES = 1024


class RngStateError(DeterministicCtxError, RuntimeError):
    """One or more ranks could not take a random state, so no rank took it.

    Raised on every rank of the group, by :func:`sync_rng_state` and by
    :class:`~deterministic_ctx.state.dcp.RngState` (saving or loading in a
    checkpoint), when any rank fails: every rank is where it was before the
    call.  ``failures`` maps each failing rank (a global rank) to its problem.
    On a failing rank the exception it met is the ``__cause__``.

    Example:
        >>> err = RngStateError("sync_rng_state from rank 0", {1: "no RNG 'augment' here"})
        >>> err.failures
        {1: "no RNG 'augment' here"}
        >>> print(err)  # doctest: +ELLIPSIS
        sync_rng_state from rank 0: rank 1 failed, so no rank changed its random state: rank 1: ...
    """

    __module__ = PUBLIC_MODULE

    def __init__(self, what: str, failures: Mapping[int, str]) -> None:
        self.what = what
        self.failures: dict[int, str] = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        detail = "; ".join(f"rank {r}: {p}" for r, p in self.failures.items())
        plural = "s" if len(self.failures) > 1 else ""
        super().__init__(
            f"{what}: rank{plural} {ranks} failed, so no rank changed its random state: {detail}"
        )

    def __reduce__(self) -> tuple[type[RngStateError], tuple[str, dict[int, str]]]:
        # Crosses process boundaries (multiprocessing) with its fields intact.
        return type(self), (self.what, self.failures)


def sync_rng_state(src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` the whole random state of rank ``src``.

    A collective: every rank of ``group`` (the default process group if
    ``None``) must call it, with the same ``src`` (a global rank, as for
    ``torch.distributed.broadcast``).  Rank ``src`` keeps its state; every
    other rank ends with a copy of it, from every random source a
    :class:`~deterministic_ctx.Snapshot` holds, registered RNGs included
    (flags, managed environment variables, torch's defaults and rank-local
    RNGs such as ``RngStreams`` stay each rank's own: see the module docstring).
    The same RNGs must be registered under the same keys on every rank, and
    the device generators must match (as ``strict_devices=True``).

    If any rank cannot apply the state, every rank raises
    :class:`RngStateError` and none has changed anything.  Ranks that pass
    different ``src`` get a ``ValueError`` on every rank.  Without an
    initialized process group (one process) there is nothing to send: it
    returns at once, and ``src`` must be 0.

    After a sync, what was per rank is shared: see the module docstring.

    Example:
        >>> import random
        >>> from deterministic_ctx import sync_rng_state
        >>> before = random.getstate()
        >>> sync_rng_state()  # no process group here: one rank, nothing to send
        >>> random.getstate() == before
        True
    """
    src = check_count(src, "src", "a non-negative int (a global rank)")
    # What new_group returns on a rank outside the group: a marker, not a group.
    given: object = group
    marker = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    outside = marker is not None and type(given) is int and given == marker
    is_group = dist.is_available() and isinstance(group, dist.ProcessGroup)
    if group is not None and not is_group and not outside:
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given, but no process group is initialized")
        if src != 0:
            raise ValueError(
                f"src must be a rank of the group: without a process group this process is "
                f"the only rank, 0; got {src}"
            )
        return
    me = -1 if outside else dist.get_rank(group)
    if me < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of group: only "
            f"its members call sync_rng_state with it"
        )
    size = dist.get_world_size(group)
    members = _members(group, size)
    if size == 1:
        if src not in members:
            raise ValueError(
                f"src {src} is not a rank of the group; its ranks are {_ranks(members)}"
            )
        return
    # A src outside the group is found in the first collective, so that every rank
    # raises rather than one, while the others wait for it.
    group_src = members.index(src) if src in members else -1
    device = collective_device(group)
    what = f"sync_rng_state from rank {src}"
    payload = b""
    problem: BaseException | None = None
    if me == group_src:
        try:
            payload = encode(Snapshot.capture().state_dict())
        except Exception as exc:  # e.g. two registered RNGs share a key
            problem = exc
    # One collective checks that every rank names the same src, and a member of
    # the group, and carries src's length and whether it could encode its state:
    # MAX of (src, -src) is (max, -min) over the ranks.
    head = torch.tensor(
        [src, -src, len(payload), int(problem is not None), int(group_src < 0)],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    high, low, length, src_failed, src_outside = (int(v) for v in head.tolist())
    if high != -low:
        raise ValueError(
            f"sync_rng_state: the ranks passed different src (from {-low} to {high}); every "
            f"rank must pass the same"
        )
    if src_outside:
        raise ValueError(f"src {src} is not a rank of the group; its ranks are {_ranks(members)}")
    if src_failed:
        check_everywhere(what, problem, group, device)  # src failed: raises on every rank
    if me == group_src:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    if me == group_src:
        apply_everywhere(None, None, what, group, device)
        return
    snapshot: Snapshot | None = None
    try:
        snapshot = received(buffer.cpu().numpy().tobytes(), f"from rank {src}")
    except Exception as exc:
        problem = exc
    apply_everywhere(snapshot, problem, what, group, device)


#: The sources of a snapshot that are this process's setup, not its random state:
#: determinism flags, managed environment variables (the NCCL recipe set before
#: init_process_group, CUBLAS_WORKSPACE_CONFIG, ...), torch's defaults (threads) and
#: torch.compile's config.  A sync or a DCP load leaves them as this process has them.
SETUP_SOURCES = ("torch.flags", "torch.compile", "torch.defaults", "environ")


def received(
    data: bytes, origin: str, *, keep_rank_local: bool = True, strict_devices: bool = True
) -> Snapshot:
    """The snapshot in a snapshot file's bytes from another rank (or a checkpoint), every
    field checked, that changes only random state when restored (internal): this
    process's own entries stand in for the sender's :data:`SETUP_SOURCES`.

    ``keep_rank_local``: also keep this process's own state of every registered RNG
    that says it belongs to its rank (``rank_local = True``: ``RngStreams`` that vary
    along a parallel dimension), which another rank's state must not replace.
    """
    state = decode(data, origin)
    here = Snapshot.capture().state_dict()["sources"]
    sources = dict(state["sources"])
    for name in SETUP_SOURCES:
        if name in here:
            sources[name] = here[name]
        else:
            sources.pop(name, None)
    if keep_rank_local and "user" in sources:
        local = {key for key, rng in registered_rngs() if getattr(rng, "rank_local", False)}
        if local:
            mine = {entry["key"]: entry for entry in here.get("user", ())}
            sources["user"] = [
                mine.get(entry["key"], entry) if entry["key"] in local else entry
                for entry in sources["user"]
            ]
    # Read as Snapshot.load reads a file: every error names ``origin``.
    return Snapshot._of(
        from_state_dict({**state, "sources": sources}, origin, strict_devices=strict_devices)
    )


def apply_everywhere(
    snapshot: Snapshot | None,
    problem: BaseException | None,
    what: str,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> None:
    """Restore ``snapshot`` on this rank if every rank of ``group`` can take its
    own, else raise :class:`RngStateError` on every rank (internal).

    A collective.  ``problem``: why this rank cannot (then ``snapshot`` is
    ``None``); ``snapshot`` ``None`` with no problem: this rank takes nothing
    but agrees.  Two rounds: the ranks agree on their problems before anything
    is restored, then on the outcome of restoring; if a restore failed
    anywhere, every rank puts back the state it had just before.  Without a
    process group of several ranks it restores or raises ``problem`` itself.
    """
    check_everywhere(what, problem, group, device)  # one process: raises problem itself
    if not _several(group):
        if snapshot is not None:
            snapshot.restore()
        return
    before = None if snapshot is None else Snapshot.capture()
    interrupt: BaseException | None = None
    try:
        if snapshot is not None:
            snapshot.restore()
    except Exception as exc:  # e.g. a registered RNG's setstate refused the state
        problem = exc
    except BaseException as exc:  # a signal: finish the protocol, then re-raise it
        problem = interrupt = exc
    failures = agree(problem, group, device)
    if failures:
        error = RngStateError(what, failures)
        error.__cause__ = problem
        if before is not None:
            try:
                before.restore()
            except Exception as rollback:  # RestoreError: this rank is left half-way
                raise rollback from error
        if interrupt is not None:
            raise interrupt from error
        raise error
    if interrupt is not None:
        raise interrupt


def check_everywhere(
    what: str,
    problem: BaseException | None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise :class:`RngStateError` on every rank of ``group`` if any rank has a
    problem (internal).

    A collective where the group has several ranks (see :func:`agree`); else
    ``problem`` itself is raised, if any.
    """
    if not _several(group):
        if problem is not None:
            raise problem
        return
    failures = agree(problem, group, device)
    if failures:
        raise RngStateError(what, failures) from problem


def agree(
    problem: BaseException | str | None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[int, str]:
    """Every failing rank's problem (by global rank), on every rank of ``group`` (internal).

    A collective: each rank passes its problem, or ``None``.  One ``all_reduce``
    of a flag per rank; only if a flag is set, a second one carries the first
    :data:`MESSAGE_BYTES` bytes of each problem.  Tensors only.
    """
    device = collective_device(group) if device is None else device
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    flags = torch.zeros(size, dtype=torch.int32, device=device)
    if problem is not None:
        flags[me] = 1
    dist.all_reduce(flags, group=group)
    failed = [int(i) for i in flags.nonzero().flatten().tolist()]
    if not failed:
        return {}
    # A row per rank, each written by its rank alone: a sum gathers them.
    text = torch.zeros((size, MESSAGE_BYTES), dtype=torch.uint8, device=device)
    mine = (_text(problem) or "").encode("utf-8")[:MESSAGE_BYTES]
    if mine:
        text[me, : len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    dist.all_reduce(text, group=group)
    rows = text.cpu()
    members = _members(group, size)
    return {
        members[i]: rows[i].numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
        for i in failed
    }


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend sends (internal): CPU for
    gloo, MPI and UCC (and a group with a CPU backend among others), the
    current CUDA device for NCCL, else the current accelerator, else CPU.

    Example:
        >>> import torch.distributed as dist
        >>> from deterministic_ctx.state.sync import collective_device
        >>> store = dist.HashStore()
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> collective_device()
        device(type='cpu')
        >>> dist.destroy_process_group()
    """
    backend = str(dist.get_backend(group)).lower()
    if any(name in backend for name in ("gloo", "mpi", "ucc")):
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    device_type = accelerator_type()
    if device_type:
        # torch.accelerator (torch >= 2.6), else the device's own module.
        index = getattr(getattr(torch, "accelerator", None), "current_device_index", None)
        index = index or getattr(getattr(torch, device_type, None), "current_device", None)
        if index is not None:
            return torch.device(device_type, index())
    return torch.device("cpu")


def _members(group: dist.ProcessGroup | None, size: int) -> list[int]:
    """The global rank of each group rank."""
    if group is None:
        return list(range(size))
    return [dist.get_global_rank(group, i) for i in range(size)]


def _ranks(members: list[int]) -> str:
    if members == list(range(members[0], members[0] + len(members))) and len(members) > 2:
        return f"{members[0]} to {members[-1]}"
    return ", ".join(str(m) for m in members)


def _several(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _text(problem: BaseException | str | None) -> str | None:
    if problem is None or isinstance(problem, str):
        return problem
    if isinstance(problem, InvalidSnapshotError):
        return str(problem)  # it names itself: "invalid snapshot from rank 0: ..."
    return f"{type(problem).__name__}: {problem}"
