"""Reproducible input pipelines: DataLoader workers and seeded generators.

What a ``deterministic(seed=s)`` block gives a ``DataLoader`` by itself, with
nothing else passed: the shuffle order and each iterator's *base seed* are
drawn from the block's torch generator, and torch seeds ``random``, NumPy and
torch in every worker from that base seed and the worker id.  So batches are
the same on every run and no two workers share a stream, with ``fork`` and
``spawn`` alike, as long as ``iter(loader)`` (a ``for`` loop) runs inside the
block.

What needs :data:`seed_worker` (or :func:`chain_worker_init`):

* ranks: the base seed comes from torch's generator, which is *shared* across
  ranks (model initialization must agree), so without it every rank's workers
  draw the same augmentation; ``seed_worker`` mixes in the global rank (never
  the local or node rank: on two nodes, local rank 0 of each is a different
  rank, and a global rank's workers draw the same whatever the layout);
* registered user RNGs (:func:`~deterministic_ctx.register_rng`): each worker
  holds a copy of the parent's, so without it all workers repeat one stream.

What needs :func:`seeded_generator`: a shuffle order (and worker seeds) that
do not depend on how much the block drew from torch before ``iter(loader)``,
for instance when a change to the model adds a layer; and per-rank orders for
loaders that shuffle the whole dataset on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._errors import MisuseError
from ..core.context import deterministic
from ..internal import (
    MAX_SEED,
    Rank,
    derive_seed,
    register_rng,
    registered_rngs,
    seed_registered_rngs,
    validate_rank,
)
from .ranks import rank_seed, resolve_rank

__all__ = ["chain_worker_init", "portable_rngs", "seed_worker", "seeded_generator"]


def seeded_generator(
    seed: int | deterministic, key: str | int = "dataloader", *, rank: Rank = None
) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``seed``, for ``DataLoader(generator=...)``
    and samplers (``RandomSampler``, ``SubsetRandomSampler``, ``random_split``, …).

    Its seed is ``derive_seed(rank_seed(seed, rank), "generator", key)``: it
    depends on nothing but its arguments, so the shuffle order does not move
    when code before the loader draws more or fewer numbers.  Give each
    loader its own ``key`` (``"train"``, ``"val"``): two generators with the
    same key produce the same permutations.

    Args:
        seed: an int seed, or a :class:`deterministic` object, whose ``seed``
            and ``rank`` are used.
        key: names the generator among others of the same seed.
        rank: a non-negative int or ``"auto"`` (the global rank, see
            :func:`~deterministic_ctx.parallel.ranks.ranks`): one generator per
            rank (a ``DataLoader`` that shuffles the whole dataset on every
            rank should not give every rank the same batches).  ``None`` (the
            default): the ``deterministic`` object's rank, and for an int seed,
            the same generator on every rank (what ``random_split`` needs).
            ``"auto"`` is looked up now.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx import seeded_generator
        >>> with deterministic(seed=0) as det:
        ...     a = list(DataLoader(range(6), shuffle=True, generator=seeded_generator(det)))
        ...     _ = torch.rand(100)  # more draws before the loader: same order
        ...     b = list(DataLoader(range(6), shuffle=True, generator=seeded_generator(det)))
        >>> a == b
        True
    """
    if isinstance(seed, deterministic):
        if rank is None:
            rank = seed.rank
        seed = seed.seed
    if not isinstance(key, str) and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
        raise TypeError(
            f"key must be a str or a non-negative int, got {type(key).__name__} {key!r}"
        )
    generator = torch.Generator()
    generator.manual_seed(derive_seed(rank_seed(seed, rank), "generator", key, bits=64))
    return generator


def _seed_this_worker(rank: int) -> None:
    info = torch.utils.data.get_worker_info()
    if info is None:
        raise MisuseError(
            "seed_worker runs in DataLoader worker processes: pass it as "
            "DataLoader(worker_init_fn=seed_worker, num_workers=1 or more)"
        )
    # torch gives worker i the seed base + i, with base drawn per iterator in
    # the parent; derive each RNG's seed from (base, rank, i) with a
    # SeedSequence instead of adding offsets.
    base = (info.seed - info.id) & 0xFFFF_FFFF_FFFF_FFFF
    words = np.random.SeedSequence(entropy=base, spawn_key=(rank, info.id)).generate_state(
        4, np.uint64
    )
    torch.manual_seed(int(words[0]))
    random.seed(int(words[1]))
    np.random.seed(int(words[2]) & MAX_SEED)  # the legacy RNG takes 32 bits
    seed_registered_rngs(int(words[3]) & MAX_SEED)


