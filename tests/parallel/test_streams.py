"""Parallel RNG streams (``deterministic_ctx/streams.py``).

Seeds per dimension, forks as generators of their own, blocks (seeded from the
shared seed, whatever ``rank=``), snapshots and checkpoint files, the
accelerator's generator, bad input, and real gloo process groups with a CPU
``DeviceMesh`` and DTensor.
"""

from __future__ import annotations

import gc
import pickle
import random
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import deterministic_ctx.parallel.streams as streams_module
from deterministic_ctx import (
    InvalidSnapshotError,
    MisuseError,
    RestoreError,
    Snapshot,
    derive_seed,
    deterministic,
    isolated,
    registered_rngs,
    reproducible,
    seed_everything,
)
from deterministic_ctx.internal import inside_block
from deterministic_ctx.parallel.streams import RngStreams
from deterministic_ctx.sources.accelerators import LazyAcceleratorSource
from tests.core.test_interrupts import _lock_free, _Timeout, _Tracer
from tests.helpers import (
    free_port,
    join_loopback_group,
    needs_gloo,
    run_python,
    spawn_ranks,
)

GRID = {"dp": (1, 2), "tp": (0, 2)}


def make(seed: int = 0, ranks: Any = GRID, *, key: str = "streams") -> RngStreams:
    """Streams over ``ranks`` with one stream per subset of {dp, tp}."""
    streams = RngStreams(seed, ranks, key=key)
    names = list(streams.ranks)
    streams.add("tp", varies=[d for d in names if d == "tp"])
    streams.add("dp", varies=[d for d in names if d == "dp"])
    streams.add("both", varies=names)
    streams.add("none")
    return streams


def drawn(streams: RngStreams, name: str, n: int = 4) -> torch.Tensor:
    with streams.fork(name):
        return torch.rand(n)


@pytest.fixture(autouse=True)
def _collected() -> None:
    """Streams of earlier tests are gone: a snapshot saved here holds only this test's
    registered RNGs (each must be registered again where it is loaded)."""
    gc.collect()


# -- seeds ----------------------------------------------------------------------------


def test_a_stream_varies_along_its_dimensions_only():
    seeds = {}
    for dp in range(2):
        for tp in range(2):
            streams = make(7, {"dp": (dp, 2), "tp": (tp, 2)})
            seeds[dp, tp] = {n: streams.seed_of(n) for n in streams.streams}
    for (dp, tp), s in seeds.items():
        assert s["tp"] == seeds[(1 - dp, tp)]["tp"] != seeds[(dp, 1 - tp)]["tp"]
        assert s["dp"] == seeds[(dp, 1 - tp)]["dp"] != seeds[(1 - dp, tp)]["dp"]
        assert s["none"] == seeds[(0, 0)]["none"]
    assert len({s["both"] for s in seeds.values()}) == 4
    # No stream shares a seed with another stream, anywhere on the grid.
    every = [v for s in seeds.values() for k, v in s.items()]
    assert len(set(every)) == 2 + 2 + 4 + 1


def test_the_seed_is_a_derivation_without_offsets():
    streams = make(7)
    base = derive_seed(7, "user", "streams")
    assert streams.seed_of("tp") == derive_seed(base, "stream", "tp", "tp", 0, bits=64)
    assert streams.seed_of("both") == derive_seed(base, "stream", "both", "dp", 1, "tp", 0, bits=64)
    assert streams.seed_of("none") == derive_seed(base, "stream", "none", bits=64)
    # Megatron's seed + 2718 + tp_rank collides: seed 0 on TP rank 1 is seed 1 on TP rank 0.
    a = RngStreams(0, {"tp": (1, 2)}, key="a")
    b = RngStreams(1, {"tp": (0, 2)}, key="a2")
    for s in (a, b):
        s.add("tp", varies=["tp"])
    assert a.seed_of("tp") != b.seed_of("tp")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    here=st.tuples(st.integers(0, 7), st.integers(0, 7), st.integers(0, 7)),
    there=st.tuples(st.integers(0, 7), st.integers(0, 7), st.integers(0, 7)),
    varies=st.lists(st.sampled_from(["dp", "tp", "pp"]), unique=True),
)
def test_seeds_agree_exactly_where_the_varied_coordinates_agree(seed, here, there, varies):
    def seed_of(coords):
        streams = RngStreams(
            seed, {d: (r, 8) for d, r in zip(("dp", "tp", "pp"), coords, strict=True)}
        )
        streams.add("s", varies=varies)
        return streams.seed_of("s")

    same = all(here[i] == there[i] for i, d in enumerate(("dp", "tp", "pp")) if d in varies)
    assert (seed_of(here) == seed_of(there)) == same  # 64-bit seeds: no chance collision


# -- forks ----------------------------------------------------------------------------

