"""Per-sample keyed randomness: augmentation that is a function of ``(seed, epoch, index)``.

:class:`SeededDataset` wraps a map-style dataset.  Each item is produced with
Python's ``random``, NumPy's global RNG, torch's CPU generator and every
registered RNG seeded from a key of its own, :meth:`SeededDataset.item_seed`,
then the process's state is put back.  So an item's randomness depends on
nothing but the seed, the epoch and the index: not on which worker or rank
draws it, how many workers there are, how far they prefetch, whether they
persist, how they were started, or where a run was resumed.

:class:`SeededSampler` is a ``DistributedSampler`` whose order is a function
of ``(seed, epoch)``, which hands the epoch to the dataset with every index
(a :class:`SeededIndex`), and which saves and loads its position in an epoch,
also into another number of ranks.

Worker-keyed streams (:data:`~deterministic_ctx.parallel.data.seed_worker`)
stay for code that cannot be keyed (an ``IterableDataset``, a transform that
runs in the main process on whole batches).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import torch.utils.data

from .._errors import StateWarning
from ..internal import (
    Block,
    check_bool,
    derive_seed,
    register_rng,
    source_named,
    validate_seed,
)
from .data import portable_rngs

__all__ = ["SeededDataset", "SeededIndex", "SeededSampler"]

T_co = TypeVar("T_co", covariant=True)

_M64 = 2**64 - 1
#: SplitMix64's increment and finalizer (Steele, Lea, Flood 2014; the seeder of
#: ``java.util.SplittableRandom`` and of the xoshiro generators): a bijective
#: mix in which every input bit reaches every output bit.
_GAMMA = 0x9E37_79B9_7F4A_7C15
_MIX1 = 0xBF58_476D_1CE4_E5B9
_MIX2 = 0x94D0_49BB_1331_11EB


def check_count(
    value: object, name: str, what: str = "a non-negative int", *, low: int | None = 0
) -> int:
    """``value`` as a plain int of at least ``low`` (any, for ``None``), or a ``TypeError`` /
    ``ValueError`` saying that ``name`` must be ``what``.  Anything ``operator.index``
    takes is an int (NumPy integers, one-element integer tensors), a bool never is."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            result = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if low is not None and result < low:
                raise ValueError(f"{name} must be {what}, got {result}")
            return result
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r:.80}")


class SeededIndex(int):
    """A dataset index that carries its epoch: what :class:`SeededSampler`
    yields, and how the epoch reaches :class:`SeededDataset` in every worker.

    It is an ``int`` (lists, arrays and tensors index with it as with the
    plain number; arithmetic on it gives plain ints) with an ``epoch``
    attribute.  It pickles with its epoch, so ``spawn`` workers and
    persistent workers receive the epoch with each index, and nothing is
    shared between processes.  A sampler of your own can yield it too.

    Example:
        >>> from deterministic_ctx import SeededIndex
        >>> i = SeededIndex(5, epoch=2)
        >>> i, i.epoch, [10, 11, 12, 13, 14, 15][i]
        (SeededIndex(5, epoch=2), 2, 15)
    """

    epoch: int

    def __new__(cls, index: int, epoch: int) -> SeededIndex:
        if type(index) is not int or index < 0:  # the sampler's case, without ABC checks
            index = check_count(index, "index")
        if type(epoch) is not int or epoch < 0:
            epoch = check_count(epoch, "epoch")
        self = super().__new__(cls, index)
        self.epoch = epoch
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # The checked constructor is for callers; a pickle holds what one made.
        return (_seeded_index, (int(self), self.epoch))

    def __repr__(self) -> str:
        return f"SeededIndex({int(self)}, epoch={self.epoch})"


_new_int = int.__new__


def _seeded_index(index: int, epoch: int) -> SeededIndex:
    """``SeededIndex(index, epoch)`` for a non-negative int ``index`` and
    ``epoch`` known good (the sampler's, a pickle's) without the checks: half
    the cost, paid per index by the sampler and again by every worker that
    unpickles one."""
    self: SeededIndex = _new_int(SeededIndex, index)
    self.epoch = epoch
    return self


