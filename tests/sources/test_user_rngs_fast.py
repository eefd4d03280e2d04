"""User RNGs' fast paths and seeded-state memos: exactly what the real calls give.

Every registered RNG takes a path chosen at registration (a proven C record,
a remembered seeded state, or the public API every time).  Each test here
compares a path with the real call: the state inside a block is the state
``seed(derived)`` gives (gaussian caches, NumPy's buffered half-draw,
``initial_seed()`` included), on the first block (memo miss), on repeats
(memo hit) and with alternating seeds, and the state after a block is the
state before it, bit for bit.

Runs of such RNGs registered one after another are handled as batches (C-level
loops over all of them).  The batch tests check how runs are cut and each
fallback of a batch to its entries; the differential test runs random
workloads (blocks nested and per rank, registrations and collections inside
them, replaced states and bit generators, two RNGs on one bit generator, an
RNG seeded through another, snapshots saved, loaded and restored anywhere)
once with every fast path and batch on and once through the public API only,
and finds every RNG, at every step, in the same state.
"""

from __future__ import annotations

import io
import random
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deterministic_ctx import Snapshot, derive_seed, deterministic, register_rng, unregister_rng
from deterministic_ctx.sources import _memory, user_rngs
from deterministic_ctx.sources.numpy_global import numpy_state_to_plain
from deterministic_ctx.sources.user_rngs import (
    batches,
    entries,
    kinds,
    persistence,
    registry,
)
from tests.helpers import RandomLike

#: NumPy's record batches take each bit generator's lock without waiting, and
#: this thread's too: only where those locks are ``RLock``s (NumPy 2), else
#: every NumPy RNG is an entry of its own (the batch is off, by design).
needs_record_batches = pytest.mark.skipif(
    type(np.random.default_rng(0).bit_generator.lock) is not type(threading.RLock())
    or not _memory.ENABLED,
    reason="NumPy's record batches need RLock bit generator locks (NumPy >= 2) and the "
    "fast paths on",
)
#: Batches are runs of RNGs whose records are copied: none with the fast paths off.
needs_batches = pytest.mark.skipif(
    not _memory.ENABLED, reason="DETERMINISTIC_CTX_NO_FAST_PATHS=1: no record, no batch"
)


class _SubRandom(random.Random):
    pass


class _SubRandomState(np.random.RandomState):
    pass


class _SubPCG64(np.random.PCG64):
    pass


class _SubTorch(torch.Generator):
    pass


_RandomLike = RandomLike


#: name -> (make, expected path on CPython with the layouts proven)
CASES: dict[str, tuple[Callable[[], Any], int]] = {
    "random": (lambda: random.Random(1), entries.MT),
    "random-subclass": (lambda: _SubRandom(1), entries.API),
    "pcg64": (lambda: np.random.Generator(np.random.PCG64(1)), entries.RECORD),
    "pcg64dxsm": (lambda: np.random.Generator(np.random.PCG64DXSM(1)), entries.RECORD),
    "mt19937": (lambda: np.random.Generator(np.random.MT19937(1)), entries.RECORD),
    "sfc64": (lambda: np.random.Generator(np.random.SFC64(1)), entries.SET),
    "philox": (lambda: np.random.Generator(np.random.Philox(1)), entries.SET),
    "pcg64-subclass": (lambda: np.random.Generator(_SubPCG64(1)), entries.SET),
    "randomstate": (lambda: np.random.RandomState(1), entries.LEGACY),
    "randomstate-subclass": (lambda: _SubRandomState(1), entries.API),
    "torch": (lambda: torch.Generator().manual_seed(1), entries.SET),
    "torch-subclass": (lambda: _SubTorch().manual_seed(1), entries.API),
    "random-like": (lambda: _RandomLike(1), entries.API),
}


def public(obj: Any) -> Any:
    """The object's whole state through its public API, comparable with ``==``."""
    if isinstance(obj, random.Random):
        return ("random", obj.getstate())
    if isinstance(obj, np.random.Generator):
        return ("generator", numpy_state_to_plain(obj.bit_generator.state))
    if isinstance(obj, np.random.RandomState):
        return ("randomstate", numpy_state_to_plain(obj.get_state(legacy=False)))
    if isinstance(obj, torch.Generator):
        return ("torch", obj.get_state().tolist(), obj.initial_seed())
    return ("like", obj.getstate())


def seeded_like(obj: Any, derived: int) -> Any:
    """A fresh object of ``obj``'s kind seeded by the real call with ``derived``."""
    if isinstance(obj, random.Random):
        return type(obj)(derived)
    if isinstance(obj, np.random.Generator):
        return np.random.Generator(type(obj.bit_generator)(derived))
    if isinstance(obj, np.random.RandomState):
        return np.random.RandomState(derived)
    if isinstance(obj, torch.Generator):
        return torch.Generator().manual_seed(derived)
    return _RandomLike(derived)


