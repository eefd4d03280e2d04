"""A transformers ``Trainer`` callback that makes training resume bit for bit.

``Trainer(..., callbacks=[TransformersCallback(seed=0)])``: training runs in
one ``deterministic`` block whose generators are seeded afresh from the step's
number when each optimizer step starts, and every
training sample's random draws are keyed by ``(seed, epoch, index)``
(:class:`~deterministic_ctx.SeededDataset`).  A run killed after any checkpoint
and resumed with ``trainer.train(resume_from_checkpoint=...)`` in a fresh
process then trains the very steps the uninterrupted run trains, with any
``dataloader_num_workers`` (0 or more, also another number than before the
crash).

Why the Trainer alone does not (transformers 5.24, accelerate 1.15): resumed
mid-epoch, the Trainer skips the epoch's first batches with a new loader
iterator whose worker processes get their seeds from the fresh process's
torch stream, and restores ``rng_state.pth`` only after the first batch of
the resumed step is loaded; the augmentation of every later batch and, with
``num_workers=0``, the interleaving of data and dropout draws then differ
from the uninterrupted run from the first resumed step.

This module imports transformers; ``import deterministic_ctx`` never does
(``TransformersCallback`` loads it when first used).

Example:
    >>> from deterministic_ctx import TransformersCallback
    >>> callback = TransformersCallback(seed=0)
    >>> callback.state()["args"]
    {'seed': 0, 'flags': True, 'warn_only': False}
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.trainer_callback import TrainerCallback

from .._errors import StateWarning
from ..internal import check_bool, validate_seed
from ..parallel.keyed import SeededDataset
from .check_resume import RECORDS_VAR, checkpoint_saved, record_step
from .trainer_steps import TrainingBlock

try:  # transformers >= 4.41: callbacks whose state goes into the checkpoint
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - older transformers: the seed is not checked on resume

    class ExportableState:  # type: ignore[no-redef]
        """Stands in for transformers' ``ExportableState`` where it does not exist."""

        def state(self) -> dict[str, Any]:
            raise NotImplementedError


__all__ = ["TransformersCallback"]


def _loader_of(train_dataloader: object) -> torch.utils.data.DataLoader[Any]:
    """The ``DataLoader`` that iterates: accelerate's ``DataLoaderShard`` wraps one
    (``base_dataloader``) and reads ``dataset`` from it."""
    inner = getattr(train_dataloader, "__dict__", {}).get("base_dataloader", train_dataloader)
    if not isinstance(inner, torch.utils.data.DataLoader):
        raise TypeError(
            f"TransformersCallback needs the Trainer's train DataLoader, got "
            f"{type(train_dataloader).__name__}"
        )
    return inner


def _set_dataset(loader: torch.utils.data.DataLoader[Any], dataset: SeededDataset[Any]) -> None:
    """Give ``loader`` (not iterated yet) ``dataset`` instead of the one it was built with.

    The one private touch of this module: torch's ``DataLoader.__setattr__``
    refuses to change ``dataset`` after construction (its sampler was sized
    from it).  The keyed dataset has the very length, kind and items' order of
    the one it wraps, so the sampler stays right; accelerate's
    ``skip_first_batches`` builds the resumed loader from this attribute.
    ``tests/integrations/test_transformers.py`` fails when torch or accelerate
    change what this relies on.
    """
    object.__setattr__(loader, "dataset", dataset)