#: What an item seeds from its key and what is put back afterwards: Python's
#: ``random``, NumPy's global RNG, torch's CPU generator and the registered RNGs
#: (accelerators are not seeded per item: augmentation runs on the CPU).  A block
#: over these sources does both, with the engine's lock, retries and
#: ``RestoreError``, and the sources' own fast paths (off under
#: ``DETERMINISTIC_CTX_NO_FAST_PATHS=1``).
_ITEM_SOURCES = tuple(source_named(name) for name in ("random", "numpy", "torch.cpu", "user"))


def _keyed_calls(dataset: Any, indices: Sequence[int], keys: Sequence[int]) -> list[Any]:
    """``[dataset[i] for i in indices]``, each item with ``random``, NumPy's
    global RNG, torch's CPU generator and the registered RNGs seeded from its
    key as a block seeded with it seeds them: one isolation-only block over
    those sources, reseeded per item, so the process's state is captured once
    before the first item and put back once after the last, however it ends."""
    block = Block(None, _ITEM_SOURCES)
    block.start()
    try:
        out: list[Any] = []
        for index, key in zip(indices, keys, strict=True):
            # Every item, registered RNGs included: an item may register one,
            # and the next item seeds it, as one by one.
            block.reseed(key)
            out.append(dataset[index])
        return out
    finally:
        block.stop()


class ItemKeys:
    """The 32-bit keys of a keyed stream: ``keys(index, epoch)`` is SplitMix64's
    output for position ``index`` of a stream whose start is
    ``derive_seed(seed, "item", epoch, bits=64)``, upper half (see
    :meth:`SeededDataset.item_seed`, which is this).  One ``derive_seed`` per
    epoch (the last epoch's base is kept), one SplitMix64 step per key.  Both
    arguments must be non-negative ints already: callers check them.

    Example:
        >>> from deterministic_ctx import SeededDataset
        >>> from deterministic_ctx.parallel.keyed import ItemKeys
        >>> ItemKeys(7)(100, 2) == SeededDataset([], seed=7).item_seed(100, epoch=2)
        True
    """

    __slots__ = ("_base", "_seed")

    def __init__(self, seed: int) -> None:
        self._seed = validate_seed(seed)
        self._base = (-1, 0)  # (epoch, its SplitMix64 base): one derivation per epoch

    def __call__(self, index: int, epoch: int) -> int:
        epoch_base = self._base
        if epoch_base[0] != epoch:
            epoch_base = self._base = (epoch, derive_seed(self._seed, "item", epoch, bits=64))
        z = (epoch_base[1] + (index + 1) * _GAMMA) & _M64
        z = ((z ^ (z >> 30)) * _MIX1) & _M64
        z = ((z ^ (z >> 27)) * _MIX2) & _M64
        return (z ^ (z >> 31)) >> 32

    def __getstate__(self) -> tuple[int, tuple[int, int]]:
        return self._seed, self._base

    def __setstate__(self, state: tuple[int, tuple[int, int]]) -> None:
        self._seed, self._base = state


