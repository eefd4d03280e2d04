"""``LightningCallback``: Lightning training that is reproducible and resumes bit for bit.

Add ``LightningCallback(seed=0)`` to ``Trainer(callbacks=[...])``; the module,
its ``DataLoader`` and the ``fit(ckpt_path=...)`` call stay as written.  Three
things happen:

* **The train loader is rebuilt keyed.**  When Lightning asks the module (or
  DataModule, or ``fit(train_dataloaders=...)``) for the train loader, the
  callback builds one of its own from it: the dataset wrapped in
  :class:`~deterministic_ctx.SeededDataset` (item ``i`` of epoch ``e`` draws
  from a key of ``(seed, e, i)``), the sampler replaced by a
  :class:`~deterministic_ctx.SeededSampler` (``shuffle`` as the original's:
  ``RandomSampler`` shuffles, ``SequentialSampler`` does not; rank-aware under
  DDP), every other setting kept.  The loader saves its position in the
  checkpoint (Lightning's stateful-loader protocol) and resumes there.
* **Each training step starts from a key of its own**: one block around
  training sets the determinism flags and, at each ``on_train_batch_start``,
  its random number generators are seeded afresh from a key of
  ``(seed, epoch, batch_idx)``.  Dropout and anything else the step draws
  depend on the seed, the epoch and the batch only; what Lightning draws
  between steps (validation, iterators) cannot shift training.
* **Under ``deterministic-ctx check-resume``** (and only there) each step is
  recorded with ``record_step``, and
  ``checkpoint_saved`` is called once a step's
  checkpoints are on disk.

Lightning is imported when the first callback is made: ``lightning.pytorch``
and the standalone ``pytorch_lightning``, whichever are installed; the callback
is an instance of each one's ``Callback``, so either ``Trainer`` takes it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from .._errors import MisuseError
from ..internal import check_bool, derive_seed, validate_seed
from ..parallel.keyed import SeededDataset, SeededSampler
from .check_resume import RECORDS_VAR, checkpoint_saved, record_step
from .trainer_steps import TrainingBlock

__all__ = ["LightningCallback"]

#: Lightning's private names this module touches, all of them: the fit loop's
#: train data source, whose ``dataloader()`` the fit loop calls for the train
#: loader (``FitLoop.setup_data`` through ``_request_dataloader``).
#: tests/integrations/test_lightning.py fails with a clear message if they move.
PRIVATE_NAMES = ("fit_loop._data_source", "_DataLoaderSource.dataloader")

#: The Lightning packages whose ``Callback`` the callback subclasses, if installed.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def train_source(trainer: Any) -> Any:
    """The fit loop's train data source (the one private touch), or a clear error."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not callable(getattr(source, "dataloader", None)):
        raise MisuseError(
            f"LightningCallback cannot find the train data source of this Lightning version "
            f"({type(trainer).__module__}): it relies on trainer.fit_loop._data_source."
            f"dataloader(), which this version does not have; please report it"
        )
    return source


class _Sampler(SeededSampler, DistributedSampler[int]):  # type: ignore[override]
    """A :class:`SeededSampler` that Lightning takes for a ``DistributedSampler``:
    under DDP it neither wraps nor replaces it (``_requires_distributed_sampler``)."""


