"""The immutable description of what a block applies, and how ranks get their seeds.

Per-rank seeding (``rank=``): Python ``random``, NumPy's global RNG and the
registered user RNGs are the *data* side of a program (augmentation, sampling
in user code) and are seeded per rank; torch's generators drive model
initialization, which must be identical on every rank, and keep the shared
seed.  Rank 0 uses the seed itself, so a one-process run, ``rank=None`` and
rank 0 of a multi-process run all draw exactly the classic recipe's numbers;
any other rank ``r`` uses ``derive_seed(seed, "rank", r)``, which shares no
structure with other seeds or ranks (unlike ``seed + rank``).
"""

from __future__ import annotations

import functools
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias

import numpy as np

from .._torch import FILL_UNINITIALIZED_MEMORY
from .errors import StateWarning
from .seed import derive_seed, show_int, validate_seed

__all__ = [
    "AUTO",
    "Rank",
    "Settings",
    "check_bool",
    "process_rank",
    "seed_for_rank",
    "validate_compiled_rng",
    "validate_rank",
    "validate_switches",
]

AUTO: Literal["auto"] = "auto"

#: What ``rank=`` accepts once validated.
Rank: TypeAlias = int | Literal["auto"] | None

#: What ``compiled_rng=`` accepts: ``None`` (inductor's setting stays as it
#: is) or ``"eager"`` (compiled random ops fall back to eager's kernels).
CompiledRng: TypeAlias = Literal["eager"] | None


def validate_rank(rank: object) -> Rank:
    """Return ``rank`` as a plain ``int``, ``"auto"`` or ``None``, or raise.

    Example:
        >>> validate_rank(np.int64(3))
        3
        >>> validate_rank(-1)
        Traceback (most recent call last):
        ...
        ValueError: rank must be a non-negative int, 'auto' or None, got -1
    """
    if rank is None:
        return None
    if isinstance(rank, str):
        if rank == AUTO:
            return AUTO
        raise ValueError(f"rank must be a non-negative int, 'auto' or None, got {rank!r}")
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, numbers.Integral):
        raise TypeError(
            f"rank must be a non-negative int, 'auto' or None, got {type(rank).__name__} "
            f"{rank!r:.80}"
        )
    value = int(rank)
    if value < 0:
        raise ValueError(f"rank must be a non-negative int, 'auto' or None, got {show_int(value)}")
    return value