NAMES = ("a", "b", "c")
_draw = st.tuples(
    st.just("draw"), st.sampled_from(["rand", "randn", "randint", "bernoulli"]), st.integers(1, 40)
)
programs = st.lists(
    st.recursive(
        _draw,
        lambda inner: st.tuples(
            st.just("fork"), st.sampled_from(NAMES), st.lists(inner, max_size=4)
        ),
        max_leaves=12,
    ),
    max_size=6,
)


def _sample(kind: str, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    if kind == "rand":
        return torch.rand(n, generator=generator)
    if kind == "randn":
        return torch.randn(n, generator=generator)
    if kind == "randint":
        return torch.randint(0, 1000, (n,), generator=generator)
    return torch.bernoulli(torch.full((n,), 0.5), generator=generator)  # dropout's draw


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), program=programs)
def test_each_stream_draws_as_one_generator_of_its_own(seed, program):
    # The law: whatever the nesting, the draws inside forks of a stream are one
    # generator's (seeded with seed_of), and the draws outside every fork are the
    # caller's stream, as if the forks never ran.
    streams = RngStreams(seed, key="law")
    for name in NAMES:
        streams.add(name)
    log: list[tuple[str | None, str, int, torch.Tensor]] = []

    def run(ops: list[Any], label: str | None) -> None:
        for op in ops:
            if op[0] == "draw":
                log.append((label, op[1], op[2], _sample(op[1], op[2])))
            else:
                with streams.fork(op[1]):
                    run(op[2], op[1])

    with isolated():
        caller = torch.Generator()
        caller.set_state(torch.get_rng_state())
        run(program, None)
        after = torch.get_rng_state()
    models: dict[str | None, torch.Generator] = {None: caller}
    for name in NAMES:
        models[name] = torch.Generator().manual_seed(streams.seed_of(name))
    for label, kind, n, got in log:
        assert torch.equal(got, _sample(kind, n, models[label])), label
    assert torch.equal(after, caller.get_state())


def test_an_exception_in_a_fork_keeps_the_advance_and_restores_the_caller():
    streams = make()
    before = torch.get_rng_state()
    with pytest.raises(KeyError, match="inside"), streams.fork("tp"):
        first = torch.rand(3)
        raise KeyError("inside")
    assert torch.equal(torch.get_rng_state(), before)
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    assert torch.equal(first, torch.rand(3, generator=model))
    assert torch.equal(drawn(streams, "tp", 3), torch.rand(3, generator=model))


def test_nested_forks_of_one_stream_continue_it_and_a_fork_object_can_be_reused():
    streams = make()
    fork = streams.fork("tp")
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    with fork:
        a = torch.rand(2)
        with fork, streams.fork("tp"):
            b = torch.rand(2)
        c = torch.rand(2)
    with fork:
        d = torch.rand(2)
    for got in (a, b, c, d):
        assert torch.equal(got, torch.rand(2, generator=model))


def test_forks_must_be_left_in_reverse_order():
    streams = make()
    outer, inner = streams.fork("tp"), streams.fork("dp")
    with isolated():
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(MisuseError, match=r"fork\('tp'\) exited while fork\('dp'\)"):
            outer.__exit__(None, None, None)
        inner.__exit__(None, None, None)
    with pytest.raises(MisuseError, match="exited without being entered"):
        outer.__exit__(None, None, None)
    # The streams are usable afterwards.
    assert drawn(streams, "tp").shape == (4,)


def test_a_fork_inside_a_fork_of_another_stream_and_back():
    streams = make()
    tp = torch.Generator().manual_seed(streams.seed_of("tp"))
    dp = torch.Generator().manual_seed(streams.seed_of("dp"))
    with streams.fork("tp"):
        a = torch.rand(2)
        with streams.fork("dp"):
            b = torch.rand(2)
        c = torch.rand(2)
    assert torch.equal(a, torch.rand(2, generator=tp))
    assert torch.equal(b, torch.rand(2, generator=dp))
    assert torch.equal(c, torch.rand(2, generator=tp))


