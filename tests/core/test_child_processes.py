"""seed_everything exports its seed; seed_everything() in a child process re-applies it.

A child started inside a block (``subprocess`` inheriting the environment,
``multiprocessing`` with ``fork`` and ``spawn``, DataLoader workers) sees
``PYTHONHASHSEED`` = the block's seed, also after many distinct seeds (issue 44
writes them into entries the process owns), and one started after the block
sees the caller's environment.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

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


# -- a child started inside a block sees the block's PYTHONHASHSEED (issue 44) -----------------

HASHSEED = "PYTHONHASHSEED"
needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
#: What a child reports: the two variables, as os.environ has them, and its str hash.
REPORT = (
    "import json, os; print(json.dumps([os.environ.get('PYTHONHASHSEED'), "
    "os.environ.get('DETERMINISTIC_CTX_SEED'), hash('deterministic')]))"
)


def _expected_hash(seed: int) -> int:
    """The str hash of a fresh interpreter given ``PYTHONHASHSEED=seed`` explicitly."""
    env = {**os.environ, HASHSEED: str(seed)}
    done = subprocess.run([sys.executable, "-c", REPORT], env=env, capture_output=True, text=True)
    return int(json.loads(done.stdout)[2])


def _inherited() -> list[object]:
    """A child that inherits the C environment (``env=None``), as it would in user code."""
    done = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found: list[object] = json.loads(done.stdout)
    return found


@pytest.fixture
def no_seed_vars(monkeypatch, restore_world):
    for name in (HASHSEED, VAR):
        monkeypatch.delenv(name, raising=False)


def test_a_subprocess_in_a_block_sees_the_blocks_seed_after_many_seeds(no_seed_vars):
    for seed in range(50_000, 50_101):  # many distinct seeds: the owned entries in turn
        with deterministic(seed=seed):
            pass
    for seed in (17, 18, 17):
        with deterministic(seed=seed):
            env_seed, exported, hashed = _inherited()
        assert env_seed == str(seed)
        assert exported is None
        assert hashed == _expected_hash(seed)  # the interpreter used it, not only os.environ
    assert _inherited()[:2] == [None, None]  # after the block: the caller's environment


def test_a_subprocess_after_seed_everything_sees_both_exports(no_seed_vars):
    for seed in range(60_000, 60_050):
        seed_everything(seed)
    seed_everything(23)
    assert _inherited() == ["23", "23", _expected_hash(23)]


def _report_child(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    c_value = getenv(HASHSEED.encode())
    queue.put([os.environ.get(HASHSEED), None if c_value is None else c_value.decode()])


def _child_report(method: str) -> list[object]:
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    process = context.Process(target=_report_child, args=(queue,))
    process.start()
    found: list[object] = queue.get(timeout=120)
    process.join(timeout=120)
    assert process.exitcode == 0
    return found


@pytest.mark.parametrize(
    "method",
    [pytest.param("fork", marks=needs_fork), pytest.param("spawn", marks=pytest.mark.slow)],
)
def test_multiprocessing_children_in_a_block_see_the_blocks_seed(no_seed_vars, method):
    for seed in range(70_000, 70_051):
        with deterministic(seed=seed):
            pass
    with deterministic(seed=31):
        assert _child_report(method) == ["31", "31"]  # os.environ and the C environment
    assert _child_report(method) == [None, None]


class _HashSeedOfWorker(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return int(os.environ[HASHSEED])


@pytest.mark.parametrize(
    "method",
    [pytest.param("fork", marks=needs_fork), pytest.param("spawn", marks=pytest.mark.slow)],
)
def test_dataloader_workers_in_a_block_see_the_blocks_seed(no_seed_vars, method):
    for seed in range(80_000, 80_051):
        with deterministic(seed=seed):
            pass
    with deterministic(seed=41):
        loader = DataLoader(
            _HashSeedOfWorker(), batch_size=None, num_workers=2, multiprocessing_context=method
        )
        assert list(loader) == [41] * 4
