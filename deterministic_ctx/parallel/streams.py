"""Parallel RNG streams: named torch generator states, per rank along chosen dimensions.

Tensor, pipeline and expert parallelism need random numbers that agree along
some dimensions of the process grid and differ along others: dropout inside a
tensor-parallel region must differ across tensor-parallel (TP) ranks, since
each holds another shard of the activations, and agree across data-parallel
(DP) ranks' copies of the model.  Megatron-LM keeps such streams
(``CudaRNGStatesTracker``) seeded ``seed + 2718 + tp_rank`` and ``seed + 1024
+ 100 * ep_rank + etp_rank``: offsets, which collide across seeds and ranks.

:class:`RngStreams` takes the process's coordinates along named dimensions
(a mapping ``{"dp": (rank, size), "tp": (rank, size)}`` or a
``DeviceMesh`` with dimension names), and streams each declared with the
dimensions it *varies along*.  A stream's seed is
``derive_seed(base, "stream", name, dim, rank_along_dim, ...)`` over those
dimensions only (:func:`~deterministic_ctx.derive_seed`, no offsets): equal on
ranks that share those coordinates, unrelated elsewhere.  ``with
streams.fork(name):`` is a block of the engine over torch's default
generators (the CPU one, and every device of each accelerator type this build
can initialize; a fork never initializes one): it enters the stream's state,
seeded from its seed at its first fork, and on exit keeps the stream's
advance and puts the caller's state back, so the next fork continues where
the last one stopped.

**Blocks, snapshots, checkpoints.**  The streams are registered as a user RNG
(``register_rng(..., key=key, shared=True)``): every
:class:`~deterministic_ctx.deterministic` block captures and restores them,
and starts them over from the block's *shared* seed ``s`` (the seed torch's
generators get), never from the per-rank seed ``rank=`` gives ``random`` and
NumPy, which would make a TP stream differ across DP ranks.  The base is
``derive_seed(s, "user", key)``, which is also what ``RngStreams(s, ...)``
starts from: the streams draw the same numbers after construction with ``s``,
after ``seed_everything(s)`` and at the entry of ``deterministic(seed=s)``, on
every rank.  :class:`~deterministic_ctx.Snapshot` holds their states, and a
saved snapshot restores them where an ``RngStreams`` with the same ``key``
declares the same streams; a stream saved by a process with other
coordinates along its dimensions is refused (``ValueError`` at restore),
never restored on the wrong rank.

**Per-rank dropout.**  torch's generators keep one seed on every rank, so that
model initialization agrees.  For dropout that differs across DP ranks,
declare a stream that varies along ``"dp"`` and fork it around the forward
pass: what runs outside the fork (building the model, now or later) still
draws the shared stream.  ``torch.utils.checkpoint`` recomputes with the
stream's state (it saves the generator state inside the fork).

**DTensor** (``torch.distributed.tensor._random``, read in torch 2.13).
DTensor keeps no generator state of its own: on a CUDA-like mesh its
``OffsetBasedRNGTracker`` reads the current device's default generator, runs
each random op at a per-shard Philox offset, then sets that generator to the
old offset plus the whole tensor's size, on every rank alike.  Inside a fork
it therefore draws from, and advances, the forked stream (a test on a GPU
checks it).  Its shards are right only if every rank of the DTensor's mesh
holds the same state, so fork streams that agree along that mesh's
dimensions: vary along *other* dimensions (``"dp"`` for a TP-sharded DTensor).
A stream that varies along the mesh's dimensions breaks DTensor's replicas.
When the tracker is made lazily, by the first random DTensor op, it
broadcasts the default group's rank 0 generator state to every rank
(``run_state_sync``); made inside a fork, that would overwrite the stream on
every rank with rank 0's.  Make it outside any fork first:
``torch.distributed.tensor._random.manual_seed(seed, mesh)`` makes it without
the broadcast (and calls ``torch.manual_seed(seed)``: torchtitan's way).
Inside ``deterministic(seed=s, rank=...)`` torch's generators hold ``s`` on
every rank, as DTensor requires.  On a CPU mesh torch has no tracker (it warns
at every random op): each rank draws its local shard from its own CPU
generator, so ranks with equal states draw equal shards; a fork applies as to
any op.

**Threads and nesting.**  A fork is a block of the engine over those
generators: it takes the process lock as every block does (a fork in one
thread waits while another thread is inside a block or a fork), its restores
complete if interrupted, and a generator that cannot be put back is a
:class:`~deterministic_ctx.RestoreError` once every other one is back.  Forks
in several threads take turns, as blocks do, and continue the stream where the
last one, in any thread, left it.  Leave forks in reverse order of entry
(``with`` does; an exit out of order raises
:class:`~deterministic_ctx.MisuseError`, a ``RuntimeError``, and still leaves
the fork: once the later forks are left too, the state from before them all
is back).  An inner fork of a stream already forked continues it, also with
forks of other streams in between, of this ``RngStreams`` or another.  A
decorated generator (:func:`~deterministic_ctx.reproducible`) may hold a fork
open across its ``yield``: its world, its fork (the engine carries the fork's
block with the generator's).  Seeding or restoring a snapshot inside a fork is
undone for torch's generators by the fork's exit, which puts back what it
found at its entry; seeding starts the streams over (a block's entry does too)
and the fork's exit then keeps nothing.

**Devices.**  A fork isolates every device of an accelerator type, not only
the current one: all of them start from the stream's seed at its first fork,
and all come back at its exit, as in a block.  On a device type not yet
initialized, the first fork queues the stream's seed for initialization
(never initializing the device), and the exit puts torch's queue back.

**Cost.**  A fork is a block over a few generators: two captures and two
restores of each (a CPU state is 5 KB), plus the block's lock and completion
step; a fork inside a fork of another stream keeps that stream's state from
the world its block captured at its start.  Side by side with the fork it
replaced, which swapped the states by hand (one process, medians of 7 runs of
CPU time on 2 busy cores, CPU only): 10 µs against 5.3 µs, 12 to 13 µs with a
draw against 7.4 to 7.9 µs, and 20 µs for a fork inside a fork of another
stream against 11 µs; ``torch.random.fork_rng(devices=[])`` took 4.5 µs.  A
block with a first fork in it (which seeds the stream, through a block of its
seed) took 1.25 times what it took before.  Of a fork's 10 µs, the generator
states take 2.0, the engine's capture and restore loops over the sources 2.4,
the block's lock, tracing check and completion step 2.7, and the fork's own
bookkeeping 2.6.  With CUDA initialized, every device's generator is read and
written (a 16-byte state each).  With streams registered, a block pays what any registered RNG costs
it, plus a few microseconds.
"""

