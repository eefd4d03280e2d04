"""register_rng: user-owned RNGs captured, seeded and restored with every block."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import weakref
from typing import ClassVar

import numpy as np
import pytest
import torch

from deterministic_ctx import (
    derive_seed,
    deterministic,
    register_rng,
    registered_rngs,
    unregister_rng,
)
from deterministic_ctx.sources import user_rngs
from deterministic_ctx.sources.user_rngs import registry


def _draw(rng):
    if isinstance(rng, random.Random):
        return rng.random()
    if isinstance(rng, np.random.Generator):
        return float(rng.random())
    if isinstance(rng, np.random.RandomState):
        return float(rng.standard_normal())
    return torch.rand(1, generator=rng).item()


def _make(kind):
    return {
        "random": lambda: random.Random(1),
        "generator": lambda: np.random.default_rng(1),
        "randomstate": lambda: np.random.RandomState(1),
        "torch": lambda: torch.Generator().manual_seed(1),
    }[kind]()


@pytest.fixture(params=["random", "generator", "randomstate", "torch"])
def rng(request):
    obj = register_rng(_make(request.param), key=f"test-{request.param}")
    yield obj
    unregister_rng(obj)


def test_seeded_inside_and_restored_after(rng):
    fresh = _draw(_clone_state_of(rng))
    with deterministic(seed=3):
        a = [_draw(rng) for _ in range(3)]
    with deterministic(seed=3):
        b = [_draw(rng) for _ in range(3)]
    assert a == b
    assert _draw(rng) == fresh  # the caller's stream continues untouched


def _clone_state_of(rng):
    if isinstance(rng, random.Random):
        clone = random.Random()
        clone.setstate(rng.getstate())
    elif isinstance(rng, np.random.Generator):
        clone = np.random.Generator(type(rng.bit_generator)())
        clone.bit_generator.state = rng.bit_generator.state
    elif isinstance(rng, np.random.RandomState):
        clone = np.random.RandomState()
        clone.set_state(rng.get_state())
    else:
        clone = torch.Generator()
        clone.set_state(rng.get_state())
    return clone


def test_seed_is_derived_from_block_seed_and_key():
    rng = register_rng(random.Random(), key="augment")
    try:
        with deterministic(seed=5):
            inside = rng.random()
        assert inside == random.Random(derive_seed(5, "user", "augment", bits=64)).random()
        with deterministic(seed=6):
            assert rng.random() != inside
    finally:
        unregister_rng(rng)


def test_different_keys_give_different_streams():
    a = register_rng(random.Random(), key="a")
    b = register_rng(random.Random(), key="b")
    try:
        with deterministic(seed=0):
            assert a.random() != b.random()
    finally:
        unregister_rng(a)
        unregister_rng(b)


def test_default_key_is_the_registration_ordinal_and_registration_is_idempotent():
    rng = random.Random()
    assert register_rng(rng) is rng
    register_rng(rng)
    try:
        keys = [k for k, o in registered_rngs() if o is rng]
        assert len(keys) == 1 and keys[0].isdigit()
    finally:
        unregister_rng(rng)


def test_weakly_held_objects_disappear():
    rng = register_rng(random.Random())
    before = len(registered_rngs())
    del rng
    gc.collect()
    assert len(registered_rngs()) == before - 1
    with deterministic(seed=0):
        pass


def test_unmanageable_object_and_bad_key():
    with pytest.raises(TypeError, match=r"cannot manage list.*accepted: random\.Random"):
        register_rng([1, 2])
    with pytest.raises(TypeError, match="key must be a str or None, got int 3"):
        register_rng(random.Random(), key=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not registered"):
        unregister_rng(random.Random())


def test_exact_random_uses_fast_path_and_subclasses_use_their_own_methods():
    class Counting(random.Random):
        seeds: ClassVar[list] = []

        def seed(self, a=None, version=2):
            Counting.seeds.append(a)
            super().seed(a, version)

    fast = register_rng(random.Random(1), key="fast")
    sub = register_rng(Counting(1), key="sub")
    try:
        Counting.seeds.clear()
        with deterministic(seed=2):
            inside_fast, inside_sub = fast.random(), sub.random()
        assert Counting.seeds == [derive_seed(2, "user", "sub", bits=64)]
        assert inside_fast == random.Random(derive_seed(2, "user", "fast", bits=64)).random()
        assert inside_sub == random.Random(derive_seed(2, "user", "sub", bits=64)).random()
    finally:
        unregister_rng(fast)
        unregister_rng(sub)


def test_system_random_is_rejected():
    with pytest.raises(TypeError, match=r"cannot manage random\.SystemRandom"):
        register_rng(random.SystemRandom())


# -- the registry: dead entries leave at once, costs stay flat ------------------------


def _count() -> int:
    """Entries the registry holds, dead or alive (an internal count, not time)."""
    return len(registry._entries)


def _sizes() -> tuple[int, ...]:
    """Every internal table's length: none may grow with dead registrations."""
    return tuple(
        len(table) for table in (getattr(registry, name, ()) for name in ("_entries", "_by_id"))
    )


