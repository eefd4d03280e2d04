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
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import deterministic_ctx.sources as _sources
from deterministic_ctx import Snapshot, register_rng, unregister_rng
from deterministic_ctx.sources.accelerators import LazyAcceleratorSource
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


# --- a CUDA device with torch's Philox state rules, for machines without one ----------------------


class PhiloxGenerator:
    """What a snapshot touches of a CUDA default generator, following torch's
    ``CUDAGeneratorImpl`` (``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``): the state is a
    16-byte CPU uint8 tensor, the seed (uint64) then the Philox offset (int64), in native
    byte order; ``set_state`` takes 16 bytes (or 8, a seed alone), sets the seed and resets
    the offset *before* it refuses an offset that is not a multiple of 4, as torch does.

    ``tests/core/test_gpu.py`` checks these rules against a real CUDA generator.
    """

    _LAYOUT = struct.Struct("=Qq")

    def __init__(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def get_state(self) -> torch.Tensor:
        offset = self.offset - (1 << 64) if self.offset >= 1 << 63 else self.offset
        raw = bytearray(self._LAYOUT.pack(self.seed, offset))
        return torch.frombuffer(raw, dtype=torch.uint8).clone()

    def set_state(self, state: torch.Tensor) -> None:
        if state.dtype != torch.uint8 or state.device.type != "cpu":
            raise TypeError(f"expected a CPU uint8 tensor, got {state.dtype} on {state.device}")
        raw = state.contiguous().numpy().tobytes()
        if len(raw) not in (8, 16):
            raise RuntimeError("RNG state is wrong size")
        self.seed, self.offset = int.from_bytes(raw[:8], sys.byteorder), 0
        offset = int.from_bytes(raw[8:], sys.byteorder, signed=True) % (1 << 64)
        if offset % 4:
            raise RuntimeError("offset must be a multiple of 4")
        self.offset = offset

    def manual_seed(self, seed: int) -> PhiloxGenerator:
        self.seed, self.offset = seed % (1 << 64), 0
        return self

    def draw(self, n: int = 4) -> None:
        """What a kernel does to the state: the offset moves on by a multiple of 4."""
        self.offset = (self.offset + (n + 3) // 4 * 4) % (1 << 64)


class PhiloxDevice:
    """An initialized CUDA device module of ``count`` devices, each generator a
    :class:`PhiloxGenerator` (what a snapshot reads of ``torch.cuda``)."""

    def __init__(self, count: int = 2) -> None:
        self.default_generators = tuple(PhiloxGenerator(1000 + i) for i in range(count))
        for i, gen in enumerate(self.default_generators):
            gen.draw(4 * (i + 1))  # the caller's streams are somewhere past their start
        self._lazy_seed_tracker = types.SimpleNamespace(
            manual_seed_all_cb=None, manual_seed_cb=None, call_order=[]
        )
        self._queued_calls: list[Any] = []

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.default_generators)

    def states(self) -> list[bytes]:
        return [g.get_state().numpy().tobytes() for g in self.default_generators]


def _no_fresh_state(index: int) -> torch.Tensor:
    raise AssertionError("the fake CUDA device is initialized from the start")


def philox_cuda_sources(device: PhiloxDevice) -> tuple[Any, ...]:
    """``SOURCES`` with ``device`` in place of ``torch.cuda`` (a monkeypatch target): every
    snapshot then captures, loads and restores it through the per-source reference path."""
    # Never initialized inside a block (it is from the start): no fresh state is ever asked for.
    cuda = LazyAcceleratorSource(device, "cuda", fresh_state=_no_fresh_state)
    sources = tuple(cuda if s.name == "torch.cuda" else s for s in _sources.SOURCES)
    assert sum(s is cuda for s in sources) == 1
    return sources