def test_forks_of_two_rng_streams_nest_as_forks_of_one():
    # torch's generators hold one stream at a time, whichever object it belongs to.
    first, second = make(key="first"), make(key="second")
    x = torch.Generator().manual_seed(first.seed_of("tp"))
    y = torch.Generator().manual_seed(second.seed_of("tp"))
    before = torch.get_rng_state()
    with first.fork("tp"):
        a = torch.rand(2)
        with second.fork("tp"):
            b = torch.rand(2)
            with first.fork("tp"):  # continues first's stream, not second's
                c = torch.rand(2)
            d = torch.rand(2)
        e = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
    for got, model in ((a, x), (b, y), (c, x), (d, y), (e, x)):
        assert torch.equal(got, torch.rand(2, generator=model))
    outer, inner = first.fork("dp"), second.fork("dp")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(MisuseError, match=r"fork\('dp'\) exited while fork\('dp'\)"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_fork_held_open_across_the_yields_of_a_decorated_generator():
    # The generator's fork stays open in its own world while the caller forks in
    # its world; each continues its own streams.
    streams = make()

    @reproducible(seed=3)
    def noise():
        with streams.fork("tp"):
            while True:
                yield torch.rand(2)

    with deterministic(seed=3), streams.fork("tp"):
        expected = [torch.rand(2) for _ in range(3)]
    tp = torch.Generator().manual_seed(streams.seed_of("tp"))
    dp = torch.Generator().manual_seed(streams.seed_of("dp"))
    gen = noise()
    assert torch.equal(next(gen), expected[0])  # its fork opens before the caller's
    with streams.fork("dp"):
        for want in expected[1:]:
            assert torch.equal(next(gen), want)
            with streams.fork("tp"):
                assert torch.equal(torch.rand(1), torch.rand(1, generator=tp))
            assert torch.equal(torch.rand(1), torch.rand(1, generator=dp))
        gen.close()  # and closes inside it
    assert streams._states._open == []


def test_a_fork_inside_a_compiled_function_draws_the_stream(restore_world):
    # Dynamo runs the fork (a block) eagerly: the compiled function draws the
    # stream, and the caller's generator is as it was.  (``restore_world``: dynamo
    # sets torch's flags as it found them through inductor's override, torch's doing.)
    streams = make()
    model = torch.Generator().manual_seed(streams.seed_of("tp"))

    def noisy(x: torch.Tensor) -> torch.Tensor:
        with streams.fork("tp"):
            return x + torch.rand(3)

    compiled = torch.compile(noisy, backend="eager")
    before = torch.get_rng_state()
    for _ in range(2):
        assert torch.equal(compiled(torch.zeros(3)), torch.rand(3, generator=model))
    assert torch.equal(torch.get_rng_state(), before)


def test_activation_checkpointing_recomputes_the_streams_masks():
    # torch.utils.checkpoint saves the generator state inside the fork and
    # recomputes with it: the gradients are those of the plain forward.
    with isolated():
        layer = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
    x = torch.ones(4, 8)

    def grads(use_checkpoint: bool) -> list[torch.Tensor]:
        streams = RngStreams(3, key="ckpt")
        streams.add("dropout")
        layer.zero_grad()
        with streams.fork("dropout"):
            out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
        out.sum().backward()  # outside the fork: the recomputation must not depend on it
        return [p.grad.clone() for p in layer.parameters()]

    plain, recomputed = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


# -- blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [None, 0, 1, 3, "auto"])
def test_blocks_seed_the_streams_from_the_shared_seed(rank):
    streams = make(0)
    with deterministic(seed=9, rank=rank):
        inside = {name: drawn(streams, name) for name in streams.streams}
    fresh = make(9)  # what construction with the block's seed gives (same key)
    for name, got in inside.items():
        assert torch.equal(got, drawn(fresh, name)), name
    assert not torch.equal(inside["tp"], drawn(make(9, key="other"), "tp"))  # the key counts


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rank=st.integers(1, 10_000))
def test_the_per_rank_seed_never_reaches_the_streams(seed, rank):
    streams = make(0)
    with deterministic(seed=seed, rank=rank):
        ranked = drawn(streams, "tp")
        python = random.random()
    with deterministic(seed=seed):
        shared = drawn(streams, "tp")
        assert python != random.random()  # while random and NumPy are per rank
    assert torch.equal(ranked, shared)


def test_a_block_restores_the_streams_and_isolates_them():
    streams = make()
    first = drawn(streams, "tp")
    with deterministic(seed=1):
        drawn(streams, "tp")
        drawn(streams, "dp")
    after = drawn(streams, "tp")
    again = make()
    assert torch.equal(first, drawn(again, "tp"))
    assert torch.equal(after, drawn(again, "tp"))


def test_a_block_inside_a_fork_has_its_own_streams():
    streams = make()
    with deterministic(seed=4):
        expected_inner = drawn(streams, "tp")
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    with streams.fork("tp"):
        a = torch.rand(2)
        with deterministic(seed=4):
            # A new world: the block's tp stream, not the outer fork's.
            assert torch.equal(drawn(streams, "tp"), expected_inner)
        b = torch.rand(2)
        with streams.fork("tp"):  # back in the outer world: nested, continues
            c = torch.rand(2)
    for got in (a, b, c):
        assert torch.equal(got, torch.rand(2, generator=model))


def test_nested_blocks():
    streams = make()
    with deterministic(seed=1):
        outer_first = drawn(streams, "both")
        with deterministic(seed=2):
            inner = drawn(streams, "both")
        outer_next = drawn(streams, "both")
    with deterministic(seed=2):
        assert torch.equal(drawn(streams, "both"), inner)
    with deterministic(seed=1):
        assert torch.equal(drawn(streams, "both"), outer_first)
        assert torch.equal(drawn(streams, "both"), outer_next)


def test_seed_everything_starts_the_streams_as_construction_does(restore_world):
    streams = make(0)
    drawn(streams, "tp")
    seed_everything(12, rank=3)
    fresh = make(12)
    assert torch.equal(drawn(streams, "tp"), drawn(fresh, "tp"))