def _weakly_referenced(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


#: torch 2.11's ``torch.Generator`` cannot be weakly referenced (seen on the GPU machine):
#: there a registered one is held until ``unregister_rng``, like NumPy's generators.
WEAK_GENERATOR = _weakly_referenced(torch.Generator())


def test_collected_rngs_leave_the_registry_at_once():
    before = _sizes()
    for _ in range(2000):
        register_rng(random.Random())  # nothing else holds it: collected at once
    held = []
    for _ in range(200):
        held.append(register_rng(torch.Generator()))
    del held
    if not WEAK_GENERATOR:  # held by the registry until unregistered
        assert _count() == before[0] + 200
        for _key, rng in registered_rngs():
            if isinstance(rng, torch.Generator):
                unregister_rng(rng)
    assert _sizes() == before
    assert _count() == before[0]


def test_collected_cycles_leave_the_registry_after_a_collection():
    before = _count()

    class Cyclic(random.Random):
        pass

    enabled = gc.isenabled()
    gc.disable()  # an automatic collection (other threads allocate too) would free some early
    try:
        for _ in range(100):
            rng = Cyclic()
            rng.me = rng  # a reference cycle: only the cyclic GC frees it
            register_rng(rng)
        del rng
        assert _count() == before + 100
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert _count() == before


def test_registration_order_and_default_keys_survive_collections():
    a, b = register_rng(random.Random()), register_rng(random.Random())
    try:
        for _ in range(50):
            register_rng(random.Random())
        c = register_rng(random.Random())
        del a
        d = register_rng(random.Random(), key="d")
        mine = [(k, o) for k, o in registered_rngs() if any(o is x for x in (b, c, d))]
        assert [o for _, o in mine] == [b, c, d]
        kb, kc = int(mine[0][0]), int(mine[1][0])
        assert kc == kb + 51  # every default key consumed an ordinal, collected or not
        assert mine[2][0] == "d"
    finally:
        for rng in (b, c, d):
            unregister_rng(rng)


def test_reregistering_is_a_no_op_and_unregister_finds_the_object():
    rng = random.Random()
    before = _count()
    register_rng(rng, key="x")
    register_rng(rng, key="y")  # already registered: kept under its first key
    assert _count() == before + 1
    assert [k for k, o in registered_rngs() if o is rng] == ["x"]
    unregister_rng(rng)
    assert _count() == before
    with pytest.raises(ValueError, match="is not registered"):
        unregister_rng(rng)


def test_a_new_object_at_a_dead_objects_address_is_a_new_registration():
    before = _count()
    for _ in range(200):  # CPython reuses the freed memory: ids repeat
        register_rng(random.Random(), key="reused")
        rng = register_rng(random.Random(3), key="live")
        assert [k for k, o in registered_rngs() if o is rng] == ["live"]
        unregister_rng(rng)
    assert _count() == before


def test_an_entry_kept_by_a_snapshot_does_not_remove_a_later_registration():
    from deterministic_ctx import Snapshot

    before, live = _count(), len(user_rngs.UserRngSource().capture())
    rng = register_rng(random.Random(1), key="old")
    snap = Snapshot.capture()  # holds the old entry and the object
    unregister_rng(rng)
    register_rng(rng, key="new")
    assert [k for k, o in registered_rngs() if o is rng] == ["new"]
    del rng
    del snap  # the object dies now: both weak references call back
    assert _count() == before
    assert len(user_rngs.UserRngSource().capture()) == live


def test_strong_references_are_kept_until_unregistered():
    gc.collect()  # dead cycles of other tests, still registered, would leave now
    before = _count()
    register_rng(np.random.default_rng(1), key="numpy")  # cannot be weakly referenced
    gc.collect()
    assert _count() == before + 1
    (obj,) = [o for k, o in registered_rngs() if k == "numpy"]
    unregister_rng(obj)
    assert _count() == before


def test_blocks_seed_the_same_after_many_register_collect_cycles():
    rng = register_rng(random.Random(), key="steady")
    try:
        with deterministic(seed=1):
            first = rng.random()
        sizes = _sizes()
        for _ in range(20_000):
            register_rng(random.Random())
        with deterministic(seed=1):
            assert rng.random() == first
        assert _sizes() == sizes  # nothing dead left behind
        assert _count() == len(registered_rngs())
    finally:
        unregister_rng(rng)


class _DropsOthersWhenCaptured(random.Random):
    """A subclass (so the source calls its ``getstate``) that drops the last
    reference to other registered RNGs in the middle of a block's capture."""

    victims: ClassVar[list[object]] = []
    trigger: ClassVar[bool] = False

    def getstate(self):
        if _DropsOthersWhenCaptured.trigger:
            _DropsOthersWhenCaptured.trigger = False
            _DropsOthersWhenCaptured.victims.clear()  # refcount deaths: callbacks run here
            gc.collect()  # and the cyclic ones
        return super().getstate()


def test_collection_inside_a_blocks_capture_loop():
    before = _count()
    dropper = register_rng(_DropsOthersWhenCaptured(5), key="dropper")
    cyclic = random.Random(6)
    cyclic.me = cyclic  # type: ignore[attr-defined]
    victims = [random.Random(i) for i in range(20)] + [cyclic]
    _DropsOthersWhenCaptured.victims[:] = victims
    for i, v in enumerate(victims):  # registered after the dropper: captured after it
        register_rng(v, key=f"victim-{i}")
    del victims, cyclic, v
    survivor = register_rng(random.Random(7), key="survivor")
    try:
        fresh = random.Random()
        fresh.setstate(survivor.getstate())
        _DropsOthersWhenCaptured.trigger = True
        with deterministic(seed=0):
            inside = survivor.random()
        assert not _DropsOthersWhenCaptured.trigger  # the capture did run the drop
        assert inside == random.Random(derive_seed(0, "user", "survivor", bits=64)).random()
        assert survivor.random() == fresh.random()  # restored
        assert _count() == before + 2
    finally:
        unregister_rng(dropper)
        unregister_rng(survivor)
    assert _count() == before


def test_a_callback_while_this_thread_holds_the_registry_lock_does_not_deadlock():
    rng = register_rng(random.Random())
    before = _count()
    holder = [rng]
    del rng
    done = threading.Event()

    def run() -> None:
        with registry._lock:
            holder.clear()  # the callback runs here, inside the lock, in this thread
            gc.collect()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert done.is_set(), "the weak-reference callback deadlocked on the registry lock"
    assert _count() == before - 1


def test_registrations_and_collections_in_many_threads():
    before = _count()
    errors: list[BaseException] = []
    steady = register_rng(random.Random(2), key="steady-threads")
    handoff: list[object] = []
    lock = threading.Lock()

    def churn(n: int) -> None:
        try:
            for i in range(n):
                fresh = torch.Generator() if i % 3 == 0 and WEAK_GENERATOR else random.Random(i)
                rng = register_rng(fresh)
                del fresh
                with lock:
                    handoff.append(rng)  # often collected by another thread
                    if len(handoff) > 8:
                        del handoff[:4]
                del rng
                if i % 50 == 0:
                    registered_rngs()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def blocks(n: int) -> None:
        try:
            for _ in range(n):
                with deterministic(seed=4):
                    steady.random()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(1500,)) for _ in range(3)]
    threads += [threading.Thread(target=blocks, args=(300,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with lock:
        handoff.clear()
    gc.collect()
    try:
        assert errors == []
        assert _count() == before + 1
        assert _sizes()[0] == _count()
    finally:
        unregister_rng(steady)
    assert _count() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_another_thread_registers_can_register():
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with registry._lock:  # as a thread inside register_rng at the moment of the fork
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the holding thread does not exist here
            code = 1
            try:
                rng = register_rng(random.Random(1), key="in-child")
                unregister_rng(rng)
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child deadlocked on the registry lock")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        t.join()


# -- shared=True: seeded from the block's shared seed -----------------------------------------


@pytest.mark.parametrize("kind", ["random", "generator", "randomstate", "torch"])
def test_shared_rngs_get_the_shared_seed_under_rank(kind):
    shared = register_rng(_make(kind), key="shared", shared=True)
    per_rank = register_rng(_make(kind), key="per-rank")
    try:
        draws = {}
        for rank in (None, 0, 1, 7, "auto"):
            with deterministic(seed=3, rank=rank):
                draws[rank] = (_draw(shared), _draw(per_rank))
    finally:
        unregister_rng(shared)
        unregister_rng(per_rank)
    assert len({d[0] for d in draws.values()}) == 1  # alike on every rank
    assert draws[1][1] != draws[7][1] != draws[None][1] == draws[0][1]  # per rank
    # The shared one draws what a block without rank= gives the same key.
    again = register_rng(_make(kind), key="shared")
    try:
        with deterministic(seed=3):
            assert _draw(again) == draws[None][0]
    finally:
        unregister_rng(again)


def test_seed_registered_rngs_takes_a_shared_seed():
    shared = register_rng(random.Random(), key="s", shared=True)
    per_rank = register_rng(random.Random(), key="p")
    try:
        with deterministic(seed=0):
            user_rngs.seed_registered_rngs(4, shared_seed=9)
            got = shared.random(), per_rank.random()
            user_rngs.seed_registered_rngs(4)  # no shared seed: one seed for all
            alike = shared.random(), per_rank.random()
    finally:
        unregister_rng(shared)
        unregister_rng(per_rank)
    assert got == (
        random.Random(derive_seed(9, "user", "s", bits=64)).random(),
        random.Random(derive_seed(4, "user", "p", bits=64)).random(),
    )
    assert alike[0] == random.Random(derive_seed(4, "user", "s", bits=64)).random()


def test_registering_again_with_another_shared_is_refused():
    rng = register_rng(random.Random(), shared=True)
    try:
        assert register_rng(rng, shared=True) is rng
        with pytest.raises(ValueError, match=r"registered already with shared=True"):
            register_rng(rng)
        with pytest.raises(TypeError, match="shared must be True or False, got 1"):
            register_rng(random.Random(), shared=1)
    finally:
        unregister_rng(rng)
    assert register_rng(rng) is rng  # after unregistering: any way
    unregister_rng(rng)


def test_an_interrupt_while_loading_the_entry_points_leaves_them_to_the_next_read(monkeypatch):
    rng = random.Random(3)
    loads: list[int] = []

    class Interrupted:  # an entry point whose first load meets a Ctrl-C
        name, value = "interrupted", "tests:rng"

        def load(self) -> object:
            loads.append(1)
            if len(loads) == 1:
                raise KeyboardInterrupt
            return lambda: rng

    monkeypatch.setattr(registry, "_entry_points", lambda: [Interrupted()])
    monkeypatch.setattr(registry, "_plugins_pending", True)
    registry._changed()  # the loops' tuples stale: the next read loads the entry points
    with pytest.raises(KeyboardInterrupt):
        registered_rngs()
    try:
        assert [k for k, o in registered_rngs() if o is rng] == ["interrupted"]
        assert len(loads) == 2
    finally:
        unregister_rng(rng)
