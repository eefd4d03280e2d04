"""Checkpoints from untrusted sources: nothing runs, every bad input raises our error.

The promises tested here:

* nothing in a file is ever unpickled or executed, and nothing in a state dict is called;
* every bad input (random bytes, mutated files, mutated state dicts) loads, and then
  restores cleanly, or raises ``InvalidSnapshotError``, nothing else (Hypothesis fuzzing).

The fields of a state dict, source by source, have their own fuzzing in
``tests/state/test_checkpoint_fuzz.py``.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import random
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deterministic_ctx import InvalidSnapshotError, Snapshot
from deterministic_ctx.state import checkpoint
from tests.state.checkpoint_helpers import (
    MAGIC,
    fresh_state,
    isolated,
    load_bytes,
    registered,
    seal,
    seal_state,
)

# -- no pickle, no code --------------------------------------------------------


class _Touch:
    """Unpickling this creates the file ``path``: a stand-in for any code a pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def test_the_payload_is_live_when_unpickled(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(_Touch(marker)))  # the control: pickle does run it
    assert marker.exists()


@pytest.mark.parametrize("wrap", ["pickle", "torch.save", "after-signature", "as-header"])
def test_a_pickle_is_never_unpickled(tmp_path, wrap):
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Touch(marker))
    if wrap == "torch.save":
        buf = io.BytesIO()
        torch.save({"rng": _Touch(marker)}, buf)
        payload = buf.getvalue()
    elif wrap == "after-signature":
        payload = MAGIC + payload
    elif wrap == "as-header":
        payload = seal(payload)  # a well-formed envelope whose header is the pickle
    path = tmp_path / "rng.snap"
    path.write_bytes(payload)
    with pytest.raises(InvalidSnapshotError) as info:
        Snapshot.load(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


class _Trap:
    """Every special method a careless validator might call creates the marker."""

    def __init__(self, path: Path) -> None:
        self.__dict__["path"] = path

    def _fire(self, *args: Any, **kwargs: Any) -> Any:
        Path(self.__dict__["path"]).touch()
        return 0

    __repr__ = __str__ = __eq__ = __ne__ = __lt__ = __hash__ = _fire  # type: ignore[assignment]
    __index__ = __int__ = __float__ = __bool__ = __len__ = __iter__ = _fire
    __getitem__ = __contains__ = __format__ = __reduce__ = _fire


class _TrapDict(dict):
    def __init__(self, path: Path, *args: Any) -> None:
        super().__init__(*args)
        self.path = path

    def _fire(self, *args: Any, **kwargs: Any) -> Any:
        Path(self.path).touch()
        return dict.keys(self)

    keys = __getitem__ = __iter__ = __contains__ = get = items = _fire  # type: ignore[assignment]


class _TrapTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Path(os.environ["DCTX_TEST_MARKER"]).touch()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize(
    "where",
    ["format", "version", "sources", "random", "random-word", "cpu-tensor", "devices", "key"],
)
def test_nothing_in_a_state_dict_is_called(tmp_path, monkeypatch, where):
    marker = tmp_path / "marker"
    monkeypatch.setenv("DCTX_TEST_MARKER", str(marker))
    state = fresh_state()
    if where in ("format", "version"):
        state[where] = _Trap(marker)
    elif where == "sources":
        state["sources"] = _TrapDict(marker, state["sources"])
    elif where == "random":
        state["sources"]["random"] = _Trap(marker)
    elif where == "random-word":
        state["sources"]["random"]["state"][3] = _Trap(marker)
    elif where == "cpu-tensor":
        state["sources"]["torch.cpu"]["state"] = state["sources"]["torch.cpu"]["state"].as_subclass(
            _TrapTensor
        )
    elif where == "devices":
        state["devices"] = _TrapDict(marker, state["devices"])
    else:
        state["devices"][_Trap(marker)] = {"initialized": False, "states": []}
    marker.unlink(missing_ok=True)  # building the state may fire a trap: only loading counts
    with pytest.raises(InvalidSnapshotError):
        Snapshot.from_state_dict(state)
    assert not marker.exists()


# -- fuzzing -------------------------------------------------------------------


def _loads_or_raises_ours(data: bytes, directory: Path) -> None:
    """Every input loads (and then restores and draws cleanly) or raises our error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # device policy notes
            snap = load_bytes(data, directory)
    except InvalidSnapshotError as exc:
        event(f"file rejected: {exc.problem.split(':')[0][:40]}")
        return
    event("file loaded")
    with isolated():
        snap.restore()  # what loaded is sound: restoring and drawing work
        random.random(), np.random.rand(), np.random.randn(), torch.randn(3)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def valid_bytes() -> bytes:
    return checkpoint.encode(fresh_state())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=512), st.binary(max_size=512).map(lambda b: MAGIC + b)))
def test_fuzz_arbitrary_bytes(fuzz_dir, data):
    _loads_or_raises_ours(data, fuzz_dir)


@st.composite
def _mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "reseal"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "reseal" and len(data) > 64:
            # Keep the envelope valid so the header and field checks are reached.
            _v, _r, h, _d = struct.unpack_from("<IIQQ", bytes(data[:32].ljust(32, b"\0")), 8)
            body = bytes(data[32:-32])
            h = min(h, len(body))
            data = bytearray(seal(body[:h], body[h:]))
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_valid_files(fuzz_dir, valid_bytes, data):
    _loads_or_raises_ours(data.draw(_mutated(valid_bytes)), fuzz_dir)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if type(value) is dict:
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif type(value) is list:
        picks = range(len(value)) if len(value) <= 4 else (0, 1, len(value) - 1)
        for i in picks:
            yield from _paths(value[i], (*prefix, i))


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**130), 2**130),
    st.sampled_from([0, 1, 623, 624, 625, 2**32 - 1, 2**32, 2**64, 2**128 - 1, 2**128, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["MT19937", "PCG64", "Philox", "SFC64", "PCG64DXSM", "ieee", "highest"]),
)
_tensors = st.builds(
    lambda n, dtype, fill: torch.full((n,), fill, dtype=dtype),
    st.sampled_from([0, 1, 16, 5055, 5056, 5057]),
    st.sampled_from([torch.uint8, torch.int8, torch.int64]),
    st.integers(0, 127),
)
_values = st.recursive(
    st.one_of(_scalars, _tensors),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _near(value: Any) -> st.SearchStrategy[Any]:
    if type(value) is bool:
        return st.booleans()
    if type(value) is int:
        return st.one_of(
            st.integers(value - 2, value + 2), st.integers(0, 2**32), st.integers(0, 2**128)
        )
    if type(value) is float:
        return st.floats()
    if type(value) is str:
        return st.sampled_from(["none", "ieee", "tf32", "bf16", "high", "medium", ":16:8", "0"])
    if isinstance(value, torch.Tensor):
        return st.binary(min_size=value.numel(), max_size=value.numel()).map(
            lambda b: (
                torch.frombuffer(bytearray(b), dtype=torch.uint8)
                if b
                else torch.empty(0, dtype=torch.uint8)
            )
        )
    return _values


@pytest.fixture(scope="module")
def valid_state() -> dict[str, Any]:
    user = {"r": random.Random(1), "g": np.random.Generator(np.random.Philox(2))}
    with registered(**user):
        return Snapshot.capture().state_dict()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_fields_of_a_valid_state_dict(fuzz_dir, valid_state, data):
    state = copy.deepcopy(valid_state)
    path = data.draw(st.sampled_from(sorted(_paths(state), key=repr)))
    action = data.draw(st.sampled_from(["replace", "delete", "add", "tweak", "tweak"]))
    parent: Any = state
    for key in path[:-1]:
        parent = parent[key]
    if action == "tweak":  # a value of the same type, often valid: reaches restore
        parent[path[-1]] = data.draw(_near(parent[path[-1]]))
    elif action == "delete":
        del parent[path[-1]]
    elif action == "add" and type(parent) is dict:
        parent[data.draw(st.text(max_size=8))] = data.draw(_values)
    else:
        parent[path[-1]] = data.draw(_values)
    user = {"r": random.Random(5), "g": np.random.Generator(np.random.Philox(6))}
    with registered(**user):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                snap = Snapshot.from_state_dict(state)
        except InvalidSnapshotError:
            event("state dict rejected")
        else:
            event("state dict loaded")
            with isolated():
                snap.restore()
                random.random(), np.random.rand(), np.random.randn(), torch.randn(3)
                user["r"].random(), user["g"].random()
        try:
            encoded = seal_state(state)
        except (TypeError, ValueError):  # not JSON: None keys etc. cannot be written
            return
        _loads_or_raises_ours(encoded, fuzz_dir)
