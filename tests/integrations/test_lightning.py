"""LightningCallback: real Lightning runs, killed with SIGKILL and resumed in fresh processes,
train exactly the uninterrupted run's steps, losses and weights; bad input is refused."""

from __future__ import annotations

import inspect
import json
import pickle
import runpy
import signal
from typing import ClassVar

import pytest

L = pytest.importorskip("lightning", reason="LightningCallback needs lightning")

import torch  # noqa: E402
from torch.utils.data import (  # noqa: E402
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

from deterministic_ctx import (  # noqa: E402
    LightningCallback,
    MisuseError,
    SeededDataset,
    derive_seed,
    deterministic,
    isolated,
)
from deterministic_ctx.integrations import lightning as integration  # noqa: E402
from deterministic_ctx.integrations.trainer_steps import StepKeys  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

EXAMPLE = ROOT / "examples" / "lightning_resume.py"


@pytest.fixture(scope="module")
def example():
    """The example's functions: train in a fresh process, compare two runs."""
    return runpy.run_path(str(EXAMPLE))


@pytest.fixture
def fresh(monkeypatch):
    """Children import this checkout."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


@pytest.fixture(scope="module")
def uninterrupted(example, tmp_path_factory):
    """The reference: one uninterrupted run with 2 workers."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT))
        assert example["launch"](directory, workers=2) == 0
    return directory


# -- process level -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("fresh")
def test_runs_repeat_bit_for_bit_with_0_or_2_workers(example, uninterrupted, tmp_path):
    # seed_everything(0), augmentation from random/NumPy/torch, dropout, 2 workers vs 0:
    # the same batches, losses and weights.
    assert example["launch"](tmp_path, workers=0) == 0
    steps = example["steps"](tmp_path)
    assert sorted(steps) == list(range(1, 19))
    assert example["same"](uninterrupted, tmp_path) == []


@pytest.mark.slow
@pytest.mark.usefixtures("fresh")
def test_killed_mid_epoch_resumes_bit_for_bit(example, uninterrupted, tmp_path):
    # Step 8 is the second batch of epoch 1: workers and Lightning's fetcher ran ahead of it.
    assert example["launch"](tmp_path, workers=2, kill_at=8) == -signal.SIGKILL
    assert max(example["steps"](tmp_path)) == 8
    assert example["launch"](tmp_path, workers=2, resume="last.ckpt") == 0
    assert example["same"](uninterrupted, tmp_path) == []


@pytest.mark.slow
@pytest.mark.usefixtures("fresh")
@pytest.mark.parametrize("checkpoint", ["epoch=1-step=12.ckpt", "last.ckpt"])
def test_killed_on_an_epochs_last_batch_resumes_the_next_epoch(
    example, uninterrupted, tmp_path, checkpoint
):
    # Step 12 is epoch 1's last batch. The step's own checkpoint was saved on the batch's
    # end, last.ckpt again at the epoch's end; Lightning resumes either into epoch 2, which
    # must train all its 6 batches (it trained 0 when the loader resumed the spent epoch 1).
    # Also 0 workers before the crash, 2 after.
    assert example["launch"](tmp_path, workers=0, kill_at=12) == -signal.SIGKILL
    assert example["launch"](tmp_path, workers=2, resume=checkpoint) == 0
    assert sorted(example["steps"](tmp_path)) == list(range(1, 19))
    assert example["same"](uninterrupted, tmp_path) == []


# -- in process ----------------------------------------------------------------------------


def module_class(package):
    """A tiny LightningModule of ``package`` (lightning or pytorch_lightning): Linear + Dropout."""

    class Model(package.LightningModule):
        def __init__(self, loader=None):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.5))
            self.loader = loader

        def training_step(self, batch, batch_idx):
            self.flags_seen = torch.are_deterministic_algorithms_enabled()
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return self.loader

    return Model


Model = module_class(L)


def data(n=12):
    return TensorDataset(torch.linspace(-1, 1, 2 * n).reshape(n, 2))


def fit(loader, *, callbacks=(), package=L, **options):
    """Train a fresh model on ``loader``; its weights and the trainer."""
    with isolated():
        torch.manual_seed(0)
        model = module_class(package)(loader)
        trainer = package.Trainer(
            max_epochs=2,
            callbacks=list(callbacks),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            **options,
        )
        trainer.fit(model)
    return model.net[0].weight.detach().clone(), trainer


def test_lightnings_private_names_are_where_the_callback_reaches_them():
    # The one private touch (PRIVATE_NAMES): if this fails, Lightning moved the fit loop's
    # train data source and LightningCallback must follow it.
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert integration.PRIVATE_NAMES == ("fit_loop._data_source", "_DataLoaderSource.dataloader")
    source = integration.train_source(trainer)
    assert type(source).__name__ == "_DataLoaderSource", (
        f"Lightning {L.__version__} changed trainer.fit_loop._data_source "
        f"({type(source).__name__}): update deterministic_ctx/integrations/lightning.py"
    )
    assert callable(source.dataloader)


def test_a_trainer_without_the_private_source_is_named_clearly():
    with pytest.raises(MisuseError, match=r"fit_loop\._data_source"):
        integration.train_source(object())