from __future__ import annotations

import itertools
import secrets
import sys
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._errors import MisuseError
from ..internal import (
    Block,
    Settings,
    World,
    complete,
    derive_seed,
    drain_signals,
    generator_sources,
    inside_block,
    register_rng,
    source_named,
    validate_seed,
)
from .keyed import check_count

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RngStreams"]

#: The sources of the generators a fork isolates: torch's CPU generator, and
#: the default generators of each accelerator type this build can initialize
#: (all its devices; the source never initializes one).  A type this build can
#: never initialize (CUDA on a CPU build) has no generator to draw from.
_SOURCES = (
    source_named("torch.cpu"),
    *(
        source
        for source in generator_sources()
        if source.device_type is not None and not source.applies_nothing
    ),
)

#: Each stream's state in a stream world: ``name -> (seed, world)``, the seed
#: it started from and its generators as its last fork left them, captured over
#: :data:`_SOURCES` (or over fewer, as read from a checkpoint: a fork then
#: seeds the rest).  Never mutated once made (a fork's exit builds a new one).
_Streams = dict[str, tuple[int, World]]
#: The same as plain data, what ``getstate()`` returns and a checkpoint holds:
#: ``name -> (seed, {device: uint8 state})``, devices ``"cpu"``, ``"cuda:0"``, ...
_Plain = dict[str, tuple[int, dict[str, torch.Tensor]]]

#: The identity of a stream world (see ``_StreamStates``): unique in this
#: process, and started at random so that a token loaded from another
#: process's checkpoint does not name one of this process's open forks.
_TOKENS = itertools.count(secrets.randbits(62))