def bits_of(obj: Any) -> int:
    if isinstance(obj, (np.random.RandomState, _RandomLike)):
        return 32
    return 64


def stir(obj: Any) -> None:
    """Draw so that every cache is in use: ``gauss_next``, NumPy's buffered
    half-draw (``has_uint32``) and legacy gaussian, torch's normal cache."""
    if isinstance(obj, random.Random):
        obj.gauss(0, 1)
    elif isinstance(obj, np.random.Generator):
        obj.random()
        obj.integers(0, 2**32, dtype=np.uint32)
    elif isinstance(obj, np.random.RandomState):
        obj.standard_normal()
    elif isinstance(obj, torch.Generator):
        torch.randn(3, generator=obj)
    elif isinstance(obj, _Wrapper):
        stir(obj.inner)
    else:
        obj.random()


def draws(obj: Any) -> list[float]:
    if isinstance(obj, torch.Generator):
        return torch.rand(3, generator=obj).tolist()
    if isinstance(obj, np.random.Generator):
        return [*obj.random(2).tolist(), int(obj.integers(0, 2**32, dtype=np.uint32))]
    if isinstance(obj, np.random.RandomState):
        return [float(obj.standard_normal()), float(obj.random_sample())]
    if isinstance(obj, _Wrapper):
        return draws(obj.inner)
    return [obj.random(), obj.random()]


@pytest.fixture(params=sorted(CASES))
def case(request):
    make, mode = CASES[request.param]
    obj = register_rng(make(), key=f"fast-{request.param}")
    try:
        yield request.param, obj, mode
    finally:
        unregister_rng(obj)


def test_the_path_chosen_at_registration(case):
    name, obj, mode = case
    (entry,) = [e for e in registry.live_entries() if e.get() is obj]
    if not _memory.ENABLED:  # DETERMINISTIC_CTX_NO_FAST_PATHS=1: the public API for all
        assert entry.mode == entries.API, name
    elif _memory.NUMPY_LAYOUT is not None and len(_memory.proven_records()) == 3:
        assert entry.mode == mode, name
    else:  # pragma: no cover - another interpreter or NumPy: the public API is exact too
        assert entry.mode in (mode, entries.API, entries.SET)


@pytest.mark.parametrize("seeds", [(0, 0, 0), (3, 4, 3, 4), (7,)])
def test_inside_every_block_the_state_is_the_real_seeding(case, seeds):
    name, obj, _mode = case
    key = f"fast-{name}"
    for seed in seeds:  # the first block misses the memo, repeats hit it
        stir(obj)
        before = public(obj)
        with deterministic(seed=seed):
            expected = seeded_like(obj, derive_seed(seed, "user", key, bits=bits_of(obj)))
            assert public(obj)[1:] == public(expected)[1:]
            assert draws(obj) == draws(expected)
            stir(obj)
        assert public(obj) == before  # restored bit for bit, caches included


def test_nested_blocks_and_rank_seeds(case):
    name, obj, _mode = case
    key = f"fast-{name}"
    stir(obj)
    before = public(obj)
    with deterministic(seed=1):
        stir(obj)
        middle = public(obj)
        with deterministic(seed=2):
            expected = seeded_like(obj, derive_seed(2, "user", key, bits=bits_of(obj)))
            assert public(obj)[1:] == public(expected)[1:]
            stir(obj)
        assert public(obj) == middle
    assert public(obj) == before


def test_the_saved_state_is_the_public_state(case):
    """Records captured as raw memory export exactly what the public API reports."""
    name, obj, _mode = case
    if name == "random-like":
        pytest.skip(
            "random-like states are saved in their own encoding (tests/sources/test_user_rngs_api.py)"
        )
    stir(obj)
    snap = Snapshot.capture()
    if name == "pcg64-subclass":  # NumPy's own bit generators only: refused when saving
        with pytest.raises(ValueError, match=r"'fast-pcg64-subclass'.*cannot be saved.*_SubPCG64"):
            snap.state_dict()
        return
    (saved,) = [u for u in snap.state_dict()["sources"]["user"] if u["key"] == f"fast-{name}"]
    entry = next(e for e in registry.live_entries() if e.get() is obj)
    kind = entry.kind
    if kind is kinds.RANDOM:
        expected = persistence.CODECS[kind.name][0](obj, obj.getstate())
    else:
        expected = persistence.CODECS[kind.name][0](obj, kind.get(obj))
    if kind is kinds.TORCH:
        assert saved["state"]["state"].tolist() == expected["state"].tolist()
    else:
        assert saved["state"] == expected
    # and it loads back: drawing, then restoring the loaded snapshot, gives the state back
    before = public(obj)
    draws(obj)
    Snapshot.from_state_dict(snap.state_dict()).restore()
    assert public(obj) == before