class _KeyedLoader(DataLoader[Any]):
    """The rebuilt train loader: a ``DataLoader`` over a :class:`SeededDataset`
    and a :class:`SeededSampler`, resumable the way Lightning resumes loaders.

    ``state_dict()`` holds the epoch and the batches the loop completed in it
    (told by the callback; workers and Lightning's fetcher run ahead), so the
    batch after the last completed one comes first after ``load_state_dict()``.
    ``len()`` stays the full epoch's, as Lightning counts a resumed epoch's
    batches from its start.  Its generator is re-seeded from ``(seed, epoch)``
    before each pass: starting workers draws nothing from torch's global stream.
    """

    def __init__(self, dataset: Any, *, seed: int, full: int, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._keyed_seed = seed
        self._full = full  # batches in a whole epoch on this rank
        self._completed = (0, 0)  # (epoch, batches the loop completed in it)
        self._resume: dict[str, Any] | None = None
        self._pass_start = 0  # batches of the epoch before the current pass (a resume)

    @property
    def keyed_sampler(self) -> SeededSampler:
        sampler = self.sampler
        assert isinstance(sampler, SeededSampler)
        return sampler

    def completed(self, epoch: int, batches: int) -> None:
        """The loop completed ``batches`` batches of ``epoch`` (the callback's count; an
        epoch's end hooks count as ``(epoch + 1, 0)``: Lightning trains the next one
        after a checkpoint saved there)."""
        self._completed = (epoch, batches)

    def __len__(self) -> int:
        return self._full

    def __iter__(self) -> Any:
        sampler = self.keyed_sampler
        resume, self._resume = self._resume, None
        self._pass_start = 0
        if resume is not None:
            epoch, batches = resume["epoch"], resume["batches"]
            if batches >= self._full:  # saved after the epoch's last batch: the next one
                epoch, batches = epoch + 1, 0
            sampler.set_epoch(epoch)
            if batches:
                sampler.load_state_dict(resume["sampler"])
                self._pass_start = batches
        assert self.generator is not None
        self.generator.manual_seed(derive_seed(self._keyed_seed, "loader", sampler.epoch, bits=64))
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self._completed
        sampler = self.keyed_sampler
        if epoch < sampler.epoch:  # no batch of the sampler's epoch completed yet
            epoch, batches = sampler.epoch, 0
        position = None
        if epoch == sampler.epoch and 0 < batches < self._full:
            consumed = (batches - self._pass_start) * (self.batch_size or 1)
            position = sampler.state_dict(consumed=consumed)
        return {"seed": self._keyed_seed, "epoch": epoch, "batches": batches, "sampler": position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = {"seed", "epoch", "batches", "sampler"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            raise ValueError(
                f"the checkpoint's train loader state is not LightningCallback's (keys "
                f"{sorted(expected)}), got {state_dict!r:.200}: was it saved without the callback?"
            )
        if state_dict["seed"] != self._keyed_seed:
            raise ValueError(
                f"the checkpoint's train loader was keyed with seed {state_dict['seed']}, "
                f"but LightningCallback's seed is {self._keyed_seed}"
            )
        self._resume = dict(state_dict)
        self._completed = (state_dict["epoch"], state_dict["batches"])


def _unkeyable(what: str) -> ValueError:
    return ValueError(
        f"LightningCallback cannot key the train loader: {what}. It keys a map-style dataset "
        f"in a torch DataLoader (or torchdata StatefulDataLoader) with batch_size and a "
        f"RandomSampler (shuffle=True) or SequentialSampler (shuffle=False); nothing was changed"
    )


_KEPT = (
    "batch_size",
    "drop_last",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


#: What this torch's ``DataLoader`` takes.
_LOADER_PARAMETERS = frozenset(inspect.signature(DataLoader.__init__).parameters)


def _torchdata(name: str) -> type | None:
    """torchdata's ``name`` (``StatefulDataLoader`` and its own samplers), if it is loaded."""
    for module_name in ("torchdata.stateful_dataloader", "torchdata.stateful_dataloader.sampler"):
        module = sys.modules.get(module_name)
        found = getattr(module, name, None) if module is not None else None
        if isinstance(found, type):
            return found
    return None


def rebuild(loader: object, seed: int, trainer: Any) -> _KeyedLoader:
    """``loader`` rebuilt keyed (see the module's description), or a ``ValueError``
    naming what cannot be keyed."""
    if isinstance(loader, _KeyedLoader):
        return loader
    if type(loader) not in (DataLoader, _torchdata("StatefulDataLoader")):
        raise _unkeyable(
            f"it is a {type(loader).__name__}, not a single torch DataLoader (a DataLoader "
            f"subclass, a list or dict of loaders or a CombinedLoader cannot be rebuilt)"
        )
    assert isinstance(loader, DataLoader)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise _unkeyable(f"its dataset {type(dataset).__name__} is an IterableDataset")
    batch_samplers = (BatchSampler, _torchdata("BatchSampler"))
    if loader.batch_size is None or type(loader.batch_sampler) not in batch_samplers:
        raise _unkeyable(f"it has a custom batch_sampler {type(loader.batch_sampler).__name__}")
    original = loader.sampler
    if type(original) in (RandomSampler, _torchdata("RandomSampler")):
        if getattr(original, "replacement", False) or getattr(original, "_num_samples", None):
            raise _unkeyable("its RandomSampler draws with replacement or num_samples")
        shuffle = True
    elif type(original) is SequentialSampler:
        shuffle = False
    else:
        raise _unkeyable(f"it has a custom sampler {type(original).__name__}")
    if isinstance(dataset, SeededDataset):
        if dataset.seed != seed:
            raise ValueError(
                f"the train dataset is a SeededDataset with seed {dataset.seed}, but "
                f"LightningCallback's seed is {seed}"
            )
        keyed = dataset
    else:
        keyed = SeededDataset(dataset, seed)
    kwargs = trainer.distributed_sampler_kwargs or {}
    sampler = _Sampler(
        keyed,
        seed=seed,
        shuffle=shuffle,
        num_replicas=kwargs.get("num_replicas", 1),
        rank=kwargs.get("rank", 0),
    )
    # The batches of a whole epoch on this rank, counted as the loader's own BatchSampler counts.
    full = len(BatchSampler(sampler, loader.batch_size, loader.drop_last))
    settings = {name: getattr(loader, name) for name in _KEPT if hasattr(loader, name)}
    if settings.get("in_order", True) is not True:
        # Batches in the order the workers finish them: not the same two runs in a row.
        raise _unkeyable("in_order=False hands out batches in the order the workers finish them")
    # A StatefulDataLoader may know settings this torch's DataLoader does not (in_order
    # before torch 2.6): left at their defaults (in_order=True), which the loader has.
    settings = {name: value for name, value in settings.items() if name in _LOADER_PARAMETERS}
    if settings.get("num_workers", 0) == 0:
        settings.pop("prefetch_factor", None)  # DataLoader refuses one without workers
    return _KeyedLoader(
        keyed,
        seed=seed,
        full=full,
        sampler=sampler,
        generator=torch.Generator(),
        **settings,
    )


def _bases() -> tuple[type, ...]:
    bases: list[type] = []
    for name in _PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        bases.append(module.Callback)
    if not bases:
        raise ImportError(
            "LightningCallback needs Lightning: pip install lightning (or pytorch-lightning)"
        )
    return tuple(bases)


_BOUND: list[type] = []  # the class made once, on first use


def _bound_class() -> type:
    if not _BOUND:
        cls = types.new_class("LightningCallback", (LightningCallback, *_bases()))
        cls.__module__ = __name__
        cls.__qualname__ = "LightningCallback"
        _BOUND.append(cls)
    return _BOUND[0]


def _rebuilt(cls: type, state: dict[str, Any]) -> LightningCallback:
    obj: LightningCallback = object.__new__(_bound_class())
    obj.__dict__.update(state)
    return obj


class LightningCallback:
    """A Lightning callback that makes training reproducible and resumable bit for bit.

    Add it to ``Trainer(callbacks=[LightningCallback(seed=0)])`` and change
    nothing else: a run gives the same losses and weights every time, and a
    run killed after any checkpoint (mid-epoch, or on an epoch's last batch)
    and restarted with ``fit(ckpt_path=...)`` trains exactly the remaining
    steps of the uninterrupted run, with the same losses and weights, with any
    ``num_workers`` (also another one after the restart).

    **What it does to your train loader.**  The loader Lightning requests for
    ``fit`` (from ``train_dataloader()`` of the module or DataModule, or
    ``fit(train_dataloaders=...)``) is rebuilt, by a ``DataLoader`` of the
    callback's own class:

    * the dataset is wrapped in :class:`~deterministic_ctx.SeededDataset`:
      item ``i`` of epoch ``e`` draws its augmentation (Python ``random``,
      NumPy's global RNG, torch's CPU generator, registered RNGs) from a key
      of ``(seed, e, i)``, whatever worker computes it, so 0 and 2 workers
      give the same batches;
    * the sampler is replaced by a :class:`~deterministic_ctx.SeededSampler`
      whose order is a function of ``(seed, epoch)``, shuffled when yours was
      a ``RandomSampler`` (``shuffle=True``), in order when it was a
      ``SequentialSampler``; under DDP it splits the epoch over the ranks
      and Lightning does not replace it with its ``DistributedSampler``;
    * ``batch_size``, ``drop_last``, ``num_workers``, ``collate_fn``,
      ``pin_memory``, ``worker_init_fn``, ``persistent_workers``,
      ``prefetch_factor``, ``timeout`` and ``multiprocessing_context`` are
      kept; the loader's ``generator`` is one of the callback's, re-seeded from
      ``(seed, epoch)`` for each pass (yours, if any, is not used: the
      replaced sampler was its only other user), so starting workers draws
      nothing from torch's global stream;
    * the loader's position (the epoch and the batches the loop completed in
      it, not those workers fetched ahead) is saved in the checkpoint through
      Lightning's stateful-loader protocol, and a resumed fit starts right
      after it.  A torchdata ``StatefulDataLoader`` is rebuilt the same way:
      its own worker state is not used, so a resume with another
      ``num_workers`` works instead of failing on torchdata's assertion.

    A loader that cannot be keyed (an ``IterableDataset``, a custom
    ``sampler`` or ``batch_sampler``, a ``DataLoader`` subclass, several
    train loaders, ``Trainer(overfit_batches=...)``) is refused with a
    ``ValueError`` naming it, before anything changed.  Validation and test
    loaders are left alone.

    **Each training step starts from its own key.**  Training as a whole
    (``on_train_start`` to ``on_train_end``, validation during it included)
    runs in one block, seeded with ``derive_seed(seed, "fit")``, which sets
    the determinism flags once (``flags``, ``warn_only``,
    ``fill_uninitialized_memory`` as for :class:`~deterministic_ctx.deterministic`)
    and gives your program's streams and flags back after ``fit`` (or on
    ``on_exception``).  At each ``on_train_batch_start`` that block's random
    number generators are seeded afresh, as
    ``deterministic(seed=k, flags=False)`` seeds them, with the batch's key
    ``k``: a function of ``(seed, epoch, batch_idx)`` only, derived as
    :class:`~deterministic_ctx.SeededDataset` derives its items' keys (one
    ``derive_seed`` per epoch, a SplitMix64 step per batch).  So dropout and
    anything else a step draws depend on the seed, the epoch and the batch
    only; what runs between two steps (validation, Lightning's own draws)
    continues from the last step's streams, the same in a resumed run, and
    cannot shift the next step, which starts from its own key again.

    The seed is saved in the checkpoint; resuming with another seed is
    refused.  Under ``deterministic-ctx check-resume`` each step is recorded
    (``record_step``) and, once a step's checkpoints
    are all on disk (before the next step starts), the run is told so
    (``checkpoint_saved``): no user code is needed.

    It subclasses the ``Callback`` of ``lightning.pytorch`` and of the
    standalone ``pytorch_lightning``, whichever are installed (Lightning is
    imported when the first callback is made).  Lightning's private name it
    relies on is listed in ``deterministic_ctx.integrations.lightning.PRIVATE_NAMES``.

    Args:
        seed: an int in ``0 .. 2**32 - 1``: the data keys, the order and the
            steps' seeds derive from it.
        warn_only: during training, deterministic algorithms warn instead of
            raising for an operation without a deterministic implementation.
        flags: with ``False``, steps are seeded and isolated but set no
            determinism flag.
        fill_uninitialized_memory: ``torch.utils.deterministic.fill_uninitialized_memory``
            during training.

    Example:
        >>> import lightning as L
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from deterministic_ctx import LightningCallback
        >>> class Model(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Dropout(0.5))
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch[0]).sum()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> def train():
        ...     L.seed_everything(0, verbose=False)
        ...     model = Model()
        ...     data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)
        ...     trainer = L.Trainer(max_epochs=2, callbacks=[LightningCallback(seed=0)],
        ...                         logger=False, enable_checkpointing=False,
        ...                         enable_progress_bar=False, enable_model_summary=False)
        ...     trainer.fit(model, data)
        ...     return model.layer[0].weight.detach()
        >>> torch.equal(train(), train())
        True
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> LightningCallback:
        if cls is LightningCallback:
            cls = _bound_class()
        obj: LightningCallback = object.__new__(cls)
        return obj

    def __init__(
        self,
        seed: int,
        *,
        warn_only: bool = False,
        flags: bool = True,
        fill_uninitialized_memory: bool = True,
    ) -> None:
        self._seed = validate_seed(seed)
        self._options = {
            "warn_only": check_bool(warn_only, "warn_only"),
            "flags": check_bool(flags, "flags"),
            "fill_uninitialized_memory": check_bool(
                fill_uninitialized_memory, "fill_uninitialized_memory"
            ),
        }
        # From on_train_start to on_train_end; its settings are built (and checked) now.
        self._training = TrainingBlock(self._seed, owner="LightningCallback", **self._options)
        self._steps_before = 0  # trainer.global_step when the open step began (check-resume)
        self._loader: _KeyedLoader | None = None
        self._source: Any = None
        self._trainer: Any = None
        self._pending: int | None = None  # a step whose checkpoints check-resume awaits
        self._recording = False  # under check-resume (set by setup)

    @property
    def seed(self) -> int:
        """The seed everything the callback keys derives from."""
        return self._seed

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__, _loader=None, _source=None, _trainer=None)
        return (_rebuilt, (LightningCallback, state))

    def __repr__(self) -> str:
        options = "".join(
            f", {name}={value}"
            for name, value in self._options.items()
            if value != (name != "warn_only")
        )
        return f"LightningCallback(seed={self._seed}{options})"

    # -- the train loader --------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.overfit_batches:
            raise ValueError(
                "LightningCallback cannot key the train loader with Trainer(overfit_batches=...): "
                "Lightning then replaces the sampler; remove overfit_batches or the callback"
            )
        source = train_source(trainer)
        original = source.dataloader
        if getattr(original, "__self__", source) is not source:
            raise ValueError(
                "the train loader is already keyed by another LightningCallback: add one only"
            )

        def dataloader() -> _KeyedLoader:
            loader = rebuild(original(), self._seed, trainer)
            self._loader = loader
            return loader

        dataloader.__self__ = self  # type: ignore[attr-defined]  # marks the source as taken
        source.dataloader = dataloader
        self._source = source
        self._trainer = trainer
        # Under check-resume only: read once, not at every step.
        self._recording = bool(os.environ.get(RECORDS_VAR))
        if self._recording:
            save = trainer.save_checkpoint

            def save_checkpoint(*args: Any, **kwargs: Any) -> None:
                save(*args, **kwargs)
                self._pending = trainer.global_step

            trainer.save_checkpoint = save_checkpoint

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._training.close()
        self._flush()
        source, self._source = self._source, None
        if source is not None:
            source.__dict__.pop("dataloader", None)
        if self._trainer is not None:
            self._trainer.__dict__.pop("save_checkpoint", None)
            self._trainer = None

    # -- steps -------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._training.start()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._training.close()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._flush()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._flush()
        # The fit block's generators seeded afresh from the step's key, not a block per
        # step: the capture and the restore are the fit block's, once a fit.
        self._training.step(trainer.current_epoch, batch_idx)
        if self._recording:
            self._steps_before = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recording:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            # The optimizer step this batch belongs to: under accumulate_grad_batches
            # the batches before the one that steps count towards the next step too.
            step = trainer.global_step
            record_step(step if step > self._steps_before else step + 1, loss=loss, batch=batch)
        if self._loader is not None:
            epoch, batches = trainer.current_epoch, batch_idx + 1
            if batches >= trainer.num_training_batches:
                # The epoch's last batch (also under limit_train_batches): resumed from a
                # checkpoint saved now, Lightning counts the epoch done and trains the next.
                epoch, batches = epoch + 1, 0
            self._loader.completed(epoch, batches)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # Lightning counts the epoch processed before its on_train_epoch_end hooks, where
        # checkpoints are saved: resumed from one, it trains the next epoch, from its start.
        if self._loader is not None:
            self._loader.completed(trainer.current_epoch + 1, 0)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._training.close()

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            checkpoint_saved(pending)

    # -- the checkpoint ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        seed = state_dict.get("seed") if isinstance(state_dict, dict) else None
        if seed != self._seed:
            raise ValueError(
                f"the checkpoint was trained with LightningCallback(seed={seed}), but this "
                f"run's callback has seed={self._seed}: resume with the same seed"
            )