class _StreamStates:
    """What blocks and snapshots see of an :class:`RngStreams`: a random-like
    object (``seed`` / ``getstate`` / ``setstate``, see ``register_rng``).

    Its state is ``(base, token, states)``: the base seed every stream's seed
    is derived from, the token of this *world*, and the streams' states.
    ``seed()`` starts a new world (a new token, no state: each stream starts
    from its seed at its next fork); ``setstate`` brings a world back, token
    included.  A fork remembers the token it was opened in, so an inner fork
    of the same stream in the same world continues it, while one in a block
    entered inside the fork (a new world) starts the block's stream.

    Kept apart from :class:`RngStreams` so that the public class has no
    ``seed()``/``getstate()`` of its own, and holds no reference back to it:
    the registry's weak reference dies with the ``RngStreams``.
    """

    __slots__ = (
        "__weakref__",
        "_base",
        "_coords",
        "_known",
        "_plain",
        "_seeds",
        "_streams",
        "_token",
        "_varies",
    )

    #: A state of this rank's: ``sync_rng_state`` keeps it rather than take another
    #: rank's (a stream that varies along a dimension would be refused anyway).
    rank_local = True

    def __init__(self, base: int, coords: dict[str, tuple[int, int]]) -> None:
        self._coords = coords
        #: Declared streams: name -> the dimensions it varies along, sorted.
        self._varies: dict[str, tuple[str, ...]] = {}
        self._base = base
        self._token = next(_TOKENS)
        self._streams: _Streams = {}
        #: ``(streams, plain)``: the plain form ``getstate`` made of ``streams`` last.
        self._plain: tuple[_Streams, _Plain] | None = None
        #: Stream seeds: ``(base, name) -> seed``.
        self._seeds: dict[tuple[int, str], int] = {}
        #: ``id(plain) -> (plain, base, streams)`` for plain states made or checked
        #: here (kept, so no id is reused): restoring one again takes its streams
        #: without the checks, which would otherwise cost every block microseconds.
        self._known: dict[int, tuple[_Plain, int, _Streams]] = {}

    @property
    def _open(self) -> list[_Frame]:
        """This object's open forks that swapped, in order of entry."""
        return [frame for frame in _OPEN if frame.states is self]

    def _remember(self, plain: _Plain, base: int, streams: _Streams) -> None:
        known = self._known
        if len(known) >= 16:  # a bound: forgetting costs one check later
            known.clear()
        known[id(plain)] = (plain, base, streams)

    # -- the random-like protocol ------------------------------------------------

    def seed(self, seed: int) -> None:
        """Start every stream over from ``seed`` (a block's entry does this)."""
        self._base = validate_seed(seed)
        self._token = next(_TOKENS)
        self._streams = {}

    def getstate(self) -> tuple[int, int, _Plain]:
        streams, made = self._streams, self._plain
        if made is not None and made[0] is streams:
            plain = made[1]
        else:  # made once per change of the streams, not per block
            plain = {name: (seed, _plain_states(world)) for name, (seed, world) in streams.items()}
            self._plain = (streams, plain)
            self._remember(plain, self._base, streams)
        return (self._base, self._token, plain)

    def setstate(self, state: object) -> None:
        """Bring back a state of :meth:`getstate`, checked first (it may come
        from a file): ``ValueError`` for a stream not declared here, or one
        drawn from another seed than its coordinates here give it."""
        if type(state) is not tuple or len(state) != 3:
            raise ValueError(f"expected (base, token, states), got {type(state).__name__}")
        base, token, plain = state
        base = validate_seed(base, name="the streams' base seed")
        if type(token) is not int:
            raise ValueError(f"the streams' token must be an int, got {type(token).__name__}")
        known = self._known.get(id(plain))
        if known is not None and known[0] is plain and known[1] == base:
            streams = known[2]
        else:
            if type(plain) is not dict:
                raise ValueError(f"the streams' states must be a dict, got {type(plain).__name__}")
            streams = {name: self._imported(base, name, entry) for name, entry in plain.items()}
            self._remember(plain, base, streams)
        self._base, self._token, self._streams = base, token, streams
        self._plain = (streams, plain)

    def _imported(self, base: int, name: object, entry: object) -> tuple[int, World]:
        if name not in self._varies:
            declared = ", ".join(map(repr, self._varies)) or "none"
            raise ValueError(
                f"the snapshot holds stream {name!r}, which is not declared here "
                f"(declared: {declared}): add() it before restoring"
            )
        assert isinstance(name, str)
        if type(entry) is not tuple or len(entry) != 2 or type(entry[1]) is not dict:
            raise ValueError(f"stream {name!r}: expected (seed, {{device: state}})")
        seed, devices = entry
        expected = self.seed_for(base, name)
        if seed != expected:
            raise ValueError(
                f"stream {name!r} in the snapshot was drawn from seed {seed!r}, but here it "
                f"is seeded {expected} ({self._where(name)}): the snapshot was saved by a "
                f"process with other coordinates along the dimensions the stream varies "
                f"along, or the stream varied along other dimensions there; restoring it "
                f"would give this rank another rank's random numbers"
            )
        return expected, _world_from_plain(name, devices)

    def _where(self, name: str) -> str:
        varies = self._varies[name]
        if not varies:
            return "it varies along no dimension"
        return ", ".join(
            f"{dim}={self._coords[dim][0]} of {self._coords[dim][1]}" for dim in varies
        )

    # -- seeds ---------------------------------------------------------------------

    def seed_for(self, base: int, name: str) -> int:
        """The seed of stream ``name`` under ``base``, remembered: blocks start the
        streams over from the same few bases again and again (a stream's dimensions
        never change once declared, so neither does its seed)."""
        seed = self._seeds.get((base, name))
        if seed is None:
            if len(self._seeds) >= 256:  # a bound: forgetting costs one derivation later
                self._seeds.clear()
            keys: list[int | str] = ["stream", name]
            for dim in self._varies[name]:
                keys += (dim, self._coords[dim][0])
            seed = self._seeds[base, name] = derive_seed(base, *keys, bits=64)
        return seed

    def record(self, name: str, token: int, world: World) -> None:
        """Keep the world a fork of ``name`` opened in world ``token`` left, if
        that world is still the current one (a new one replaced it: nothing to keep)."""
        if token != self._token:
            return
        old = self._streams
        entry = old.get(name)
        seed = entry[0] if entry is not None else self.seed_for(self._base, name)
        self._streams = {**old, name: (seed, world)}

    def __repr__(self) -> str:
        return f"<RngStreams states {sorted(self._varies)}>"


