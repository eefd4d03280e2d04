"""register_rng for any random-like object: seed(), getstate(), setstate().

The protocol of Hypothesis's ``register_random``: seeded with a 32-bit
``derive_seed(seed, "user", key)``, captured with ``getstate()``, restored
with ``setstate()``, held by weak reference when it can be.  A snapshot
saves its state when ``getstate()`` returns plain data, and otherwise
refuses to save, naming the RNG.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx import (
    InvalidSnapshotError,
    Snapshot,
    derive_seed,
    deterministic,
    register_rng,
    registered_rngs,
    unregister_rng,
)
from deterministic_ctx.sources.rngs import persistence
from tests.helpers import RandomLike

Like = RandomLike  # a random-like object: not a random.Random, only the three methods


class Counter:
    """A random-like object with a dict state (ints, a str, a list, a float)."""

    def __init__(self) -> None:
        self.n, self.label, self.log, self.scale = 0, "x", [1, 2], 0.5

    def seed(self, s: int) -> None:
        self.n, self.label, self.log, self.scale = s, f"seeded {s}", [], 1.0

    def getstate(self) -> dict[str, Any]:
        return {"n": self.n, "label": self.label, "log": list(self.log), "scale": self.scale}

    def setstate(self, state: dict[str, Any]) -> None:
        self.n, self.label = state["n"], state["label"]
        self.log, self.scale = list(state["log"]), state["scale"]

    def draw(self) -> int:
        self.n = (self.n * 6364136223846793005 + 1442695040888963407) % 2**64
        self.log.append(self.n % 7)
        return self.n


class Slotted:
    """Random-like, and cannot be weakly referenced (``__slots__`` without ``__weakref__``)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = 1

    def seed(self, s: int) -> None:
        self.state = s

    def getstate(self) -> int:
        return self.state

    def setstate(self, state: int) -> None:
        self.state = state


class Token:
    pass


class Opaque(Like):
    """Random-like whose state is not plain data."""

    def getstate(self) -> Any:
        return {"mt": self._r.getstate(), "token": Token()}

    def setstate(self, state: Any) -> None:
        self._r.setstate(state["mt"])


def test_a_random_like_object_is_seeded_with_32_bits_and_restored():
    like = register_rng(Like(5), key="like")
    try:
        before = like.getstate()
        with deterministic(seed=3):
            inside = like.random()
        assert like.seeds == [derive_seed(3, "user", "like", bits=32)]
        assert like.seeds[0] < 2**32
        assert inside == random.Random(like.seeds[0]).random()
        assert like.getstate() == before
        with deterministic(seed=3):  # its own seed() is called every block
            assert like.random() == inside
        assert like.seeds == [like.seeds[0]] * 2
    finally:
        unregister_rng(like)


def test_random_like_objects_are_weakly_held_when_they_can_be():
    like = register_rng(Like(), key="weak-like")
    del like
    gc.collect()
    assert "weak-like" not in dict(registered_rngs())
    slotted = register_rng(Slotted(), key="slotted")
    held = [o for k, o in registered_rngs() if k == "slotted"]
    assert held == [slotted]
    del slotted, held
    gc.collect()
    (obj,) = [o for k, o in registered_rngs() if k == "slotted"]  # held until unregistered
    with deterministic(seed=0):
        assert obj.state == derive_seed(0, "user", "slotted", bits=32)
    assert obj.state == 1
    unregister_rng(obj)


def test_what_is_not_random_like_is_rejected_naming_the_protocol():
    class SeedOnly:
        def seed(self, s: int) -> None:
            pass

        def getstate(self) -> None:
            return None

        setstate = None  # not callable

    for bad in (SeedOnly(), object(), 3):
        with pytest.raises(
            TypeError,
            match=r"cannot manage .*; accepted: random\.Random, numpy\.random\.Generator, "
            r"numpy\.random\.RandomState, torch\.Generator, or an object with seed\(\), "
            r"getstate\(\) and setstate\(\) methods",
        ):
            register_rng(bad)