class SeededDataset(torch.utils.data.Dataset[T_co], Generic[T_co]):
    """A map-style dataset whose item ``i`` of epoch ``e`` draws its random
    numbers from a key of ``(seed, e, i)`` only, and leaves the process's
    random state as it found it.

    Each ``dataset[i]`` runs with Python's ``random``, NumPy's global RNG and
    torch's CPU generator seeded with ``k = item_seed(i, e)`` (as
    ``random.seed(k); np.random.seed(k); torch.default_generator.manual_seed(k)``)
    and every registered RNG (:func:`~deterministic_ctx.register_rng`) seeded
    as a block seeded with ``k`` seeds it: the numbers ``deterministic(seed=k)``
    gives these generators.  Afterwards each is put back, so a loader with
    ``num_workers=0`` leaves the main process's streams where they were.
    Accelerator generators are not seeded per item (augmentation in workers
    runs on the CPU).

    The epoch comes with the index: :class:`SeededSampler` yields
    :class:`SeededIndex` objects, which carry it into every worker, persistent
    or not, forked or spawned.  A plain ``int`` index (any other sampler) uses
    the epoch of :meth:`set_epoch`, 0 until it is called.  Wrap the outermost
    dataset (``SeededDataset(ConcatDataset(parts), seed)``): a ``Subset`` or a
    ``ConcatDataset`` around a ``SeededDataset`` computes plain ints from the
    indices it gets, and the epoch is lost on the way.

    A ``DataLoader`` (torch >= 2.0) fetches a batch with one
    :meth:`__getitems__` call, which saves the process's state once, seeds
    each item afresh from its own key and puts the state back once: the
    items are bit for bit those of ``dataset[i]`` one by one.  The wrapped
    dataset's own ``__getitems__`` is not used: a batched fetch cannot be
    keyed per sample.

    Registered RNGs travel with the dataset to ``spawn`` workers (as with
    :data:`~deterministic_ctx.seed_worker`): the worker registers the very
    objects its dataset holds.  A batch is fetched inside a block over those
    generators (the engine's, reseeded per item), so it waits for blocks in
    other threads of the process, as any block does, and its restore is the
    engine's (completed if interrupted, :class:`~deterministic_ctx.RestoreError`
    if a generator cannot be put back).

    Args:
        dataset: a map-style dataset (``__getitem__`` with int indices).
        seed: an int in ``0 .. 2**32 - 1``; the item keys derive from it.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from deterministic_ctx import SeededDataset, SeededSampler
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __len__(self):
        ...         return 6
        ...     def __getitem__(self, i):
        ...         return i + torch.rand(())
        >>> data = SeededDataset(Noisy(), seed=0)
        >>> sampler = SeededSampler(data, seed=0)
        >>> a = torch.cat(list(DataLoader(data, batch_size=2, sampler=sampler)))
        >>> b = torch.cat(list(DataLoader(data, batch_size=2, sampler=sampler, num_workers=2)))
        >>> torch.equal(a, b)  # the same items, whatever the workers
        True
        >>> sampler.set_epoch(1)
        >>> c = torch.cat(list(DataLoader(data, batch_size=2, sampler=sampler)))
        >>> torch.equal(a.sort().values, c.sort().values)  # another epoch, other draws
        False
    """

    def __init__(self, dataset: torch.utils.data.Dataset[T_co], seed: int) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(
            type(dataset), "__getitem__"
        ):
            raise TypeError(
                f"dataset must be a map-style dataset (with __getitem__, not an "
                f"IterableDataset), got {type(dataset).__name__}; for an IterableDataset use "
                f"DataLoader(worker_init_fn=seed_worker)"
            )
        self._dataset = dataset
        self._seed = validate_seed(seed)
        self._epoch = 0
        self._key = ItemKeys(self._seed)  # ``_key(index, epoch)``
        self._pending: tuple[tuple[str, object], ...] = ()  # registered RNGs to adopt

    @property
    def dataset(self) -> torch.utils.data.Dataset[T_co]:
        """The wrapped dataset."""
        return self._dataset

    @property
    def seed(self) -> int:
        """The seed every item key derives from."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch of plain ``int`` indices (see :meth:`set_epoch`)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch of plain ``int`` indices, for samplers other than :class:`SeededSampler`.

        It reaches workers that start after the call: ``num_workers=0`` and
        non-persistent workers (which start with every ``for`` loop over the
        loader).  Persistent workers hold the copy of the dataset they started
        with: give them :class:`SeededIndex` indices (:class:`SeededSampler`).

        Example:
            >>> from deterministic_ctx import SeededDataset
            >>> data = SeededDataset([0.0, 1.0], seed=0)
            >>> data.set_epoch(3)
            >>> data.epoch
            3
        """
        self._epoch = check_count(epoch, "epoch")

    def item_seed(self, index: int, epoch: int | None = None) -> int:
        """The 32-bit seed of item ``index`` in ``epoch`` (default: :attr:`epoch`).

        It is SplitMix64's output for position ``index`` of a stream whose
        start is ``derive_seed(seed, "item", epoch, bits=64)``, upper half:
        well mixed in the seed, the epoch and the index (never ``seed + i``),
        and derived in about a microsecond.  Two items share a seed with
        probability ``2**-32``: they then draw the same numbers, which
        for augmentation of two different samples is harmless.

        Example:
            >>> import random
            >>> from deterministic_ctx import SeededDataset, SeededIndex, deterministic
            >>> data = SeededDataset(list(range(10)), seed=0)
            >>> k = data.item_seed(3, epoch=1)
            >>> k == data.item_seed(3, epoch=1) != data.item_seed(4, epoch=1)
            True
            >>> class Draw:
            ...     def __getitem__(self, i):
            ...         return random.random()
            >>> with deterministic(seed=k):
            ...     expected = random.random()
            >>> SeededDataset(Draw(), seed=0)[SeededIndex(3, epoch=1)] == expected
            True
        """
        i = self._plain_index(index)
        e = self._epoch if epoch is None else check_count(epoch, "epoch")
        return self._key(i, e)

    def _plain_index(self, index: object) -> int:
        what = "an int (one sample; slices and lists are not keyed)"
        i = check_count(index, "index", what, low=None)
        if i < 0:
            if not isinstance(self._dataset, Sized):
                raise ValueError(f"index must be non-negative for a dataset without len(), got {i}")
            size = len(self._dataset)
            if i < -size:
                raise IndexError(f"index {i} is out of range for a dataset of {size} items")
            i += size
        return i

    def __getitem__(self, index: int) -> T_co:
        return self.__getitems__((index,))[0]

    def __getitems__(self, indices: Iterable[int]) -> list[T_co]:
        """``[self[i] for i in indices]``, with the process's state saved and put
        back once for them all instead of once per item: what a ``DataLoader``
        calls for a batch (torch >= 2.0).  Each item is seeded afresh from its
        own key, so it is bit for bit the item ``self[i]`` gives, and an item
        that raises leaves the state as it was found.  Each comes from the
        wrapped dataset's ``__getitem__``, never from its ``__getitems__``.

        Example:
            >>> import random
            >>> from deterministic_ctx import SeededDataset, SeededIndex
            >>> class Draw:
            ...     def __getitem__(self, i):
            ...         return i + random.random()
            >>> data = SeededDataset(Draw(), seed=0)
            >>> batch = data.__getitems__([SeededIndex(i, epoch=1) for i in (4, 2, 7)])
            >>> batch == [data[SeededIndex(i, epoch=1)] for i in (4, 2, 7)]
            True
        """
        plain: list[int] = []
        keys: list[int] = []
        for index in indices:
            if type(index) is SeededIndex:
                i: int = int(index)
                epoch = index.epoch
            else:
                i = self._plain_index(index)
                epoch = self._epoch
            plain.append(i)
            keys.append(self._key(i, epoch))
        if self._pending and torch.utils.data.get_worker_info() is not None:
            self._adopt()
        return _keyed_calls(self._dataset, plain, keys)

    def __len__(self) -> int:
        if not isinstance(self._dataset, Sized):
            raise TypeError(f"the wrapped dataset {type(self._dataset).__name__} has no len()")
        return len(self._dataset)

    def _adopt(self) -> None:
        # In a spawned worker: the registered RNGs came in the same pickle as
        # the dataset, so these are the objects the wrapped dataset draws from.
        pending, self._pending = self._pending, ()
        for key, obj in pending:
            register_rng(obj, key=key)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Sent to a spawn/forkserver worker (or copied): take the registered RNGs
        # along, for a worker to register; a fork worker never pickles them.
        state["_pending"] = portable_rngs()
        return state

    def __repr__(self) -> str:
        return f"SeededDataset({self._dataset!r:.80}, seed={self._seed})"


