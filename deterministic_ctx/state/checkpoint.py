"""Saving and loading snapshots: a plain ``state_dict`` and a file that never unpickles.

**State dict** (``Snapshot.state_dict()``), version 1::

    {"format": "deterministic_ctx.snapshot",
     "version": 1,
     "sources": {"random": {...}, "numpy": {...}, "torch.cpu": {...},
                 "torch.flags": {...},
                 "torch.defaults": {"dtype": "float32", "tensor_type": "cpu",
                                    "threads": 8, "flush_denormal": false,
                                    "device": "cuda:0"},       # device: only when set
                 "environ": {"set": {name: value}, "unset": [name, ...]},
                 "user": [...]},
     "devices": {"cuda": {"initialized": bool, "states": [uint8 tensor per device]},
                 "xpu": {...}, "mtia": {...}}}

Each CUDA or XPU generator state is the 16 bytes torch writes, a 64-bit seed then
a 64-bit Philox offset, and the offset is a multiple of 4: torch's ``set_state``
refuses any other, so loading does (``restore()`` would fail half-way otherwise).

``torch.flags`` holds each ``fp32_precision`` entry's own value (``"none"``:
inherits) and, optionally, ``cudnn_allow_tf32``, ``onednn_allow_tf32`` and
``inductor_deterministic`` (present only when a user set it); version-1 files
without them still load.

Version-1 files may hold the earlier ``environ`` entry, ``{name: value}`` of
``CUBLAS_WORKSPACE_CONFIG`` / ``PYTHONHASHSEED`` only (an unset one left
out): it still loads and restores just those two.  Every environment name in
a snapshot must be managed where it is loaded (``register_env_var`` first).

It holds only dicts with string keys, lists, strings, ints (``bool`` among
them), floats and 1-D uint8 CPU tensors, so ``torch.load(...,
weights_only=True)`` accepts it inside any checkpoint.  Each source writes and
checks its own entry (``export_state`` / ``import_state`` of the
:class:`~deterministic_ctx.sources.Source` contract).

Entries of sources added after version 1 was first written (see
:data:`OPTIONAL_SOURCES`: ``"torch.defaults"``, ``"torch.compile"``) may be missing: a
state dict or file written before they existed still loads, and the loaded
snapshot leaves that source alone, as it leaves alone a device it holds no
state for.  Every other source's entry is required, and no unknown entry is
accepted.

**File** (``Snapshot.save``), format version 1, integers little-endian::

    offset     size  field
    0          8     signature  b"\\x89DCS\\r\\n\\x1a\\n"
    8          4     u32  format version (1)
    12         4     u32  reserved, 0
    16         8     u64  H, header length
    24         8     u64  D, data length
    32         H     header, UTF-8 JSON: {"state": <state dict>, "tensors": [[n], ...]}
                     where each tensor of the state dict is written {"$tensor": i}
                     and tensor i is a uint8 tensor of shape [n]
    32+H       D     the tensors' bytes, in order, back to back
    32+H+D     32    SHA-256 of every byte before it

Loading reads at most :data:`MAX_FILE_BYTES`, checks the sizes against the
file's length and the checksum before parsing anything, then parses JSON and
checks every field.  Any problem raises :class:`InvalidSnapshotError`.
Writing is atomic: a temporary file in the same directory, flushed and
fsynced, then renamed over the target.

The same container holds other plain data: a :class:`FileKind` names the
kind of file, its signature and its error (a subclass of
:class:`InvalidSnapshotError`); :mod:`~deterministic_ctx.trace` writes traces
this way, with the signature ``b"\\x89DCT\\r\\n\\x1a\\n"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
from typing import Any, NamedTuple, cast

import torch

from .. import sources as _sources
from ..base import plain as _plain
from ..base.errors import InvalidSnapshotError, UnregisteredRngError
from ..core.world import World
from ..sources import DeviceSource, Source
from ..sources.accelerators import check_foreign_devices

__all__ = [
    "FORMAT",
    "MAGIC",
    "MAX_FILE_BYTES",
    "OPTIONAL_SOURCES",
    "SNAPSHOT_FILE",
    "VERSION",
    "FileKind",
    "InvalidSnapshotError",
    "check_version",
    "decode",
    "encode",
    "from_state_dict",
    "origin_of",
    "read",
    "to_state_dict",
    "write",
]

FORMAT = "deterministic_ctx.snapshot"
VERSION = 1
MAGIC = b"\x89DCS\r\n\x1a\n"  # like PNG's: catches text-mode and 7-bit mangling
_PREAMBLE = struct.Struct("<IIQQ")
_HEAD = len(MAGIC) + _PREAMBLE.size
_DIGEST = hashlib.sha256().digest_size
#: A snapshot is a few kilobytes (plus 5 KB per registered torch generator); this
#: bounds what a crafted file can make the loader read.
MAX_FILE_BYTES = 64 << 20
_MAX_TENSORS = 1 << 16
_MAX_DEPTH = 16
_TENSOR = "$tensor"
#: What JSON parses besides lists and dicts.
_SCALARS = frozenset({str, int, float, bool, type(None)})
#: Sources whose entry a version-1 state dict may lack: they were added after
#: files of that version existed.  A missing one is left alone on restore.
OPTIONAL_SOURCES = frozenset({"torch.defaults", "torch.compile"})

StateDict = dict[str, Any]


class FileKind(NamedTuple):
    """A kind of file in this container: its name in messages, its signature
    (8 bytes) and the error that bad input raises.

    Example:
        >>> SNAPSHOT_FILE.name, SNAPSHOT_FILE.magic == MAGIC
        ('snapshot', True)
    """

    name: str
    magic: bytes
    error: type[InvalidSnapshotError]


SNAPSHOT_FILE = FileKind("snapshot", MAGIC, InvalidSnapshotError)


# -- state dict ----------------------------------------------------------------


def to_state_dict(world: World) -> StateDict:
    """The plain state dict of a captured world (see the module docstring)."""
    saved: dict[str, Any] = {}
    devices: dict[str, Any] = {}
    for source, state in zip(world.sources, world.states, strict=True):
        device = source.device_type
        if device is None:
            saved[source.name] = source.export_state(state)
        else:
            devices[device] = source.export_state(state)
    return {"format": FORMAT, "version": VERSION, "sources": saved, "devices": devices}


def from_state_dict(data: object, origin: str, *, strict_devices: bool) -> World:
    """Check a state dict and rebuild, for every source of this process, the
    state to restore.  Raises :class:`InvalidSnapshotError` naming ``origin``."""
    try:
        return _import(data, origin, strict_devices)
    except InvalidSnapshotError:
        raise
    except ValueError as exc:
        raise InvalidSnapshotError(origin, str(exc)) from exc
    except Exception as exc:  # whatever a field made a check trip over is bad input too
        raise InvalidSnapshotError(origin, f"{type(exc).__name__}: {exc}") from exc


def _not_a_snapshot(data: object) -> str | None:
    """What to say when ``data`` is no snapshot's state dict at all (a model's
    ``state_dict``, a whole checkpoint), or ``None`` when it may be one."""
    if not isinstance(data, dict):
        return f"expected the dict that Snapshot.state_dict() returns, got {type(data).__name__}"
    if "format" in data:
        return None  # a snapshot's, maybe damaged: its fields' checks say what is wrong
    inside = _snapshot_inside(data)
    if inside is not None:
        return (
            f"it holds a snapshot's state dict at {inside}, but is not one: pass state_dict{inside}"
        )
    keys = list(data)
    shown = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
    return (
        f"it is not what Snapshot.state_dict() returns: it has no 'format' field (its keys: "
        f"{shown or 'none'}); pass the snapshot's own dict, e.g. checkpoint[key] where you "
        f"saved Snapshot.capture().state_dict() under key"
    )


def _snapshot_inside(data: dict[Any, Any], depth: int = 2) -> str | None:
    """The index path (``['rng']``) of a snapshot's state dict among ``data``'s
    values, two levels down at most: a whole checkpoint passed instead of its entry."""
    for key, value in data.items():
        if isinstance(value, dict):
            if value.get("format") == FORMAT:
                return f"[{key!r}]"
            if depth > 1 and (deeper := _snapshot_inside(value, depth - 1)) is not None:
                return f"[{key!r}]{deeper}"
    return None


def _unregistered_rng(saved_user: object, origin: str) -> None:
    """Raise :class:`UnregisteredRngError` if the snapshot holds a user RNG
    registered under no key here: the snapshot is valid, the process is missing a
    ``register_rng`` call, and the error must say that rather than "invalid".
    A malformed list is left to the user source's checks."""
    if type(saved_user) is not list:
        return
    here = {key for key, _ in _sources.registered_rngs()}
    for item in saved_user:
        if type(item) is dict and type(key := item.get("key")) is str and key not in here:
            kind = item.get("kind")
            raise UnregisteredRngError(origin, key, kind if type(kind) is str else "unknown kind")