def test_hundreds_of_rngs_are_each_seeded_exactly():
    """No shared cache to overflow: each of 300 RNGs gets its own seeded state."""
    rngs = [register_rng(random.Random(i), key=f"many-{i}") for i in range(300)]
    gens = [register_rng(np.random.default_rng(i), key=f"many-np-{i}") for i in range(40)]
    try:
        before = [public(r) for r in rngs + gens]
        for seed in (0, 0, 9):
            with deterministic(seed=seed):
                for i, r in enumerate(rngs):
                    assert (
                        r.getstate()
                        == random.Random(derive_seed(seed, "user", f"many-{i}", bits=64)).getstate()
                    )
                for i, g in enumerate(gens):
                    derived = derive_seed(seed, "user", f"many-np-{i}", bits=64)
                    assert g.bit_generator.state == np.random.PCG64(derived).state
                    g.random()
                for r in rngs:
                    r.random()
            assert [public(r) for r in rngs + gens] == before
    finally:
        for r in rngs + gens:
            unregister_rng(r)


def test_probes_prove_the_records_they_accept():
    for cls, record in _memory.proven_records().items():
        bg = cls(12345)
        np.random.Generator(bg).integers(0, 2**32, dtype=np.uint32)  # a buffered half
        view = record.view(bg)
        assert view is not None
        state = record.decode(view.tobytes())
        assert numpy_state_to_plain(state) == numpy_state_to_plain(bg.state)


def test_a_pcg_record_of_another_layout_is_refused():
    record = _memory.probe_pcg(np.random.PCG64)
    if record is None:  # pragma: no cover - not CPython, or NumPy laid out otherwise
        pytest.skip("no PCG64 record on this interpreter")
    wrong = _memory.PcgRecord("PCG64", record.gap + 16)  # a pointer that does not match
    assert wrong.view(np.random.PCG64(1)) is None
    assert _memory.probe_pcg(np.random.SFC64) is None  # no pointer where PCG64 has one


def test_a_failed_restore_of_one_rng_still_restores_the_others():
    class Flaky(_RandomLike):
        fail = False

        def setstate(self, state: Any) -> None:
            if Flaky.fail:
                Flaky.fail = False
                raise RuntimeError("setstate failed once")
            super().setstate(state)

    first = register_rng(random.Random(1), key="flaky-first")
    flaky = register_rng(Flaky(2), key="flaky")
    last = register_rng(np.random.default_rng(3), key="flaky-last")
    source = user_rngs.UserRngSource()
    try:
        state = source.capture()
        before = [public(first), public(last)]
        for obj in (first, flaky, last):
            stir(obj)
        Flaky.fail = True
        with pytest.raises(RuntimeError, match="setstate failed once"):
            source.restore(state)
        assert [public(first), public(last)] == before  # both sides of the failure
        source.restore(state)  # idempotent: the retry puts the flaky one back too
    finally:
        for obj in (first, flaky, last):
            unregister_rng(obj)


# -- batches: runs of RNGs handled by C-level loops -------------------------------------


def _layout(keys_prefix: str) -> list[tuple[Any, ...]]:
    """The blocks' steps for the entries whose keys start with ``keys_prefix``."""
    out: list[tuple[Any, ...]] = []
    names = {batches._MtBatch: "mt", batches._RecordBatch: "record"}
    for step in registry.block_steps():
        if isinstance(step, batches.Batch):
            keys = [e.key for e in step.entries if e.key.startswith(keys_prefix)]
            if keys:
                out.append((names[type(step)], step.shared, keys))
        elif step.key.startswith(keys_prefix):
            out.append(("entry", step.key))
    return out


