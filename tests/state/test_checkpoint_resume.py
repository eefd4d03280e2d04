"""Checkpoints: a training run resumed in a fresh process equals the uninterrupted run.

The phases are those of ``examples/resume_training.py``, each in a fresh Python process.
Each phase that several tests need runs once (module-scoped fixtures).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deterministic_ctx import Snapshot, deterministic
from tests.helpers import ROOT, run_python
from tests.state.checkpoint_helpers import isolated

EXAMPLE = ROOT / "examples" / "resume_training.py"

pytestmark = pytest.mark.slow


def _phase(*args: str) -> dict[str, Any]:
    """One phase of the example training script, in a fresh Python process."""
    proc = run_python([str(EXAMPLE), *args])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tmp_path_factory.mktemp("whole") / "never-written.pt"
    result = _phase("--steps", "20", "--checkpoint", str(ckpt))
    assert len(result["losses"]) == 20
    return result


@pytest.fixture(scope="module")
def saved_at_ten(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[bool, Path], dict[str, Any]]:
    """The first phase: 10 steps, a checkpoint ``ckpt.pt`` (and ``ckpt.pt.rng`` with
    ``--rng-file``), then stop.  ``saved_at_ten(rng_file, directory)`` copies the files
    into ``directory`` and returns what the phase printed; each variant runs once."""
    runs: dict[bool, tuple[dict[str, Any], Path]] = {}

    def copy(rng_file: bool, directory: Path) -> dict[str, Any]:
        if rng_file not in runs:
            where = tmp_path_factory.mktemp("saved-at-ten")
            extra = ["--rng-file"] if rng_file else []
            result = _phase(
                "--steps", "20", "--save-at", "10", "--checkpoint", str(where / "ckpt.pt"), *extra
            )
            runs[rng_file] = result, where
        result, where = runs[rng_file]
        shutil.copytree(where, directory, dirs_exist_ok=True)
        return result

    return copy


@pytest.mark.parametrize("rng_file", [False, True], ids=["state_dict-in-torch.save", "save-file"])
def test_resume_in_a_fresh_process_equals_the_uninterrupted_run(
    tmp_path, uninterrupted, saved_at_ten, rng_file
):
    ckpt = str(tmp_path / "ckpt.pt")
    extra = ["--rng-file"] if rng_file else []
    first = saved_at_ten(rng_file, tmp_path)
    second = _phase("--steps", "20", "--resume", "--checkpoint", ckpt, *extra)
    assert len(first["losses"]) == len(second["losses"]) == 10
    assert first["losses"] + second["losses"] == uninterrupted["losses"]  # float.hex: bitwise
    assert second["weights"] == uninterrupted["weights"]  # SHA-256 of every weight's bytes


def test_resume_from_another_random_state_diverges(tmp_path, uninterrupted, saved_at_ten):
    # The test above has teeth: the same checkpoint with the random state of
    # another moment gives another run.
    ckpt = str(tmp_path / "ckpt.pt")
    saved_at_ten(False, tmp_path)
    state = torch.load(ckpt, weights_only=True)
    with isolated(), deterministic(seed=1):
        state["rng"] = Snapshot.capture().state_dict()
    torch.save(state, ckpt)
    second = _phase("--steps", "20", "--resume", "--checkpoint", ckpt)
    assert second["losses"] != uninterrupted["losses"][10:]
    assert second["weights"] != uninterrupted["weights"]
