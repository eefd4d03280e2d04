"""seed_everything exports its seed; seed_everything() in a child process re-applies it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from deterministic_ctx import deterministic, seed_everything
from tests.helpers import draw, run_python

VAR = "DETERMINISTIC_CTX_SEED"

#: A child: seed as the parent did, report the seed, its draws and a string hash.
CHILD = """
import json
from deterministic_ctx import seed_everything
from tests.helpers import draw
seed = seed_everything()
print(json.dumps([seed, draw(), hash("deterministic")]))
"""


def test_the_seed_and_the_hash_seed_are_exported(restore_world):
    seed_everything(7)
    assert os.environ[VAR] == "7"
    assert os.environ["PYTHONHASHSEED"] == "7"


def test_seed_everything_without_a_seed_reuses_the_exported_one(restore_world, monkeypatch):
    seed_everything(11)
    expected = draw()
    monkeypatch.setenv(VAR, "11")
    assert seed_everything() == 11
    assert draw() == expected


def test_an_explicit_none_still_draws_a_fresh_seed(restore_world, monkeypatch):
    monkeypatch.setenv(VAR, "11")
    seeds = {seed_everything(None) for _ in range(3)}
    assert len(seeds) == 3  # fresh each time (a tiny chance of a false alarm)


def test_without_an_exported_seed_a_fresh_one_is_drawn(restore_world, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert 0 <= seed_everything() < 2**32


@pytest.mark.parametrize("value", ["seven", "-1", str(2**32)])
def test_a_bad_exported_seed_is_refused_by_name(restore_world, monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ValueError, match=f"{VAR}=.*is not a seed"):
        seed_everything()


def test_a_block_puts_the_exported_seed_back(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with deterministic(seed=0):
        seed_everything(3)
        assert os.environ[VAR] == "3"
    assert VAR not in os.environ


@pytest.mark.slow
def test_a_subprocess_applies_the_parents_seed(restore_world):
    seed_everything(5)
    expected = draw()
    outputs = [
        json.loads(run_python([], code=CHILD, env=os.environ, check=True).stdout.splitlines()[-1])
        for _ in range(2)
    ]
    for seed, draws, _hash in outputs:
        assert seed == 5
        assert tuple(draws) == expected
    assert outputs[0][2] == outputs[1][2]  # PYTHONHASHSEED was exported too


def _spawned(index: int, path: str) -> None:
    sys.path.insert(0, os.getcwd())
    seed = seed_everything()
    with open(f"{path}.{index}", "w") as f:
        json.dump([seed, torch.rand(3).tolist()], f)


@pytest.mark.slow
def test_torch_multiprocessing_spawn_children_apply_the_parents_seed(restore_world, tmp_path):
    seed_everything(9)
    expected = torch.rand(3).tolist()
    mp.spawn(_spawned, args=(str(tmp_path / "out"),), nprocs=2, join=True)
    for index in range(2):
        seed, draws = json.loads((tmp_path / f"out.{index}").read_text())
        assert seed == 9
        assert draws == expected
