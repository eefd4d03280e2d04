"""Resuming mid-epoch, bit for bit: torchdata's StatefulDataLoader with real workers, and the
example of docs/how-to/resume-mid-epoch.md, which resumes in a fresh process.

(The plain DataLoader's resume through the sampler, and a changed world size, are in
test_keyed.py.)
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable

import pytest
import torch

from deterministic_ctx import SeededDataset, SeededSampler, Snapshot, StateWarning, deterministic
from tests.helpers import ROOT, run_python
from tests.parallel.test_keyed import Augmenting

try:  # installed but built for another torch (the lowest corner), it may fail to import
    from torchdata.stateful_dataloader import StatefulDataLoader
except Exception as exc:  # any failure means: not usable here
    StatefulDataLoader = None
    WHY = f"needs torchdata's StatefulDataLoader (pip install -e '.[test]'): {exc!r:.200}"
else:
    WHY = ""
needs_torchdata = pytest.mark.skipif(StatefulDataLoader is None, reason=WHY)
needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

EXAMPLE = ROOT / "examples" / "resume_mid_epoch.py"
BATCH = 2


def _stateful_rows(
    make_dataset: Callable[[], torch.utils.data.Dataset],
    *,
    stop_at: int | None = None,
    state: dict | None = None,
    workers: int = 2,
    like_a_trainer: bool = False,
) -> tuple[list[tuple[float, ...]], dict | None]:
    """Rows of epochs 0 and 1 through a 2-worker StatefulDataLoader; with ``stop_at``, the rows
    up to that step and the loader's state there; with ``state``, the rows after it.
    ``like_a_trainer``: a state saved on an epoch's last batch resumes at the next epoch, whose
    set_epoch comes before the loader applies the state (in its ``__iter__``), as in Lightning."""
    dataset = make_dataset()
    sampler = SeededSampler(dataset, seed=1)
    loader = StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        generator=torch.Generator().manual_seed(0),
    )
    start = 0
    if state is not None:
        loader.load_state_dict(state["loader"])
        start = state["epoch"] + (like_a_trainer and state["last"])
    rows, step = [], 0
    for epoch in range(start, 2):
        sampler.set_epoch(epoch)
        for batch in loader:
            rows += [tuple(row.tolist()) for row in batch]
            step += 1
            if step == stop_at:
                last = len(rows) == (epoch + 1) * len(dataset)
                return rows, {"loader": loader.state_dict(), "epoch": epoch, "last": last}
    return rows, None


@needs_torchdata
@needs_fork
@pytest.mark.parametrize("stop_at", [1, 8])  # in the first epoch, in the second
def test_stateful_dataloader_resumes_keyed_items_bit_for_bit(stop_at):
    def keyed():
        return SeededDataset(Augmenting(), seed=3)

    whole, _ = _stateful_rows(keyed)
    first, state = _stateful_rows(keyed, stop_at=stop_at)
    assert state is not None
    rest, _ = _stateful_rows(keyed, state=state)
    assert first + rest == whole
    assert len(whole) == 2 * len(keyed())


@pytest.fixture(scope="module")
def keyed_whole() -> list[tuple[float, ...]]:
    rows, _ = _stateful_rows(_keyed)
    return rows


def _keyed() -> SeededDataset:
    return SeededDataset(Augmenting(), seed=3)


@needs_torchdata
@needs_fork
@pytest.mark.slow
@pytest.mark.parametrize("stop_at", range(1, 12))  # 6 steps an epoch, 2 epochs
def test_stateful_dataloader_resumes_at_any_step(keyed_whole, stop_at):
    first, state = _stateful_rows(_keyed, stop_at=stop_at)
    rest, _ = _stateful_rows(_keyed, state=state)
    assert first + rest == keyed_whole


@needs_torchdata
@needs_fork
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("like_a_trainer", [True, False])
def test_a_state_saved_on_an_epochs_last_batch_resumes_the_next_epoch(
    keyed_whole, workers, like_a_trainer
):
    # Step 6 is epoch 0's last batch.  A trainer moves on to epoch 1 and calls set_epoch(1)
    # before StatefulDataLoader applies the saved "epoch 0, all taken": that once gave an empty
    # epoch 1, and training ended silently.  A loop that asks for epoch 0 again gets its empty
    # rest, then epoch 1.
    first, state = _stateful_rows(_keyed, stop_at=6, workers=workers)
    assert state is not None and state["last"]
    rest, _ = _stateful_rows(_keyed, state=state, workers=workers, like_a_trainer=like_a_trainer)
    assert first + rest == keyed_whole


@needs_torchdata
@needs_fork
def test_without_keys_the_same_resume_changes_the_augmentation():
    # The control: torchdata restores the position, not what the workers' streams were.
    whole, _ = _stateful_rows(Augmenting)
    first, state = _stateful_rows(Augmenting, stop_at=3)
    rest, _ = _stateful_rows(Augmenting, state=state)
    indices = [row[0] for row in first + rest]
    assert indices == [row[0] for row in whole]  # the same samples, in the same order
    assert first + rest != whole  # but other numbers


@pytest.fixture(scope="module")
def example_output() -> str:
    proc = run_python([str(EXAMPLE)], own_session=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _line(output: str, start: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith(start)]
    return line


def test_the_example_resumes_a_plain_dataloader_in_a_fresh_process_with_other_workers(
    example_output,
):
    line = _line(example_output, "DataLoader + SeededSampler, 2 workers, then 1")
    assert line.endswith("identical losses: True, identical weights: True"), line


@needs_torchdata
def test_the_example_resumes_a_stateful_dataloader_in_a_fresh_process(example_output):
    line = _line(example_output, "StatefulDataLoader, 2 workers")
    assert "stopped at step 7 of 10" in line
    assert line.endswith("identical losses: True, identical weights: True"), line


# -- a loader without its own generator: the resumed run's extra iterator --------------------


def _plain_steps(
    *,
    generator: bool,
    workers: int = 0,
    stop_at: int | None = None,
    ckpt: dict | None = None,
    stateful: bool = False,
) -> tuple[list[tuple[object, ...]], dict | None]:
    """The loop of docs/how-to/resume-mid-epoch.md, with a dropout-like draw from torch's global
    generator each step: (batch, draw) per step of 2 epochs; stopped and saved at ``stop_at``,
    or resumed from ``ckpt`` (sampler, epoch, Snapshot), in fresh objects."""
    steps: list[tuple[object, ...]] = []
    with deterministic(seed=0):
        dataset = _keyed()
        sampler = SeededSampler(dataset, seed=1)
        Loader = StatefulDataLoader if stateful else torch.utils.data.DataLoader
        loader = Loader(
            dataset,
            batch_size=BATCH,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context="fork" if workers else None,
            generator=torch.Generator().manual_seed(0) if generator else None,
        )
        start = 0
        if ckpt is not None:
            start = ckpt["epoch"]
            if stateful:
                loader.load_state_dict(ckpt["loader"])
            else:
                sampler.load_state_dict(ckpt["sampler"])
            Snapshot.from_state_dict(ckpt["rng"]).restore()
        for epoch in range(start, 2):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                steps.append((batch.tolist(), torch.rand(()).item()))
                if len(steps) == stop_at:
                    saved = {"epoch": epoch, "rng": Snapshot.capture().state_dict()}
                    if stateful:
                        saved["loader"] = loader.state_dict()
                    else:
                        saved["sampler"] = sampler.state_dict(consumed=(i + 1) * BATCH)
                    return steps, saved
    return steps, None


def _resume_pieces(*, stop_at: int = 3, **kwargs) -> tuple[list, list, list]:
    whole, _ = _plain_steps(**kwargs)
    first, ckpt = _plain_steps(stop_at=stop_at, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest, _ = _plain_steps(ckpt=ckpt, **kwargs)
    assert [step[0] for step in first + rest] == [step[0] for step in whole]  # the same data
    ours = [w for w in caught if issubclass(w.category, StateWarning)]
    return first + rest, whole, ours


@needs_fork
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_at", [3, 6])  # mid-epoch; the first epoch's last batch
def test_a_resumed_pass_of_a_loader_without_its_own_generator_warns(workers, stop_at):
    resumed, whole, warned = _resume_pieces(generator=False, workers=workers, stop_at=stop_at)
    assert resumed != whole  # the draws after the resume: why it warns
    (warning,) = warned  # once
    assert "generator=seeded_generator(" in str(warning.message)


@needs_fork
@pytest.mark.parametrize("workers", [0, 2])
def test_with_its_own_generator_the_resume_is_exact_and_silent(workers):
    resumed, whole, warned = _resume_pieces(generator=True, workers=workers)
    assert resumed == whole and warned == []


@needs_torchdata
@needs_fork
@pytest.mark.parametrize("generator", [False, True])
def test_a_stateful_dataloader_without_its_own_generator_warns_too(generator):
    # StatefulDataLoader hands the sampler its state in __iter__, after the draw.
    resumed, whole, warned = _resume_pieces(generator=generator, stateful=True)
    assert (resumed == whole) is generator
    assert len(warned) == (not generator)


def test_a_run_that_resumes_nothing_does_not_warn_without_a_generator():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _plain_steps(generator=False)
    assert not [w for w in caught if issubclass(w.category, StateWarning)]