def check_bool(value: object, name: str) -> bool:
    """``value``, checked to be ``True`` or ``False``; else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r:.80}")
    return value


def validate_switches(
    warn_only: object, flags: object, fill_uninitialized_memory: object
) -> tuple[bool, bool, bool]:
    """The three on/off options of a block, each checked to be a bool.

    Example:
        >>> validate_switches(False, True, True)
        (False, True, True)
        >>> validate_switches(False, "no", True)
        Traceback (most recent call last):
        ...
        TypeError: flags must be True or False, got 'no'
    """
    values = (warn_only, flags, fill_uninitialized_memory)
    names = ("warn_only", "flags", "fill_uninitialized_memory")
    for name, value in zip(names, values, strict=True):
        check_bool(value, name)
    if not fill_uninitialized_memory:
        # Asked for explicitly: a torch without the flag cannot honour it (the
        # default, True, is simply off there, and report() says so).
        FILL_UNINITIALIZED_MEMORY.require("fill_uninitialized_memory=False")
    return warn_only, flags, fill_uninitialized_memory  # type: ignore[return-value]


def validate_compiled_rng(compiled_rng: object) -> CompiledRng:
    """``compiled_rng`` if it is ``None`` or ``"eager"``, else raise.

    Example:
        >>> validate_compiled_rng("eager")
        'eager'
        >>> validate_compiled_rng("inductor")
        Traceback (most recent call last):
        ...
        ValueError: compiled_rng must be None or 'eager', got 'inductor'
    """
    if compiled_rng is None or (type(compiled_rng) is str and compiled_rng == "eager"):
        return compiled_rng  # type: ignore[return-value]
    if isinstance(compiled_rng, str):
        raise ValueError(f"compiled_rng must be None or 'eager', got {compiled_rng!r:.80}")
    raise TypeError(
        f"compiled_rng must be None or 'eager', got {type(compiled_rng).__name__} "
        f"{compiled_rng!r:.80}"
    )


#: (group, launcher) pairs already warned about by :func:`process_rank`.
_WARNED: set[tuple[tuple[int, int], tuple[int, int]]] = set()


def process_rank() -> int:
    """The global rank of this process: what ``rank="auto"`` stands for.

    In this order:

    * the rank in torch.distributed's default process group, where one is
      initialized;
    * else the launcher's ``RANK``: ``torchrun`` (like
      ``torch.distributed.launch``, DeepSpeed and accelerate) exports it with
      ``WORLD_SIZE`` before the script starts, so a block or
      ``seed_everything`` that runs before ``init_process_group`` seeds what
      it would seed after it;
    * else 0: one process.

    Only the global rank counts.  The local rank (``LOCAL_RANK``: which
    device the process drives) and the node rank (``GROUP_RANK``) never
    enter a seed, so a global rank draws the same numbers whether the world
    is laid out as 1 node x 4 processes or 2 x 2.

    Before a process group exists, the launcher's variables are checked
    (``ValueError`` naming the variable): decimal ints with ``0 <= RANK <
    WORLD_SIZE``, and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK``, where set, must fit them.  Only one of ``RANK`` and
    ``WORLD_SIZE`` set (Lightning's launcher exports ``WORLD_SIZE`` without
    ``RANK`` and passes the rank to ``init_process_group``): the rank cannot
    be known yet, so it is 0, with a :class:`StateWarning` once.  Once a process
    group exists it is the truth: the variables are not checked any more,
    and where ``RANK`` and ``WORLD_SIZE`` are both set and differ from the
    group's, a :class:`StateWarning` (once per pair) says that ``"auto"`` meant
    another rank before ``init_process_group`` (the process inherited them,
    say from a torchrun worker that spawned it).

    Never imports ``torch.distributed`` itself: if it was never imported, no
    process group can exist.

    Example:
        >>> process_rank()  # no process group, no launcher
        0
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return _group_rank(dist)
    found = launcher_variables(strict=True)
    return 0 if found is None else found["RANK"]


def _group_rank(dist: Any) -> int:
    """:func:`process_rank` where a process group exists: the group's rank."""
    group = (int(dist.get_rank()), int(dist.get_world_size()))
    found = launcher_variables(strict=False)
    launcher = None if found is None else (found["RANK"], found["WORLD_SIZE"])
    if launcher is not None and group != launcher and (group, launcher) not in _WARNED:
        # The group is the truth now; the variables were inherited (a process a
        # torchrun worker started itself, say).  Raising would break such programs,
        # which worked before; a silent switch would hide that rank='auto' meant
        # another rank before init_process_group.  So: the group wins, said once.
        _WARNED.add((group, launcher))
        warnings.warn(
            f"rank='auto': the process group says rank {group[0]} of {group[1]}, but the "
            f"environment says RANK={launcher[0]}, WORLD_SIZE={launcher[1]}, which this "
            f"process inherited from a launcher it did not come from; the group's rank is "
            f"used, so rank='auto' before init_process_group meant rank {launcher[0]}. "
            f"Remove RANK and WORLD_SIZE from the environment of processes you start "
            f"yourself, or pass rank= explicitly",
            StateWarning,
            stacklevel=2,
        )
    return group[0]