def test_per_rank_dropout_with_a_shared_model():
    # What each of two data-parallel ranks does: build the model (alike), then
    # train with a dropout stream that varies along dp (different masks).
    def rank_step(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        streams = RngStreams(0, {"dp": (dp, 2)}, key=f"rank{dp}")
        streams.add("dropout", varies=["dp"])
        with deterministic(seed=0, rank=dp):
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
            with streams.fork("dropout"):
                out = model(torch.ones(2, 16))
        return model[0].weight.detach(), out.detach()

    (w0, out0), (w1, out1) = rank_step(0), rank_step(1)
    assert torch.equal(w0, w1)
    assert not torch.equal(out0 == 0, out1 == 0)


# -- snapshots and checkpoints -------------------------------------------------------------


def test_a_snapshot_holds_the_streams():
    streams = make()
    drawn(streams, "tp")
    snap = Snapshot.capture()
    ahead = [drawn(streams, n) for n in ("tp", "dp", "tp")]
    snap.restore()
    assert all(
        torch.equal(a, drawn(streams, n)) for a, n in zip(ahead, ("tp", "dp", "tp"), strict=True)
    )
    # Through a state dict, as a checkpoint holds it.
    state = snap.state_dict()
    Snapshot.from_state_dict(state).restore()
    assert torch.equal(ahead[0], drawn(streams, "tp"))


def test_a_checkpoint_file_restores_the_streams_in_a_fresh_process(tmp_path):
    streams = make(5, key="ckpt-file")
    drawn(streams, "tp")
    drawn(streams, "dp")
    path = tmp_path / "rng.snapshot"
    Snapshot.capture().save(path)
    expected = [drawn(streams, n).tolist() for n in ("tp", "dp", "both")]
    code = f"""
import json, sys, torch
from deterministic_ctx import Snapshot
from deterministic_ctx.parallel.streams import RngStreams
streams = RngStreams(0, {GRID!r}, key="ckpt-file")  # any seed: the file has the state
for name, varies in {streams.streams!r}.items():
    streams.add(name, varies=varies)
Snapshot.load(sys.argv[1]).restore()
out = []
for name in ("tp", "dp", "both"):
    with streams.fork(name):
        out.append(torch.rand(4).tolist())
print(json.dumps(out))
"""
    proc = run_python([str(path)], code=code, timeout=120, check=True)
    assert proc.stdout.strip() == __import__("json").dumps(expected)


def test_a_snapshot_of_another_rank_is_refused_at_restore(tmp_path):
    saved = make(5, {"dp": (0, 2), "tp": (1, 2)}, key="other-rank")
    for name in saved.streams:
        drawn(saved, name)
    path = tmp_path / "rank1.snapshot"
    Snapshot.capture().save(path)
    del saved
    gc.collect()
    # Another data-parallel rank with the same TP rank: its tp and none streams
    # are this rank's too, but dp and both are not.
    here = make(0, {"dp": (1, 2), "tp": (1, 2)}, key="other-rank")
    snap = Snapshot.load(path)
    before = torch.get_rng_state()
    with pytest.raises(RestoreError, match=r"stream 'dp' in the snapshot was drawn from seed"):
        snap.restore()
    assert torch.equal(torch.get_rng_state(), before)  # the rest was restored (to the same)
    with pytest.raises(RestoreError, match=r"here it is seeded \d+ \(dp=1 of 2\)"):
        snap.restore()
    del here, snap  # the snapshot was loaded for those streams: it holds them
    gc.collect()
    # A rank whose coordinates along every stream's dimensions agree loads it.
    same = make(0, {"dp": (0, 2), "tp": (1, 2)}, key="other-rank")
    Snapshot.load(path).restore()
    assert drawn(same, "both").shape == (4,)


def test_a_snapshot_needs_the_streams_declared(tmp_path):
    saved = make(5, key="declared")
    drawn(saved, "tp")
    path = tmp_path / "s.snapshot"
    Snapshot.capture().save(path)
    del saved
    gc.collect()
    with pytest.raises(InvalidSnapshotError, match="register_rng\\(rng, key='declared'\\)"):
        Snapshot.load(path)
    partial = RngStreams(5, GRID, key="declared")
    partial.add("dp", varies=["dp"])
    with pytest.raises(RestoreError, match=r"stream 'tp', which is not declared here"):
        Snapshot.load(path).restore()


def test_streams_leave_the_registry_with_their_object():
    streams = RngStreams(0, key="collected")
    assert any(key == "collected" for key, _ in registered_rngs())
    del streams
    gc.collect()
    assert not any(key == "collected" for key, _ in registered_rngs())


# -- the accelerator's generator ------------------------------------------------------------


def _simulate(monkeypatch: pytest.MonkeyPatch, devices: int = 1) -> Any:
    device = types.SimpleNamespace(
        initialized=True,
        is_initialized=lambda: device.initialized,
        current_device=lambda: 0,
        default_generators=tuple(torch.Generator().manual_seed(11 + i) for i in range(devices)),
        _lazy_seed_tracker=type(torch.cuda._lazy_seed_tracker)(),
        _queued_calls=[],
    )
    # A fork isolates the generators of its sources: torch's CPU one and this device's.
    cpu = next(s for s in streams_module._SOURCES if s.device_type is None)
    monkeypatch.setattr(streams_module, "_SOURCES", (cpu, LazyAcceleratorSource(device, "sim")))
    return device


@pytest.fixture
def simulated_device(monkeypatch):
    """An accelerator module over a real (CPU) generator: where a build without a
    GPU checks that the current device's generator is swapped with the CPU one."""
    return _simulate(monkeypatch)


def test_the_current_device_generator_is_swapped_too(simulated_device):
    gen = simulated_device.default_generators[0]
    streams = make()
    before = gen.get_state()
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    with streams.fork("tp"):
        a = torch.rand(3, generator=gen)
    with streams.fork("tp"):
        b = torch.rand(3, generator=gen)
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(a, torch.rand(3, generator=model))
    assert torch.equal(b, torch.rand(3, generator=model))
    simulated_device.initialized = False  # a device not initialized is left alone
    with streams.fork("tp"):
        assert torch.equal(gen.get_state(), before)


class _Refusing:
    """A device generator that refuses its next ``refuse`` states with ``error``."""

    def __init__(self, gen: torch.Generator, error: type[BaseException] = RuntimeError) -> None:
        self.gen = gen
        self.refuse = 0
        self.error = error

    def get_state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        if self.refuse:
            self.refuse -= 1
            raise self.error("refused")
        self.gen.set_state(state)

    def manual_seed(self, seed: int) -> torch.Generator:
        return self.gen.manual_seed(seed)


def test_a_fork_that_fails_to_enter_changes_nothing(simulated_device):
    # The engine's restore: the stream's state refused twice by the device (the
    # restore and its retry) is a RestoreError, and the entry rolls back.
    streams = make()
    with streams.fork("tp"):
        pass
    gen = simulated_device.default_generators[0]
    refusing = _Refusing(gen)
    simulated_device.default_generators = (refusing,)
    refusing.refuse = 2
    before, device_before = torch.get_rng_state(), gen.get_state()
    with pytest.raises(RestoreError, match=r"torch\.sim"), streams.fork("tp"):
        pytest.fail("entered")
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(gen.get_state(), device_before)
    assert streams._states._open == []


def test_a_state_no_fork_could_restore_is_refused_where_it_is_set(simulated_device):
    streams = make()
    with streams.fork("tp"):
        pass
    base, token, states = streams._states.getstate()
    seed, devices = states["tp"]
    bad = {**states, "tp": (seed, {**devices, "sim:0": torch.zeros(7, dtype=torch.uint8)})}
    with pytest.raises(ValueError, match=r"stream 'tp', device sim\.states\[0\]: expected 5056"):
        streams._states.setstate((base, token, bad))
    assert streams._states.getstate()[2] is states  # nothing changed


# -- a fork is a block of the engine ------------------------------------------------------


def test_a_fork_waits_for_a_block_in_another_thread():
    # The engine's lock: torch's generators are never swapped under another
    # thread's block.
    streams = make()
    inside, release, forked = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with isolated():
            inside.set()
            release.wait(10)

    def fork() -> None:
        with streams.fork("tp"):
            forked.set()

    holder, other = threading.Thread(target=hold), threading.Thread(target=fork)
    holder.start()
    assert inside.wait(10)
    other.start()
    try:
        assert not forked.wait(0.5)
    finally:
        release.set()
        holder.join(10)
        other.join(10)
    assert forked.is_set()


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, _Timeout])
def test_an_exception_at_any_line_of_a_fork_leaves_the_callers_state_and_no_lock(exc_type, nested):
    # What test_interrupts checks for blocks, for forks: an exception raised by a
    # signal handler at any line of the library, entry or exit; nested: a fork of
    # another stream, and in it forks of the first (one swaps, one continues it).
    streams = make()
    forks = [streams.fork(name) for name in ("tp", "dp", "tp", "tp")[: 4 if nested else 1]]

    def operation() -> None:
        with forks[0]:
            torch.rand(1)
            if nested:
                with forks[1], forks[2], forks[3]:
                    torch.rand(1)

    def clean() -> bool:
        return (
            torch.equal(torch.get_rng_state(), before)
            and streams._states._open == []
            and all(fork._frames == [] for fork in forks)
            and not inside_block()
            and _lock_free()
        )

    before = torch.get_rng_state()
    _Tracer().run(operation)
    dry = _Tracer()
    dry.run(operation)
    assert clean() and dry.count > 20
    problems = []
    boundary = 0
    for k in range(1, dry.count + 1):
        tracer = _Tracer(k, exc_type)
        raised = tracer.run(operation)
        assert tracer.fired is not None and isinstance(raised, (exc_type, MisuseError)), k
        name, _line, first = tracer.fired
        if not clean() and name == "__exit__" and first:
            # Before the first line of ``__exit__``: the fork is still open (the
            # enclosing ones, left before it, raised MisuseError), and leaving it
            # again restores everything, as for a block.
            boundary += 1
            for fork in reversed(forks):
                while fork._frames:
                    fork.__exit__(None, None, None)
        if not clean():
            problems.append(tracer.fired)
    assert problems == []
    assert boundary <= len(forks)  # only the first line of each fork's exit