def _plain_states(world: World) -> dict[str, torch.Tensor]:
    """A stream's world as ``{device: uint8 state}`` (``"cpu"``, ``"cuda:0"``, ...),
    through each source's export: an accelerator type not initialized has none."""
    out: dict[str, torch.Tensor] = {}
    for source, state in zip(world.sources, world.states, strict=True):
        device_type = source.device_type
        if device_type is None:
            # The CPU generator's state is a uint8 tensor that nothing writes to:
            # plain already.  Its export would copy it, which a block entered after
            # every fork would pay (a snapshot copies it when it saves it).
            out["cpu"] = (
                state if type(state) is torch.Tensor else source.export_state(state)["state"]
            )
        else:
            for index, value in enumerate(source.export_state(state)["states"]):
                out[f"{device_type}:{index}"] = value
    return out


def _world_from_plain(name: str, devices: dict[Any, Any]) -> World:
    """The checked inverse of :func:`_plain_states`, through each source's import
    (``ValueError`` names the stream and the device).  A device type this build
    cannot use is left out, and so is one the state has nothing for: the fork
    seeds it from the stream's seed."""
    cpu = None
    by_type: dict[str, dict[int, Any]] = {}
    for key, value in devices.items():
        if key == "cpu":
            cpu = value
            continue
        kind, colon, index = key.partition(":") if type(key) is str else ("", "", "")
        if not (kind and colon and index.isdigit() and index == str(int(index))):
            raise ValueError(
                f"stream {name!r}: expected {{device: uint8 tensor}} with devices 'cpu', "
                f"'cuda:0', ..., got the key {key!r:.80}"
            )
        by_type.setdefault(kind, {})[int(index)] = value
    sources = []
    states = []
    for source in _SOURCES:
        device_type = source.device_type
        path = f"stream {name!r}, device {device_type or 'cpu'}"
        if device_type is None:
            if cpu is None:
                continue
            state = source.import_state({"state": cpu}, path)
        else:
            found = by_type.get(device_type)
            if not found:
                continue
            if sorted(found) != list(range(len(found))):
                raise ValueError(
                    f"{path}: expected devices 0 to {len(found) - 1}, got {sorted(found)}"
                )
            data = {"initialized": True, "states": [found[i] for i in range(len(found))]}
            state = source.import_state(data, path)
            if state is None:  # no device here to restore
                continue
        sources.append(source)
        states.append(state)
    return World(tuple(sources), tuple(states))


