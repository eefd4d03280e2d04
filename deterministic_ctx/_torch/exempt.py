"""The dispatcher's side of ``allow_nondeterministic``: naming ops, and a kernel
in front of each exempted one that runs only where an exemption is open.

**Mechanism.**  torch checks ``use_deterministic_algorithms`` inside its
kernels (``alertNotDeterministic``) and keeps the flag process-wide, so an op
is exempted by turning the flag off for exactly that op's call.  The call is
intercepted in the dispatcher, not by a dispatch mode (a Python call for every
op of the step, several times the cost of a small model's step): a Python
kernel is registered, once per exempted overload, at the ``PreDispatch`` key,
whose every other op runs torch's own no-op fallback.  That key is in no
tensor's key set: it is reached only while a thread *includes* it
(:func:`include`), which an exemption does while it is open.  Outside
exemptions no op pays anything; inside one, every other op pays one C++
redispatch.  The included key is part of the thread-local state that autograd
hands to its engine threads, so the backward kernels of a ``backward()``
called inside an exemption (CUDA runs them on those threads) reach the kernel
too.

Importing this module imports torch.

Example:
    >>> from deterministic_ctx._torch.exempt import resolve_ops, op_label
    >>> [op_label(op) for op in resolve_ops("aten::index_add")]
    ['aten::index_add', 'aten::index_add.out']
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

from . import SCOPED_EXEMPTION, TorchFeatureError

__all__ = ["include", "included", "install", "op_label", "redispatch", "resolve_ops", "tracing_now"]

_C: Any = torch._C


def resolve_ops(spec: object) -> tuple[OpOverload, ...]:
    """The overloads ``spec`` names: ``"ns::name"``, ``"ns.name"`` (every overload),
    ``"ns::name.overload"``, an ``OpOverloadPacket`` (every overload) or an
    ``OpOverload`` (that one).  ``ValueError`` names an op torch does not know;
    ``TypeError`` anything else."""
    if isinstance(spec, OpOverload):
        return (spec,)
    if isinstance(spec, OpOverloadPacket):
        return tuple(getattr(spec, name) for name in spec.overloads())  # type: ignore[no-untyped-call]
    if not isinstance(spec, str):
        raise TypeError(
            f"allow_nondeterministic: each op is a name like 'aten::index_add' or an op "
            f"object like torch.ops.aten.index_add, not {type(spec).__name__} ({spec!r})"
        )
    namespace, sep, rest = spec.partition("::")
    if not sep:
        namespace, sep, rest = spec.partition(".")
    name, _, overload = rest.partition(".")
    if not (sep and namespace and name):
        raise ValueError(
            f"allow_nondeterministic: {spec!r} is not an op name: write it as torch's alert "
            f"and audit_nondeterminism do, 'namespace::name' (e.g. "
            f"'aten::upsample_bilinear2d_backward')"
        )
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        if not isinstance(packet, OpOverloadPacket):
            raise AttributeError(name)
        if overload:
            found = getattr(packet, overload)
            return (found,) if isinstance(found, OpOverload) else ()
        return tuple(getattr(packet, o) for o in packet.overloads())  # type: ignore[no-untyped-call]
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"allow_nondeterministic: torch has no op {spec!r} (no '{namespace}::{rest}' is "
            f"registered; the name is the one in torch's alert or audit_nondeterminism's "
            f"table, e.g. 'aten::upsample_bilinear2d_backward'; a custom op's library must "
            f"be loaded first)"
        ) from None


def op_label(op: OpOverload) -> str:
    """``'aten::index_add'``, ``'aten::index_add.out'``: an overload as torch names it."""
    label: str = op.name()  # type: ignore[no-untyped-call]
    return label


_key: Any
_included: Any
_set_included: Any
_after: Any
_key, _included, _set_included, _after = SCOPED_EXEMPTION.value or (None, None, None, None)

#: The libraries that hold the kernels, by namespace (one per namespace: a
#: ``torch.library.Library`` registers only in its own), and the overloads done.
_libraries: dict[str, Any] = {}
_installed: set[OpOverload] = set()
_install_lock = threading.Lock()


def _require() -> None:
    if _key is None:
        raise TorchFeatureError(
            f"allow_nondeterministic needs {SCOPED_EXEMPTION.reads} (torch >= "
            f"{SCOPED_EXEMPTION.since}); this torch lacks it, so no op can be exempted: turn "
            f"deterministic algorithms off around the op, or use warn_only=True"
        )


def install(op: OpOverload, kernel: Callable[..., Any]) -> None:
    """Register ``kernel(keyset, *args, **kwargs)`` in front of ``op``, once per
    process.  ``TorchFeatureError`` where this torch cannot, or where torch put
    a kernel of its own there (``torch.export``'s pre-dispatch tracing does for
    a few ops): that one is never replaced."""
    _require()
    with _install_lock:
        if op in _installed:
            return
        name = op_label(op)
        if _C._dispatch_has_kernel_for_dispatch_key(name, _key):
            raise TorchFeatureError(
                f"allow_nondeterministic cannot exempt {name}: torch has a kernel of its own "
                f"for it at the dispatch key the exemption uses (PreDispatch)"
            )
        namespace, _, qualified = name.partition("::")
        library = _libraries.get(namespace)
        if library is None:
            library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
        library.impl(qualified, kernel, "PreDispatch", with_keyset=True)
        _installed.add(op)


def included() -> bool:
    """Whether the calling thread's ops reach the kernels now."""
    now: bool = _included(_key)
    return now


def include(on: bool) -> None:
    """Make the calling thread's ops reach the kernels (``on``) or not."""
    _set_included(_key, on)


def redispatch(op: OpOverload, keyset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``op`` as if the kernel were not there: what torch's fallback does."""
    return op.redispatch(keyset & _after, *args, **kwargs)


def tracing_now() -> bool:
    """Whether the calling thread traces a graph (a fake or proxy tensor mode:
    dynamo, AOTAutograd, ``torch.export``), where an op's call is recorded, not run."""
    from .compiler import tracing_here

    return tracing_here()
