"""RNGs by kind (issue 42): the adapters, ``random.Random``'s batch, the registry's
stdlib weak containers, the sources' declarations, and caches that obey the switch."""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest
import torch

from deterministic_ctx import (
    Snapshot,
    derive_seed,
    deterministic,
    register_rng,
    registered_rngs,
    unregister_rng,
)
from deterministic_ctx.base import fast_paths as switch
from deterministic_ctx.base.cache import BoundedCache
from deterministic_ctx.sources import SOURCES, fast_paths
from deterministic_ctx.sources.rngs import kinds, layouts, uncollected
from deterministic_ctx.sources.user_rngs import registry

#: More than enough ``random.Random`` in a row to make a batch.
_N = kinds.MT_BATCH_MIN + 3


def _seeded(seed: int, key: str) -> random.Random:
    return random.Random(derive_seed(seed, "user", key, bits=64))


@pytest.fixture
def many():
    rngs = [register_rng(random.Random(i), key=f"kinds-{i}") for i in range(_N)]
    try:
        yield rngs
    finally:
        for r in rngs:
            unregister_rng(r)


def test_a_run_of_random_random_is_one_batch_with_the_fast_paths(many):
    steps = [s for s in registry.live_steps() if isinstance(s, kinds.MtBatch)]
    if layouts.RANDOM_LAYOUT is None:  # the switch, or another interpreter: entries only
        assert steps == []
        return
    (batch,) = steps
    assert [e.get() for e in batch.entries] == many


def test_a_batch_seeds_and_restores_each_exactly(many):
    for r in many:
        r.gauss(0, 1)  # a cached gaussian: restored too
    before = [r.getstate() for r in many]
    for seed in (4, 4, 5):  # a miss, a hit of the batch's memo, a miss
        with deterministic(seed=seed):
            for i, r in enumerate(many):
                assert r.getstate() == _seeded(seed, f"kinds-{i}").getstate()
                r.random()
        assert [r.getstate() for r in many] == before


def test_a_batch_saves_each_rng_s_public_state(many):
    for r in many:
        r.gauss(0, 1)
    saved = {u["key"]: u["state"] for u in Snapshot.capture().state_dict()["sources"]["user"]}
    for i, r in enumerate(many):
        _version, words, gauss = r.getstate()
        assert saved[f"kinds-{i}"] == {"state": list(words), "gauss_next": gauss}


def test_an_rng_collected_inside_a_block_leaves_the_rest_restored():
    rngs = [register_rng(random.Random(i), key=f"dying-{i}") for i in range(_N)]
    try:
        before = [r.getstate() for r in rngs]
        with deterministic(seed=1):
            dead = rngs.pop(3)
            unregister_rng(dead)
            del dead
            gc.collect()
            for r in rngs:
                r.random()
        assert [r.getstate() for r in rngs] == before[:3] + before[4:]
        with deterministic(seed=1):  # the batch made again without it
            assert rngs[3].getstate() == _seeded(1, "dying-4").getstate()
    finally:
        for r in rngs:
            unregister_rng(r)


def test_the_registry_drops_a_collected_rng_through_its_keyed_reference():
    before = len(registry._entries)
    rng = register_rng(random.Random(1))
    ref = registry._entries[id(rng)].get
    assert isinstance(ref, weakref.KeyedRef) and ref.key == id(rng)
    del rng
    gc.collect()
    assert ref() is None
    assert len(registry._entries) == before


def test_unregistering_keeps_no_reference_to_the_rng_alive():
    rng = random.Random(2)
    for _ in range(3):  # registered again and again: no reference (or callback) kept alive
        register_rng(rng)
        unregister_rng(rng)
    registry.live_entries()  # the loops' tuples rebuilt without it
    assert weakref.getweakrefcount(rng) == 0
    assert id(rng) not in registry._entries


