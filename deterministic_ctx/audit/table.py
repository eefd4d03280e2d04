"""The table behind :func:`~deterministic_ctx.audit.audit_nondeterminism`: aten ops that are
nondeterministic on CUDA, or have no deterministic CUDA kernel, and what
``torch.use_deterministic_algorithms(True)`` does about each.

Data, not logic: one object per case in the data file :data:`DATA_FILE`
beside this module, read once, at the first call of :func:`table`, through
:mod:`importlib.resources`, and checked field by field (a bad edit raises
:class:`TableError`); each becomes an :class:`~.model.OpEntry`.  An entry
names the aten ops it covers (overload packet names: ``"index_put_"`` covers
``aten.index_put_.default`` and ``aten.index_put_.hacked_twin``), the
condition on the call's arguments (the name of a small predicate of
:data:`~.conditions.CONDITIONS`, and the same condition in words), the
behaviour under deterministic mode (and, where torch changed it, the
behaviour on earlier releases), the phase the op normally runs in, and a
note; a field left out takes :class:`~.model.OpEntry`'s default.  Each entry
has a runnable example under its key in the tests (``tests/verify/audit_examples.py``),
which ``tests/verify/test_audit.py`` runs on a real CUDA device to check the
behaviour.  Entries for one op are tried in order; the first whose condition
holds wins.

The releases it was checked against are :data:`~.model.CHECKED_TORCH`;
:data:`~.model.CHECKS` says how.  On torch 2.11 every entry's example ran on an NVIDIA H200 (torch
2.11.0+cu130, 2026-11-23) under ``use_deterministic_algorithms(True)`` and
``(True, warn_only=True)``: what it did there is the table's 2.11 behaviour
(an entry's :attr:`~.model.OpEntry.observed`).  On torch 2.13 the behaviours are
read, not run: ``torch/nn/functional.py`` and ``torch/_decomp`` of 2.13.0 (the
Python routes around native kernels), the ``use_deterministic_algorithms``
docstring, and the alert names and kernels present in ``libtorch_cuda.so`` of
the 2.13.0+cu130 wheel (git ``cf30153c``), compared with 2.11.0's (git
``70d99e99``).  Where they disagree, the code wins over the docstring, which
is stale in both releases: it still lists ``cumsum`` and ``ReflectionPad2d``
among the ops that raise, and 2.13's lists ``MaxPool3d`` among those that
become deterministic although only ``F.max_pool3d(return_indices=True)`` does.

What changed between the two releases: ``F.max_pool3d_with_indices``
(``return_indices=True``) on CUDA in deterministic mode computes the pooling
with a decomposition whose backward is deterministic from 2.13 on (absent in
2.12.0's ``functional.py``); the default ``F.max_pool3d`` still calls the
native kernel, which raises.  Entries that differ from torch's docstring, from
the kernels: ``scatter_reduce`` with ``"amax"``/``"amin"`` neither raises nor
warns although its atomic maximum can pick either of ``0.0`` and ``-0.0``;
``index_reduce`` raises for every reduction; ``scatter_(reduce="multiply")``
raises (``scatter_reduce_cuda_kernel``) while ``reduce="add"`` is rerouted to
``index_put_``; ``cumsum`` switches to a deterministic scan;
``ReflectionPad2d`` backward has a deterministic kernel
(``reflection_pad2d_backward_det_out_kernel``), ``ReflectionPad1d``/``3d`` do
not; ``AdaptiveMaxPool3d`` backward accumulates atomically and is not flagged
(``"none"``).

Not listed, because their CUDA kernels are deterministic: ``index_put`` with
``accumulate=True`` (always sorted on CUDA), ``embedding`` backward and
``EmbeddingBag`` backward with ``mode="sum"`` / ``"mean"`` (sorted),
``nll_loss`` on 1-D/2-D input, ``avg_pool2d`` and ``max_pool2d`` backward,
nearest-neighbour upsampling, ``kthvalue`` (no alert since before 2.11, and
ties gave the same indices on the H200), ``cumsum`` along a dimension that is
not the whole tensor, ``scatter_`` with a scalar value (every update is the
same), matmuls (cuBLAS; torch 2.10 dropped the ``CUBLAS_WORKSPACE_CONFIG``
check, see :data:`~.model.CUBLAS_CONFIG_CHECKED_BEFORE`).

Example:
    >>> from deterministic_ctx.audit.table import entries_for, table
    >>> [e.key for e in entries_for("put_")]
    ['put', 'put-accumulate']
    >>> all(e.behaviour in ("raise", "warn", "deterministic", "none") for e in table())
    True
    >>> pool = entries_for("max_pool3d_with_indices_backward")[0]
    >>> pool.behaviour_on("2.11.0+cu130"), pool.behaviour_on("2.13.0")
    ('raise', 'deterministic')
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from importlib import resources
from typing import Any, NoReturn, cast, get_args

from .._errors import DeterministicCtxError
from .conditions import CONDITIONS
from .model import Behaviour, Kind, OpCall, OpEntry, Phase

__all__ = ["DATA_FILE", "TableError", "entries_for", "parse", "table", "uninitialized_entry"]

#: The table's data file, in this package (``[tool.setuptools.package-data]`` ships it).
DATA_FILE = "nondeterministic_ops.json"

_PACKAGE = __name__.rpartition(".")[0]


class TableError(DeterministicCtxError, ValueError):
    """The table's data file is malformed: the message names the entry, the field and
    what is wrong with it."""


def _fail(where: str, problem: str) -> NoReturn:
    raise TableError(f"{DATA_FILE}: {where}: {problem}")


def _string(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        _fail(where, f"{field} must be a string, got {type(value).__name__} {value!r:.80}")
    return value


def _strings(value: object, where: str, field: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        _fail(where, f"{field} must be a list of strings, got {type(value).__name__}")
    return tuple(_string(item, where, f"{field}[{i}]") for i, item in enumerate(value))


def _choice(value: object, where: str, field: str, choices: tuple[str, ...]) -> str:
    if not (isinstance(value, str) and value in choices):
        _fail(where, f"{field} must be one of {', '.join(map(repr, choices))}, got {value!r:.80}")
    return value


def _behaviour(value: object, where: str, field: str) -> Behaviour:
    return cast(Behaviour, _choice(value, where, field, get_args(Behaviour)))


def _earlier(value: object, where: str, field: str) -> tuple[tuple[str, Behaviour], ...]:
    if not isinstance(value, list):
        _fail(where, f"{field} must be a list of [release, behaviour] pairs, got {value!r:.80}")
    pairs = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            _fail(where, f"{field}[{i}] must be a [release, behaviour] pair, got {pair!r:.80}")
        release = _string(pair[0], where, f"{field}[{i}][0]")
        pairs.append((release, _behaviour(pair[1], where, f"{field}[{i}][1]")))
    return tuple(pairs)


def _when(value: object, where: str, field: str) -> Callable[[OpCall], bool]:
    name = _string(value, where, field)
    if name not in CONDITIONS:
        _fail(where, f"{field} names no predicate of conditions.CONDITIONS: {name!r}")
    return CONDITIONS[name]


#: Each field of an entry, with the check that makes it an :class:`~.model.OpEntry`
#: field: the first five are required, the others take OpEntry's defaults when left out
#: (or, for those of ``_NULLABLE``, null).
_FIELDS: dict[str, Callable[[object, str, str], Any]] = {
    "key": _string,
    "ops": _strings,
    "behaviour": _behaviour,
    "phase": lambda value, where, field: _choice(value, where, field, get_args(Phase)),
    "note": _string,
    "condition": _string,
    "when": _when,
    "warn_only_behaviour": _behaviour,
    "kind": lambda value, where, field: _choice(value, where, field, get_args(Kind)),
    "parameters": _strings,
    "unless_dispatched": _strings,
    "earlier": _earlier,
    "observed": _strings,
}
_REQUIRED = tuple(_FIELDS)[:5]
_NULLABLE = ("when", "warn_only_behaviour")


def _entry(raw: object, index: int) -> OpEntry:
    """One entry of the data file, checked, as an :class:`~.model.OpEntry`."""
    where = f"entry {index}"
    if not isinstance(raw, dict):
        _fail(where, f"must be an object, got {type(raw).__name__}")
    if isinstance(raw.get("key"), str):
        where = f"entry {index} ({raw['key']!r})"
    missing = [field for field in _REQUIRED if field not in raw]
    if missing:
        _fail(where, f"missing field(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        _fail(where, f"unknown field(s) {', '.join(unknown)} (known: {', '.join(_FIELDS)})")
    fields = {
        field: check(raw[field], where, field)
        for field, check in _FIELDS.items()
        if field in raw and not (raw[field] is None and field in _NULLABLE)
    }
    if not fields["key"] or not fields["ops"]:
        _fail(where, "key and ops must not be empty")
    return OpEntry(**fields)


def parse(data: object) -> tuple[OpEntry, ...]:
    """The entries of the data file's contents ``data`` (parsed JSON), checked: each
    field's type and values, unique keys, one ``"uninitialized"`` entry, and that every
    predicate named exists and is used.  Raises :class:`TableError`."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        _fail("top level", "must be an object with an entries list")
    unknown = sorted(set(data) - {"about", "entries"})
    if unknown:
        _fail("top level", f"unknown field(s) {', '.join(unknown)} (known: about, entries)")
    entries = tuple(_entry(raw, i) for i, raw in enumerate(data["entries"]))
    keys = [entry.key for entry in entries]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        _fail("entries", f"keys must be unique, repeated: {', '.join(repeated)}")
    if sum(entry.kind == "uninitialized" for entry in entries) != 1:
        _fail("entries", 'there must be exactly one entry of kind "uninitialized"')
    named = {raw.get("when") for raw in data["entries"]}
    unused = sorted(set(CONDITIONS) - named)
    if unused:
        _fail(
            "entries",
            f"no entry names these predicates of conditions.CONDITIONS: {', '.join(unused)}",
        )
    return entries


