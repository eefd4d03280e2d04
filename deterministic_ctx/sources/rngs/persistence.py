"""RNG states as checkpoint data, and back, checked: the codecs the kinds
(:mod:`.kinds`) and the global ``random``, NumPy and torch CPU sources share.

``*_to_plain`` turns a public state into plain data (``ValueError`` says why
a checkpoint cannot hold it); ``*_from_plain`` checks plain data read from a
file field by field (``ValueError`` names the field) and returns a public
state.  A random-like object's ``getstate()`` may return any tree of plain
Python data: it is flattened (no nesting in the file) and bounded
(``_MAX_*``), so that a crafted or runaway state cannot make a checkpoint
slow to write or load.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

from ...base import plain as _plain
from ..accelerators import PHILOX_DEVICES, check_philox_state
from .layouts import MT_WORDS


def random_state_to_plain(public: tuple[Any, ...]) -> dict[str, Any]:
    """``random.getstate()`` as ``{"state": [625 ints], "gauss_next": float}``.

    ``gauss_next`` is left out when it is ``None`` (a checkpoint holds no ``None``).
    """
    _version, internal, gauss_next = public
    out: dict[str, Any] = {"state": list(internal)}
    if gauss_next is not None:
        out["gauss_next"] = float(gauss_next)
    return out


def random_state_from_plain(data: object, path: str) -> tuple[Any, ...]:
    """The checked inverse of :func:`random_state_to_plain`, in ``getstate()`` form."""
    d = _plain.fields(data, path, ["state"], ["gauss_next"])
    words = _plain.integers(d["state"], f"{path}.state", MT_WORDS + 1, 0, 2**32 - 1)
    _plain.integer(words[-1], f"{path}.state[{MT_WORDS}] (the index)", 0, MT_WORDS)
    gauss = _plain.real(d["gauss_next"], f"{path}.gauss_next") if "gauss_next" in d else None
    public = (3, tuple(words), gauss)
    try:  # CPython's own check, on a throw-away generator
        random.Random().setstate(public)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{path}: random.setstate() rejects the state ({exc})") from exc
    return public


_U32, _U64, _U128 = 2**32 - 1, 2**64 - 1, 2**128 - 1
#: field -> (array length, or None for a scalar int; largest value)
_Fields = dict[str, tuple[int | None, int]]
_BUFFERED: _Fields = {"has_uint32": (None, 1), "uinteger": (None, _U32)}
#: The state of each bit generator that NumPy ships: ``(state["state"], the rest)``.
#: ``pos`` and ``buffer_pos`` index C arrays, and NumPy's setters do not check
#: them: out of range, the next draw reads outside the generator's memory.
BIT_GENERATORS: dict[str, tuple[_Fields, _Fields]] = {
    "MT19937": ({"key": (624, _U32), "pos": (None, 624)}, {}),
    "PCG64": ({"state": (None, _U128), "inc": (None, _U128)}, _BUFFERED),
    "PCG64DXSM": ({"state": (None, _U128), "inc": (None, _U128)}, _BUFFERED),
    "Philox": (
        {"counter": (4, _U64), "key": (2, _U64)},
        {"buffer": (4, _U64), "buffer_pos": (None, 4), **_BUFFERED},
    ),
    "SFC64": ({"state": (4, _U64)}, _BUFFERED),
}
_LEGACY: _Fields = {"has_gauss": (None, 1)}


def numpy_state_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    """A bit generator's ``state`` dict (or ``RandomState.get_state(legacy=False)``)
    with arrays turned into lists of ints and NumPy scalars into Python ones."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        # An array's tolist() is a list of Python ints, a NumPy scalar's a Python scalar.
        return value.tolist() if isinstance(value, np.ndarray | np.generic) else value

    result: dict[str, Any] = plain(state)
    return result


