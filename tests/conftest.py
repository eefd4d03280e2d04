"""Suite-wide guard: every test must leave global random state as it found it.

A test that draws from a global RNG, changes a flag or an environment
variable, or leaves a lazy CUDA seed queued fails here, naming what leaked.
So does a test that leaves a user RNG registered (``register_rng`` without
``unregister_rng``, for an object that is still alive after a collection) or
unregisters one it did not register, or registers an environment variable:
registrations are process-wide, and one left behind makes every later test
on the worker capture, seed and save it (two under one key make every save
fail).  Tests that need to change global state on purpose do it inside a
block or restore it themselves; the ``registry`` fixture unregisters the
environment variables a test registers.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from deterministic_ctx import Snapshot, managed_env_vars, registered_rngs
from tests._oracle import World

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _no_global_state_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("allow_leak") is not None:
        yield
        return
    before = World.now()
    registered = Registrations.now()
    yield
    leaked = before.diff(World.now())
    leaked += registered.diff(Registrations.now())
    if leaked:
        pytest.fail(f"test leaked global state: {', '.join(leaked)}", pytrace=False)


class Registrations:
    """What the process-wide registries hold, through the public API: each live
    user RNG as ``(key, id)`` (never the object: holding it would keep alive an
    RNG that the test expects to be collected), and the managed environment variables."""

    def __init__(self, rngs: frozenset[tuple[str, int]], env: tuple[str, ...]) -> None:
        self.rngs = rngs
        self.env = env

    @classmethod
    def now(cls) -> Registrations:
        # The first call also registers what installed packages contribute through the
        # registry's entry points: that happens here, before the test, never inside it.
        return cls(frozenset((key, id(obj)) for key, obj in registered_rngs()), managed_env_vars())

    def diff(self, after: Registrations) -> list[str]:
        """What changed from ``self`` to ``after``, in words; ``[]`` if nothing did.

        A weakly held RNG that the test dropped leaves the registry when it is
        collected, which a reference cycle can put off until the next collection:
        only a difference that survives ``gc.collect()`` counts (and the collection
        runs only then, so passing tests pay nothing for it).
        """
        if (after.rngs, after.env) != (self.rngs, self.env):
            gc.collect()
            after = Registrations.now()
        out = []
        added = sorted(key for key, oid in after.rngs - self.rngs)
        if added:
            out.append(f"user RNGs left registered under the keys {added} (unregister_rng)")
        removed = sorted(key for key, oid in self.rngs - after.rngs)
        if removed:
            out.append(f"user RNGs registered before the test unregistered: {removed}")
        env = [name for name in after.env if name not in self.env]
        if env:
            out.append(f"environment variables registered: {env} (the registry fixture)")
        lost = [name for name in self.env if name not in after.env]
        if lost:
            out.append(f"environment variables no longer managed: {lost}")
        return out


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment variables a test registers are unregistered after it.

    ``register_env_var`` is process-wide and cannot be undone: a name left registered changes
    what every later snapshot of the process captures (one saved here no longer loads in a
    fresh process), whichever test comes next on this worker.
    """
    from deterministic_ctx.sources import environ

    monkeypatch.setattr(environ, "_MANAGED", environ._MANAGED)


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
