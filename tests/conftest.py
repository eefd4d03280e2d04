"""Suite-wide guard: every test must leave global random state as it found it.

A test that draws from a global RNG, changes a flag or an environment
variable, or leaves a lazy CUDA seed queued fails here, naming what leaked.
Tests that need to change global state on purpose do it inside a block or
restore it themselves; the ``registry`` fixture unregisters the environment
variables a test registers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from deterministic_ctx import Snapshot
from tests._oracle import World

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _no_global_state_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("allow_leak") is not None:
        yield
        return
    before = World.now()
    yield
    leaked = before.diff(World.now())
    if leaked:
        pytest.fail(f"test leaked global state: {', '.join(leaked)}", pytrace=False)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment variables a test registers are unregistered after it.

    ``register_env_var`` is process-wide and cannot be undone: a name left registered changes
    what every later snapshot of the process captures (one saved here no longer loads in a
    fresh process), whichever test comes next on this worker.
    """
    from deterministic_ctx.sources import environ

    monkeypatch.setattr(environ, "_MANAGED", environ._MANAGED)
    monkeypatch.setattr(environ, "_MANAGED_SET", environ._MANAGED_SET)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_leak: the test changes global state on purpose and cleans up itself"
    )


@pytest.fixture
def restore_world() -> Iterator[None]:
    """For tests that change global state on purpose (``seed_everything``, a restore,
    an inner test that leaks): everything is put back afterwards."""
    snap = Snapshot.capture()
    yield
    snap.restore()


@pytest.fixture
def gloo_of_one() -> Iterator[None]:
    """A real gloo process group of one rank in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