def test_lightning_trains_on_the_keyed_loader_and_the_source_is_given_back():
    original = DataLoader(data(), batch_size=4, shuffle=True)
    _, trainer = fit(original, callbacks=[LightningCallback(seed=0)])
    used = trainer.train_dataloader
    assert isinstance(used, integration._KeyedLoader), (
        f"Lightning {L.__version__} no longer trains on the loader its data source gives"
    )
    assert isinstance(used.dataset, SeededDataset) and used.dataset.dataset is original.dataset
    assert used.sampler.shuffle and used.batch_size == 4
    assert "dataloader" not in vars(integration.train_source(trainer))  # teardown undid it
    assert trainer.lightning_module.flags_seen  # steps run with deterministic algorithms
    assert not torch.are_deterministic_algorithms_enabled()  # given back after fit
    assert original.sampler.__class__.__name__ == "RandomSampler"  # the user's loader is as it was


@pytest.mark.parametrize("package_name", ["lightning.pytorch", "pytorch_lightning"])
def test_either_lightning_package_takes_it_and_repeats_bit_for_bit(package_name):
    package = pytest.importorskip(package_name, reason=f"{package_name} is not installed")
    callback = LightningCallback(seed=3)
    assert isinstance(callback, package.Callback)
    loader = DataLoader(data(), batch_size=4, shuffle=True)
    a, _ = fit(loader, callbacks=[callback], package=package)
    b, _ = fit(loader, callbacks=[LightningCallback(seed=3)], package=package)
    c, _ = fit(loader, callbacks=[LightningCallback(seed=4)], package=package)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # the seed matters: dropout and order are keyed by it


def test_steps_leave_the_global_streams_alone():
    # Dropout draws inside each step's block; after fit, torch's stream is where it was.
    with isolated():
        torch.manual_seed(1)
        before = torch.get_rng_state()
        model = Model(DataLoader(data(), batch_size=4))
        trainer = L.Trainer(
            max_epochs=1,
            callbacks=[LightningCallback(seed=0)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        torch.set_rng_state(before)
        trainer.fit(model)
        assert torch.equal(torch.get_rng_state(), before)


def test_each_step_starts_from_its_key_in_the_one_block_around_training(monkeypatch):
    # A step's first draw is the first draw of a block seeded with its key, whatever ran
    # before it (the previous step, validation); no block is entered per step.
    class Draws(Model):
        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch_idx, torch.rand(()).item()))
            torch.rand(5)  # the rest of the step moves the stream on
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            torch.rand(7)  # validation between steps draws too

    starts = []
    start = integration.TrainingBlock.start
    monkeypatch.setattr(
        integration.TrainingBlock, "start", lambda self: (starts.append(1), start(self))[1]
    )
    with isolated():
        model = Draws(DataLoader(data(), batch_size=4, shuffle=True))
        model.seen = []
        model.val_dataloader = lambda: DataLoader(data(4), batch_size=2)
        trainer = L.Trainer(
            max_epochs=2,
            callbacks=[LightningCallback(seed=9)],
            val_check_interval=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
    keys = StepKeys(derive_seed(9, "step"))
    assert [(e, b) for e, b, _ in model.seen] == [(e, b) for e in (0, 1) for b in range(3)]
    for epoch, batch_idx, first in model.seen:
        with deterministic(seed=keys.key(epoch, batch_idx), flags=False):
            assert torch.rand(()).item() == first
    assert len(starts) == 1  # one block for the whole fit, reseeded per step


def test_a_block_left_open_at_a_steps_start_is_named():
    class LeavesOneOpen(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            self.block = deterministic(seed=1).start()

        def on_exception(self, trainer, pl_module, exception):
            self.block.stop()

    with pytest.raises(MisuseError, match="LightningCallback seeds each training step"):
        fit(
            DataLoader(data(), batch_size=4),
            callbacks=[LightningCallback(seed=0), LeavesOneOpen()],
        )


def test_check_resume_records_each_step_and_each_checkpointed_step_once(tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    monkeypatch.setenv("DETERMINISTIC_CTX_RESUME_RECORDS", str(records))
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_last=True
    )
    with isolated():
        model = Model(DataLoader(data(), batch_size=4, shuffle=True))
        trainer = L.Trainer(
            max_epochs=2,
            callbacks=[LightningCallback(seed=0), checkpoints],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["step"] for r in lines if "step" in r] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] and r["data"] and r["rng"] for r in lines if "step" in r)
    # Two files per step (top-k and last), one notice, after both are on disk.
    assert [r["checkpoint"] for r in lines if "checkpoint" in r] == [2, 4, 6]
    assert "save_checkpoint" not in vars(trainer)