_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _raw_reader() -> Callable[[], tuple[object, ...]]:
    """Reads the launcher's variables raw: from ``os.environ``'s own dict under
    encoded keys where it has one (what ``os.environ[name]`` reads, without the
    ``KeyError`` that ``get`` raises and catches for each absent name, about
    1 µs each), else through ``os.environ.get``."""
    env = os.environ
    data, encodekey = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if type(data) is dict and callable(encodekey):
        keys = tuple(map(encodekey, _LAUNCHER_NAMES))
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(map(env.get, _LAUNCHER_NAMES))


_launcher_env = _raw_reader()


def launcher_variables(*, strict: bool = True) -> dict[str, int] | None:
    """The launcher's ``RANK``, ``WORLD_SIZE`` and, where set, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``, as ints; ``None`` where neither
    ``RANK`` nor ``WORLD_SIZE`` is set, or only one of them is (then, if
    ``strict``, with a :class:`StateWarning` once: the rank cannot be known).

    ``strict``: malformed or contradictory values raise ``ValueError`` naming
    the variable; otherwise they give ``None`` (a process group is the truth
    then, and a variable it does not need must not stop the program).
    """
    raw = _launcher_env()
    if raw[0] is None and raw[1] is None:
        return None
    try:
        # Parsed once per distinct set of values: ``rank="auto"`` asks at every block.
        found = _checked_launcher_variables(raw)
    except ValueError:
        if strict:
            raise
        return None
    if found:
        return dict(found)
    given, missing = ("RANK", "WORLD_SIZE") if raw[1] is None else ("WORLD_SIZE", "RANK")
    if strict and given not in _WARNED_PARTIAL:
        _WARNED_PARTIAL.add(given)
        warnings.warn(
            f"rank='auto': the environment variable {given} is set but "
            f"{missing} is not (Lightning's launcher, for one, exports WORLD_SIZE "
            f"and passes the rank to init_process_group), so this process's global rank "
            f"cannot be known before init_process_group: 0 is used until a process group "
            f"exists.  Seed after init_process_group, or pass rank= explicitly",
            StateWarning,
            stacklevel=3,
        )
    return None


#: Variables already warned about by :func:`launcher_variables`.
_WARNED_PARTIAL: set[str] = set()


@functools.lru_cache(maxsize=16)
def _checked_launcher_variables(raw: tuple[object, ...]) -> dict[str, int]:
    environ = dict(zip(_LAUNCHER_NAMES, raw, strict=True))

    def number(name: str, least: int = 0) -> int | None:
        value = environ[name]
        if value is None:
            return None
        text = os.fsdecode(value)  # type: ignore[arg-type]  # as os.environ decodes it
        # Decimal digits only: int() also takes " 3", "+3", "1_0" and
        # non-ASCII digits, none of which a launcher writes.
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise ValueError(
                f"the environment variable {name}={text!r:.40} is not "
                f"{'a positive' if least else 'a non-negative'} int; rank='auto' reads "
                f"the launcher's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
                f"GROUP_RANK variables"
            )
        return int(text)

    rank, world = number("RANK"), number("WORLD_SIZE", 1)
    if rank is None or world is None:  # only one of them is set: no rank, said by the caller
        return {}
    found = {"RANK": rank, "WORLD_SIZE": world}
    for name, least in (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1), ("GROUP_RANK", 0)):
        if (value := number(name, least)) is not None:
            found[name] = value
    problems = [
        f"{low}={found[low]} {'exceeds' if size else 'is not below'} {high}={found[high]}"
        for low, high, size in _LIMITS
        if low in found and high in found and found[low] >= found[high] + size
    ]
    if problems:
        raise ValueError("the launcher's environment variables disagree: " + "; ".join(problems))
    return found


#: ``(a, b, size)``: variable ``a`` must be below ``b`` (at most ``b`` where ``a`` is a size).
_LIMITS = (
    ("RANK", "WORLD_SIZE", False),
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", False),
    ("LOCAL_WORLD_SIZE", "WORLD_SIZE", True),
    ("GROUP_RANK", "WORLD_SIZE", False),
)