def portable_rngs() -> tuple[tuple[str, object], ...]:
    """The registered RNGs that can travel to a ``spawn`` worker with a pickled
    ``worker_init_fn`` or dataset, as ``(key, rng)`` pairs (used by
    :class:`~deterministic_ctx.parallel.keyed.SeededDataset` too)."""
    # A device generator would initialize the device in the worker.
    return tuple(
        (key, obj)
        for key, obj in registered_rngs()
        if not (isinstance(obj, torch.Generator) and obj.device.type != "cpu")
    )


class _WorkerSeeder:
    """The ``worker_init_fn`` behind :data:`seed_worker` and :func:`chain_worker_init`."""

    __slots__ = ("_fn", "_rank", "_rngs")

    def __init__(
        self,
        fn: Callable[[int], Any] | None,
        rank: Rank,
        rngs: tuple[tuple[str, object], ...] = (),
    ) -> None:
        self._fn = fn
        self._rank = rank
        self._rngs = rngs

    def __call__(self, worker_id: int) -> None:
        # Only set when this object was pickled for a spawn/forkserver worker.
        for key, obj in self._rngs:
            register_rng(obj, key=key)
        _seed_this_worker(resolve_rank(self._rank))
        if self._fn is not None:
            self._fn(worker_id)

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned worker starts a fresh interpreter: no process group, an
        # empty RNG registry.  This runs in the parent when the worker starts,
        # so resolve the rank here, and send the registered RNGs along: they
        # are pickled together with the dataset, so the worker's copies are
        # the very objects its dataset holds.  Fork needs none of it.
        return (_WorkerSeeder, (self._fn, resolve_rank(self._rank), portable_rngs()))

    def __repr__(self) -> str:
        if self._fn is None and self._rank == "auto":
            return "seed_worker"
        return f"chain_worker_init({self._fn!r}, rank={self._rank!r})"


#: ``DataLoader(worker_init_fn=seed_worker)``: seeds ``random``, NumPy's global
#: RNG, torch and every registered user RNG in each worker, from torch's
#: per-iterator base seed, the worker id and the global rank (``rank="auto"``:
#: the process group's, else the launcher's ``RANK``), with well-mixed
#: :class:`numpy.random.SeedSequence` sub-seeds.  Workers never share a stream,
#: ranks never share workers' streams, and runs repeat.  Works with ``fork``,
#: ``spawn`` and ``forkserver`` workers: for the latter two the rank is
#: resolved in the parent and the registered RNGs travel with the dataset.  It
#: is a picklable callable ``seed_worker(worker_id)``; to add your own
#: ``worker_init_fn``, or to give a rank by hand, use
#: :func:`chain_worker_init`.
seed_worker: Callable[[int], None] = _WorkerSeeder(None, "auto")


def chain_worker_init(
    fn: Callable[[int], Any] | None = None, *, rank: Rank = "auto"
) -> Callable[[int], None]:
    """A ``worker_init_fn`` that seeds the worker as :data:`seed_worker` does,
    then calls ``fn(worker_id)``.

    ``fn`` runs last, so whatever it seeds itself wins.  It must be picklable
    (a module-level function) for ``spawn`` workers, as any ``worker_init_fn``.

    Args:
        fn: your own ``worker_init_fn``, or ``None``.
        rank: the rank to mix into worker seeds: ``"auto"`` (the global
            rank: the process group's, else the launcher's ``RANK``; resolved
            when the workers start), an int for ranks you manage yourself, or
            ``None`` (as rank 0).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from deterministic_ctx import chain_worker_init
        >>> def open_shard(worker_id):
        ...     pass
        >>> loader = DataLoader(range(8), num_workers=2,
        ...                     worker_init_fn=chain_worker_init(open_shard))
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"fn must be a callable taking the worker id, or None, got {fn!r}")
    return _WorkerSeeder(fn, validate_rank(rank))