def test_a_fork_entry_whose_undo_is_interrupted_too_is_still_left(monkeypatch):
    # Two signals: a pending one, run at the end of the entry, stops it; a
    # second stops the undo of it at its first line.  The undo is completed
    # (run again, as every undo of the library) and nothing stays entered,
    # applied or locked.
    streams = make()
    fork = streams.fork("tp")
    with fork:  # the stream's first fork seeds it: the one below restores it
        pass
    before = torch.get_rng_state()

    def pending_signal() -> None:
        raise KeyboardInterrupt("at the end of the entry")

    fired: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not fired and frame.f_code.co_name in ("_leave_from", "_drop"):
            fired.append(frame.f_code.co_name)
            raise KeyboardInterrupt("in the undo")
        return tracer

    monkeypatch.setattr(streams_module, "drain_signals", pending_signal)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            fork.__enter__()
    finally:
        sys.settrace(None)
    monkeypatch.undo()
    assert fired
    assert fork._frames == [] and streams._states._open == []
    assert not inside_block() and _lock_free()
    assert torch.equal(torch.get_rng_state(), before)


def test_forks_of_one_stream_in_two_threads_take_turns_and_continue_it():
    streams = make()
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    inside, release = threading.Event(), threading.Event()
    got: dict[str, torch.Tensor] = {}

    def first() -> None:
        with streams.fork("tp"):
            got["first"] = torch.rand(2)
            inside.set()
            release.wait(10)

    def second() -> None:
        with streams.fork("tp"):
            got["second"] = torch.rand(2)

    one, two = threading.Thread(target=first), threading.Thread(target=second)
    one.start()
    assert inside.wait(10)
    two.start()
    try:
        two.join(0.5)
        assert two.is_alive()  # its fork waits for the first thread's
    finally:
        release.set()
        one.join(10)
        two.join(10)
    assert torch.equal(got["first"], torch.rand(2, generator=model))
    assert torch.equal(got["second"], torch.rand(2, generator=model))  # from where it stopped