def seed_for_rank(seed: int, rank: int) -> int:
    """The per-rank seed: ``seed`` itself on rank 0, a well-mixed sub-seed elsewhere."""
    return seed if rank == 0 else derive_seed(seed, "rank", rank)


@dataclass(frozen=True, slots=True)
class Settings:
    """What a deterministic block applies on entry: the seed, the flag mode, the rank.

    Built (and validated) once, where the user writes ``deterministic(...)`` or
    ``@reproducible(...)``; every source reads it when a block starts.  Sources
    of per-rank RNGs read :attr:`rank_seed`, the others :attr:`seed`.  With
    ``flags`` false, the flag and environment sources apply nothing (they
    still capture and restore); ``fill_uninitialized_memory`` is that flag's
    value in the block (torch's default with deterministic algorithms is on);
    ``compiled_rng="eager"`` makes inductor's random ops fall back to eager's
    kernels in the block (the ``torch.compile`` source applies it).
    """

    seed: int
    warn_only: bool
    rank: Rank = None
    flags: bool = True
    fill_uninitialized_memory: bool = True
    compiled_rng: CompiledRng = None
    # ``None`` only for ``rank="auto"``, which is resolved each time a block
    # starts: a decorator is often built at import, before the process group.
    _fixed_rank_seed: int | None = field(init=False, repr=False, compare=False)
    #: For ``rank="auto"``: the settings :meth:`resolved` built, by rank.
    _by_rank: dict[int, Settings] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fixed = None if self.rank == AUTO else seed_for_rank(self.seed, self.rank or 0)
        object.__setattr__(self, "_fixed_rank_seed", fixed)
        object.__setattr__(self, "_by_rank", {})

    @property
    def rank_seed(self) -> int:
        """The seed of the per-rank RNGs (``random``, NumPy, registered user RNGs)."""
        fixed = self._fixed_rank_seed
        return seed_for_rank(self.seed, process_rank()) if fixed is None else fixed

    def resolved(self) -> Settings:
        """These settings with ``rank="auto"`` looked up now: a block starting
        resolves it once, not once per source that reads :attr:`rank_seed`."""
        if self._fixed_rank_seed is not None:
            return self
        rank = process_rank()
        found = self._by_rank.get(rank)
        if found is None:
            found = replace(self, rank=rank)
            if len(self._by_rank) >= 64:  # one rank per process, but keep it bounded
                self._by_rank.clear()
            self._by_rank[rank] = found
        return found

    @classmethod
    def build(
        cls,
        seed: object,
        warn_only: object,
        rank: object = None,
        flags: object = True,
        fill_uninitialized_memory: object = True,
        compiled_rng: object = None,
    ) -> Settings:
        """Validated settings; ``TypeError``/``ValueError`` name the bad argument.

        ``with deterministic(seed=i):`` builds them on every block: settings
        of plain ints are remembered (they are immutable), so validating and
        building them costs a dict lookup when the arguments repeat.
        """
        key = (seed, warn_only, rank, flags, fill_uninitialized_memory, compiled_rng)
        # Exact types only in the key: 1, True and 1.0 are equal dict keys.
        plain = (
            type(seed) is int
            and type(warn_only) is bool
            and (rank is None or type(rank) is int)
            and type(flags) is bool
            and type(fill_uninitialized_memory) is bool
            and (compiled_rng is None or type(compiled_rng) is str)
        )
        if plain:
            found = _BUILT.get(key)
            if found is not None:
                return found
        switches = validate_switches(warn_only, flags, fill_uninitialized_memory)
        settings = cls(
            validate_seed(seed),
            switches[0],
            validate_rank(rank),
            *switches[1:],
            validate_compiled_rng(compiled_rng),
        )
        if plain:
            if len(_BUILT) >= 1024:  # a new seed every block must not grow it without bound
                _BUILT.clear()
            _BUILT[key] = settings
        return settings


_BUILT: dict[tuple[object, ...], Settings] = {}