def test_a_plain_state_is_saved_and_loaded(tmp_path: Path):
    counter = register_rng(Counter(), key="counter")
    like = register_rng(Like(2), key="like-saved")
    try:
        counter.draw()
        snap = Snapshot.capture()
        state = snap.state_dict()
        (entry,) = [u for u in state["sources"]["user"] if u["key"] == "counter"]
        assert entry["kind"] == "random-like"
        assert entry["state"]["class"].endswith("Counter")
        expected = (counter.getstate(), like.getstate())
        # through a file (JSON header) and through torch.save(weights_only=True)
        snap.save(tmp_path / "rng.snap")
        buf = io.BytesIO()
        torch.save({"rng": state}, buf)
        for load in (
            lambda: Snapshot.load(tmp_path / "rng.snap"),
            lambda: Snapshot.from_state_dict(
                torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["rng"]
            ),
        ):
            counter.draw()
            like.random()
            load().restore()
            assert (counter.getstate(), like.getstate()) == expected
            assert type(like.getstate()) is tuple  # a tuple comes back a tuple
    finally:
        unregister_rng(counter)
        unregister_rng(like)


def test_a_state_that_is_not_plain_data_cannot_be_saved():
    opaque = register_rng(Opaque(), key="opaque")
    try:
        snap = Snapshot.capture()
        with pytest.raises(
            ValueError,
            match=r"the state of user RNG 'opaque' \(.*Opaque\) cannot be saved: "
            r"getstate\(\)\['token'\] is a .*Token, and a snapshot holds only plain data",
        ):
            snap.state_dict()
        snap.restore()  # capturing and restoring it still work
    finally:
        unregister_rng(opaque)


def test_a_saved_state_loads_only_into_the_same_class():
    counter = register_rng(Counter(), key="swap")
    state = Snapshot.capture().state_dict()
    unregister_rng(counter)
    other = register_rng(Like(), key="swap")
    try:
        with pytest.raises(InvalidSnapshotError, match=r"sources\.user\[0\]\.state\.class"):
            Snapshot.from_state_dict(state)
    finally:
        unregister_rng(other)


# -- the plain-data encoding of a random-like state ---------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: Hypothesis's check that ``extend`` uses
    # its argument misreads a multi-line lambda (a deprecation warning).
    keys = _scalars.filter(lambda k: not (isinstance(k, float) and math.isnan(k)))
    return (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
    )


_trees = st.recursive(_scalars, _containers, max_leaves=30)


def _encode(tree: Any) -> dict[str, Any]:
    """A tree as the saved state of a random-like ``object()``."""
    return persistence.random_like_to_plain(object(), tree)


def _decode(data: dict[str, Any], path: str) -> Any:
    """Saved ``shape``, ``values`` and ``sizes`` back as a random-like ``object()``'s state."""
    return persistence.random_like_from_plain(object(), {"class": "builtins.object", **data}, path)


@settings(max_examples=300, deadline=None)
@given(_trees)
def test_plain_trees_round_trip_exactly_through_json(tree):
    plain = _encode(tree)
    back = _decode(json.loads(json.dumps(plain)), "state")
    assert repr(back) == repr(tree)  # types too: tuple/list, bool/int, -0.0, nan


def _junk_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3)


_junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(alphabet="ifsbntldx", max_size=6),
    _junk_containers,
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(
    shape=st.text(alphabet="ifsbntldx", max_size=12) | _junk,
    values=st.lists(_scalars, max_size=8) | _junk,
    sizes=st.lists(st.integers(-2, 5), max_size=6) | _junk,
)
def test_crafted_encodings_raise_value_error_only(shape, values, sizes):
    with contextlib.suppress(ValueError):
        _decode({"shape": shape, "values": values, "sizes": sizes}, "s")