def _read(data: object, path: str, spec: _Fields, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    d = _plain.fields(data, path, [*spec, *extra])
    out: dict[str, Any] = {}
    for name, (length, hi) in spec.items():
        where = f"{path}.{name}"
        if length is None:
            out[name] = _plain.integer(d[name], where, 0, hi)
        else:
            values = _plain.integers(d[name], where, length, 0, hi)
            out[name] = np.array(values, dtype=np.uint32 if hi == _U32 else np.uint64)
    return out


def bit_generator_state_from_plain(
    data: object, path: str, *, legacy: bool = False
) -> dict[str, Any]:
    """The checked inverse of :func:`numpy_state_to_plain`, ready for
    ``bit_generator.state = ...`` (or, with ``legacy``, ``RandomState.set_state``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict, got {type(data).__name__}")
    name = _plain.text(data.get("bit_generator"), f"{path}.bit_generator", choices=BIT_GENERATORS)
    inner, outer = BIT_GENERATORS[name]
    outer = {**outer, **_LEGACY} if legacy else outer
    extra = ("bit_generator", "state", "gauss") if legacy else ("bit_generator", "state")
    rest = _read(data, path, outer, extra)  # checks the whole key set
    public = {"bit_generator": name, "state": _read(data["state"], f"{path}.state", inner), **rest}
    if legacy:
        public["gauss"] = _plain.real(data["gauss"], f"{path}.gauss")
    try:  # NumPy's own checks, on a throw-away generator
        probe = getattr(np.random, name)()
        if legacy:
            np.random.RandomState(probe).set_state(public)
        else:
            probe.state = public
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise ValueError(f"{path}: NumPy rejects the {name} state ({exc})") from exc
    return public


def generator_state_from_plain(value: object, path: str, like: torch.Generator) -> torch.Tensor:
    """A checked state for the generator ``like``: a uint8 tensor of its size.

    A CPU state is also set on a throw-away generator first: torch checks the
    Mersenne Twister's fields there (a bad ``left``/``next`` is "Invalid mt19937
    state"), so a crafted state fails here, not at restore.  A CUDA or XPU state
    is checked against torch's Philox rules instead (:func:`check_philox_state`),
    without touching the device: a throw-away generator there would.
    """
    state = _plain.byte_tensor(value, path, numel=like.get_state().numel())
    if like.device.type == "cpu":
        try:
            torch.Generator().set_state(state)
        except RuntimeError as exc:
            raise ValueError(f"{path}: torch rejects the generator state ({exc})") from exc
    elif like.device.type in PHILOX_DEVICES:
        check_philox_state(state, path, like.device.type)
    return state


def class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


#: Bounds on a random-like object's saved state: far above a Mersenne Twister's
#: 627 items, far below what would make a checkpoint slow to write or load.
_MAX_NODES = 1 << 16
_MAX_TEXT = 1 << 20  # characters of all strings together
_MAX_INT_BITS = 4096  # JSON writes ints as decimal digits; Python caps them at 4300
_MAX_DEPTH = 64
#: Bytes of all tensors together: a CPU generator's state is 5056 bytes.
_MAX_TENSOR_BYTES = 1 << 22
#: One letter per item, in prefix order: scalars, then containers.
_SCALARS: dict[type, str] = {int: "i", float: "f", str: "s", bool: "b", type(None): "n"}
#: The letter of a tensor leaf (a generator state): a value, like a scalar,
#: but never a dict key.
_TENSOR = "x"
_CONTAINERS: dict[type, str] = {tuple: "t", list: "l", dict: "d"}


def random_like_to_plain(obj: object, state: object) -> dict[str, Any]:
    """A random-like object's state, a tree of plain Python data, as checkpoint
    data, without nesting.

    ``{"class": str, "shape": str, "values": [...], "sizes": [...]}``:
    ``class`` the object's class path, ``shape`` has one letter per item in
    prefix order (``i`` int, ``f`` float, ``s`` str, ``b``
    bool, ``n`` None, ``x`` 1-D uint8 CPU tensor, ``t`` tuple, ``l`` list,
    ``d`` dict), ``values`` the scalars other than ``None`` and the tensors
    (copies) in that order, ``sizes`` the length of each container (a dict's
    items follow it as key, value, key, value, ...; keys are scalars).  Exact
    types only: a subclass (a NamedTuple, an IntEnum) would come back as its
    base type.  Raises ``ValueError``, saying why a checkpoint cannot hold it.
    """
    shape: list[str] = []
    values: list[object] = []
    sizes: list[int] = []
    text = 0
    nbytes = 0

    def walk(item: Any, where: str, depth: int) -> None:
        nonlocal text, nbytes
        if len(shape) >= _MAX_NODES:
            raise ValueError(f"getstate() returned more than {_MAX_NODES} items")
        kind = type(item)
        if kind is torch.Tensor:
            if item.dtype != torch.uint8 or item.dim() != 1 or item.device.type != "cpu":
                raise ValueError(
                    f"getstate(){where} is a {item.device.type} {item.dtype} tensor of shape "
                    f"{tuple(item.shape)}, and only 1-D uint8 CPU tensors (generator states) "
                    f"are saved"
                )
            nbytes += item.numel()
            if nbytes > _MAX_TENSOR_BYTES:
                raise ValueError(f"getstate() holds more than {_MAX_TENSOR_BYTES} tensor bytes")
            shape.append(_TENSOR)
            values.append(item.detach().clone())  # the file is written later: a copy
            return
        letter = _SCALARS.get(kind)
        if letter is not None:
            if kind is int and item.bit_length() > _MAX_INT_BITS:
                raise ValueError(f"getstate(){where} is an int of more than {_MAX_INT_BITS} bits")
            if kind is str:
                text += len(item)
                if text > _MAX_TEXT:
                    raise ValueError(f"getstate() holds more than {_MAX_TEXT} characters")
            shape.append(letter)
            if letter != "n":
                values.append(item)
            return
        letter = _CONTAINERS.get(kind)
        if letter is None:
            raise ValueError(f"getstate(){where} is a {class_path(item)}")
        if depth >= _MAX_DEPTH:
            raise ValueError(f"getstate() nests deeper than {_MAX_DEPTH} levels")
        shape.append(letter)
        sizes.append(len(item))
        if letter == "d":
            for k, v in item.items():
                if type(k) not in _SCALARS:
                    raise ValueError(f"getstate(){where} has a key of type {class_path(k)}")
                walk(k, where, depth + 1)
                walk(v, f"{where}[{k!r}]", depth + 1)
        else:
            for j, v in enumerate(item):
                walk(v, f"{where}[{j}]", depth + 1)

    try:
        walk(state, "", 0)
    except ValueError as exc:
        raise ValueError(
            f"{exc}, and a snapshot holds only plain data (int, float, str, bool, None, 1-D "
            f"uint8 CPU tensors, and lists, tuples and dicts of them, at most {_MAX_NODES} "
            f"items); or make its "
            f"getstate() return plain data"
        ) from None
    return {"class": class_path(obj), "shape": "".join(shape), "values": values, "sizes": sizes}


def random_like_from_plain(obj: object, data: object, path: str) -> object:
    """The checked inverse of :func:`random_like_to_plain`, for ``obj`` (whose
    class must be the saved one); ``ValueError`` names the field.

    It nests no deeper than :data:`_MAX_DEPTH` (a crafted file cannot exhaust
    the stack), and it allocates no more than the data holds.
    """
    d = _plain.fields(data, path, ["class", "shape", "values", "sizes"])
    _plain.text(d["class"], f"{path}.class", choices=(class_path(obj),))
    shape, values, sizes = d["shape"], d["values"], d["sizes"]
    if type(shape) is not str or not shape or len(shape) > _MAX_NODES:
        raise ValueError(f"{path}.shape: expected a str of 1 to {_MAX_NODES} letters")
    if type(values) is not list or type(sizes) is not list:
        raise ValueError(f"{path}: values and sizes must be lists")
    types = {letter: kind for kind, letter in _SCALARS.items()}
    pos = nv = ns = nbytes = 0  # read so far: letters, values, sizes; tensor bytes

    def item(depth: int) -> Any:
        nonlocal pos, nv, ns, nbytes
        if pos == len(shape):
            raise ValueError(f"{path}.shape: the state ends inside a container")
        letter, where = shape[pos], f"{path}.shape[{pos}]"
        pos += 1
        if letter == "n":
            return None
        if letter in types or letter == _TENSOR:
            if nv == len(values):
                raise ValueError(f"{path}.values: too few for the shape")
            value: Any = values[nv]
            at = f"{path}.values[{nv}]"
            nv += 1
            if letter == _TENSOR:
                value = _plain.byte_tensor(value, at)  # checked, copied
                nbytes += value.numel()
                if nbytes > _MAX_TENSOR_BYTES:
                    raise ValueError(f"{path}.values: more than {_MAX_TENSOR_BYTES} tensor bytes")
            elif type(value) is not types[letter]:
                raise ValueError(
                    f"{at}: expected a {types[letter].__name__} (shape {letter!r}), "
                    f"got {type(value).__name__}"
                )
            elif letter == "i" and cast(int, value).bit_length() > _MAX_INT_BITS:
                raise ValueError(f"{at}: an int of more than {_MAX_INT_BITS} bits")
            return value
        if letter not in ("t", "l", "d"):
            raise ValueError(f"{where}: unknown letter {letter!r} (expected one of ifsbnxtld)")
        n = sizes[ns] if ns < len(sizes) else None
        ns += 1
        if type(n) is not int or not 0 <= n <= len(shape) - pos:
            raise ValueError(f"{path}.sizes[{ns - 1}]: expected an int of at most the items left")
        if depth >= _MAX_DEPTH:
            raise ValueError(f"{where}: nests deeper than {_MAX_DEPTH} levels")
        items = [item(depth + 1) for _ in range(2 * n if letter == "d" else n)]
        if letter != "d":
            return tuple(items) if letter == "t" else items
        if any(type(key) not in _SCALARS for key in items[::2]):
            raise ValueError(f"{where}: a dict key must be a scalar")
        out = dict(zip(items[::2], items[1::2], strict=True))
        if len(out) != n:
            raise ValueError(f"{where}: a dict repeats a key")
        return out

    root = item(0)
    if pos < len(shape):
        raise ValueError(f"{path}.shape[{pos}]: items after the end of the state")
    if nv < len(values) or ns < len(sizes):
        raise ValueError(f"{path}: values or sizes left over after the shape")
    return root