def _world(num_replicas: object, rank: object) -> tuple[int, int]:
    """``(num_replicas, rank)``: as given, else the default process group's, else ``(1, 0)``."""
    group = None
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = (dist.get_world_size(), dist.get_rank())
    if num_replicas is None:
        replicas = group[0] if group is not None else 1
    else:
        replicas = check_count(num_replicas, "num_replicas", "a positive int", low=1)
    where = (group[1] if group is not None else 0) if rank is None else check_count(rank, "rank")
    if where >= replicas:
        raise ValueError(f"rank must be in 0 .. num_replicas - 1 = {replicas - 1}, got {where}")
    return replicas, where


#: torch's global generator, the one a ``DataLoader`` without a generator draws from.
_TORCH_CPU = _ITEM_SOURCES[2]


def _after_base_seed_draw() -> torch.Tensor:
    """torch's global generator as the draw ``_BaseDataLoaderIter.__init__`` makes
    from it for its workers' base seed (when the loader has no generator of its
    own: every torch from 2.1 on) would leave it now; the draw is made in a
    block over that generator, which puts it back."""
    block = Block(None, (_TORCH_CPU,))
    block.start()
    try:
        torch.empty((), dtype=torch.int64).random_()
        after: torch.Tensor = _TORCH_CPU.capture()
        return after
    finally:
        block.stop()