@needs_record_batches
def test_runs_of_batchable_rngs_are_batched_by_kind_in_registration_order():
    n, m = batches._MT_BATCH_MIN, batches._RECORD_BATCH_MIN
    a = [register_rng(random.Random(i), key=f"run-a{i}") for i in range(n)]
    g = [register_rng(np.random.default_rng(i), key=f"run-g{i}") for i in range(m - 1)]
    g.append(register_rng(np.random.RandomState(0), key=f"run-g{m - 1}"))  # the same family
    b = [register_rng(random.Random(i), key=f"run-b{i}", shared=i >= n) for i in range(2 * n)]
    sub = register_rng(_SubRandom(0), key="run-sub")  # its own seed(): never in a batch
    short = [register_rng(random.Random(i), key=f"run-s{i}") for i in range(n - 1)]
    lone = register_rng(np.random.default_rng(0), key="run-lone")
    rngs = [*a, *g, *b, sub, *short, lone]
    try:
        assert _layout("run-") == [
            # One run (both kinds, shared=False): the kinds apart, each in order.
            ("mt", False, [f"run-a{i}" for i in range(n)] + [f"run-b{i}" for i in range(n)]),
            ("record", False, [f"run-g{i}" for i in range(m)]),
            ("mt", True, [f"run-b{i}" for i in range(n, 2 * n)]),  # shared: another run
            ("entry", "run-sub"),  # not batchable: ends the run
            *[("entry", f"run-s{i}") for i in range(n - 1)],  # too few for a batch
            ("entry", "run-lone"),
        ]
        unregister_rng(b[0])  # the registry changed: the steps are made again
        assert _layout("run-")[0] == (
            "mt",
            False,
            [f"run-a{i}" for i in range(n)] + [f"run-b{i}" for i in range(1, n)],
        )
    finally:
        for rng in rngs:
            if rng is not b[0]:
                unregister_rng(rng)


@needs_batches
@pytest.mark.parametrize("seeds", [(0, 0, 0), (3, 4, 3, 4)])
def test_inside_every_block_a_batch_is_the_real_seeding(seeds):
    """``test_inside_every_block_the_state_is_the_real_seeding`` for a batch:
    the memo of the whole run is written (and ``gauss_next`` cleared) on a hit."""
    n = batches._MT_BATCH_MIN
    rngs = [register_rng(random.Random(i), key=f"seeded{i}", shared=True) for i in range(n)]
    try:
        assert _layout("seeded") == [("mt", True, [f"seeded{i}" for i in range(n)])]
        for seed in seeds:
            for rng in rngs:
                stir(rng)
            before = [rng.getstate() for rng in rngs]
            with deterministic(seed=seed, rank=1):  # shared: the block's shared seed
                for i, rng in enumerate(rngs):
                    expected = random.Random(derive_seed(seed, "user", f"seeded{i}", bits=64))
                    assert rng.getstate() == expected.getstate()
                    stir(rng)
            assert [rng.getstate() for rng in rngs] == before
    finally:
        for rng in rngs:
            unregister_rng(rng)


@needs_batches
@needs_record_batches
def test_a_batch_made_before_one_of_its_rngs_died_skips_it():
    """The loops fetch the steps, then read the weak references: an RNG may die
    in between (a collection, another thread).  The batch then falls back to
    its live entries, each exactly as alone."""
    n = max(batches._MT_BATCH_MIN, 3)
    rngs = [register_rng(random.Random(i), key=f"stale{i}") for i in range(n)]
    keys = [f"stale{i}" for i in range(n) if i != 1]
    try:
        for rng in rngs:
            rng.gauss(0.0, 1.0)
        (batch,) = [
            s
            for s in registry.block_steps()
            if isinstance(s, batches.Batch) and s.entries[0].key == "stale0"
        ]
        del rngs[1]  # the last reference: its entry leaves the registry at once
        layout = _layout("stale")  # the next steps lack it, batched or not
        assert [k for step in layout for k in (step[2] if step[0] != "entry" else step[1:])] == keys
        before = [rng.getstate() for rng in rngs]
        out: list[Any] = []
        batch.capture_into(out)
        assert [record[0].key for record in out] == keys
        assert [record[0].public(record[2], record[3]) for record in out] == before
        for seed in (4, 4):  # a memo miss, then a hit
            batch.seed(seed)
            for key, rng in zip(keys, rngs, strict=True):
                assert (
                    rng.getstate()
                    == random.Random(derive_seed(seed, "user", key, bits=64)).getstate()
                )
        user_rngs.UserRngSource().restore(tuple(out))
        assert [rng.getstate() for rng in rngs] == before
    finally:
        for rng in rngs:
            unregister_rng(rng)


@needs_batches
def test_a_batch_restore_interrupted_half_way_restores_every_rng(monkeypatch):
    n = batches._MT_BATCH_MIN
    rngs = [register_rng(random.Random(i), key=f"half{i}") for i in range(n)]
    source = user_rngs.UserRngSource()
    try:
        for rng in rngs:
            rng.gauss(0.0, 1.0)
        before = [rng.getstate() for rng in rngs]
        state = source.capture()
        assert any(isinstance(record[0], batches.Batch) for record in state)
        for rng in rngs:
            rng.random()
            rng.gauss(0.0, 1.0)

        class Interrupted(io.BytesIO):
            def readinto(self, buffer: Any) -> int:
                if self.tell() >= 2 * len(buffer):  # the third RNG
                    raise KeyboardInterrupt("injected")
                return super().readinto(buffer)

        monkeypatch.setattr(batches, "BytesIO", Interrupted)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            source.restore(state)
        assert [rng.getstate() for rng in rngs] == before
    finally:
        for rng in rngs:
            unregister_rng(rng)