def _import(data: object, origin: str, strict: bool) -> World:
    problem = _not_a_snapshot(data)
    if problem is not None:
        raise ValueError(problem)
    top = _plain.fields(data, "top level", ["format", "version", "sources", "devices"])
    _plain.text(top["format"], "format", choices=(FORMAT,))
    version = top["version"]
    if type(version) is int and version > VERSION:
        raise ValueError(
            f"version {version} is newer than this deterministic-ctx reads ({VERSION}): "
            f"upgrade deterministic-ctx to load it"
        )
    _plain.integer(version, "version", VERSION, VERSION)
    here = _sources.SOURCES
    names = [s.name for s in here if s.device_type is None]
    saved = _plain.fields(
        top["sources"],
        "sources",
        [n for n in names if n not in OPTIONAL_SOURCES],
        [n for n in names if n in OPTIONAL_SOURCES],
    )
    _unregistered_rng(saved.get("user"), origin)
    devices = _plain.mapping(top["devices"], "devices")
    # Every entry is checked, known here or not.
    check_foreign_devices(devices, {t for s in here if (t := s.device_type)}, strict=strict)
    sources: list[Source] = []
    states: list[Any] = []
    for source in here:
        device = source.device_type
        if device is None:
            if source.name not in saved:  # an optional entry a file predating it lacks
                continue
            state = source.import_state(saved[source.name], f"sources.{source.name}")
        else:
            state = cast(DeviceSource, source).import_state(
                devices.get(device), f"devices.{device}", strict=strict
            )
            if state is None:  # nothing of it can be restored here (it warned or raised)
                continue
        sources.append(source)
        states.append(state)
    return World(tuple(sources), tuple(states))