def _step_loss(output: object) -> torch.Tensor | None:
    """The loss in a model's output, as the Trainer's ``compute_loss`` takes it."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, Sequence) and not isinstance(output, str) and output:
        loss = output[0]
    else:
        loss = output
    return loss.detach() if isinstance(loss, torch.Tensor) else None


class TransformersCallback(TrainerCallback, ExportableState):
    """Make a transformers ``Trainer`` reproducible run to run and resumable bit for bit.

    Add it to the Trainer and change nothing else:
    ``Trainer(model, args, train_dataset=..., callbacks=[TransformersCallback(seed=0)])``,
    then ``trainer.train()`` or ``trainer.train(resume_from_checkpoint=...)``.
    A run killed after any checkpoint (mid-epoch or on an epoch's last step)
    and resumed in a fresh process trains exactly the steps of the
    uninterrupted run, with the same losses and weights, bit for bit, with
    ``dataloader_num_workers`` 0 or more, the same or another number after the
    crash.

    What it does:

    * **each optimizer step** (all its gradient-accumulation micro-batches,
      the backward passes and the optimizer's step) starts from a key of its
      own: ``train()`` runs in one block (from ``on_train_begin`` to
      ``on_train_end``; it sets the determinism flags once, for evaluation
      during training too, and puts the process's own streams and flags back
      at the end), and at each ``on_step_begin`` that block's generators are
      seeded afresh, as ``deterministic(seed=k, flags=False)`` seeds them,
      with the step's key ``k``, a function of ``(seed, n)`` only, ``n`` the
      number of steps taken before it.  Dropout and any other draw of the
      step depend on ``(seed, n)`` only; what runs between steps (loading
      data, the Trainer's ``rng_state.pth``, evaluation) continues from the
      last step's streams and cannot shift the next step, which starts from
      its own key again.  Like every open block it holds the process-wide
      block lock: a block entered in another thread waits for ``train()``;
    * **the training data**: when training starts, the train loader's dataset
      is wrapped in ``SeededDataset(dataset, seed)`` (one private touch: torch
      guards the loader's ``dataset`` attribute), and each epoch's number is
      given to it before the epoch's iterator starts; sample ``i`` of epoch
      ``e`` draws from a key of ``(seed, e, i)`` only, in whichever worker
      loads it.  A dataset that already is a ``SeededDataset`` is used as it
      is.  The epoch's order stays accelerate's (keyed by the Trainer's seed
      and the epoch), and the Trainer skips the batches a resumed epoch has
      already trained.
    * **the checkpoint** holds the callback's settings (transformers'
      ``ExportableState``); resuming with another seed raises ``ValueError``.
      With ``restore_callback_states_from_checkpoint=True`` the Trainer
      replaces the callback by one built from the checkpoint's settings.
    * under ``deterministic-ctx check-resume`` only: each step's record
      (the losses of its forward passes, its inputs, the random state it
      leaves) and the point right after each checkpoint is on disk; nothing
      of this runs otherwise.

    Not covered: randomness in the data collator (it runs per batch, not per
    sample: draw in the dataset instead), ``IterableDataset`` training data
    and ``dataloader_persistent_workers=True`` (whose workers keep the first
    epoch's dataset) raise ``TypeError``/``ValueError`` when training starts.

    The Trainer has no event for errors: an exception in the model's forward
    (training or evaluation) leaves the block on its way out (a forward hook
    of the callback's, ``always_call=True``); one raised anywhere else during
    ``train()`` (the backward pass, the optimizer, loading data, evaluation,
    saving a checkpoint, another callback) leaves it open, with the training's
    streams and flags in force, until the next ``train()`` or :meth:`close`
    (``try: trainer.train() finally: callback.close()``).

    Args:
        seed: an int in ``0 .. 2**32 - 1``: the steps' and the samples' keys
            derive from it.
        flags: turn deterministic algorithms on during ``train()`` (as
            ``deterministic(flags=...)``); ``False`` keeps the caller's flags.
        warn_only: deterministic algorithms warn instead of raising where an
            operation has no deterministic implementation.

    Example:
        >>> from deterministic_ctx import TransformersCallback
        >>> TransformersCallback(seed=3)
        TransformersCallback(seed=3, flags=True, warn_only=False)
    """

    def __init__(self, seed: int, *, flags: bool = True, warn_only: bool = False) -> None:
        self.seed = validate_seed(seed)
        self.flags = check_bool(flags, "flags")
        self.warn_only = check_bool(warn_only, "warn_only")
        self._training = TrainingBlock(
            self.seed, owner="TransformersCallback", flags=self.flags, warn_only=self.warn_only
        )
        self._in_step = False  # from on_step_begin to on_step_end
        self._recording = False  # under check-resume (read by on_train_begin)
        self._dataset: SeededDataset[Any] | None = None
        self._next_epoch: int | None = None
        self._hooks: list[Any] = []
        self._forwards: list[tuple[object, torch.Tensor | None]] = []
        self._handling: list[BaseException | None] = []  # per forward: what its caller handled

    def __repr__(self) -> str:
        return (
            f"TransformersCallback(seed={self.seed}, flags={self.flags}, "
            f"warn_only={self.warn_only})"
        )

    def state(self) -> dict[str, Any]:
        """What the Trainer keeps of the callback in a checkpoint's ``trainer_state.json``.

        Example:
            >>> from deterministic_ctx import TransformersCallback
            >>> TransformersCallback(seed=5, warn_only=True).state()
            {'args': {'seed': 5, 'flags': True, 'warn_only': True}, 'attributes': {}}
        """
        return {
            "args": {"seed": self.seed, "flags": self.flags, "warn_only": self.warn_only},
            "attributes": {},
        }

    def close(self) -> None:
        """Leave the block around training if it is open (after an exception during
        ``train()``); nothing otherwise.

        Example:
            >>> from deterministic_ctx import TransformersCallback
            >>> TransformersCallback(seed=0).close()  # not training: nothing happens
        """
        self._in_step = False
        self._training.close()

    # -- the events ------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()  # the block an exception left open
        self._remove_hooks()
        loader = _loader_of(kwargs.get("train_dataloader"))
        if getattr(loader, "persistent_workers", False) and loader.num_workers > 0:
            raise ValueError(
                "TransformersCallback does not support dataloader_persistent_workers=True: "
                "persistent workers keep the dataset of the first epoch; set it to False"
            )
        dataset = loader.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                f"TransformersCallback keys map-style training data only (a Dataset with "
                f"__getitem__ and __len__), got the IterableDataset {type(dataset).__name__}"
            )
        self._check_checkpoint(state)  # after the checks above: nothing changed if they raise
        if not isinstance(dataset, SeededDataset):
            dataset = SeededDataset(dataset, self.seed)
            _set_dataset(loader, dataset)
        self._dataset = dataset
        self._next_epoch = None
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module):
            # The Trainer has no event for errors: an exception in the model's forward
            # leaves the training block here, on its way out (torch runs always_call hooks).
            self._hooks.append(model.register_forward_pre_hook(self._forward_starts))
            self._hooks.append(model.register_forward_hook(self._forward_ends, always_call=True))
            self._recording = bool(os.environ.get(RECORDS_VAR))
            if self._recording:
                self._hooks.append(model.register_forward_hook(self._record, with_kwargs=True))
        self._training.start()  # last: nothing is left open if the above raises

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer's first epoch of a train() call is the one its state's epoch is in
        # (1.0 after a checkpoint on the first epoch's last step); the next ones follow.
        epoch = math.floor(state.epoch or 0) if self._next_epoch is None else self._next_epoch
        self._next_epoch = epoch + 1
        if self._dataset is not None:
            self._dataset.set_epoch(epoch)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._forwards = []
        self._in_step = True
        # The training block's generators seeded afresh from the step's key, not a
        # block per step: the capture and the restore are paid once a train().
        self._training.step(0, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recording and self._in_step:
            forwards, self._forwards = self._forwards, []
            losses = [loss for _, loss in forwards if loss is not None]
            record_step(
                state.global_step,
                loss=torch.stack(losses) if losses else None,
                batch=[inputs for inputs, _ in forwards],
            )
        self._in_step = False

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._in_step = False  # a step a callback's should_epoch_stop cut between micro-batches

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer calls on_save once the checkpoint's files are written.
        checkpoint_saved(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
        self._remove_hooks()

    # -- helpers ---------------------------------------------------------------------------

    def _check_checkpoint(self, state: Any) -> None:
        stored_all = getattr(state, "stateful_callbacks", None)
        if not isinstance(stored_all, dict):
            return
        stored = stored_all.get(type(self).__name__)
        if stored is None:
            # A checkpoint written without the callback: the Trainer's next save looks the
            # callback's entry up and would fail with a KeyError.
            stored_all[type(self).__name__] = self.state()
            warnings.warn(
                "resuming a checkpoint written without TransformersCallback: the steps from "
                "here on are keyed, but they are not the steps the crashed run would have trained",
                StateWarning,
                stacklevel=2,
            )
            return
        entries = stored if isinstance(stored, list) else [stored]
        seeds = [entry.get("args", {}).get("seed") for entry in entries if isinstance(entry, dict)]
        if seeds and self.seed not in seeds:
            raise ValueError(
                f"the checkpoint was trained with TransformersCallback(seed={seeds[0]}), "
                f"this run has seed={self.seed}: resuming with another seed would not continue "
                f"the same run; use seed={seeds[0]}"
            )

    def _forward_starts(self, module: object, args: object) -> None:
        self._handling.append(sys.exc_info()[1])

    def _forward_ends(self, module: object, args: object, output: object) -> None:
        # Called after every forward; inside torch's ``except`` when the forward raised,
        # where the exception being handled is no longer the one of the forward's caller.
        handling = self._handling.pop() if self._handling else None
        if sys.exc_info()[1] is not handling:
            self.close()

    def _record(
        self, module: object, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        if self._in_step:  # a training step's forward, not an evaluation's
            self._forwards.append(((args, kwargs), _step_loss(out)))

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        self._forwards = []
        self._handling = []