@needs_batches
@pytest.mark.parametrize("family", ["mt", pytest.param("record", marks=needs_record_batches)])
def test_a_batch_saves_and_loads_what_each_rng_alone_would(family):
    if family == "mt":
        makes = [random.Random] * batches._MT_BATCH_MIN
    else:  # Generators on each proven record, and RandomStates (two records each)
        makes = [
            np.random.default_rng,
            lambda k: np.random.Generator(np.random.PCG64DXSM(k)),
            lambda k: np.random.Generator(np.random.MT19937(k)),
            np.random.RandomState,
        ] * batches._RECORD_BATCH_MIN
    rngs = [register_rng(make(i), key=f"save{i}") for i, make in enumerate(makes)]
    try:
        for rng in rngs[::2]:
            stir(rng)  # half of them with every cache in use
        before = [public(rng) for rng in rngs]
        snap = Snapshot.capture()
        assert _layout("save") == [(family, False, [f"save{i}" for i in range(len(rngs))])]
        saved = {u["key"]: u for u in snap.state_dict()["sources"]["user"]}
        for i, rng in enumerate(rngs):
            entry = next(e for e in registry.live_entries() if e.get() is rng)
            state = rng.getstate() if isinstance(rng, random.Random) else entry.kind.get(rng)
            assert saved[f"save{i}"]["state"] == persistence.CODECS[entry.kind.name][0](rng, state)
        for loaded in (snap, Snapshot.from_state_dict(snap.state_dict())):
            for rng in rngs:
                stir(rng)
            loaded.restore()
            assert [public(rng) for rng in rngs] == before
    finally:
        for rng in rngs:
            unregister_rng(rng)


# -- differential: the fast paths against the public API, over random workloads ----------


class _SubGenerator(np.random.Generator):
    pass


#: kind -> how to make one from an int.  ``random.Random`` is listed many
#: times: registered in a row, they form batches.
KINDS: dict[str, Callable[[int], Any]] = {
    "random": random.Random,
    "random-subclass": _SubRandom,
    "random-like": _RandomLike,
    "pcg64": np.random.default_rng,
    "mt19937": lambda k: np.random.Generator(np.random.MT19937(k)),
    "philox": lambda k: np.random.Generator(np.random.Philox(k)),
    "pcg64-subclass": lambda k: np.random.Generator(_SubPCG64(k)),
    "generator-subclass": lambda k: _SubGenerator(np.random.PCG64(k)),
    "randomstate": np.random.RandomState,
    "torch": lambda k: torch.Generator().manual_seed(k),
}
_KIND_CHOICES = ["random"] * 6 + sorted(KINDS)
#: The bit generators a Generator's ``__init__`` can install instead of its own.
_NEW_BIT_GENERATORS = [np.random.PCG64, np.random.MT19937, np.random.Philox, np.random.PCG64DXSM]


class _Wrapper:
    """A random-like object around another registered ``random.Random``."""

    def __init__(self, inner: random.Random) -> None:
        self.inner = inner

    def seed(self, s: int) -> None:
        self.inner.seed(s)

    def getstate(self) -> Any:
        return self.inner.getstate()

    def setstate(self, state: Any) -> None:
        self.inner.setstate(state)


def _replace_state(obj: Any, k: int) -> None:
    """Set the state of a fresh object of the same kind, through the public API."""
    if isinstance(obj, random.Random):
        obj.setstate(type(obj)(k).getstate())
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = type(obj.bit_generator)(k).state
    elif isinstance(obj, np.random.RandomState):
        obj.set_state(np.random.RandomState(k).get_state())
    elif isinstance(obj, torch.Generator):
        obj.set_state(torch.Generator().manual_seed(k).get_state())
    else:
        obj.setstate(_RandomLike(k).getstate())


def _replace_bit_generator(obj: Any, which: int, k: int) -> None:
    """``__init__`` again with a new bit generator: the object stays, its state moves."""
    if isinstance(obj, np.random.Generator):
        obj.__init__(_NEW_BIT_GENERATORS[which % len(_NEW_BIT_GENERATORS)](k))  # type: ignore[misc]
    elif isinstance(obj, np.random.RandomState):
        obj.__init__(np.random.MT19937(k))  # type: ignore[misc]


