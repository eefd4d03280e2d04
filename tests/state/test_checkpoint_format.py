"""Checkpoint files: the documented layout, and every bad file named and explained.

The file format is re-implemented in ``tests/state/checkpoint_helpers.py`` from its
documentation, so the tests also check that the writer follows the documented layout.
Every bad file or crafted field raises ``InvalidSnapshotError`` naming what is wrong.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import pickle
import struct
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from deterministic_ctx import InvalidSnapshotError, Snapshot, isolated
from deterministic_ctx.state import checkpoint
from tests.state.checkpoint_helpers import MAGIC, fresh_state, load_bytes, seal, seal_state


@pytest.fixture(scope="module")
def valid_bytes() -> bytes:
    return checkpoint.encode(fresh_state())


def test_the_file_follows_the_documented_layout(valid_bytes):
    assert valid_bytes[:8] == MAGIC
    version, reserved, h, d = struct.unpack_from("<IIQQ", valid_bytes, 8)
    assert (version, reserved) == (1, 0)
    assert len(valid_bytes) == 32 + h + d + 32
    assert hashlib.sha256(valid_bytes[:-32]).digest() == valid_bytes[-32:]
    header = json.loads(valid_bytes[32 : 32 + h])
    assert header.keys() == {"state", "tensors"}
    assert sum(n for (n,) in header["tensors"]) == d
    assert header["state"]["sources"]["torch.cpu"]["state"] == {"$tensor": 0}
    rebuilt = seal_state(fresh_state())  # our independent writer makes loadable files
    assert Snapshot.load(_write(rebuilt)).sources == Snapshot.capture().sources


def _write(data: bytes) -> Path:
    fd, name = tempfile.mkstemp(suffix=".snap")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)


@pytest.mark.parametrize("cut", [0, 1, 8, 31, 32, 100, -33, -1])
def test_truncated(tmp_path, valid_bytes, cut):
    with pytest.raises(InvalidSnapshotError, match=r"truncated|empty") as info:
        load_bytes(valid_bytes[:cut], tmp_path)
    assert "fuzz.snap" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert info.value.origin.endswith("fuzz.snap'")


@pytest.mark.parametrize("at", [40, -40, -1])
def test_corrupted(tmp_path, valid_bytes, at):
    data = bytearray(valid_bytes)
    data[at] ^= 0x01
    with pytest.raises(InvalidSnapshotError, match="corrupted: the SHA-256 checksum"):
        load_bytes(bytes(data), tmp_path)


def test_trailing_bytes(tmp_path, valid_bytes):
    with pytest.raises(InvalidSnapshotError, match="trailing bytes"):
        load_bytes(valid_bytes + b"\0", tmp_path)


def test_future_file_format_version(tmp_path):
    with pytest.raises(InvalidSnapshotError, match=r"format version 2 is newer .* upgrade"):
        load_bytes(seal(b"{}", version=2), tmp_path)
    with pytest.raises(InvalidSnapshotError, match="unknown format version 0"):
        load_bytes(seal(b"{}", version=0), tmp_path)
    with pytest.raises(InvalidSnapshotError, match=r"unknown format version 1\.5"):
        load_bytes(seal(b"{}", reserved=5), tmp_path)


def test_future_state_dict_version(tmp_path):
    state = fresh_state()
    state["version"] = 2
    with pytest.raises(InvalidSnapshotError, match=r"version 2 is newer .* upgrade"):
        load_bytes(seal_state(state), tmp_path)
    with pytest.raises(InvalidSnapshotError, match="state_dict: version 2 is newer"):
        Snapshot.from_state_dict(state)
    state["version"] = True
    with pytest.raises(InvalidSnapshotError, match=r"version: expected an int in 1 \.\. 1"):
        Snapshot.from_state_dict(state)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the file is empty"),
        (b"PK\x03\x04rest-of-a-zip", "zip archive"),
        (b"\x93NUMPY\x01\x00", "NumPy .npy"),
        (b"hello world", "does not start with the snapshot signature"),
        (pickle.dumps({"a": 1}), "looks like a pickle"),
        (json.dumps({"format": "deterministic_ctx.snapshot"}).encode(), "signature"),
    ],
)
def test_wrong_kind_of_file(tmp_path, content, message):
    with pytest.raises(InvalidSnapshotError, match=message):
        load_bytes(content, tmp_path)


def test_torch_save_of_a_state_dict_is_not_a_snapshot_file(tmp_path):
    path = tmp_path / "rng.pt"
    torch.save(fresh_state(), path)
    with pytest.raises(InvalidSnapshotError, match=r"zip archive \(what torch.save writes\)"):
        Snapshot.load(path)


_FROM_CHECKPOINT = (
    "if it is a checkpoint that holds a Snapshot.state_dict() under some key, load that with "
    "Snapshot.from_state_dict(torch.load(path, weights_only=True)[key])"
)


def test_a_torch_checkpoint_file_says_how_to_load_the_snapshot_inside(tmp_path):
    path = tmp_path / "ckpt.pt"
    with isolated():  # a model's initialization draws from torch's generator
        model = torch.nn.Linear(2, 2)
    torch.save({"model": model.state_dict(), "rng": fresh_state()}, path)
    with pytest.raises(InvalidSnapshotError) as info:
        Snapshot.load(path)
    assert str(info.value) == (
        f"invalid snapshot file {str(path)!r}: it is a zip archive (what torch.save writes), "
        f"not a snapshot file written by Snapshot.save(); {_FROM_CHECKPOINT}"
    )
    # What it says to do works.
    Snapshot.from_state_dict(torch.load(path, weights_only=True)["rng"])


def test_a_pickle_file_says_how_to_load_the_snapshot_inside(tmp_path):
    with pytest.raises(InvalidSnapshotError) as info:
        load_bytes(pickle.dumps({"a": 1}), tmp_path)
    assert str(info.value).endswith(
        f": it looks like a pickle, which this loader never unpickles; {_FROM_CHECKPOINT}"
    )


def test_a_zip_given_as_a_trace_gets_no_snapshot_advice(tmp_path):
    from deterministic_ctx import InvalidTraceError, Trace

    path = tmp_path / "ckpt.pt"
    torch.save({"a": torch.zeros(1)}, path)
    with pytest.raises(
        InvalidTraceError, match=r"not a trace file written by Trace\.save\(\)"
    ) as info:
        Trace.load(path)
    assert "Snapshot" not in str(info.value)


def test_a_models_state_dict_is_named_for_what_it_is():
    with isolated():
        model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidSnapshotError) as info:
        Snapshot.from_state_dict(model.state_dict())
    assert str(info.value) == (
        "invalid snapshot state_dict: it is not what Snapshot.state_dict() returns: it has no "
        "'format' field (its keys: 'weight', 'bias'); pass the snapshot's own dict, e.g. "
        "checkpoint[key] where you saved Snapshot.capture().state_dict() under key"
    )


@pytest.mark.parametrize(
    ("wrap", "where"),
    [
        (lambda s: {"model": {}, "rng": s}, "['rng']"),
        (lambda s: {"state": {"epoch": 3, "rng": s}}, "['state']['rng']"),
    ],
)
def test_a_whole_checkpoint_points_to_the_snapshot_inside(wrap, where):
    with pytest.raises(InvalidSnapshotError) as info:
        Snapshot.from_state_dict(wrap(fresh_state()))
    assert str(info.value) == (
        f"invalid snapshot state_dict: it holds a snapshot's state dict at {where}, "
        f"but is not one: pass state_dict{where}"
    )


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([1, 2], "expected the dict that Snapshot.state_dict() returns, got list"),
        ({"format": "x"}, "top level: missing field(s) devices, sources, version"),
        (
            {},
            "it is not what Snapshot.state_dict() returns: it has no 'format' field (its keys: "
            "none); pass the snapshot's own dict, e.g. checkpoint[key] where you saved "
            "Snapshot.capture().state_dict() under key",
        ),
    ],
)
def test_a_bad_state_dict_is_named_once(data, problem):
    # Not "invalid snapshot state_dict: state_dict: ...": the origin says it already.
    with pytest.raises(InvalidSnapshotError) as info:
        Snapshot.from_state_dict(data)
    assert str(info.value) == f"invalid snapshot state_dict: {problem}"


@pytest.mark.parametrize(
    ("header_len", "data_len"), [(2**63, 0), (0, 2**63), (2**64 - 1, 2**64 - 1), (10**9, 1)]
)
def test_huge_declared_sizes_allocate_nothing(tmp_path, header_len, data_len):
    data = seal(b"{}", header_len=header_len, data_len=data_len)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidSnapshotError, match="truncated: the file has 66 bytes"):
            load_bytes(data, tmp_path)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_huge_declared_tensor(tmp_path):
    header = json.dumps({"state": {"$tensor": 0}, "tensors": [[2**40]]}).encode()
    with pytest.raises(InvalidSnapshotError, match=r"header.tensors\[0\]"):
        load_bytes(seal(header, b"\0" * 16), tmp_path)


def test_file_larger_than_any_snapshot(tmp_path, monkeypatch, valid_bytes):
    monkeypatch.setattr(checkpoint, "MAX_FILE_BYTES", len(valid_bytes) - 1)
    with pytest.raises(InvalidSnapshotError, match="larger than any snapshot"):
        load_bytes(valid_bytes, tmp_path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\xff\xfe", "bad header"),
        (b"[" * 100_000 + b"]" * 100_000, "bad header"),
        (b'{"state": {}, "state": {}, "tensors": []}', "repeats a key"),
        (b'{"state": {}, "tensors": [[1]]}', "never used"),
        (b'{"state": {"a": {"$tensor": 0}, "b": {"$tensor": 0}}, "tensors": [[1]]}', "used twice"),
        (b'{"state": {"a": {"$tensor": 5}}, "tensors": [[1]]}', r"state.a: expected an int"),
        (b'{"state": [], "tensors": []}', "state: expected a dict"),
        (b'{"state": {}, "tensors": {}}', "header.tensors: expected a list"),
        (b'{"state": {}, "tensors": [[-1]]}', r"header.tensors\[0\]"),
        (b'{"state": {}, "tensors": [[1, 1]]}', r"header.tensors\[0\]"),
        (b"[" * 20 + b"1" + b"]" * 20, "header: expected a dict"),
    ],
)
def test_crafted_headers(tmp_path, header, message):
    data = b"\0" if b"[[1" in header else b""
    with pytest.raises(InvalidSnapshotError, match=message):
        load_bytes(seal(header, data), tmp_path)


def test_deeply_nested_state(tmp_path):
    state: Any = {}
    for _ in range(40):
        state = {"x": state}
    header = json.dumps({"state": state, "tensors": []}).encode()
    with pytest.raises(InvalidSnapshotError, match="nested deeper than"):
        load_bytes(seal(header), tmp_path)


def _set(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target: Any = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


_CPU = ("sources", "torch.cpu", "state")
_NP = ("sources", "numpy")


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            _CPU,
            torch.zeros(1264, dtype=torch.float32),
            r"sources\.torch\.cpu\.state: expected a 1-D uint8",
        ),
        (_CPU, torch.zeros(2, 2528, dtype=torch.uint8), "expected a 1-D uint8"),
        (_CPU, torch.zeros(10, dtype=torch.uint8), "expected 5056 bytes, got 10"),
        (_CPU, torch.full((5056,), 255, dtype=torch.uint8), "torch rejects the generator state"),
        (_CPU, [0] * 5056, "expected a uint8 tensor, got a list"),
        ((*_NP, "state", "pos"), 10**6, r"sources\.numpy\.state\.pos: expected an int in 0 .. 624"),
        ((*_NP, "state", "pos"), -1, "expected an int in 0 .. 624"),
        ((*_NP, "state", "key", 0), 2**32, r"state\.key\[0\]: expected an int in 0 .. 4294967295"),
        ((*_NP, "state", "key"), [1, 2, 3], "expected a list of 624 ints, got of 3"),
        ((*_NP, "has_gauss"), 2, "has_gauss: expected an int in 0 .. 1"),
        ((*_NP, "gauss"), "0.5", "gauss: expected a float"),
        ((*_NP, "bit_generator"), "os.system", "expected one of MT19937, PCG64"),
        ((*_NP, "bit_generator"), "PCG64", "missing field"),
        (("sources", "random", "state", 624), 625, r"state\[624\] \(the index\)"),
        (("sources", "random", "state", 0), -1, r"random\.state\[0\]: expected an int"),
        (("sources", "random", "state", 0), 2**10000, "an int of 10001 bits"),
        (("sources", "random", "gauss_next"), None, "gauss_next: expected a float"),
        (
            ("sources", "environ", "set", "PYTHONHASHSEED"),
            "1\x002",
            r"environ\.set\.PYTHONHASHSEED: expected a string",
        ),
        (("sources", "environ", "set", "PYTHONHASHSEED"), "\ud800", "cannot be encoded"),
        (("sources", "environ", "LD_PRELOAD"), "x.so", "unexpected field"),
        (
            ("sources", "torch.flags", "cudnn_benchmark"),
            1,
            "cudnn_benchmark: expected True or False",
        ),
        (("sources", "torch.flags", "float32_matmul_precision"), "low", "expected one of highest"),
        (("sources", "user"), {}, r"sources\.user: expected a list"),
        (("sources", "later"), {}, "unexpected field"),
        (("devices", "cuda", "initialized"), True, "empty exactly when"),
        (
            ("devices", "cuda", "states"),
            [torch.zeros(16, dtype=torch.uint8)] * 5000,
            "at most 4096",
        ),
        (("format",), "other.format", "format: expected one of deterministic_ctx.snapshot"),
    ],
)
def test_crafted_fields_are_named(tmp_path, path, value, message):
    state = _set(fresh_state(), path, value)
    with pytest.raises(InvalidSnapshotError, match=message) as info:
        Snapshot.from_state_dict(state)
    assert str(info.value).startswith("invalid snapshot state_dict: ")
    if not isinstance(value, torch.Tensor) or (value.dtype, value.dim()) == (torch.uint8, 1):
        # The same through a file (which holds only 1-D uint8 tensors).
        with pytest.raises(InvalidSnapshotError, match=message):
            load_bytes(seal_state(state), tmp_path)


def test_precision_combinations_torch_refuses_are_refused_at_load():
    # Every combination of the precisions that decide matmul, against what the
    # installed torch does: refuses to set it, or sets it and then refuses to
    # read it back (which would break every later capture).
    from deterministic_ctx.sources.flags import PRECISION_OPS, TorchFlagsSource

    ops = [o for o in PRECISION_OPS if o[1] in ("all", "matmul")]
    if not ops:
        pytest.skip("this torch has no fp32_precision API")
    c: Any = torch._C
    source = TorchFlagsSource()
    fresh = source.export_state(source.capture())
    saved = source.capture()
    checked = 0
    try:
        for legacy in ("highest", "high", "medium"):
            for values in itertools.product(("none", "ieee", "tf32", "bf16"), repeat=len(ops)):
                data = copy.deepcopy(fresh)
                data["float32_matmul_precision"] = legacy
                data["fp32_precision"].update(
                    {f"{b}.{o}": v for (b, o), v in zip(ops, values, strict=True)}
                )
                try:
                    source.import_state(data, "flags")
                    accepted = True
                except ValueError as exc:
                    if "torch refuses" not in str(exc):
                        raise
                    accepted = False
                try:
                    torch.set_float32_matmul_precision(legacy)
                    for op, value in zip(ops, values, strict=True):
                        c._set_fp32_precision_setter(*op, value)
                    c._get_float32_matmul_precision()
                    refused = False
                except RuntimeError:
                    refused = True
                assert accepted != refused, (legacy, dict(zip(ops, values, strict=True)))
                checked += 1
    finally:  # exact, own values included, even from a state torch refuses to read
        source.restore(saved)
    assert checked == 3 * 4 ** len(ops)


def test_a_missing_source_is_an_error():
    state = fresh_state()
    del state["sources"]["numpy"]
    with pytest.raises(InvalidSnapshotError, match=r"sources: missing field\(s\) numpy"):
        Snapshot.from_state_dict(state)


def test_flags_of_another_torch_build_are_an_error():
    state = fresh_state()
    state["sources"]["torch.flags"]["fp32_precision"]["future.op"] = "ieee"
    with pytest.raises(InvalidSnapshotError, match=r"unexpected field.*future\.op"):
        Snapshot.from_state_dict(state)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Snapshot.load(tmp_path / "absent.snap")


def test_strict_devices_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="strict_devices must be True or False"):
        Snapshot.from_state_dict(fresh_state(), strict_devices="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strict_devices must be True or False"):
        Snapshot.load(tmp_path / "x", strict_devices=1)  # type: ignore[arg-type]


def test_the_error_survives_pickling():
    err = InvalidSnapshotError("file 'x.snap'", "truncated")
    back = pickle.loads(pickle.dumps(err))
    assert (back.origin, back.problem, str(back)) == (err.origin, err.problem, str(err))