def test_encoding_limits_and_messages():
    with pytest.raises(ValueError, match=r"getstate\(\)\[1\] is a builtins\.bytes"):
        _encode((1, b"raw"))
    with pytest.raises(ValueError, match=r"has a key of type builtins\.tuple"):
        _encode({(1, 2): 3})
    with pytest.raises(ValueError, match="more than 65536 items"):
        _encode(list(range(70_000)))
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="deeper than 64 levels"):
        _encode(loop)
    bad = [
        ({"shape": "t", "values": [], "sizes": [2]}, "at most the items left"),
        ({"shape": "dii", "values": [1, 2], "sizes": [2]}, "ends inside a container"),
        ({"shape": "ii", "values": [1, 2], "sizes": []}, "items after the end"),
        ({"shape": "i", "values": [True], "sizes": []}, "expected a int"),
        ({"shape": "dii", "values": [1, 2], "sizes": [1]}, ""),
        ({"shape": "dlii", "values": [1, 2], "sizes": [1, 0]}, "a dict key must be a scalar"),
        ({"shape": "diiii", "values": [1, 2, 1, 3], "sizes": [2]}, "repeats a key"),
        ({"shape": "i", "values": [], "sizes": []}, "too few"),
        ({"shape": "", "values": [], "sizes": []}, "expected a str of 1 to"),
        ({"shape": "l", "values": [], "sizes": ["0"]}, "at most the items left"),
        ({"shape": "i", "values": [1, 2], "sizes": []}, "left over"),
        ({"shape": "q", "values": [], "sizes": []}, "unknown letter"),
        ({"shape": "i", "values": [2**5000], "sizes": []}, "more than 4096 bits"),
    ]
    for data, message in bad:
        if data["sizes"] == [1] and data["shape"] == "dii":  # a valid dict: {1: 2}
            assert _decode(data, "s") == {1: 2}
            continue
        with pytest.raises(ValueError, match=message):
            _decode(data, "s")


def test_round_trip_of_a_mersenne_twister_state_through_a_file():
    like = register_rng(Like(11), key="mt-like")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            Snapshot.capture().save(Path(tmp) / "s")
            expected = [like.random() for _ in range(3)]
            Snapshot.load(Path(tmp) / "s").restore()
            assert [like.random() for _ in range(3)] == expected
            Snapshot.load(Path(tmp) / "s").restore()
    finally:
        unregister_rng(like)


# -- generator states (1-D uint8 CPU tensors) in a random-like state ----------------------


class TorchBacked:
    """Random-like around two torch generators: its state holds their state tensors."""

    def __init__(self) -> None:
        self.gens = [torch.Generator(), torch.Generator()]

    def seed(self, s: int) -> None:
        for i, g in enumerate(self.gens):
            g.manual_seed(s + i)

    def getstate(self) -> Any:
        return {"label": "pair", "states": tuple(g.get_state() for g in self.gens)}

    def setstate(self, state: Any) -> None:
        for g, s in zip(self.gens, state["states"], strict=True):
            g.set_state(s)

    def draw(self) -> list[float]:
        return [torch.rand(1, generator=g).item() for g in self.gens]


def test_generator_states_in_a_random_like_state_round_trip_through_a_file(tmp_path):
    obj = register_rng(TorchBacked(), key="torch-backed")
    try:
        obj.draw()
        Snapshot.capture().save(tmp_path / "s")
        expected = [obj.draw() for _ in range(3)]
        Snapshot.load(tmp_path / "s").restore()
        assert [obj.draw() for _ in range(3)] == expected
        state = Snapshot.capture().state_dict()
        saved = state["sources"]["user"][-1]["state"]
        assert saved["shape"] == "dssstxx"  # {"label": "pair", "states": (x, x)}
        tensors = [v for v in saved["values"] if isinstance(v, torch.Tensor)]
        assert [t.numel() for t in tensors] == [5056, 5056]
        assert all(t is not s for t, s in zip(tensors, obj.getstate()["states"], strict=True))
    finally:
        unregister_rng(obj)


def test_tensors_a_snapshot_cannot_hold_are_refused_with_their_place():
    with pytest.raises(ValueError, match=r"getstate\(\)\[1\] is a cpu torch.float32"):
        _encode((1, torch.zeros(2)))
    with pytest.raises(ValueError, match="only 1-D uint8 CPU tensors"):
        _encode([torch.zeros(2, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"has a key of type torch\.Tensor"):
        _encode({torch.zeros(1, dtype=torch.uint8): 1})
    with pytest.raises(ValueError, match="tensor bytes"):
        _encode([torch.zeros(1 << 21, dtype=torch.uint8)] * 3)
    for values, message in [
        ([3], "expected a uint8 tensor, got int"),
        ([torch.zeros(2)], "expected a 1-D uint8 tensor"),
        ([], "too few"),
    ]:
        with pytest.raises(ValueError, match=message):
            _decode({"shape": "x", "values": values, "sizes": []}, "s")
    back = _decode(
        {"shape": "tx", "values": [torch.arange(3, dtype=torch.uint8)], "sizes": [1]}, "s"
    )
    assert isinstance(back, tuple) and back[0].tolist() == [0, 1, 2]