# -- bytes ---------------------------------------------------------------------


def encode(state: StateDict, kind: FileKind = SNAPSHOT_FILE) -> bytes:
    """The file's bytes for a state dict made by :func:`to_state_dict` (or, with
    another ``kind``, for plain data of the same types)."""
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(value, dict):
            return {k: v if type(v) in _SCALARS else strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [v if type(v) in _SCALARS else strip(v) for v in value]
        return value

    header = json.dumps(
        {"state": strip(state), "tensors": [[t.numel()] for t in tensors]},
        separators=(",", ":"),
    ).encode("ascii")
    data = b"".join(t.detach().cpu().contiguous().numpy().tobytes() for t in tensors)
    preamble = _PREAMBLE.pack(VERSION, 0, len(header), len(data))
    body = b"".join((kind.magic, preamble, header, data))
    return body + hashlib.sha256(body).digest()


def _looks_like(data: bytes, kind: FileKind) -> str:
    name = kind.name
    if not data:
        return "the file is empty"
    # A snapshot saved inside a training checkpoint is the common mix-up: say how to load it.
    inside = (
        "; if it is a checkpoint that holds a Snapshot.state_dict() under some key, load "
        "that with Snapshot.from_state_dict(torch.load(path, weights_only=True)[key])"
        if kind.magic == MAGIC
        else ""
    )
    if data.startswith(b"PK\x03\x04"):
        return (
            f"it is a zip archive (what torch.save writes), not a {name} file written by "
            f"{name.capitalize()}.save(){inside}"
        )
    if data[:1] == b"\x80" or data[:1] in (b"(", b"}", b"]", b"c"):
        return f"it looks like a pickle, which this loader never unpickles{inside}"
    if data.startswith(b"\x93NUMPY"):
        return f"it is a NumPy .npy file, not a {name} file"
    if data.startswith(MAGIC):
        return f"it is a deterministic-ctx snapshot file, not a {name} file"
    return (
        f"it does not start with the {name} signature {kind.magic!r} (it starts with {data[:8]!r})"
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a JSON object repeats a key")
    return out


def decode(data: bytes, origin: str, kind: FileKind = SNAPSHOT_FILE) -> StateDict:
    """The state dict in a file's bytes; ``kind.error`` (:class:`InvalidSnapshotError`)
    if they are not one."""
    error = kind.error
    magic = kind.magic
    if data[: len(magic)] != magic[: len(data)] or not data:
        raise error(origin, _looks_like(data, kind))
    if len(data) < _HEAD + _DIGEST:
        raise error(origin, f"truncated: {len(data)} bytes, no room for a header")
    version, reserved, header_len, data_len = _PREAMBLE.unpack_from(data, len(MAGIC))
    check_version(version, reserved, VERSION, origin, error)
    expected = _HEAD + header_len + data_len + _DIGEST  # Python ints: no overflow
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "trailing bytes"
        raise error(
            origin, f"{what}: the file has {len(data)} bytes, its header declares {expected}"
        )
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise error(origin, "corrupted: the SHA-256 checksum does not match")
    raw = data[_HEAD : _HEAD + header_len]
    # The checksum is no defence against a crafted file.  Parsing builds a
    # Python object per list or dict: real headers hold one per ~30 bytes, a
    # crafted ``[[],[],...]`` one per 3, which would cost gigabytes before any
    # field is checked.  Counted in C first (brackets inside strings count
    # too: a bound, not a parse).
    if raw.count(b"[") + raw.count(b"{") > max(1 << 16, header_len // 8):
        raise error(origin, "bad header: far more lists and objects than its size allows")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        return _attach(header, memoryview(data)[_HEAD + header_len : _HEAD + header_len + data_len])
    except (ValueError, TypeError, RecursionError) as exc:
        raise error(origin, f"bad header: {exc}") from exc


def check_version(
    version: int,
    reserved: int,
    supported: int,
    origin: str,
    error: type[InvalidSnapshotError] = InvalidSnapshotError,
) -> None:
    """Refuse a format version (and reserved field) other than ``supported``, a newer one
    with the advice to upgrade; for this container and the formats inside others."""
    if version > supported:
        raise error(
            origin,
            f"format version {version} is newer than this deterministic-ctx reads ({supported}): "
            f"upgrade deterministic-ctx to load it",
        )
    if version != supported or reserved != 0:
        raise error(origin, f"unknown format version {version}.{reserved}")


def _attach(header: object, blob: memoryview) -> StateDict:
    """Replace each ``{"$tensor": i}`` of the header's state with tensor ``i``."""
    h = _plain.fields(header, "header", ["state", "tensors"])
    sizes = h["tensors"]
    if type(sizes) is not list or len(sizes) > _MAX_TENSORS:
        raise ValueError(f"header.tensors: expected a list of at most {_MAX_TENSORS} shapes")
    tensors: list[torch.Tensor] = []
    offset = 0
    for i, shape in enumerate(sizes):
        (n,) = _plain.integers(shape, f"header.tensors[{i}]", 1, 0, len(blob) - offset)
        chunk = bytearray(blob[offset : offset + n])  # frombuffer wants a writable buffer
        # frombuffer refuses an empty buffer; the device is explicit because the
        # caller's default device (torch.set_default_device) may be another.
        empty = torch.empty(0, dtype=torch.uint8, device="cpu")
        tensors.append(torch.frombuffer(chunk, dtype=torch.uint8) if n else empty)
        offset += n
    if offset != len(blob):
        raise ValueError(f"header.tensors: they hold {offset} bytes, the data section {len(blob)}")
    used: set[int] = set()

    def attach(value: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
        # Scalars are taken as they are, without a call or a path each (traces hold
        # many); below the depth limit only, which they would exceed.
        flat = depth < _MAX_DEPTH
        if isinstance(value, dict):
            if value.keys() == {_TENSOR}:
                i = _plain.integer(value[_TENSOR], path, 0, len(tensors) - 1)
                if i in used:
                    raise ValueError(f"{path}: tensor {i} is used twice")
                used.add(i)
                return tensors[i]
            return {
                k: v if flat and type(v) in _SCALARS else attach(v, f"{path}.{k}", depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [
                v if flat and type(v) in _SCALARS else attach(v, f"{path}[{j}]", depth + 1)
                for j, v in enumerate(value)
            ]
        return value

    state = attach(h["state"], "state", 0)
    if len(used) != len(tensors):
        raise ValueError(f"header.tensors: {len(tensors) - len(used)} tensor(s) are never used")
    if not isinstance(state, dict):
        raise ValueError(f"state: expected a dict, got {type(state).__name__}")
    return state


# -- files ---------------------------------------------------------------------


def origin_of(path: str | os.PathLike[str]) -> str:
    """How errors name a file."""
    return f"file {os.fspath(path)!r}"


def read(path: str | os.PathLike[str], kind: FileKind = SNAPSHOT_FILE) -> bytes:
    """The file's bytes, refusing to read more than :data:`MAX_FILE_BYTES`."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray()
        # ``read(n)`` allocates n bytes up front: ask for what the file holds
        # (plus one, to see it end), then in small steps if it is not a regular
        # file or grew meanwhile, never past the limit.
        want = size + 1
        while size <= MAX_FILE_BYTES and len(data) <= MAX_FILE_BYTES:
            chunk = f.read(min(want, MAX_FILE_BYTES + 1 - len(data)))
            if not chunk:
                break
            data += chunk
            want = 1 << 16
    if size > MAX_FILE_BYTES or len(data) > MAX_FILE_BYTES:
        raise kind.error(
            origin_of(path), f"larger than any {kind.name} (the limit is {MAX_FILE_BYTES} bytes)"
        )
    return bytes(data)


def write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: the file is the old one or the new one,
    never a mix, even if the process or the machine dies half-way."""
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never reuse a file someone else made; 0o666 & umask, like open().
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
        replaced = True
    finally:
        if not replaced:  # whatever stopped it: no temporary file left behind
            with contextlib.suppress(OSError):
                os.unlink(temp)
    # Fsyncing the directory makes the rename itself durable.  Not possible on
    # Windows, and some file systems refuse it: the rename is atomic all the same.
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