def _dies_when_dropped(obj: Any) -> bool:
    """Whether the registry holds ``obj`` weakly, so that dropping it unregisters it.

    ``random.Random`` always; ``torch.Generator`` only where the running torch lets it be
    weakly referenced (not torch 2.11: there the registry holds it, as NumPy's generators).
    The random-like test classes could be, but are unregistered by hand, as before.
    """
    if not isinstance(obj, random.Random | torch.Generator):
        return False
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _workload(ops: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``ops`` on fresh RNGs; what every op did, as plain data to compare."""
    log: list[Any] = []
    objs: list[list[Any]] = []  # [object, registered]
    snaps: list[Snapshot] = []
    blocks: list[Any] = []
    outer = Snapshot.capture()  # snapshots restored outside their block move global RNGs

    def pick(i: int) -> list[Any] | None:
        return objs[i % len(objs)] if objs else None

    try:
        for n, op in enumerate(ops):
            name, *args = op
            try:
                out: Any = None
                if name == "register":
                    kind, k, shared = args
                    obj = register_rng(KINDS[kind](k), key=f"w{n}", shared=shared)
                    objs.append([obj, True])
                elif name == "register run":  # consecutive: a batch
                    kind, count = args
                    for j in range(count):
                        objs.append([register_rng(KINDS[kind](j), key=f"w{n}.{j}"), True])
                elif name == "register on the same bit generator" and (item := pick(args[0])):
                    # Two objects, one state: the order of their seeding matters.
                    if isinstance(item[0], np.random.Generator):
                        bg = item[0].bit_generator
                        twin = np.random.Generator(bg) if args[1] else np.random.RandomState(bg)
                        if isinstance(twin, np.random.Generator) or isinstance(
                            bg, np.random.MT19937
                        ):
                            objs.append([register_rng(twin, key=f"w{n}"), True])
                elif name == "unregister" and (item := pick(args[0])) and item[1]:
                    item[1] = False
                    unregister_rng(item[0])
                elif name == "drop" and (item := pick(args[0])):
                    # Weakly held ones die here (refcount), leaving the registry on their own;
                    # the registry holds the others until unregister_rng, so they are unregistered
                    # (left behind, the second run's registrations would share their keys).
                    if item[1] and not _dies_when_dropped(item[0]):
                        unregister_rng(item[0])
                    objs.remove(item)
                    del item
                elif name == "draw" and (item := pick(args[0])):
                    out = draws(item[0])
                elif name == "stir" and (item := pick(args[0])):
                    stir(item[0])  # every cache in use: gauss_next, a buffered half-draw, ...
                elif name == "register wrapper" and (item := pick(args[0])):
                    # Seeding it seeds a registered RNG: the order of the two matters.
                    inner = item[0]
                    if isinstance(inner, random.Random):
                        obj = register_rng(_Wrapper(inner), key=f"w{n}", shared=args[1])
                        objs.append([obj, True])
                elif name == "set state" and (item := pick(args[0])):
                    _replace_state(item[0], args[1])
                elif name == "replace bit generator" and (item := pick(args[0])):
                    _replace_bit_generator(item[0], args[1], args[2])
                elif name == "enter":
                    block = deterministic(seed=args[0], rank=args[1])
                    block.__enter__()
                    blocks.append(block)
                elif name == "exit" and blocks:
                    blocks.pop().__exit__(None, None, None)
                elif name == "seed registered":
                    user_rngs.seed_registered_rngs(args[0], shared_seed=args[1])
                elif name == "snapshot":
                    snaps.append(Snapshot.capture())
                elif name == "save and load":  # restored through the public API, checked
                    snaps.append(Snapshot.from_state_dict(Snapshot.capture().state_dict()))
                elif name == "restore snapshot" and snaps:
                    snaps[args[0] % len(snaps)].restore()
                log.append((n, "ok", out))
            except Exception as exc:  # the same failures on both paths
                log.append((n, "raised", type(exc).__name__))
            log.append((n, [public(item[0]) for item in objs]))
    finally:
        while blocks:
            try:
                blocks.pop().__exit__(None, None, None)
            except Exception as exc:
                log.append(("exit", "raised", type(exc).__name__))
        log.append(("end", [public(item[0]) for item in objs]))
        for obj, registered in objs:
            if registered:
                unregister_rng(obj)
        outer.restore()
    return log


def _runs(ops: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]]:
    """The workload on the fast paths (batches from two RNGs on), then on the public API."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches, "_MT_BATCH_MIN", 2)
        mp.setattr(batches, "_RECORD_BATCH_MIN", 2)
        registry._changed()  # steps made with another threshold are stale
        fast = _workload(ops)
        mp.setattr(batches, "_MT_BATCH_MIN", 10**9)
        mp.setattr(batches, "_RECORD_BATCH_MIN", 10**9)
        mp.setattr(entries.Entry, "_choose_path", lambda self, obj: None)
        registry._changed()
        reference = _workload(ops)
    registry._changed()
    return fast, reference


_I = st.integers(0, 15)
_OPS = st.one_of(
    st.tuples(
        st.just("register"), st.sampled_from(_KIND_CHOICES), st.integers(0, 9), st.booleans()
    ),
    st.tuples(
        st.just("register run"),
        st.sampled_from(["random", "pcg64", "mt19937", "randomstate"]),
        st.integers(2, 5),
    ),
    st.tuples(st.just("register on the same bit generator"), _I, st.booleans()),
    st.tuples(st.just("unregister"), _I),
    st.tuples(st.just("drop"), _I),
    st.tuples(st.just("draw"), _I),
    st.tuples(st.just("stir"), _I),
    st.tuples(st.just("register wrapper"), _I, st.booleans()),
    st.tuples(st.just("set state"), _I, st.integers(0, 9)),
    st.tuples(st.just("replace bit generator"), _I, st.integers(0, 3), st.integers(0, 9)),
    st.tuples(st.just("enter"), st.integers(0, 2), st.sampled_from([None, 0, 1])),
    st.tuples(st.just("exit")),
    st.tuples(st.just("seed registered"), st.integers(0, 2), st.sampled_from([None, 5])),
    st.tuples(st.just("snapshot")),
    st.tuples(st.just("save and load")),
    st.tuples(st.just("restore snapshot"), _I),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=1, max_size=30))