def test_check_resume_records_micro_batches_under_the_step_they_belong_to(tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    monkeypatch.setenv("DETERMINISTIC_CTX_RESUME_RECORDS", str(records))
    fit(
        DataLoader(data(), batch_size=4, shuffle=True),
        callbacks=[LightningCallback(seed=0)],
        accumulate_grad_batches=2,
    )
    steps = [json.loads(line)["step"] for line in records.read_text().splitlines()]
    # 3 batches an epoch, 2 epochs: Lightning steps the optimizer at every second batch and
    # at an epoch's last one.
    assert steps == [1, 1, 2, 3, 3, 4]


def test_resuming_with_another_seed_is_refused():
    callback = LightningCallback(seed=0)
    assert callback.state_dict() == {"seed": 0}
    with pytest.raises(ValueError, match=r"seed=1.*seed=0"):
        callback.load_state_dict({"seed": 1})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": "0"}, TypeError, "seed"),
        ({"seed": 0, "warn_only": 1}, TypeError, "warn_only"),
        ({"seed": 0, "flags": None}, TypeError, "flags"),
    ],
)
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LightningCallback(**kwargs)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.zeros(4, 2))


class Custom(DataLoader):
    pass


class Items(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(2)


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (lambda: DataLoader(Stream(), batch_size=2), "IterableDataset"),
        (lambda: DataLoader(Items(), sampler=list(range(8)), batch_size=2), "custom sampler list"),
        (lambda: DataLoader(Items(), batch_sampler=[[0, 1], [2, 3]]), "custom batch_sampler"),
        (lambda: Custom(Items(), batch_size=2), "Custom"),
        (lambda: [DataLoader(Items(), batch_size=2)], "list"),
        (lambda: DataLoader(SeededDataset(Items(), seed=5), batch_size=2), "seed 5"),
    ],
)
def test_loaders_that_cannot_be_keyed_are_refused_unchanged(loader, match):
    made = loader()
    with pytest.raises(ValueError, match=match):
        integration.rebuild(made, 0, L.Trainer(logger=False, enable_progress_bar=False))


def test_a_refused_loader_stops_fit_before_any_step():
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.raises(ValueError, match="IterableDataset"):
        fit(loader, callbacks=[LightningCallback(seed=0)])
    assert loader.dataset.__class__ is Stream


def test_overfit_batches_is_refused():
    with pytest.raises(ValueError, match="overfit_batches"):
        fit(
            DataLoader(data(), batch_size=4),
            callbacks=[LightningCallback(seed=0)],
            overfit_batches=1,
        )


def test_two_callbacks_are_refused():
    # Lightning refuses two callbacks of one state_key before the second could wrap the loader.
    with pytest.raises((RuntimeError, ValueError), match="LightningCallback"):
        fit(
            DataLoader(data(), batch_size=4),
            callbacks=[LightningCallback(seed=0), LightningCallback(seed=0)],
        )


class Ranks:  # a trainer under DDP, as the loader sees it
    distributed_sampler_kwargs: ClassVar[dict[str, int]] = {"num_replicas": 2, "rank": 1}


def test_under_ddp_the_sampler_is_rank_aware_and_lightning_leaves_it():
    # Lightning replaces a sampler that is not a DistributedSampler under DDP
    # (_requires_distributed_sampler); not run with real ranks here.
    loader = integration.rebuild(DataLoader(data(12), batch_size=2, shuffle=True), 0, Ranks())
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
    assert len(loader) == 3  # 6 of the 12 items on this rank, 2 a batch


def test_the_loader_saves_the_batches_completed_not_those_fetched():
    loader = integration.rebuild(DataLoader(data(12), batch_size=2, shuffle=True), 0, Ranks())
    full = [b[0] for b in loader]
    it = iter(loader)
    next(it), next(it)  # fetched ahead of the loop
    loader.completed(0, 1)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 1)
    again = integration.rebuild(DataLoader(data(12), batch_size=2, shuffle=True), 0, Ranks())
    again.load_state_dict(state)
    rest = [b[0] for b in again]
    assert len(again) == 3  # Lightning counts a resumed epoch from its start
    assert all(torch.equal(x, y) for x, y in zip(rest, full[1:], strict=True))


def test_a_stateful_dataloader_is_rebuilt_keyed():
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is not installed"
    )
    with isolated():  # its RandomSampler draws a seed
        user = stateful.StatefulDataLoader(data(), batch_size=4, shuffle=True, num_workers=0)
    loader = integration.rebuild(user, 0, L.Trainer(logger=False, enable_progress_bar=False))
    assert type(loader) is integration._KeyedLoader
    assert isinstance(loader.dataset, SeededDataset) and loader.batch_size == 4
    assert loader.sampler.shuffle


def test_a_stateful_dataloader_out_of_order_is_refused():
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is not installed"
    )
    if "in_order" not in inspect.signature(stateful.StatefulDataLoader.__init__).parameters:
        pytest.skip("this torchdata's StatefulDataLoader has no in_order")
    user = stateful.StatefulDataLoader(Items(), batch_size=2, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="in_order=False"):
        integration.rebuild(user, 0, L.Trainer(logger=False, enable_progress_bar=False))


def test_the_callback_pickles_with_its_settings():
    callback = LightningCallback(seed=7, warn_only=True)
    again = pickle.loads(pickle.dumps(callback))
    assert isinstance(again, LightningCallback) and isinstance(again, L.pytorch.Callback)
    assert (again.seed, repr(again)) == (7, "LightningCallback(seed=7, warn_only=True)")
