"""Helpers shared by the checkpoint tests (``tests/test_checkpoint_*.py``).

The file format is re-implemented here from its documentation (``seal``), so
the tests also check that the writer follows the documented layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deterministic_ctx import Snapshot, register_rng, unregister_rng
from tests._oracle import World

MAGIC = b"\x89DCS\r\n\x1a\n"  # as documented in deterministic_ctx/checkpoint.py


@contextmanager
def isolated() -> Iterator[None]:
    """Whatever the body does to global state is undone by an in-memory snapshot."""
    outer = Snapshot.capture()
    try:
        yield
    finally:
        outer.restore()


@contextmanager
def registered(**rngs: Any) -> Iterator[dict[str, Any]]:
    for key, rng in rngs.items():
        register_rng(rng, key=key)
    try:
        yield rngs
    finally:
        for rng in rngs.values():
            unregister_rng(rng)


def world_view() -> World:
    """The oracle's view, less the *identity* of NumPy's bit generator: a loaded
    snapshot restores the bit generator's type and state, not the object."""
    w = World.now()
    return dataclasses.replace(w, numpy=w.numpy[1:])


def user_state(rng: Any) -> Any:
    """An independent view of a user RNG's state, through its public API."""
    if isinstance(rng, random.Random):
        return rng.getstate()
    if isinstance(rng, torch.Generator):
        return rng.get_state().numpy().tobytes()
    state = (
        rng.bit_generator.state
        if isinstance(rng, np.random.Generator)
        else rng.get_state(legacy=False)
    )
    return json.dumps(state, default=lambda a: a.tolist(), sort_keys=True)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def seal(
    header: bytes,
    data: bytes = b"",
    *,
    version: int = 1,
    reserved: int = 0,
    header_len: int | None = None,
    data_len: int | None = None,
) -> bytes:
    """A file built from the documented layout, with a correct checksum."""
    h = len(header) if header_len is None else header_len
    d = len(data) if data_len is None else data_len
    body = MAGIC + struct.pack("<IIQQ", version, reserved, h, d) + header + data
    return body + hashlib.sha256(body).digest()


def seal_state(state: dict[str, Any]) -> bytes:
    """A file holding ``state`` (a state dict, maybe crafted), as the documented format says."""
    tensors: list[torch.Tensor] = []

    def strip(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"$tensor": len(tensors) - 1}
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    header = json.dumps({"state": strip(state), "tensors": [[t.numel()] for t in tensors]})
    data = b"".join(t.contiguous().numpy().tobytes() for t in tensors)
    return seal(header.encode(), data)


def load_bytes(data: bytes, directory: Path, **kwargs: Any) -> Snapshot:
    path = directory / "fuzz.snap"
    path.write_bytes(data)
    return Snapshot.load(path, **kwargs)


def fresh_state() -> dict[str, Any]:
    return Snapshot.capture().state_dict()