@functools.cache
def table() -> tuple[OpEntry, ...]:
    """Every case, in the order they are tried (per op, the first that matches wins): the
    data file, read and checked at the first call."""
    text = resources.files(_PACKAGE).joinpath(DATA_FILE).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableError(f"{DATA_FILE}: not valid JSON: {exc}") from None
    return parse(data)


@functools.cache
def _by_name() -> dict[str, tuple[OpEntry, ...]]:
    by_name: dict[str, tuple[OpEntry, ...]] = {}
    for entry in table():
        if entry.kind != "uninitialized":
            for name in entry.ops:
                by_name[name] = (*by_name.get(name, ()), entry)
    return by_name


def entries_for(name: str) -> tuple[OpEntry, ...]:
    """The entries (not ``"uninitialized"`` ones) for an aten overload packet name or a
    qualified function name, in the order they are tried; ``()`` when none.

    Example:
        >>> [e.key for e in entries_for("upsample_bilinear2d_backward")]
        ['upsample-F.interpolate', 'upsample']
        >>> entries_for("mm")
        ()
    """
    return _by_name().get(name, ())


def uninitialized_entry() -> OpEntry:
    """The entry for memory read before it was written.

    Example:
        >>> "empty" in uninitialized_entry().ops
        True
    """
    return next(e for e in table() if e.kind == "uninitialized")