@dataclass(slots=True, eq=False)  # eq=False: frames are found by identity
class _Frame:
    """An open fork that swapped: its streams, stream and world, and its block."""

    states: _StreamStates
    name: str
    #: The stream world it was opened in: ``states``' token then.  The fork is
    #: in the current world while ``states`` has that token; a block entered
    #: inside it (or a suspended decorated generator's, outside) has another.
    token: int
    #: The fork's block: the engine's, over :data:`_SOURCES`.
    block: Block
    #: For a fork of a stream open lower in its world, under forks of other
    #: streams: the frame entered right above that stream's, whose ``held``
    #: is the stream's live state.
    holder: _Frame | None
    #: The fork whose stream was live in its world at this one's entry (``None``:
    #: none was), and that stream's state then: a fork of that stream inside this
    #: one continues from it and leaves its advance here, which this fork's exit
    #: puts back (if ``below`` is still open).
    below: _Frame | None = None
    held: World | None = None
    #: Whether a fork inside this one moved ``held`` on.
    moved: bool = False
    #: The block of the stream's seed a first fork starts and commits inside its
    #: own (``stop()`` does nothing once it is committed).
    seeding: Block | None = None


#: The open forks that swapped, of every :class:`RngStreams`, in order of entry:
#: which stream is live in which world (the engine's stack holds their blocks,
#: not their streams).  One list for all: torch's generators hold one stream at
#: a time, whichever object it belongs to.
_OPEN: list[_Frame] = []


class _Fork:
    """``with streams.fork(name):`` (see :meth:`RngStreams.fork`)."""

    __slots__ = ("_frames", "_name", "_states")

    def __init__(self, states: _StreamStates, name: str) -> None:
        self._states = states
        self._name = name
        #: Per entry of this object, in order: its frame, or ``None`` where the
        #: stream was live already (nothing swapped).
        self._frames: list[_Frame | None] = []

    def __enter__(self) -> None:
        # Nothing half-applied: an entry that anything stops is left, its undo
        # completed.  Written out, as a block's entry (``core/context.py``): an
        # interrupt delivered as a helper that entered returns (Python 3.10, a
        # PEP 523 frame evaluator) must land under this frame's handler, or
        # ``with`` calls no ``__exit__``.
        depth = len(self._frames)
        try:
            self._enter()
        except BaseException:
            complete(self._leave_from, depth)
            raise

    def _enter(self) -> None:
        """Record an entry (a frame, or ``None`` where nothing is swapped), then
        apply it; nothing is applied before it is recorded.  Pending signal
        handlers run at its end, while the entry can still be rolled back."""
        states, name = self._states, self._name
        # The open forks of the current world (a suspended decorated generator's
        # stay open in its own world), innermost first, down to this stream's:
        # ``top``, the innermost, is live; ``holder``, the one entered right
        # after the stream's, holds the stream's live state.
        top: _Frame | None = None
        holder: _Frame | None = None
        # Outside every block no fork of this thread is open: an open fork of the
        # current world is another thread's (whose lock the block below waits
        # for), and this thread's state is nobody's stream.  Inside one, this
        # thread holds the lock: no other thread's fork is open now.
        for other in reversed(_OPEN) if _OPEN and inside_block() else ():
            if other.token != other.states._token:
                continue
            if other.states is states and other.name == name:  # forked already here
                if holder is None:  # and it is the live stream: nothing to swap
                    self._frames.append(None)
                    drain_signals()
                    return
                break
            top = top or other
            holder = other
        else:
            holder = None
        sources = _SOURCES
        frame = _Frame(states, name, states._token, Block(None, sources), holder)
        # Recorded first: from here ``__enter__`` leaves the frame's blocks on any
        # exception (stopping a block not started yet does nothing).
        self._frames.append(frame)
        block = frame.block
        block.start()
        # Under the lock from here: the world and the stream's state are read after
        # any other thread's fork has left.
        frame.token = states._token
        if top is not None:  # the stream live until now, for a fork of it inside
            # The world the block captured at its start: that stream's state now.
            assert isinstance(block.outer, World)
            frame.below, frame.held = top, block.outer
        if holder is not None:
            start = holder.held
        else:
            entry = states._streams.get(name)
            start = entry[1] if entry is not None else None
        if start is None or (start.sources is not sources and start.sources != sources):
            # Seeded where the stream has no state yet for every generator (its
            # first fork in this world; a state read from a checkpoint lacks a
            # device): a block of the stream's seed, kept.
            seed = states.seed_for(states._base, name)
            frame.seeding = Block(Settings(seed, False, None, False), sources)
            frame.seeding.start()
            frame.seeding.commit()
            if start is not None:  # restore only what the fork's block puts back
                pairs = [
                    p for p in zip(start.sources, start.states, strict=True) if p[0] in sources
                ]
                start = World(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))
        if start is not None:
            start.restore()
        _OPEN.append(frame)
        drain_signals()

    def _leave_from(self, depth: int) -> None:
        """Leave this object's entries from the ``depth``-th on (the latest one,
        wherever its entry or exit stopped); idempotent."""
        frames = self._frames
        while len(frames) > depth:
            entry = frames[-1]
            if entry is None:
                del frames[-1]
            else:
                self._drop(entry)

    def _drop(self, frame: _Frame) -> None:
        """Leave ``frame``'s block (the engine's ``stop()``: idempotent, completed
        if interrupted) and forget the frame, wherever an entry or exit stopped."""
        try:
            if frame.seeding is not None:  # left open between its start and commit
                frame.seeding.stop()
            frame.block.stop()
        finally:
            if frame in _OPEN:
                _OPEN.remove(frame)
            if self._frames and self._frames[-1] is frame:
                del self._frames[-1]

    def __exit__(self, *exc: object) -> None:
        # Protected from the first line, as a block's exit: an exception raised
        # anywhere in it leaves the fork all the same (the engine hands the
        # caller's state on to a block still open above it), so that nothing
        # stays applied or locked.  Until its last line the exit's entry is the
        # latest one.
        try:
            frames = self._frames
            if not frames:
                raise MisuseError(f"fork({self._name!r}) exited without being entered")
            frame = frames[-1]
            if frame is not None:  # else the stream was live: nothing was swapped
                self._leave(frame)
            del frames[-1]
        except BaseException:
            if self._frames:
                self._leave_from(len(self._frames) - 1)
            raise

    def _leave(self, frame: _Frame) -> None:
        # The innermost open fork (the usual case) has none entered after it.
        later = None if _OPEN[-1] is frame else _later(frame)
        if later is not None:
            raise MisuseError(
                f"fork({self._name!r}) exited while fork({later.name!r}), entered after it, is "
                f"still open: forks swap torch's process-global generators and must be "
                f"left in reverse order of entry (interleaved tasks or threads cannot "
                f"share them)"
            )
        advanced = World.capture(_SOURCES)
        # Kept before the caller's state comes back: a restore that fails
        # (RestoreError) or is interrupted leaves the fork all the same.
        holder = frame.holder
        if holder is None:
            self._states.record(self._name, frame.token, advanced)
        else:  # the stream lives on in the holder's held state
            holder.held = advanced
            holder.moved = True
        frame.block.stop()
        _OPEN.remove(frame)
        # The stream below advanced inside: its state, not the entry's (unless
        # its fork was left meanwhile, out of order).
        if frame.moved and frame.below in _OPEN:
            assert frame.held is not None
            frame.held.restore()