# A torch generator registered, dropped, then saved: on a torch whose generators cannot be
# weakly referenced the drop must unregister it, or the reference run finds its key taken.
@example(ops=[("register", "torch", 1, False), ("drop", 0), ("save and load",)])
def test_fast_paths_and_batches_equal_the_public_api_over_random_workloads(ops):
    """The law: whatever happens to registered RNGs (blocks nested or not, per
    rank, shared, registered and unregistered inside blocks, collected,
    states and bit generators replaced, snapshots restored anywhere), the
    fast paths leave every RNG, at every step, exactly where the public API does."""
    fast, reference = _runs(ops)
    assert fast == reference


@pytest.mark.parametrize("where", ["before the blocks", "inside a block"])
@pytest.mark.parametrize(
    ("kind", "which"),
    [("pcg64", 0), ("pcg64", 2), ("mt19937", 0), ("mt19937", 1), ("randomstate", 1)],
    ids=[
        "pcg64-by-pcg64",
        "pcg64-by-philox",
        "mt19937-by-pcg64",
        "mt19937-by-mt19937",
        "randomstate",
    ],
)
def test_a_replaced_bit_generator_takes_the_public_api(kind, which, where):
    """``Generator.__init__`` / ``RandomState.__init__`` called again installs
    another bit generator: the entry's views and memo belong to the old one,
    so the object takes the public API, as an entry without a fast path does
    (writing the old views was a use after free once the old one was collected)."""
    replace = ("replace bit generator", 0, which, 7)
    blocks = [("enter", 3, None), ("draw", 0), ("exit",)] * 2  # a memo miss, then a hit
    if where == "before the blocks":
        ops = [("register", kind, 1, False), replace, *blocks]
    else:
        ops = [
            ("register", kind, 1, False),
            ("enter", 3, None),
            replace,
            ("draw", 0),
            ("exit",),
            *blocks,
        ]
    fast, reference = _runs(ops)
    assert fast == reference
    if where == "before the blocks":  # and they are seeded there, for the new one
        assert all(entry[1] == "ok" for entry in fast if len(entry) == 3)


