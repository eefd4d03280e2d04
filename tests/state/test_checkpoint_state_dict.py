"""Checkpoints: ``state_dict`` / ``from_state_dict``, ``save`` / ``load`` and user RNGs.

The promises tested here:

* a state dict holds only plain data, loads with ``torch.load(weights_only=True)``
  and shares no memory with the snapshot;
* capture → save → load → restore is the identity (a Hypothesis property);
* a saved user RNG is found again by its key, and must match the registered one.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deterministic_ctx import (
    InvalidSnapshotError,
    Snapshot,
    UnregisteredRngError,
    register_rng,
    unregister_rng,
)
from tests.state.checkpoint_helpers import (
    fresh_state,
    isolated,
    registered,
    same,
    user_state,
    world_view,
)

# -- the state dict ------------------------------------------------------------


def _leaves(value: Any, path: str = "state") -> Iterator[tuple[str, Any]]:
    if type(value) is dict:
        for k, v in value.items():
            assert type(k) is str, f"{path}: key {k!r}"
            yield from _leaves(v, f"{path}.{k}")
    elif type(value) is list:
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def test_state_dict_holds_only_plain_data():
    user = {
        "r": random.Random(1),
        "g": np.random.Generator(np.random.Philox(2)),
        "rs": np.random.RandomState(3),
        "t": torch.Generator().manual_seed(4),
    }
    with registered(**user):
        state = Snapshot.capture().state_dict()
    assert state["format"] == "deterministic_ctx.snapshot"
    assert state["version"] == 1
    for path, leaf in _leaves(state):
        if isinstance(leaf, torch.Tensor):
            assert type(leaf) is torch.Tensor, path
            assert (leaf.dtype, leaf.dim(), leaf.device.type) == (torch.uint8, 1, "cpu"), path
        else:
            assert type(leaf) in (str, int, float, bool), f"{path}: {type(leaf).__name__}"


def test_state_dict_loads_with_weights_only_inside_a_checkpoint():
    snap = Snapshot.capture()
    with isolated():
        model = torch.nn.Linear(2, 2)  # its initialization draws
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "rng": snap.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert same(Snapshot.from_state_dict(loaded["rng"]).state_dict(), snap.state_dict())


def test_state_dict_and_loaded_snapshot_share_no_memory_with_their_inputs():
    with isolated():
        snap = Snapshot.capture()
        expected = torch.rand(4)
        state = snap.state_dict()
        loaded = Snapshot.from_state_dict(state)
        state["sources"]["torch.cpu"]["state"].zero_()  # mutating the dict changes neither
        snap.restore()
        assert torch.equal(torch.rand(4), expected)
        loaded.restore()
        assert torch.equal(torch.rand(4), expected)


def test_loaded_snapshot_restores_every_source_of_this_machine():
    loaded = Snapshot.from_state_dict(fresh_state())
    assert loaded.sources == Snapshot.capture().sources


# -- round trip ----------------------------------------------------------------

_OPS: dict[str, Any] = {
    "random.random": lambda u, k: [random.random() for _ in range(k)],
    "random.gauss": lambda u, k: random.gauss(0, 1),  # sets the gaussian cache
    "random.seed": lambda u, k: random.seed(k),
    "np.rand": lambda u, k: np.random.rand(k),
    "np.randn": lambda u, k: np.random.randn(),  # sets the legacy gaussian cache
    "np.seed": lambda u, k: np.random.seed(k),
    "np.MT19937": lambda u, k: np.random.set_bit_generator(np.random.MT19937(k)),
    "np.PCG64": lambda u, k: np.random.set_bit_generator(np.random.PCG64(k)),
    "np.Philox": lambda u, k: np.random.set_bit_generator(np.random.Philox(k)),
    "np.SFC64": lambda u, k: np.random.set_bit_generator(np.random.SFC64(k)),
    "np.randint32": lambda u, k: np.random.randint(0, 2**31, size=k, dtype=np.uint32),
    "torch.rand": lambda u, k: torch.rand(k),
    "torch.randn": lambda u, k: torch.randn(k),  # torch's normal cache
    "torch.cpu_seed": lambda u, k: torch.default_generator.manual_seed(k),
    "flag.benchmark": lambda u, k: setattr(torch.backends.cudnn, "benchmark", bool(k % 2)),
    "flag.precision": lambda u, k: torch.set_float32_matmul_precision(
        ("highest", "high", "medium")[k % 3]
    ),
    "env.hashseed": lambda u, k: os.environ.__setitem__("PYTHONHASHSEED", str(k)),
    "env.unset": lambda u, k: os.environ.pop("PYTHONHASHSEED", None),
    "user.random": lambda u, k: u["r"].gauss(0, 1),
    "user.generator": lambda u, k: u["g"].random(k),
    "user.randomstate": lambda u, k: u["rs"].randn(),
    "user.torch": lambda u, k: torch.randn(k, generator=u["t"]),
}
_ops = st.lists(st.tuples(st.sampled_from(sorted(_OPS)), st.integers(1, 5)), max_size=10)


def _run(ops: list[tuple[str, int]], user: dict[str, Any]) -> None:
    for name, k in ops:
        _OPS[name](user, k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_ops, after=_ops, via=st.sampled_from(["file", "torch.load"]))
def test_round_trip_is_the_identity(before, after, via):
    user = {
        "r": random.Random(1),
        "g": np.random.Generator(np.random.PCG64(2)),
        "rs": np.random.RandomState(np.random.MT19937(3)),
        "t": torch.Generator().manual_seed(4),
    }
    with isolated(), registered(**user), tempfile.TemporaryDirectory() as tmp:
        _run(before, user)
        world = world_view()
        users = {k: user_state(v) for k, v in user.items()}
        snap = Snapshot.capture()
        if via == "file":
            snap.save(Path(tmp) / "rng.snap")
        else:
            buf = io.BytesIO()
            torch.save({"rng": snap.state_dict()}, buf)

        _run(after, user)

        if via == "file":
            loaded = Snapshot.load(Path(tmp) / "rng.snap")
        else:
            buf.seek(0)
            loaded = Snapshot.from_state_dict(torch.load(buf, weights_only=True)["rng"])
        loaded.restore()
        assert world.diff(world_view()) == []
        assert {k: user_state(v) for k, v in user.items()} == users
        assert same(loaded.state_dict(), snap.state_dict())


def test_loaded_snapshot_restores_repeatedly():
    with isolated(), tempfile.TemporaryDirectory() as tmp:
        Snapshot.capture().save(Path(tmp) / "s")
        expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
        loaded = Snapshot.load(Path(tmp) / "s")
        for _ in range(3):
            loaded.restore()
            assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_a_loaded_numpy_state_keeps_the_installed_bit_generator_object():
    with isolated():
        installed = np.random.PCG64(7)
        np.random.set_bit_generator(installed)
        state = fresh_state()
        np.random.rand(3)
        Snapshot.from_state_dict(state).restore()
        assert np.random.get_bit_generator() is installed  # same type: kept, state set
        np.random.set_bit_generator(np.random.MT19937(1))
        Snapshot.from_state_dict(state).restore()
        assert type(np.random.get_bit_generator()) is np.random.PCG64  # other type: replaced


# -- user RNGs -----------------------------------------------------------------


def test_a_saved_user_rng_must_be_registered_before_loading(tmp_path):
    with registered(aug=random.Random(1)):
        state = fresh_state()
        Snapshot.capture().save(tmp_path / "rng.snap")
    # The snapshot is valid: the error says what the process lacks, not "invalid".
    with pytest.raises(UnregisteredRngError) as info:
        Snapshot.from_state_dict(state)
    assert str(info.value) == (
        "cannot restore snapshot state_dict here: it holds user RNG 'aug' (random.Random), and "
        "no RNG is registered with that key in this process: call register_rng(rng, key='aug') "
        "before loading it"
    )
    assert (info.value.key, info.value.kind) == ("aug", "random.Random")
    with pytest.raises(UnregisteredRngError) as info:
        Snapshot.load(tmp_path / "rng.snap")
    assert str(info.value).startswith(
        f"cannot restore snapshot file {str(tmp_path / 'rng.snap')!r}"
    )
    assert "invalid" not in str(info.value)
    # Still an InvalidSnapshotError: code that handles every failed load keeps working.
    assert isinstance(info.value, InvalidSnapshotError)
    back = pickle.loads(pickle.dumps(info.value))
    assert (type(back), str(back), back.key) == (UnregisteredRngError, str(info.value), "aug")
    # Registered as the message says, the same file loads.
    with registered(aug=random.Random(5)):
        Snapshot.load(tmp_path / "rng.snap")
    with (
        registered(aug=np.random.default_rng(1)),
        pytest.raises(
            InvalidSnapshotError, match=r"saved a random\.Random, .* is a numpy\.random\.Generator"
        ),
    ):
        Snapshot.from_state_dict(state)


def test_a_user_rng_is_found_by_key_in_a_fresh_object():
    with isolated():
        with registered(aug=random.Random(1)) as rngs:
            rngs["aug"].random()
            state = fresh_state()
            expected = rngs["aug"].random()
        with registered(aug=random.Random(99)) as fresh:
            Snapshot.from_state_dict(state).restore()
            assert fresh["aug"].random() == expected


def test_bit_generator_and_device_of_a_user_rng_must_match():
    with registered(g=np.random.Generator(np.random.PCG64(1))):
        state = fresh_state()
    with (
        registered(g=np.random.Generator(np.random.SFC64(1))),
        pytest.raises(InvalidSnapshotError, match="saved PCG64, but the registered RNG uses SFC64"),
    ):
        Snapshot.from_state_dict(state)
    with registered(t=torch.Generator()):
        state = fresh_state()
    assert state["sources"]["user"][0]["state"]["device"] == "cpu"
    state["sources"]["user"][0]["state"]["device"] = "cuda:0"
    with registered(t=torch.Generator()), pytest.raises(InvalidSnapshotError, match="device"):
        Snapshot.from_state_dict(state)


def test_two_rngs_with_one_key_cannot_be_saved():
    with registered(a=random.Random(1)):
        other = register_rng(random.Random(2), key="a")
        try:
            with pytest.raises(ValueError, match="share the key 'a'"):
                Snapshot.capture().state_dict()
        finally:
            unregister_rng(other)


def test_an_rng_registered_after_the_snapshot_is_left_alone():
    state = fresh_state()
    with registered(late=random.Random(3)) as rngs:
        before = rngs["late"].getstate()
        Snapshot.from_state_dict(state).restore()
        assert rngs["late"].getstate() == before


def test_a_received_snapshot_names_where_it_came_from():
    # sync_rng_state and RngState name where a snapshot came from (a rank, a DCP entry).
    from deterministic_ctx.state.checkpoint import encode
    from deterministic_ctx.state.sync import received

    with registered(aug=random.Random(1)):
        data = encode(fresh_state())
    with pytest.raises(UnregisteredRngError) as info:
        received(data, "from rank 0")
    assert str(info.value).startswith(
        "cannot restore snapshot from rank 0 here: it holds user RNG 'aug'"
    )
    assert info.value.key == "aug"
    with pytest.raises(InvalidSnapshotError) as bad:
        received(data[:-1], "from rank 0")
    assert type(bad.value) is InvalidSnapshotError
    assert str(bad.value).startswith("invalid snapshot from rank 0: truncated")