def _later(frame: _Frame) -> _Frame | None:
    """An open fork entered after ``frame`` in its world, which must be left
    first; ``None`` if ``frame`` is the innermost.  Its world: the forks of its
    object opened in the same stream world, and, while that world is the
    current one, the current forks of every other object."""
    states, token = frame.states, frame.token
    current = token == states._token
    for other in reversed(_OPEN):
        if other is frame:
            return None
        if (
            other.token == token
            if other.states is states
            else (current and other.token == other.states._token)
        ):
            return other
    return None


class RngStreams:
    """Named RNG streams that differ along some parallel dimensions and agree along the others.

    Each stream is declared with :meth:`add` and the dimensions it varies
    along; its seed is ``derive_seed(base, "stream", name, dim, rank, ...)``
    over those dimensions' ranks (no offsets, so no collisions), where
    ``base`` is ``derive_seed(seed, "user", key)``.  ``with
    streams.fork(name):`` is a block over torch's default generators (CPU,
    and every device of the accelerator types this build can initialize)
    that runs in the stream and keeps its advance.  The streams are registered with
    ``register_rng(..., key=key, shared=True)``: blocks restart them from their
    shared seed and restore them on exit, snapshots and checkpoints hold them
    (see the module docstring for the rules, DTensor and threads).

    Args:
        seed: an int in ``0 .. 2**32 - 1``, the same on every rank (as given
            to ``seed_everything`` or ``deterministic``).
        ranks: this process's coordinates: a mapping of dimension names to
            ``(rank, size)`` with ``0 <= rank < size``, a
            ``torch.distributed.device_mesh.DeviceMesh`` with
            ``mesh_dim_names`` (its coordinates are read once, here), or
            ``None`` (one process: streams vary along no dimension).
        key: the registration key, which a saved snapshot finds the streams
            by; distinct objects need distinct keys.

    Example (two data-parallel ranks, run in turn here):

        >>> import torch
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx import RngStreams
        >>> def step(dp_rank):
        ...     streams = RngStreams(0, {"dp": (dp_rank, 2), "tp": (0, 2)})
        ...     streams.add("tensor-parallel", varies=["tp"])
        ...     streams.add("dropout", varies=["dp"])
        ...     with deterministic(seed=0, rank=dp_rank):
        ...         init = torch.rand(2)  # model initialization: torch's shared stream
        ...         with streams.fork("dropout"):
        ...             mask = torch.rand(2)
        ...         with streams.fork("tensor-parallel"):
        ...             tp = torch.rand(2)
        ...     return init, mask, tp
        >>> zero, one = step(0), step(1)
        >>> [torch.equal(a, b) for a, b in zip(zero, one)]  # init, dropout, tensor-parallel
        [True, False, True]
    """

    __slots__ = ("_key", "_seed", "_states")

    def __init__(
        self,
        seed: int,
        ranks: Mapping[str, tuple[int, int]] | DeviceMesh | None = None,
        *,
        key: str = "streams",
    ) -> None:
        seed = validate_seed(seed)
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r:.80}")
        self._seed = seed
        self._key = key
        self._states = _StreamStates(derive_seed(seed, "user", key, bits=32), _coordinates(ranks))
        register_rng(self._states, key=key, shared=True)

    def add(self, name: str, *, varies: Iterable[str] = ()) -> None:
        """Declare stream ``name``, different on ranks whose coordinates along
        ``varies`` differ, and alike on ranks that share them.

        Declaring it again with the same dimensions does nothing; with others
        it is a ``ValueError``.

        Example:
            >>> from deterministic_ctx import RngStreams
            >>> streams = RngStreams(0, {"dp": (0, 2), "tp": (1, 2)})
            >>> streams.add("tp", varies=["tp"])
            >>> streams.add("tp", varies=["dp"])
            Traceback (most recent call last):
            ...
            ValueError: stream 'tp' is declared already, varying along ('tp',), not ('dp',)
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__} {name!r:.80}")
        if not name:
            raise ValueError("name must be a non-empty str")
        dims = _dimensions(varies, self._states._coords)
        declared = self._states._varies
        if name in declared:
            if declared[name] != dims:
                raise ValueError(
                    f"stream {name!r} is declared already, varying along {declared[name]}, "
                    f"not {dims}"
                )
            return
        declared[name] = dims

    def fork(self, name: str) -> AbstractContextManager[None]:
        """A context manager that runs its body with stream ``name`` in torch's generators.

        A block of the engine over torch's CPU generator and every device of
        the accelerator types this build can initialize (a fork never
        initializes one): on entry the generators are set to the stream's
        state, seeded with :meth:`seed_of` at its first fork; on exit, by any
        route, the stream keeps its advance and the caller's generator states
        come back.  A fork inside a fork of the same stream continues it.
        The object can be entered again; leave forks in reverse order of
        entry.  Like any block, a fork waits for blocks of other threads, and
        a generator that cannot be put back is a
        :class:`~deterministic_ctx.RestoreError` once the others are back.

        Example:
            >>> import torch
            >>> from deterministic_ctx import deterministic
            >>> from deterministic_ctx import RngStreams
            >>> streams = RngStreams(0)
            >>> streams.add("noise")
            >>> with deterministic(seed=1):
            ...     with streams.fork("noise"):
            ...         a = torch.rand(1)
            ...     with streams.fork("noise"):
            ...         b = torch.rand(1)
            ...     outside = torch.rand(1)
            >>> with deterministic(seed=1):  # torch's own stream, as if no fork ran
            ...     bool(torch.rand(1) == outside)
            True
            >>> bool(a != b)  # the second fork went on from the first
            True
        """
        if name not in self._states._varies:
            declared = ", ".join(map(repr, self._states._varies)) or "none yet: add() them"
            raise ValueError(f"no stream named {name!r:.80}; declared: {declared}")
        return _Fork(self._states, name)

    def seed_of(self, name: str) -> int:
        """The seed stream ``name`` starts from now (a 64-bit int): inside a
        block, the block's.  Also for seeding torch by hand with it.

        Example:
            >>> from deterministic_ctx import derive_seed
            >>> from deterministic_ctx import RngStreams
            >>> streams = RngStreams(0, {"tp": (1, 2)})
            >>> streams.add("tp", varies=["tp"])
            >>> base = derive_seed(0, "user", "streams")
            >>> streams.seed_of("tp") == derive_seed(base, "stream", "tp", "tp", 1, bits=64)
            True
        """
        if name not in self._states._varies:
            raise ValueError(f"no stream named {name!r:.80}")
        states = self._states
        return states.seed_for(states._base, name)

    @property
    def seed(self) -> int:
        """The seed given to the constructor.

        Example:
            >>> from deterministic_ctx import RngStreams
            >>> RngStreams(7).seed
            7
        """
        return self._seed

    @property
    def key(self) -> str:
        """The key the streams are registered (and saved) under.

        Example:
            >>> from deterministic_ctx import RngStreams
            >>> RngStreams(7, key="model-parallel").key
            'model-parallel'
        """
        return self._key

    @property
    def ranks(self) -> dict[str, tuple[int, int]]:
        """This process's ``(rank, size)`` along each dimension.

        Example:
            >>> from deterministic_ctx import RngStreams
            >>> RngStreams(7, {"tp": (1, 4)}).ranks
            {'tp': (1, 4)}
        """
        return dict(self._states._coords)

    @property
    def streams(self) -> dict[str, tuple[str, ...]]:
        """Each declared stream and the dimensions it varies along.

        Example:
            >>> from deterministic_ctx import RngStreams
            >>> streams = RngStreams(7, {"ep": (0, 2), "etp": (1, 2)})
            >>> streams.add("expert", varies=["etp", "ep"])
            >>> streams.streams
            {'expert': ('ep', 'etp')}
        """
        return dict(self._states._varies)

    def __repr__(self) -> str:
        return (
            f"RngStreams(seed={self._seed}, ranks={self.ranks}, streams={self.streams}"
            + ("" if self._key == "streams" else f", key={self._key!r}")
            + ")"
        )


def _dimensions(varies: object, coords: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    if isinstance(varies, str) or not isinstance(varies, Iterable):
        raise TypeError(
            f"varies must be a list of dimension names (of ranks: {', '.join(coords) or 'none'}), "
            f"got {type(varies).__name__} {varies!r:.80}"
        )
    dims = list(varies)
    for dim in dims:
        if dim not in coords:
            raise ValueError(
                f"varies: {dim!r:.80} is not a dimension of ranks "
                f"(there are: {', '.join(map(repr, coords)) or 'none'})"
            )
    if len(set(dims)) != len(dims):
        raise ValueError(f"varies names a dimension twice: {dims}")
    return tuple(sorted(dims))


def _coordinates(ranks: object) -> dict[str, tuple[int, int]]:
    """``{dimension: (rank, size)}`` from what ``ranks=`` accepts, checked."""
    if ranks is None:
        return {}
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is not None and isinstance(ranks, mesh_module.DeviceMesh):
        return _mesh_coordinates(ranks)
    if not isinstance(ranks, Mapping):
        raise TypeError(
            f"ranks must be a mapping of dimension names to (rank, size), a DeviceMesh with "
            f"dimension names, or None, got {type(ranks).__name__} {ranks!r:.80}"
        )
    coords: dict[str, tuple[int, int]] = {}
    for dim, value in ranks.items():
        if not isinstance(dim, str) or not dim:
            raise TypeError(f"ranks: dimension names must be non-empty str, got {dim!r:.80}")
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"ranks[{dim!r}] must be a pair (rank, size), got {value!r:.80}")
        rank, size = (check_count(v, f"ranks[{dim!r}]", "ints", low=None) for v in value)
        if not 0 <= rank < size:
            raise ValueError(
                f"ranks[{dim!r}] must be (rank, size) with 0 <= rank < size, got {value!r:.80}"
            )
        coords[dim] = (rank, size)
    return coords


def _mesh_coordinates(mesh: Any) -> dict[str, tuple[int, int]]:
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            "ranks: the DeviceMesh has no dimension names, and streams name the dimensions "
            "they vary along: build it with init_device_mesh(..., mesh_dim_names=(...))"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("ranks: this process is not part of the DeviceMesh")
    return {str(name): (int(coordinate[i]), int(mesh.size(i))) for i, name in enumerate(names)}
