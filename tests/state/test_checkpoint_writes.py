"""Checkpoint writes: a write that fails before the rename leaves the previous file loadable."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from deterministic_ctx import Snapshot
from deterministic_ctx.state import checkpoint
from tests.helpers import run_python
from tests.state.checkpoint_helpers import isolated


def _old_file(tmp_path: Path) -> tuple[Path, bytes, float]:
    path = tmp_path / "rng.snap"
    Snapshot.capture().save(path)
    first = random.random()
    return path, path.read_bytes(), first


@pytest.mark.parametrize("fail", ["replace", "fsync", "write", "interrupt"])
def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch, fail):
    with isolated():
        path, before, first = _old_file(tmp_path)

        def boom(*args: Any, **kwargs: Any) -> None:
            if fail == "interrupt":
                raise KeyboardInterrupt
            raise OSError(f"simulated failure in {fail}")

        if fail == "write":
            monkeypatch.setattr(checkpoint, "encode", lambda state: b"x" * 10)
            monkeypatch.setattr(os, "fsync", boom)  # a short write, then the failure
        else:
            monkeypatch.setattr(os, fail if fail != "interrupt" else "fsync", boom)
        with pytest.raises(KeyboardInterrupt if fail == "interrupt" else OSError):
            Snapshot.capture().save(path)
        monkeypatch.undo()
        assert path.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["rng.snap"]  # the temporary file is gone
        Snapshot.load(path).restore()
        assert random.random() == first


_CRASH = """
import os, random, sys
from deterministic_ctx import Snapshot

def crash(src, dst):  # the machine dies after the write and fsync, before the rename
    os._exit(17)

os.replace = crash
random.random()
Snapshot.capture().save(sys.argv[1])
"""


def test_a_process_killed_before_the_rename_leaves_the_previous_file(tmp_path):
    with isolated():
        path, before, first = _old_file(tmp_path)
        proc = run_python([str(path)], code=_CRASH, timeout=120)
        assert proc.returncode == 17, proc.stderr
        assert path.read_bytes() == before
        Snapshot.load(path).restore()
        assert random.random() == first
        leftovers = [p for p in os.listdir(tmp_path) if p != "rng.snap"]
        assert len(leftovers) == 1  # documented: a crash can leave .rng.snap.*.tmp behind
        assert leftovers[0].startswith(".rng.snap.") and leftovers[0].endswith(".tmp")
        Snapshot.load(tmp_path / leftovers[0])  # complete, since it was fsynced


def test_save_replaces_and_respects_the_umask(tmp_path):
    path = tmp_path / "rng.snap"
    Snapshot.capture().save(path)
    Snapshot.capture().save(path)  # over an existing file
    umask = os.umask(0)
    os.umask(umask)
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert os.listdir(tmp_path) == ["rng.snap"]