def test_an_interrupted_fork_exit_still_restores_every_generator(simulated_device):
    streams = make()
    gen = simulated_device.default_generators[0]
    refusing = _Refusing(gen, KeyboardInterrupt)
    simulated_device.default_generators = (refusing,)
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    before, device_before = torch.get_rng_state(), gen.get_state()
    with pytest.raises(KeyboardInterrupt), streams.fork("tp"):
        first = torch.rand(2)
        refusing.refuse = 1  # the caller's state, put back at the exit: interrupted once
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(gen.get_state(), device_before)
    assert streams._states._open == [] and not inside_block()
    assert torch.equal(first, torch.rand(2, generator=model))
    assert torch.equal(drawn(streams, "tp", 2), torch.rand(2, generator=model))  # kept its advance


def test_a_device_that_refuses_the_callers_state_is_a_restore_error_and_the_fork_is_left(
    simulated_device,
):
    streams = make()
    gen = simulated_device.default_generators[0]
    refusing = _Refusing(gen)
    simulated_device.default_generators = (refusing,)
    before = torch.get_rng_state()
    with pytest.raises(RestoreError, match=r"torch\.sim"), streams.fork("tp"):
        refusing.refuse = 2
    assert torch.equal(torch.get_rng_state(), before)  # every other generator is back
    assert streams._states._open == [] and not inside_block()


