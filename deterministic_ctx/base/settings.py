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

import numbers
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np

from .._torch import FILL_UNINITIALIZED_MEMORY
from .._torch.distributed import process_rank
from .cache import BoundedCache
from .fast_paths import FastPath
from .seed import derive_seed, show_int, validate_seed

__all__ = [
    "AUTO",
    "Rank",
    "Settings",
    "check_bool",
    "seed_for_rank",
    "validate_compiled_rng",
    "validate_rank",
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

    def __post_init__(self) -> None:
        fixed = None if self.rank == AUTO else seed_for_rank(self.seed, self.rank or 0)
        object.__setattr__(self, "_fixed_rank_seed", fixed)

    @property
    def rank_seed(self) -> int:
        """The seed of the per-rank RNGs (``random``, NumPy, registered user RNGs)."""
        fixed = self._fixed_rank_seed
        return seed_for_rank(self.seed, process_rank()) if fixed is None else fixed

    def resolved(self) -> Settings:
        """These settings with ``rank="auto"`` looked up now: a block starting
        resolves it once, not once per source that reads :attr:`rank_seed`.
        Built through :meth:`build`, and found in its cache without its checks: these
        fields are checked and of plain types already (this runs at every block)."""
        if self._fixed_rank_seed is not None:
            return self
        args = (
            self.seed,
            self.warn_only,
            process_rank(),
            self.flags,
            self.fill_uninitialized_memory,
            self.compiled_rng,
        )
        return _BUILT.get(args) or self.build(*args)

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
        """Validated settings; ``TypeError``/``ValueError`` name the bad argument
        (each checked in the order of the parameters).

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
        settings = cls(
            validate_seed(seed),
            check_bool(warn_only, "warn_only"),
            validate_rank(rank),
            check_bool(flags, "flags"),
            check_bool(fill_uninitialized_memory, "fill_uninitialized_memory"),
            validate_compiled_rng(compiled_rng),
        )
        if not settings.fill_uninitialized_memory:
            # Asked for explicitly: a torch without the flag cannot honour it (the
            # default, True, is simply off there, and report() says so).
            FILL_UNINITIALIZED_MEMORY.require("fill_uninitialized_memory=False")
        if plain:
            _BUILT.put(key, settings)
        return settings


#: Settings of plain arguments, by their arguments (empty with the fast paths off).
_BUILT: BoundedCache[tuple[object, ...], Settings] = BoundedCache(1024)
#: The fast path of :data:`_BUILT`, listed by ``fast_paths()``.
FAST_PATH = FastPath("settings: built and checked once per plain arguments", lambda: True)
