"""TransformersCallback: a transformers ``Trainer`` killed with SIGKILL resumes bit for bit.

The process-level tests (``slow``) run ``examples/transformers_resume.py``'s training in
fresh processes: uninterrupted, killed right after a checkpoint is on disk (through
``check-resume``'s kill switch, which the callback calls), and resumed.  The others train
in this process inside ``isolated()`` (the Trainer seeds the global RNGs itself).

They skip where transformers or accelerate do not import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deterministic_ctx import (
    SeededDataset,
    SeededIndex,
    StateWarning,
    derive_seed,
    deterministic,
    isolated,
)
from tests.helpers import ROOT, run_python

try:
    import accelerate  # noqa: F401
    import transformers
    from accelerate.data_loader import DataLoaderShard, skip_first_batches
except Exception as exc:  # not installed, or built for another torch
    pytest.skip(f"transformers/accelerate do not import: {exc}", allow_module_level=True)
if not transformers.utils.is_torch_available():  # transformers 5 wants a newer torch
    pytest.skip(
        f"transformers {transformers.__version__} does not support torch {torch.__version__}: "
        f"its Trainer is a placeholder here",
        allow_module_level=True,
    )

from deterministic_ctx import TransformersCallback
from deterministic_ctx.integrations import transformers as integration
from deterministic_ctx.integrations.trainer_steps import StepKeys

EXAMPLE = ROOT / "examples" / "transformers_resume.py"


# -- fresh processes -------------------------------------------------------------------------


def _run(
    workdir: Path,
    *,
    workers: int,
    resume: bool = False,
    kill_at: int | None = None,
    callback: bool = True,
) -> dict[str, Any] | None:
    report = workdir / "report.json"
    env = {"DETERMINISTIC_CTX_RESUME_RECORDS": str(workdir / "records.jsonl")}
    env["DETERMINISTIC_CTX_RESUME_KILL_AT"] = "" if kill_at is None else str(kill_at)
    spec = {
        "output_dir": str(workdir / "out"),
        "workers": workers,
        "resume": resume,
        "callback": callback,
        "report": str(report),
    }
    proc = run_python([str(EXAMPLE), "--child", json.dumps(spec)], env=env, timeout=300)
    if kill_at is not None:
        assert proc.returncode == -9, proc.stderr  # killed by the callback, not finished
        assert not report.exists()
        return None
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(report.read_text()))


def _records(workdir: Path) -> list[dict[str, Any]]:
    lines = (workdir / "records.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted run, 2 workers."""
    workdir = tmp_path_factory.mktemp("whole")
    report = _run(workdir, workers=2)
    assert report is not None
    return workdir, report


@pytest.mark.slow
def test_runs_repeat_whatever_the_workers(whole, tmp_path):
    again = _run(tmp_path, workers=0)
    assert len(whole[1]["losses"]) == 12
    assert again == whole[1]


@pytest.mark.slow
def test_killed_with_0_workers_resumed_with_2(whole, tmp_path):
    _run(tmp_path, workers=0, kill_at=8)  # mid-epoch 2
    records = _records(tmp_path)
    assert records[-1] == {"checkpoint": 8}
    assert [r["step"] for r in records if "step" in r] == list(range(1, 9))
    resumed = _run(tmp_path, workers=2, resume=True)
    assert resumed == whole[1]
    # check-resume's records of the resumed steps: the same data, losses and random state
    expected = [r for r in _records(whole[0]) if r.get("step", 0) > 8]
    got = [r for r in _records(tmp_path)[len(records) :] if "step" in r]
    assert got == expected and len(got) == 4


@pytest.mark.slow
def test_the_example_resumes_mid_epoch_and_at_an_epochs_end():
    proc = run_python([str(EXAMPLE)], timeout=600, own_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("killed")]
    assert len(lines) == 3
    assert all("identical losses: True, identical weights: True" in line for line in lines)


@pytest.mark.slow
def test_without_the_callback_a_mid_epoch_resume_differs(tmp_path):
    # The report, which the tests above would show if the callback did nothing.
    reference = _run(tmp_path / "whole", workers=2, callback=False)
    _run(tmp_path / "crash", workers=2, kill_at=4, callback=False)
    resumed = _run(tmp_path / "crash", workers=2, resume=True, callback=False)
    assert reference is not None and resumed is not None
    assert resumed["losses"] != reference["losses"]


# -- in this process ---------------------------------------------------------------------------