@needs_record_batches
def test_a_record_batch_with_a_lock_held_elsewhere_waits_entry_by_entry():
    """A batch takes its bit generators' locks without waiting; one held by
    another thread (a draw in progress) makes the entries do the work, each
    waiting for its lock as alone: the record is read after the draw."""
    m = batches._RECORD_BATCH_MIN
    gens = [register_rng(np.random.default_rng(i), key=f"locked{i}") for i in range(m)]
    held, release = threading.Event(), threading.Event()
    target = gens[-1].bit_generator

    def draw_while_holding() -> None:
        with target.lock:
            held.set()
            release.wait(10)
            target.random_raw(3)  # the state moves while the lock is held

    thread = threading.Thread(target=draw_while_holding)
    try:
        assert _layout("locked") == [("record", False, [f"locked{i}" for i in range(m)])]
        before = [public(g) for g in gens]
        thread.start()
        assert held.wait(10)
        threading.Timer(0.05, release.set).start()
        state = user_rngs.UserRngSource().capture()  # waits for the draw
        thread.join(10)
        mine = [r for r in state if getattr(r[0], "key", "").startswith("locked")]
        assert [r[0].key for r in mine] == [f"locked{i}" for i in range(m)]  # entry by entry
        saved = [numpy_state_to_plain(r[0].public(r[2], None)) for r in mine]
        assert saved == [public(g)[1] for g in gens]  # the last one after the draw
        assert saved[-1] != before[-1][1]
    finally:
        release.set()
        thread.join(10)
        for g in gens:
            unregister_rng(g)


def _free_everywhere(locks: list[Any]) -> bool:
    """Whether another thread can take each of ``locks`` now (an RLock this thread
    still holds, even once, would make it wait: every other thread's draws would hang)."""
    free: list[bool] = []

    def probe() -> None:
        for lock in locks:
            taken = lock.acquire(False)
            free.append(taken)
            if taken:
                lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(10)
    return len(free) == len(locks) and all(free)


def _record_batch(prefix: str) -> tuple[list[Any], Any]:
    """Registered NumPy Generators that form one record batch, and that batch."""
    m = batches._RECORD_BATCH_MIN
    gens = [register_rng(np.random.default_rng(i), key=f"{prefix}{i}") for i in range(m)]
    assert _layout(prefix) == [("record", False, [f"{prefix}{i}" for i in range(m)])]
    (batch,) = [s for s in registry.block_steps() if isinstance(s, batches._RecordBatch)]
    return gens, batch


@needs_record_batches
def test_a_record_batch_leaves_no_lock_held():
    gens, _batch = _record_batch("freed")
    locks = [g.bit_generator.lock for g in gens]
    try:
        with deterministic(seed=1):
            with deterministic(seed=2):
                [g.random() for g in gens]
            snapshot = Snapshot.capture()
            [g.random() for g in gens]
            snapshot.restore()
        assert _free_everywhere(locks)
    finally:
        for g in gens:
            unregister_rng(g)


@needs_record_batches
@pytest.mark.parametrize("where", ["work", "acquire"])
def test_an_interrupt_inside_a_record_batch_releases_every_lock(monkeypatch, where):
    # A KeyboardInterrupt from a signal handler while the batch holds its locks (or
    # while it takes them) must not leave any of them held by this thread.
    gens, batch = _record_batch("interrupted")
    locks = [g.bit_generator.lock for g in gens]

    def interrupt() -> Any:
        raise KeyboardInterrupt

    try:
        if where == "acquire":
            calls = iter(range(len(locks)))

            def acquire(lock: Any, blocking: bool) -> bool:
                if next(calls) == len(locks) // 2:  # half of them taken already
                    raise KeyboardInterrupt
                return bool(lock.acquire(blocking))

            monkeypatch.setattr(batches, "_acquire", acquire)
        with pytest.raises(KeyboardInterrupt):
            batch.locked(interrupt)
        monkeypatch.undo()
        assert _free_everywhere(locks)
        # And through a block: the interrupted exit is completed, every state restored.
        before = [public(g) for g in gens]
        real = batches._RecordBatch._write
        fired: list[bool] = []

        def write_once(self: Any, raw: bytes) -> bool:
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return bool(real(self, raw))

        with pytest.raises(KeyboardInterrupt), deterministic(seed=3):
            [g.random() for g in gens]
            monkeypatch.setattr(batches._RecordBatch, "_write", write_once)
        monkeypatch.undo()
        assert fired
        assert [public(g) for g in gens] == before
        assert _free_everywhere(locks)
    finally:
        monkeypatch.undo()
        for g in gens:
            unregister_rng(g)


@needs_record_batches
def test_a_bit_generator_replaced_inside_a_block_in_a_batch():
    # A member of a batch gets another bit generator in the body: the batch hands that
    # restore to its entries, which take the public API onto the new bit generator.
    gens, _batch = _record_batch("replaced")
    other = np.random.default_rng(99)
    try:
        before = [public(g) for g in gens]
        with deterministic(seed=4):
            gens[2].__init__(np.random.PCG64(7))  # type: ignore[misc]
            [g.random() for g in gens]
        after = [public(g) for g in gens]
        assert after == before
        assert _free_everywhere([g.bit_generator.lock for g in gens])
        assert public(other) == public(np.random.default_rng(99))
    finally:
        for g in gens:
            unregister_rng(g)