def _warn_if_base_seed_drawn(expected: torch.Tensor) -> None:
    """Warn if torch's global generator is ``expected``: exactly one ``DataLoader``
    base seed past its state at ``set_epoch`` (:func:`_after_base_seed_draw`), before
    the sampler's first index.  A resumed pass starts mid-epoch, where the
    uninterrupted run created no iterator: from here on the main process's stream
    (dropout) is not that run's.  Only that exact step warns: a Snapshot restored
    after set_epoch does not, and a torch that ever drew otherwise would make this
    silent, never wrong."""
    if torch.equal(expected, _TORCH_CPU.capture()):
        warnings.warn(
            "SeededSampler: this resumed pass began in a DataLoader without a generator of "
            "its own, which drew its workers' base seed from torch's global generator: the "
            "uninterrupted run made no such draw mid-epoch, so the main process's random "
            "numbers (dropout) differ from its own from here on.  Pass the loader a "
            "generator: DataLoader(..., generator=seeded_generator(seed, 'train'))",
            StateWarning,
            stacklevel=3,
        )


class SeededSampler(torch.utils.data.Sampler[int]):
    """A ``DistributedSampler`` keyed by ``(seed, epoch)`` that can resume mid-epoch,
    also on another number of ranks.

    The epoch's order is ``torch.randperm`` from a generator seeded with
    ``derive_seed(seed, "order", epoch)`` (``range(n)`` without ``shuffle``);
    it does not depend on the number of ranks.  Rank ``r`` of ``W`` takes
    every ``W``-th index from ``r``, padded by repeating the epoch's first
    indices to a multiple of ``W`` (``drop_last=False``) or cut to one, as
    ``DistributedSampler`` does.  Each index is a :class:`SeededIndex`
    carrying the epoch, for :class:`SeededDataset`.

    **Resuming.** :meth:`state_dict` holds the epoch and how many of the
    epoch's indices the ranks took so far, all ranks together;
    :meth:`load_state_dict` makes the next pass start after them.  Inside
    torchdata's ``StatefulDataLoader`` this is automatic (its state holds the
    sampler's).  With a plain ``DataLoader``, workers take indices ahead of
    the loop, so tell the sampler what the loop consumed:
    ``sampler.state_dict(consumed=n)``, ``n`` the samples this rank's loop
    took from the current pass (``(i + 1) * batch_size`` after batch ``i`` of
    ``enumerate(loader)`` while batches are full), never more than the pass
    handed out.  Every rank must have consumed the same number.

    **An epoch's end is a resume point.**  A state saved once the pass had
    handed out the epoch's last index (a checkpoint on the last batch) loads
    as "start the next epoch": the next pass is epoch ``e + 1`` from its
    beginning, whether :meth:`set_epoch` ``(e + 1)`` comes before the load
    (torchdata's ``StatefulDataLoader`` loads in ``__iter__``, after the
    trainer's ``set_epoch``), after it, or not at all.  A loop that saved
    ``e`` with the state and calls ``set_epoch(e)`` again (before or after the
    load) gets the empty rest of ``e``, then ``e + 1`` whole.  Until a pass
    begins, :meth:`state_dict` gives the loaded state back and ``len()`` the
    next pass's length.
    Loaded on another number of ranks, the indices not yet taken are split
    over the new ranks as above: each once, plus padding (or minus the cut
    tail with ``drop_last``).

    Args:
        data_source: the dataset (only its ``len()`` is used, read now).
        seed: an int in ``0 .. 2**32 - 1``.
        shuffle: permute each epoch (else the dataset's order).
        num_replicas: the number of ranks; default: the initialized default
            process group's world size, else 1.
        rank: this rank; default: its rank in that group, else 0.
        drop_last: cut the epoch to a multiple of ``num_replicas`` instead of
            padding it.

    Example:
        >>> from deterministic_ctx import SeededSampler
        >>> ranks = [SeededSampler(range(10), seed=0, num_replicas=2, rank=r) for r in (0, 1)]
        >>> for sampler in ranks:
        ...     sampler.set_epoch(3)
        >>> halves = [list(sampler) for sampler in ranks]
        >>> [len(half) for half in halves], halves[1][0].epoch
        ([5, 5], 3)
        >>> sorted(halves[0] + halves[1]) == list(range(10))  # each index once
        True
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        seed: int,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(data_source, Sized):
            raise TypeError(
                f"data_source must have a len() (a map-style dataset), got "
                f"{type(data_source).__name__}"
            )
        self._size = len(data_source)
        self._seed = validate_seed(seed)
        self._shuffle = check_bool(shuffle, "shuffle")
        self._drop_last = check_bool(drop_last, "drop_last")
        self._replicas, self._rank = _world(num_replicas, rank)
        self._epoch = 0
        self._start = 0  # indices of the epoch taken before the next pass (a resume)
        # The live pass: [epoch, start, indices yielded]; None before the first pass.
        self._pass: list[int] | None = None
        # A loaded finished epoch, (epoch, taken), while the next pass is the epoch after
        # it: set_epoch(epoch) still gives the loaded (empty) rest of that epoch.
        self._done: tuple[int, int] | None = None
        # The epoch set_epoch asked for since the last pass began (None: not asked).
        self._asked: int | None = None
        # Torch's global generator one DataLoader base-seed draw past that set_epoch,
        # and whether a state was loaded since the last pass began: what the resumed
        # pass checks (_warn_if_base_seed_drawn).
        self._global_at_set_epoch: torch.Tensor | None = None
        self._loaded = False

    @property
    def seed(self) -> int:
        """The seed the orders derive from."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch of the next pass."""
        return self._epoch

    @property
    def num_replicas(self) -> int:
        """The number of ranks the epoch is split over."""
        return self._replicas

    @property
    def rank(self) -> int:
        """This sampler's rank."""
        return self._rank

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is permuted."""
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        """Whether the epoch is cut to a multiple of :attr:`num_replicas`."""
        return self._drop_last

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass draw ``epoch``'s order and keys.

        After :meth:`load_state_dict`, setting the loaded epoch keeps the
        resume position (the empty rest of an epoch that was finished);
        another epoch starts from its beginning.

        Example:
            >>> from deterministic_ctx import SeededSampler
            >>> sampler = SeededSampler(range(4), seed=0)
            >>> first = list(sampler)
            >>> sampler.set_epoch(1)
            >>> list(sampler) != first
            True
        """
        epoch = check_count(epoch, "epoch")
        done, self._done, self._asked = self._done, None, epoch
        self._global_at_set_epoch = _after_base_seed_draw()
        if done is not None and epoch == done[0]:
            # A loop that saved the finished epoch with the state asks for it again:
            # it gets that epoch's empty rest, then asks for the next one.
            self._epoch, self._start, self._pass = done[0], done[1], None
            return
        if epoch != self._epoch:
            self._start = 0
            self._pass = None
        self._epoch = epoch

    def _total(self, start: int) -> int:
        """How many indices a pass from ``start`` hands out, all ranks together."""
        count = max(self._size - start, 0)
        w = self._replicas
        return count // w * w if self._drop_last else math.ceil(count / w) * w

    def __len__(self) -> int:
        """The number of indices the next pass yields on this rank (fewer after a
        :meth:`load_state_dict` mid-epoch)."""
        return self._total(self._start) // self._replicas

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._epoch, self._start
        self._start = 0  # the pass after this one starts at the beginning
        self._done = self._asked = None
        at_set_epoch, self._global_at_set_epoch = self._global_at_set_epoch, None
        if self._loaded and start > 0 and at_set_epoch is not None:
            _warn_if_base_seed_drawn(at_set_epoch)
        self._loaded = False
        total = self._total(start)
        if self._shuffle:
            gen = torch.Generator()
            gen.manual_seed(derive_seed(self._seed, "order", epoch, bits=64))
            order: list[int] = torch.randperm(self._size, generator=gen).tolist()
        else:
            order = list(range(self._size))
        seq = order[start : start + total]
        if len(seq) < total:  # pad with the epoch's first indices, as DistributedSampler
            missing = total - len(seq)
            seq += (order * math.ceil(missing / len(order)))[:missing]
        record = self._pass = [epoch, start, 0]
        for i in seq[self._rank :: self._replicas]:
            record[2] += 1  # before the yield: a state taken right after it counts this index
            yield _seeded_index(i, epoch)

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The epoch and how far into it the ranks got: plain ints and bools,
        for ``torch.save`` and ``torch.load(weights_only=True)``.

        Args:
            consumed: the number of indices this rank's loop consumed from
                the current pass (with a plain ``DataLoader`` whose workers
                take indices ahead of the loop), ``0`` up to the number the
                pass handed out (``0`` before a pass begins); a larger one
                raises ``ValueError``.  ``None``: every index the pass handed
                out (exact with ``num_workers=0`` and inside torchdata's
                ``StatefulDataLoader``).

        Example:
            >>> from deterministic_ctx import SeededSampler
            >>> sampler = SeededSampler(range(10), seed=0)
            >>> it = iter(sampler)
            >>> taken = [next(it) for _ in range(4)]
            >>> state = sampler.state_dict()
            >>> state["epoch"], state["consumed"]
            (0, 4)
            >>> resumed = SeededSampler(range(10), seed=0)
            >>> resumed.load_state_dict(state)
            >>> taken + list(resumed) == list(SeededSampler(range(10), seed=0))
            True
        """
        record = self._pass
        live = record is not None and record[0] == self._epoch
        handed_out = record[2] if record is not None and live else 0
        if consumed is not None:
            consumed = check_count(consumed, "consumed")
            if consumed > handed_out:
                raise ValueError(
                    f"consumed must be in 0 .. {handed_out} (the indices this pass has handed "
                    f"out so far), got {consumed}"
                )
        if self._done is not None:  # a loaded finished epoch, no pass since
            epoch, taken = self._done
        elif record is None or not live:
            epoch, taken = self._epoch, self._start
        else:
            epoch, start, yielded = record
            if consumed is not None:
                yielded = consumed
            taken = min(start + yielded * self._replicas, self._size)
        return {
            "seed": self._seed,
            "epoch": epoch,
            "consumed": taken,
            "size": self._size,
            "shuffle": self._shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass continue the saved epoch after the indices taken,
        or start the next epoch if the saved pass had finished its epoch.

        The state is checked before anything changes: a ``ValueError`` names
        what does not fit (another seed, dataset size or ``shuffle``; a
        malformed field).  The number of ranks may differ from the saving
        run's: see the class's description.

        Example:
            >>> from deterministic_ctx import SeededSampler
            >>> sampler = SeededSampler(range(10), seed=0)
            >>> sampler.load_state_dict({"seed": 1, "epoch": 0, "consumed": 0, "size": 10,
            ...                          "shuffle": True})
            Traceback (most recent call last):
            ...
            ValueError: state_dict["seed"] is 1, but this sampler's seed is 0
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        expected = {"seed", "epoch", "consumed", "size", "shuffle"}
        if set(state_dict) != expected:
            raise ValueError(
                f"state_dict must have exactly the keys {sorted(expected)}, got "
                f"{sorted(map(str, state_dict))}"
            )

        def field(name: str) -> int:
            value = state_dict[name]
            try:
                return check_count(value, f'state_dict["{name}"]')
            except TypeError as exc:
                raise ValueError(str(exc)) from None

        epoch, taken = field("epoch"), field("consumed")
        for name, mine in (("seed", self._seed), ("size", self._size)):
            if field(name) != mine:
                raise ValueError(
                    f'state_dict["{name}"] is {state_dict[name]}, but this sampler\'s {name} '
                    f"is {mine}"
                )
        if state_dict["shuffle"] is not self._shuffle:
            raise ValueError(
                f'state_dict["shuffle"] is {state_dict["shuffle"]!r}, but this sampler\'s '
                f"shuffle is {self._shuffle}"
            )
        if taken > self._size:
            raise ValueError(
                f'state_dict["consumed"] is {taken}, more than the {self._size} indices of an epoch'
            )
        asked, self._asked = self._asked, None
        if self._total(taken) == 0 and asked != epoch:
            # The saved pass had handed out its last index: an epoch's end, so the next
            # pass starts the next epoch (torchdata's StatefulDataLoader loads the state
            # after the trainer's set_epoch(epoch + 1)).
            self._epoch, self._start, self._pass = epoch + 1, 0, None
            self._done = (epoch, taken)
        else:
            self._epoch, self._start, self._pass, self._done = epoch, taken, None, None
        self._loaded = True

    def __repr__(self) -> str:
        return (
            f"SeededSampler(size={self._size}, seed={self._seed}, shuffle={self._shuffle}, "
            f"num_replicas={self._replicas}, rank={self._rank}, drop_last={self._drop_last})"
        )