class Indexed(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Item ``i``: its index and a draw from torch's global stream."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([torch.tensor(float(i)), torch.rand(())])}


class Probe(torch.nn.Module):
    """Keeps, for each training forward, whether it ran in a step's block, its inputs and a draw."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.seen: list[tuple[bool, torch.Tensor, float]] = []
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            if self.fail_at is not None and len(self.seen) == self.fail_at:
                raise RuntimeError("planted failure")
            # deterministic algorithms: on in the step's block, off in the test's isolated()
            steps = torch.are_deterministic_algorithms_enabled()
            self.seen.append((steps, x.clone(), torch.rand(()).item()))
        return {"loss": (x * self.w).sum() * 1e-3}


def _trainer(tmp_path: Path, model: torch.nn.Module, callback: Any, data: Any = None, **kw: Any):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_train_epochs=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        **kw,
    )
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Indexed() if data is None else data,
        callbacks=[callback],
    )


def test_each_step_starts_from_its_key_and_each_item_is_keyed(tmp_path, monkeypatch):
    model = Probe()
    callback = TransformersCallback(seed=7)
    with isolated():
        trainer = _trainer(tmp_path, model, callback, gradient_accumulation_steps=2)
        trainer.train()
        assert not callback._training.is_open
    assert len(model.seen) == 8  # 2 epochs of 4 batches, 2 steps of 2 batches each
    keyed = SeededDataset(Indexed(), seed=7)
    for n, (inside, x, draw) in enumerate(model.seen):
        assert inside
        epoch = n // 4
        for i, value in x.tolist():
            assert value == keyed[SeededIndex(int(i), epoch=epoch)]["x"][1].item()
        if n % 2 == 0:  # the first draw of a step: the step's key, whatever came before
            with deterministic(seed=StepKeys(derive_seed(7, "step")).key(0, n // 2)):
                assert draw == torch.rand(()).item()


def test_an_exception_in_the_forward_leaves_the_training_block(tmp_path):
    callback = TransformersCallback(seed=0)
    with isolated():
        trainer = _trainer(tmp_path, Probe(fail_at=3), callback)
        with pytest.raises(RuntimeError, match="planted failure"):
            trainer.train()
        assert not callback._training.is_open
        assert not torch.are_deterministic_algorithms_enabled()
        trainer.model.fail_at = None
        trainer.train()
        assert len(trainer.model.seen) == 3 + 8
        assert not callback._training.is_open


def test_an_exception_elsewhere_is_closed_by_close_and_by_the_next_train(tmp_path):
    class Fails(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise RuntimeError("planted failure")

    callback = TransformersCallback(seed=0)
    with isolated():
        trainer = _trainer(tmp_path, Probe(), callback)
        trainer.add_callback(Fails())
        with pytest.raises(RuntimeError, match="planted failure"):
            trainer.train()
        assert callback._training.is_open  # the Trainer has no event for errors
        callback.close()
        assert not callback._training.is_open
        assert not torch.are_deterministic_algorithms_enabled()
        with pytest.raises(RuntimeError, match="planted failure"):
            trainer.train()
        trainer.remove_callback(Fails)
        trainer.train()  # the next train() first leaves the block the error left open
        assert not callback._training.is_open


NEEDS_EXPORTABLE_STATE = pytest.mark.skipif(
    not hasattr(transformers.trainer_callback, "ExportableState"),
    reason="this transformers keeps no callback state in its checkpoints (ExportableState)",
)


@NEEDS_EXPORTABLE_STATE
def test_resuming_with_another_seed_is_refused():
    state = transformers.TrainerState(stateful_callbacks=[TransformersCallback(seed=1)])
    assert state.stateful_callbacks["TransformersCallback"]["args"]["seed"] == 1
    with pytest.raises(ValueError, match=r"seed=1.*seed=2"):
        TransformersCallback(seed=2)._check_checkpoint(state)
    TransformersCallback(seed=1)._check_checkpoint(state)


@NEEDS_EXPORTABLE_STATE
def test_resuming_a_checkpoint_written_without_it_warns_and_can_be_saved_again():
    state = transformers.TrainerState(stateful_callbacks=[])  # as loaded from such a checkpoint
    with pytest.warns(StateWarning, match="without TransformersCallback"):
        TransformersCallback(seed=4)._check_checkpoint(state)
    assert state.stateful_callbacks["TransformersCallback"]["args"]["seed"] == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": "0"}, TypeError, "seed"),
        ({"seed": 0, "flags": 1}, TypeError, "flags"),
        ({"seed": 0, "warn_only": None}, TypeError, "warn_only"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TransformersCallback(**kwargs)


def test_data_it_cannot_key_is_refused_before_training(tmp_path):
    class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
        def __iter__(self):
            return iter([{"x": torch.zeros(2)}] * 4)

    with isolated():
        trainer = _trainer(
            tmp_path, Probe(), TransformersCallback(seed=0), data=Stream(), max_steps=2
        )
        with pytest.raises(TypeError, match="IterableDataset"):
            trainer.train()
        trainer = _trainer(
            tmp_path,
            Probe(),
            TransformersCallback(seed=0),
            dataloader_num_workers=1,
            dataloader_persistent_workers=True,
        )
        with pytest.raises(ValueError, match="persistent_workers"):
            trainer.train()
        assert not torch.are_deterministic_algorithms_enabled()


def test_canary_the_loaders_dataset_attribute():
    """What ``_set_dataset`` relies on: fails when torch or accelerate change it."""
    data = list(range(6))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    with pytest.raises(ValueError, match="dataset"):  # torch guards it: hence the bypass
        loader.dataset = data  # type: ignore[misc]
    shard = DataLoaderShard(data, batch_size=2)
    inner = integration._loader_of(shard)  # accelerate >= 0.32: the DataLoader it wraps
    assert isinstance(inner, torch.utils.data.DataLoader)
    assert shard.dataset is data
    keyed = SeededDataset(data, seed=0)
    integration._set_dataset(inner, keyed)
    assert shard.dataset is keyed  # accelerate reads it from the loader inside
    resumed = skip_first_batches(shard, 1)  # how the Trainer skips a resumed epoch's batches
    assert resumed.dataset is keyed
    with isolated():  # an iterator draws its workers' base seed from torch's stream
        assert [b.tolist() for b in shard] == [[0, 1], [2, 3], [4, 5]]
        assert [b.tolist() for b in resumed] == [[2, 3], [4, 5]]
    with pytest.raises(TypeError, match="DataLoader"):
        integration._loader_of(object())