def test_forks_left_out_of_order_still_restore_the_state_before_them():
    streams = make()
    before = torch.get_rng_state()
    outer, inner = streams.fork("tp"), streams.fork("dp")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(MisuseError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert torch.equal(torch.get_rng_state(), before)
    assert streams._states._open == [] and not inside_block()


def test_every_device_of_the_accelerator_type_is_isolated(monkeypatch):
    device = _simulate(monkeypatch, devices=2)
    streams = make()
    before = [g.get_state() for g in device.default_generators]
    with streams.fork("tp"):
        got = [torch.rand(3, generator=g) for g in device.default_generators]
    expected = torch.rand(3, generator=torch.Generator().manual_seed(streams.seed_of("tp")))
    assert all(torch.equal(g, expected) for g in got)  # each device starts from the stream's seed
    assert all(
        torch.equal(g.get_state(), b)
        for g, b in zip(device.default_generators, before, strict=True)
    )


def test_a_stream_holding_a_generator_forks_no_longer_isolate_leaves_it_alone(monkeypatch):
    device = _simulate(monkeypatch)
    streams = make()
    gen = device.default_generators[0]
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    with streams.fork("tp"):
        first = torch.rand(2)
        torch.rand(3, generator=gen)  # the stream's state now holds the device's too
    monkeypatch.undo()  # forks isolate torch's CPU generator alone again
    before = gen.get_state()
    with streams.fork("tp"):
        second = torch.rand(2)
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(first, torch.rand(2, generator=model))
    assert torch.equal(second, torch.rand(2, generator=model))


def test_a_saved_stream_without_a_device_seeds_it_at_its_next_fork():
    streams = make()
    drawn(streams, "tp")
    base, token, states = streams._states.getstate()
    seed, _devices = states["tp"]
    streams._states.setstate((base, token, {**states, "tp": (seed, {})}))
    model = torch.Generator().manual_seed(streams.seed_of("tp"))
    assert torch.equal(drawn(streams, "tp"), torch.rand(4, generator=model))
    with pytest.raises(ValueError, match="got the key 'gpu'"):
        streams._states.setstate((base, token, {"tp": (seed, {"gpu": torch.zeros(1)})}))


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: RngStreams("1"), TypeError, "seed must be an int"),
        (lambda: RngStreams(-1), ValueError, "seed must be in"),
        (lambda: RngStreams(0, [("tp", (0, 2))]), TypeError, "ranks must be a mapping"),
        (lambda: RngStreams(0, {"tp": 1}), TypeError, r"ranks\['tp'\] must be a pair"),
        (lambda: RngStreams(0, {"tp": (2, 2)}), ValueError, "0 <= rank < size"),
        (
            lambda: RngStreams(0, {"tp": (True, 2)}),
            TypeError,
            r"ranks\[.tp.\] must be ints, got bool True",
        ),
        (lambda: RngStreams(0, {"": (0, 2)}), TypeError, "non-empty str"),
        (lambda: RngStreams(0, key=""), TypeError, "key must be a non-empty str"),
        (lambda: make().add(3), TypeError, "name must be a str"),
        (lambda: make().add(""), ValueError, "non-empty"),
        (lambda: make().add("x", varies="tp"), TypeError, "varies must be a list"),
        (lambda: make().add("x", varies=["ep"]), ValueError, "'ep' is not a dimension"),
        (lambda: make().add("x", varies=["tp", "tp"]), ValueError, "twice"),
        (lambda: make().add("tp", varies=["dp"]), ValueError, "declared already"),
        (lambda: make().fork("ep"), ValueError, "no stream named 'ep'; declared: 'tp'"),
        (lambda: make().seed_of("ep"), ValueError, "no stream named 'ep'"),
    ],
)
def test_bad_arguments_are_refused_where_they_are_written(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_declaring_a_stream_again_alike_is_a_no_op_and_the_object_shows_itself():
    streams = RngStreams(np.int64(3), {"dp": (np.int32(1), 2)}, key="shown")
    streams.add("dp", varies=("dp",))
    streams.add("dp", varies=["dp"])
    assert streams.seed == 3 and streams.key == "shown"
    assert streams.ranks == {"dp": (1, 2)}
    assert streams.streams == {"dp": ("dp",)}
    assert repr(streams) == (
        "RngStreams(seed=3, ranks={'dp': (1, 2)}, streams={'dp': ('dp',)}, key='shown')"
    )


# -- real process groups: a CPU DeviceMesh and DTensor ----------------------------------------

LAUNCH_TIMEOUT = 180.0


def _mesh_scenario(rank: int, world: int) -> dict[str, Any]:
    """One rank of a 2 x 2 (dp, tp) CPU mesh: streams, then DTensor random ops in forks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    try:
        RngStreams(0, init_device_mesh("cpu", (world,)), key="unnamed")
    except ValueError as exc:
        out["unnamed"] = str(exc)
    streams = make(5, mesh)
    out["ranks"] = streams.ranks
    tp_mesh = mesh["tp"]
    with deterministic(seed=5, rank="auto"), warnings.catch_warnings():
        # torch warns at every random op on a CPU mesh (it has no RNG tracker there).
        warnings.filterwarnings("ignore", "DTensor random operators")
        out["init"] = torch.rand(4)
        out["python"] = random.random()
        for name in ("tp", "dp", "both", "none"):
            out[name] = drawn(streams, name)
        sharded = distribute_tensor(torch.zeros(4, 4), tp_mesh, [Shard(0)])
        replicated = distribute_tensor(torch.zeros(4), tp_mesh, [Replicate()])
        with streams.fork("dp"):
            out["sharded in dp"] = sharded.uniform_().to_local().clone()
            out["replicated in dp"] = replicated.uniform_().to_local().clone()
        with streams.fork("tp"):
            out["replicated in tp"] = replicated.uniform_().to_local().clone()
    return out


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    join_loopback_group(rank, world, port)
    try:
        result = _mesh_scenario(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def _launch(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Run :func:`_mesh_scenario` on ``world`` spawned ranks, killed after ``LAUNCH_TIMEOUT``."""
    args = (world, free_port(), str(tmp_path))
    return spawn_ranks(
        _rank_main, args, world, tmp_path, timeout=LAUNCH_TIMEOUT, what="the mesh scenario"
    )


@needs_gloo
@pytest.mark.slow
def test_streams_on_a_cpu_device_mesh_with_dtensor(tmp_path):
    ranks = _launch(4, tmp_path)
    coords = [(r // 2, r % 2) for r in range(4)]  # init_device_mesh lays ranks out row-major
    for rank, ((dp, tp), got) in enumerate(zip(coords, ranks, strict=True)):
        assert got["ranks"] == {"dp": (dp, 2), "tp": (tp, 2)}
        assert "no dimension names" in got["unnamed"]
        # Each rank drew what a local RngStreams with its coordinates draws in the block.
        local = make(0, {"dp": (dp, 2), "tp": (tp, 2)})  # the ranks' key
        with deterministic(seed=5, rank=rank):
            assert torch.equal(torch.rand(4), got["init"])
            for name in ("tp", "dp", "both", "none"):
                assert torch.equal(drawn(local, name), got[name]), (rank, name)
            with local.fork("dp"):  # DTensor's local shard: the stream's next draws
                assert torch.equal(torch.rand(2, 4), got["sharded in dp"])
        del local
        gc.collect()

    def same(key: str, a: int, b: int) -> bool:
        return torch.equal(ranks[a][key], ranks[b][key])

    # Ranks 0, 1 are dp 0 (tp 0, 1); ranks 2, 3 are dp 1.
    assert same("init", 0, 3) and ranks[0]["python"] != ranks[1]["python"]
    assert same("tp", 0, 2) and same("tp", 1, 3) and not same("tp", 0, 1)
    assert same("dp", 0, 1) and same("dp", 2, 3) and not same("dp", 0, 2)
    assert len({tuple(r["both"].tolist()) for r in ranks}) == 4
    assert all(same("none", 0, r) for r in range(4))
    # On a CPU mesh torch has no RNG tracker: each rank draws its local shard from
    # its generator, so a stream alike along tp gives both tp shards equal values
    # and keeps replicas equal, and a stream that varies along tp breaks replicas.
    assert same("sharded in dp", 0, 1) and not same("sharded in dp", 0, 2)
    assert same("replicated in dp", 0, 1)
    assert not same("replicated in tp", 0, 1)


# -- a real CUDA device ---------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_a_fork_swaps_the_current_cuda_generator():
    torch.cuda.init()
    streams = make(key="cuda")
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.get_state()
    model = torch.Generator(device="cuda").manual_seed(streams.seed_of("tp"))
    with streams.fork("tp"):
        a = torch.rand(1000, device="cuda")
    with streams.fork("tp"):
        b = torch.rand(1000, device="cuda")
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(a, torch.rand(1000, device="cuda", generator=model))
    assert torch.equal(b, torch.rand(1000, device="cuda", generator=model))
    with deterministic(seed=2):
        inside = drawn(streams, "tp").cuda()
        with streams.fork("tp"):
            on_cuda = torch.rand(4, device="cuda")
    with deterministic(seed=2):
        assert torch.equal(drawn(streams, "tp").cuda(), inside)
        with streams.fork("tp"):
            assert torch.equal(torch.rand(4, device="cuda"), on_cuda)


@pytest.mark.gpu
@needs_cuda
def test_a_fork_never_initializes_cuda():
    code = """
import torch
from deterministic_ctx.parallel.streams import RngStreams
streams = RngStreams(0)
streams.add("s")
with streams.fork("s"):
    torch.rand(2)
print(torch.cuda.is_initialized())
"""
    assert run_python([], code=code, timeout=120, check=True).stdout.strip() == "False"


@pytest.mark.gpu
@needs_cuda
def test_dtensor_on_cuda_draws_from_the_forked_stream():
    # One rank, a CUDA mesh: DTensor's tracker reads and advances the current
    # device's generator, which the fork has swapped for the stream.
    code = f"""
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import torch.distributed.tensor._random as dtensor_random
from deterministic_ctx.parallel.streams import RngStreams
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
try:
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(1)
    dtensor_random.manual_seed(1, mesh)  # the tracker, made outside any fork
    streams = RngStreams(0, mesh)
    streams.add("s")
    gen = torch.cuda.default_generators[0]
    before = gen.get_state()
    dt = distribute_tensor(torch.zeros(8, 8, device="cuda"), mesh, [Shard(0)])
    with streams.fork("s"):
        dt.uniform_()
    model = torch.Generator(device="cuda").manual_seed(streams.seed_of("s"))
    same = torch.equal(dt.to_local(), torch.rand(8, 8, device="cuda", generator=model))
    with streams.fork("s"):
        offset = gen.get_offset()
    print(same, offset, torch.equal(gen.get_state(), before))
finally:
    dist.destroy_process_group()
"""
    out = run_python([], code=code, timeout=180, check=True).stdout.split()
    assert out == ["True", "64", "True"]  # DTensor advanced the stream by the tensor's size