def test_objects_that_cannot_be_weakly_referenced_are_held_by_their_entry():
    gen = register_rng(np.random.default_rng(3))
    try:
        (entry,) = [e for e in registry.live_entries() if e.get() is gen]
        assert not isinstance(entry.get, weakref.ref)
    finally:
        unregister_rng(gen)


def test_every_source_declares_applies_nothing_and_its_fast_paths():
    for source in SOURCES:
        assert isinstance(source.applies_nothing, bool), source.name
        assert all(isinstance(p, switch.FastPath) for p in source.fast_paths), source.name


def test_fast_paths_lists_the_mt19937_record_copies_of_registered_generators():
    row = "NumPy Generators: state copied as memory (MT19937)"
    assert fast_paths()[row] is (switch.ENABLED and np.random.MT19937 in layouts.proven_records())
    if layouts.NUMPY_LAYOUT is not None:
        gen = register_rng(np.random.Generator(np.random.MT19937(5)))
        try:
            (entry,) = [e for e in registry.live_entries() if e.get() is gen]
            assert entry.views  # it is copied as memory, as the row says
        finally:
            unregister_rng(gen)


def test_every_kind_has_an_adapter_with_its_codec():
    for obj, kind in (
        (random.Random(1), kinds.RANDOM),
        (np.random.default_rng(1), kinds.GENERATOR),
        (np.random.RandomState(1), kinds.RANDOM_STATE),
    ):
        assert kinds.kind_of(obj) is kind
        data = kind.to_plain(obj, kind.get(obj))
        state = kind.from_plain(obj, data, "x")
        kind.set(obj, state)
        assert kind.to_plain(obj, kind.get(obj)) == data


def test_a_disabled_cache_remembers_nothing():
    cache: BoundedCache[int, int] = BoundedCache(4, enabled=False)
    cache.put(1, 1)
    assert cache.get(1) is None and len(cache) == 0
    on: BoundedCache[int, int] = BoundedCache(2, enabled=True)
    for n in range(5):
        on.put(n, n)
    assert len(on) == 2 and on.get(4) == 4 and on.get(0) is None


class _EqualToAll:
    """Random-like, unhashable and equal to anything."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __eq__(self, other: object) -> bool:
        return True

    def seed(self, s: int) -> None:
        self.rng.seed(s)

    def getstate(self) -> object:
        return self.rng.getstate()

    def setstate(self, state: object) -> None:
        self.rng.setstate(state)


def test_the_registry_goes_by_identity_not_by_hash_or_equality():
    a, b = register_rng(_EqualToAll(), key="eq-a"), register_rng(_EqualToAll(), key="eq-b")
    try:
        assert [k for k, o in registered_rngs() if o is a or o is b] == ["eq-a", "eq-b"]
        with deterministic(seed=1):
            assert a.rng.getstate() == random.Random(derive_seed(1, "user", "eq-a")).getstate()
            assert b.rng.getstate() == random.Random(derive_seed(1, "user", "eq-b")).getstate()
    finally:
        unregister_rng(a)
        unregister_rng(b)


@pytest.mark.parametrize("collector_on", [True, False])
def test_calls_made_without_collections_leave_the_collector_as_it_was(collector_on, monkeypatch):
    # Where a library allocates under a lock of its own (NumPy 1.x's seeding,
    # torch 2.1's get_state), collections are held off around the call; the
    # collector is then as it was, on or off.  Both paths taken here whatever
    # the installed versions.
    monkeypatch.setattr(uncollected, "NUMPY_LOCK_REENTRANT", False)
    monkeypatch.setattr(uncollected, "GET_STATE_COLLECTS", True)
    rs, reference = np.random.RandomState(), np.random.RandomState(11)
    gen = torch.Generator().manual_seed(3)
    (gc.enable if collector_on else gc.disable)()
    try:
        kinds.RANDOM_STATE.seed(rs, 11)
        state = uncollected.get_state(gen)
        assert gc.isenabled() is collector_on
    finally:
        gc.enable()
    assert rs.random_sample() == reference.random_sample()
    assert torch.equal(state, gen.get_state())
