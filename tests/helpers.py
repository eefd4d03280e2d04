"""Shared helpers for the tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deterministic_ctx import _torch


#: For tests that start gloo process groups (on loopback).
def needs(capability: _torch.Capability) -> pytest.MarkDecorator:
    """Skip where the running torch lacks ``capability`` (``deterministic_ctx._torch``),
    naming what it reads and the torch version that has it."""
    return pytest.mark.skipif(
        not capability.available,
        reason=f"needs {capability.reads} (torch >= {capability.since}); "
        f"torch {torch.__version__} lacks it",
    )


def needs_config_entries(module: str, *keys: str) -> pytest.MarkDecorator:
    """Skip where torch's config ``module`` (imported here: the tests that ask import
    it anyway) lacks one of ``keys``, or cannot tell a value from a default
    (``torch.utils._config_module``'s user overrides)."""
    import importlib

    config = importlib.import_module(module)
    missing = [k for k in keys if not hasattr(config, k)]
    layout = _torch.CONFIG_OVERRIDES.available
    return pytest.mark.skipif(
        bool(missing) or not layout,
        reason=f"torch {torch.__version__}'s {module} lacks {', '.join(missing)}"
        if missing
        else f"needs {_torch.CONFIG_OVERRIDES.reads} (torch >= {_torch.CONFIG_OVERRIDES.since})",
    )


def default_device() -> torch.device:
    """The device a factory call puts a new tensor on (``_torch.default_device()``,
    which also answers where torch 2.6's ``get_default_device()`` raises)."""
    device: torch.device = _torch.default_device()
    return device


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

#: Every tensor dtype the verification tools must compare bit for bit.
TENSOR_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


def draw() -> tuple[float, float, float]:
    """One draw from each global RNG."""
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def solo(seed: int, n: int) -> list[tuple[float, float, float]]:
    """What ``n`` draws inside a fresh block with ``seed`` give."""
    from deterministic_ctx import deterministic

    with deterministic(seed=seed):
        return [draw() for _ in range(n)]


#: The repository root: examples and the package are found from here.
ROOT = Path(__file__).resolve().parent.parent


def python_command(
    args: Sequence[str], *, code: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment of a fresh Python on the checkout.

    ``python -c code *args`` or ``python *args``; the environment is
    ``os.environ`` with ``env`` added or replaced, and ``PYTHONPATH`` the
    repository root in front of whatever it was, so the child imports this
    checkout's ``deterministic_ctx``.
    """
    command = [sys.executable, *(("-c", code) if code is not None else ()), *args]
    merged = {**os.environ, **(env or {})}
    merged["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), merged.get("PYTHONPATH", "")) if p
    )
    return command, merged


def run_python(
    args: Sequence[str],
    *,
    code: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    check: bool = False,
    own_session: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run a fresh Python on the checkout: ``python -c code`` or ``python *args``.

    The child imports this checkout's ``deterministic_ctx`` (``PYTHONPATH`` is
    the repository root, in front of whatever the caller's environment has),
    runs in the repository root, and its output is captured as text.
    ``env`` adds or replaces variables of ``os.environ``; ``check`` raises on
    a non-zero exit status with the child's stderr in the message.

    ``own_session`` is for a child that starts processes of its own: it runs
    in a session of its own, and on a timeout the whole session is killed
    (the child and every process it started) before ``TimeoutExpired`` is
    raised.
    """
    command, merged = python_command(args, code=code, env=env)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=merged,
        start_new_session=own_session,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            if own_session:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            process.communicate()
    proc = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    return _checked(proc) if check else proc


def cuda_initialized_after(code: str, *, timeout: float = 300) -> bool:
    """Whether CUDA is initialized after ``code`` (dedented) runs in a fresh interpreter.

    For tests that check that something never initializes CUDA: whether it is
    initialized is process-wide and cannot be undone, so in the test's own process
    the answer would depend on whether an earlier test of the same worker used the
    GPU.  ``code`` may assert; a failure, or no answer within ``timeout`` seconds,
    fails the test with the child's output.
    """
    proc = run_python(
        [],
        code=textwrap.dedent(code) + "\nimport torch\nprint(torch.cuda.is_initialized())\n",
        timeout=timeout,
        check=True,
    )
    answer = proc.stdout.strip().splitlines()[-1:]
    assert answer in (["True"], ["False"]), proc.stdout + proc.stderr
    return answer == ["True"]


def _checked(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``proc``, or an error with its output if it exited with a non-zero status."""
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


class RandomLike:
    """Any object with ``seed`` / ``getstate`` / ``setstate`` (Hypothesis's protocol,
    what ``register_rng`` accepts besides its four types), around a Mersenne
    Twister; ``seeds`` lists every seed it was given."""

    def __init__(self, seed: int = 0) -> None:
        self._r = random.Random(seed)
        self.seeds: list[int] = []

    def seed(self, s: int) -> None:
        self.seeds.append(s)
        self._r.seed(s)

    def getstate(self) -> Any:
        return self._r.getstate()

    def setstate(self, state: Any) -> None:
        self._r.setstate(state)

    def random(self) -> float:
        return self._r.random()


def config_override(config: Any, key: str) -> object:
    """The user override of a torch config entry (torch's sentinel if unset).

    torch 2.12 and later keep it in a ``ContextVar``, older torch in a plain
    attribute; test-only access to torch internals, in either layout.
    """
    override = config._config[key].user_override
    return override.get() if hasattr(override, "set") else override


def set_config_override(config: Any, key: str, value: object) -> None:
    """Write the user override of a torch config entry as torch's own patcher does."""
    entry = config._config[key]
    if hasattr(entry.user_override, "set"):
        entry.user_override.set(value)
        config._hash_dirty_var.set(True)
        config._mark_get_dict_dirty(key)
    else:
        entry.user_override = value
        config._is_dirty = True


def spawn_ranks(
    main: Any, args: tuple[Any, ...], world: int, out: Path | str, *, timeout: float, what: str
) -> list[Any]:
    """Run ``main(rank, *args)`` on ``world`` processes started with ``spawn``; each rank
    pickles its result to ``out/rank{r}.pkl``, returned by rank.

    Bounded: after ``timeout`` seconds the ranks are killed and the test fails, naming ``what``.
    """
    import pickle
    import time

    import pytest
    import torch.multiprocessing as torch_mp

    context = torch_mp.start_processes(
        main, args=args, nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{what} on {world} ranks did not finish in {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback() -> str:
    """The loopback interface's name, for gloo (``GLOO_SOCKET_IFNAME``)."""
    import socket

    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def join_loopback_group(rank: int, world: int, port: int) -> None:
    """In a rank spawned by :func:`spawn_ranks`: join a real gloo group of ``world``
    ranks over TCP on 127.0.0.1 at ``port``."""
    from datetime import timedelta

    os.environ["GLOO_SOCKET_IFNAME"] = loopback()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
