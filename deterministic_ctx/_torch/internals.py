"""torch's private Python modules and attributes, read in one place: config
modules, lazily seeded devices, dispatch modes, dynamo and inductor.

With :mod:`deterministic_ctx._torch.flags` (torch's C functions) and the
capabilities of :mod:`deterministic_ctx._torch`, this is the only module
that names a private torch attribute or module; the rest of the package
calls the names below.  Each says what it reads, the torch versions that
have it (the supported range, torch 2.1 and later, unless said), and what
happens without it.

What a block reads every time is read once here and kept by the caller
(:data:`lazy_seed_queue`, a C ``operator.attrgetter``), or is a C function
of :mod:`deterministic_ctx._torch.flags`: no Python frame per block.  Nothing
here imports a torch module that torch itself does not import, but where a
name says so (:func:`inductor_config`, :func:`dynamo_disable`,
:func:`device_context`).

Importing this module imports torch.

Example:
    >>> from deterministic_ctx._torch import internals
    >>> internals.INDUCTOR_CONFIG
    'torch._inductor.config'
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from operator import attrgetter
from types import CodeType
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from . import SCOPED_EXEMPTION, TorchFeatureError

__all__ = [
    "AUTOGRAD_ENGINE_ENTRIES",
    "BATCH_NORM_BASE",
    "CONFIG_MODULE",
    "DROPOUT_BASE",
    "DYNAMO",
    "DYNAMO_CONFIG",
    "FUNCTORCH_CONFIG",
    "INDUCTOR",
    "INDUCTOR_CONFIG",
    "TORCH_MACHINERY",
    "UnwrappedDispatchMode",
    "bad_fork_check",
    "compiled_in_place",
    "compiled_original",
    "config_default",
    "config_entries",
    "config_layout",
    "config_unset",
    "current_dispatch_mode",
    "device_context",
    "device_context_slot",
    "dynamo_disable",
    "dynamo_disable_message",
    "exemption_included",
    "foreach_copy_",
    "function_mode_stack",
    "import_dynamo",
    "include_exemption",
    "inductor_config",
    "inductor_mode_options",
    "install_exemption",
    "is_compiled_check",
    "is_device_context",
    "lazy_seed_queue",
    "mark_opaque_to_dynamo",
    "node_sequence_nr",
    "op_label",
    "redispatch_exempted",
    "remove_function_mode",
    "require_exemption",
    "resolve_ops",
    "set_device_context_slot",
    "write_config_override",
]


# -- module names -------------------------------------------------------------------------

INDUCTOR = "torch._inductor"
"""Inductor, torch.compile's default backend (every supported torch).  Read from
``sys.modules`` only: importing it costs about a second."""

INDUCTOR_CONFIG = "torch._inductor.config"
"""Inductor's config module (every supported torch): ``fallback_random``,
``deterministic`` (torch >= 2.7), ... ."""

FUNCTORCH_CONFIG = "torch._functorch.config"
"""AOTAutograd's config module (every supported torch): ``functionalize_rng_ops``, ... ."""

DYNAMO = "torch._dynamo"
"""Dynamo, torch.compile's tracer (every supported torch).  Importing it costs about 2 s."""

DYNAMO_CONFIG = "torch._dynamo.config"
"""Dynamo's config module (every supported torch): ``use_numpy_random_stream``, ... ."""

CONFIG_MODULE = "torch.utils._config_module"
"""torch's implementation of config modules (every supported torch)."""

TORCH_MACHINERY = ("torch._dynamo", "torch._compile", "torch._ops", "torch.utils._python_dispatch")
"""Prefixes of the modules between an op's caller and ``__torch_dispatch__`` (every
supported torch; a module renamed by a later torch reads as the caller's code)."""


# -- config modules (sources/config_entries.py) -------------------------------------------


def config_unset() -> object | None:
    """torch's "nobody set it" sentinel of config entries,
    ``torch.utils._config_module._UNSET_SENTINEL`` (torch >= 2.6; ``None`` before, or
    while no config module is imported: then entries are read and written by value)."""
    return getattr(sys.modules.get(CONFIG_MODULE), "_UNSET_SENTINEL", None)


def config_entries(config: object) -> dict[str, Any] | None:
    """A config module's entries, ``config._config`` (``{key: _ConfigEntry}``; every
    supported torch), or ``None`` where it is not a dict (an unknown layout, or no module)."""
    entries = getattr(config, "_config", None)
    return entries if isinstance(entries, dict) else None


_NO_DEFAULT: tuple[bool, Any] = (False, None)


def config_default(config: object, key: str) -> tuple[bool, Any]:
    """``(True, default)``: an entry's default as torch made it when it imported the module,
    or ``(False, None)`` where the module does not say.  ``config._config[key].default``
    where the entries are torch's ``_ConfigEntry`` (torch >= 2.6); before, ``config._config``
    holds the values themselves and ``config._default`` (``{key: value}``, written once at
    import) the defaults (torch 2.1 to 2.5)."""
    entries = config_entries(config)
    entry = entries.get(key, _NO_DEFAULT) if entries is not None else _NO_DEFAULT
    if entry is not _NO_DEFAULT and hasattr(entry, "default"):
        return True, entry.default
    defaults = getattr(config, "_default", None)
    if isinstance(defaults, dict) and key in defaults:
        return True, defaults[key]
    return _NO_DEFAULT


def config_layout(config: Any, entry: Any) -> bool | None:
    """How a config module keeps an entry's user override: ``True``, a ``ContextVar``
    with the module's ``_hash_dirty_var`` and ``_mark_get_dict_dirty`` (torch >= 2.12);
    ``False``, a plain attribute with the module's ``_is_dirty`` (torch <= 2.11);
    ``None``: neither layout (the entry is then read and written with getattr/setattr)."""
    if entry is None or not hasattr(entry, "user_override"):
        return None
    override = entry.user_override
    if (
        callable(getattr(override, "get", None))
        and callable(getattr(override, "set", None))
        and callable(getattr(config, "_mark_get_dict_dirty", None))
        and hasattr(config, "_hash_dirty_var")
    ):
        return True
    if hasattr(config, "_is_dirty") and not hasattr(config, "_hash_dirty_var"):
        return False
    return None


def write_config_override(config: Any, entry: Any, var: bool, key: str, target: object) -> None:
    """Write an entry's user override as torch's own patcher does, and mark the module's
    caches dirty, in the layout :func:`config_layout` found (``var``)."""
    if var:
        entry.user_override.set(target)
        # The caches of the compile-cache key and of get_dict (torch's own patcher does this).
        config._hash_dirty_var.set(True)
        config._mark_get_dict_dirty(key)
    else:
        entry.user_override = target
        # The compile-cache key is hashed again.  Written into the module's dict, as
        # the module's own __setattr__ does for this bypass key, without running that
        # Python method: a restore at the recursion limit must not need more frames.
        vars(config)["_is_dirty"] = True


# -- lazily seeded devices (sources/accelerators.py) -----------------------------------------

lazy_seed_queue: Callable[[Any], tuple[Any, list[Any]]] = attrgetter(
    "_lazy_seed_tracker", "_queued_calls"
)
"""``(module._lazy_seed_tracker, module._queued_calls)`` of ``torch.cuda``, ``torch.xpu``
(torch >= 2.4) or ``torch.mtia`` (torch >= 2.7), in one C call: the seeds queued until the
device initializes, and the calls it runs then.  torch makes both once, when it imports
the module, and only mutates them after: a source reads them once.  Only called on a
module that :func:`deterministic_ctx._torch.lazy_device` accepted."""


def is_compiled_check(module: object) -> Callable[[], bool] | None:
    """A device module's ``_is_compiled`` (whether this build has the device: every
    supported torch's ``torch.cuda``); ``None`` where missing: the device is assumed
    usable."""
    return getattr(module, "_is_compiled", None)


def bad_fork_check(module: object) -> Callable[[], bool] | None:
    """A device module's ``_is_in_bad_fork`` (whether this is a child forked after the
    device initialized, which cannot use it: every supported torch's ``torch.cuda``);
    ``None`` where missing: never in a bad fork."""
    return getattr(module, "_is_in_bad_fork", None)


# -- torch's process defaults (sources/torch_defaults.py) --------------------------------


def function_mode_stack() -> list[Any]:
    """The calling thread's torch-function modes, bottom first:
    ``torch.overrides._get_current_function_mode_stack()`` (every supported torch)."""
    stack: list[Any] = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return stack


def device_context_slot(holder: Any = torch) -> Any:
    """``holder._GLOBAL_DEVICE_CONTEXT``, where torch keeps the context of
    ``torch.set_default_device`` (``holder`` is the torch module; tests pass a stand-in):
    a ``threading.local`` whose ``device_context`` is the context in newer torch (2.13 is
    one), the context itself or ``None`` in older ones; ``None`` where missing."""
    return getattr(holder, "_GLOBAL_DEVICE_CONTEXT", None)


def set_device_context_slot(holder: Any, context: Any) -> None:
    """Write ``holder._GLOBAL_DEVICE_CONTEXT`` (the older torch's process-wide layout of
    :func:`device_context_slot`)."""
    holder._GLOBAL_DEVICE_CONTEXT = context


def device_context(device: torch.device) -> Any:
    """A new ``torch.utils._device.DeviceContext(device)``: the mode that
    ``torch.set_default_device`` pushes (every supported torch; imports
    ``torch.utils._device``)."""
    from torch.utils._device import DeviceContext

    return DeviceContext(device)


def is_device_context(mode: Any) -> bool:
    """Whether ``mode`` is a ``torch.utils._device.DeviceContext``: what
    ``torch.set_default_device`` and ``with torch.device(...)`` push (every
    supported torch; imports ``torch.utils._device``)."""
    from torch.utils._device import DeviceContext

    return isinstance(mode, DeviceContext)


def remove_function_mode(mode: Any) -> None:
    """Take ``mode`` off the calling thread's torch-function mode stack wherever
    it is, the other modes kept in order, and point the device factories at the
    topmost ``DeviceContext`` left (``torch.utils._device.CURRENT_DEVICE``, what
    dynamo guards on), as the mode's ``__exit__`` would.

    Uses ``torch._C._len_torch_function_stack`` and ``torch.overrides._pop_mode``
    / ``_push_mode`` (every supported torch).  Needed where another
    ``DeviceContext`` is on the stack too: torch 2.2 to 2.6 push a default device
    set inside ``with torch.device(...)`` beneath it, and their
    ``DeviceContext.__exit__`` then fails its assertion that only the bottom mode
    is a ``DeviceContext``.
    """
    import torch.utils._device as device_module

    overrides: Any = torch.overrides
    above: list[Any] = []
    while torch._C._len_torch_function_stack() > 0:
        top = overrides._pop_mode()
        if top is mode:
            break
        above.append(top)
    for top in reversed(above):
        overrides._push_mode(top)
    devices = [m.device for m in function_mode_stack() if is_device_context(m)]
    device_module.CURRENT_DEVICE = devices[-1] if devices else None


# -- dispatch modes and autograd (verify/ops.py, audit/recorder.py) ----------------------

current_dispatch_mode: Callable[[], Any] = _get_current_dispatch_mode
"""``torch.utils._python_dispatch._get_current_dispatch_mode``: the calling thread's top
torch-dispatch mode, ``None`` for none (every supported torch)."""


class UnwrappedDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A ``TorchDispatchMode`` whose subclasses' ``__torch_dispatch__`` torch leaves as it is.

    torch wraps a dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``
    where the class's ``_should_skip_dynamo()`` is true (the default of torch 2.13), and
    that wrapper imports ``torch._dynamo`` at its first call: about 2 s, and a change of
    process state.  Here the hook answers ``False``; a torch without the hook never wraps.
    A subclass then keeps dynamo out of its own Python code itself, once dynamo is imported
    (:func:`dynamo_disable`).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def node_sequence_nr(node: Any) -> int | None:
    """An autograd node's ``_sequence_nr()`` (every supported torch), ``None`` where the
    node has no such method."""
    sequence_nr = getattr(node, "_sequence_nr", None)
    return None if sequence_nr is None else int(sequence_nr())


def _engine_entries() -> frozenset[CodeType]:
    graph = getattr(torch.autograd, "graph", None)
    run = getattr(graph, "_engine_run_backward", None)
    # torch 2.1: backward and grad (and grad's nested vjp) call the engine themselves.
    functions = [run] if run is not None else [torch.autograd.backward, torch.autograd.grad]
    codes = {c for f in functions if isinstance(c := getattr(f, "__code__", None), CodeType)}
    for code in list(codes):
        codes.update(c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == "vjp")
    return frozenset(codes)


AUTOGRAD_ENGINE_ENTRIES: frozenset[CodeType] = _engine_entries()
"""The code of torch's Python functions that hand a backward pass to autograd's C++
engine: ``torch.autograd.graph._engine_run_backward`` (torch 2.6 has it), else those of
``torch.autograd.backward`` and ``torch.autograd.grad`` and ``grad``'s nested ``vjp``
(torch 2.1, where they call ``Variable._execution_engine.run_backward`` themselves).  An op
call with one of them below it on the stack was made by the engine, not by the Python
code above."""


BATCH_NORM_BASE: type[_BatchNorm] = _BatchNorm
"""``torch.nn.modules.batchnorm._BatchNorm``: the base of the BatchNorm modules that
normalize with a batch's statistics in training (every supported torch)."""

DROPOUT_BASE: type[_DropoutNd] = _DropoutNd
"""``torch.nn.modules.dropout._DropoutNd``: the base of the dropout modules (every
supported torch)."""

foreach_copy_: Callable[..., Any] | None = getattr(torch, "_foreach_copy_", None)
"""``torch._foreach_copy_(into, out_of)``: copy lists of tensors in one op (torch >= 2.1);
``None`` where missing: the tensors are copied one by one."""


# -- dynamo and inductor (verify/ops.py, verify/compiled.py, trace/recording.py) ---------


def dynamo_disable(fn: Callable[..., Any], recursive: bool = True) -> Callable[..., Any]:
    """``torch._dynamo.disable(fn, recursive=...)``: ``fn``, never traced by dynamo
    (every supported torch; imports ``torch._dynamo``, about 2 s the first time)."""
    dynamo = importlib.import_module(DYNAMO)
    disabled: Callable[..., Any] = dynamo.disable(fn, recursive=recursive)
    return disabled


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (every supported torch; about 2 s the first time)."""
    importlib.import_module(DYNAMO)


def inductor_config() -> Any:
    """``torch._inductor.config`` (every supported torch; imports it, about a second the
    first time)."""
    return importlib.import_module(INDUCTOR_CONFIG)


def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """``torch._inductor.list_mode_options(mode, dynamic)``: the inductor options a
    ``torch.compile`` mode stands for (every supported torch).  An unknown mode raises
    ``RuntimeError`` listing the modes, on every torch: torch 2.1 to 2.6 would raise a bare
    ``KeyError`` (and return the table of every mode for ``""``), later ones the
    ``RuntimeError``."""
    inductor = importlib.import_module(INDUCTOR)
    modes: dict[str, Any] = inductor.list_mode_options(None, dynamic)
    if mode not in modes:
        raise RuntimeError(f"Unrecognized mode={mode}, should be one of: {', '.join(modes)}")
    options: dict[str, Any] = inductor.list_mode_options(mode, dynamic)
    return options


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled the module in place
    (``module._compiled_call_impl``, torch >= 2.2; before, never)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def dynamo_disable_message(fn: object) -> str:
    """The reason ``torch.compiler.disable(fn, reason=...)`` gave, from
    ``fn._torchdynamo_disable_msg`` (torch >= 2.6; ``""`` without one)."""
    return str(getattr(fn, "_torchdynamo_disable_msg", ""))


def compiled_original(fn: object) -> object | None:
    """What ``torch.compile`` compiled into ``fn`` (the module of an ``OptimizedModule``,
    else the function: ``_torchdynamo_orig_callable`` and ``_orig_mod``, every supported
    torch); ``None`` where ``fn`` is not compiled, or is kept eager by
    ``torch.compiler.disable`` (which sets ``_torchdynamo_disable``)."""
    original = getattr(fn, "_torchdynamo_orig_callable", None)
    if original is None or getattr(fn, "_torchdynamo_disable", False):
        return None
    found: object = getattr(fn, "_orig_mod", original)
    return found


#: Attributes through which dynamo or TorchScript reach another function than
#: the one called.
_REDIRECTS = (
    "_torchdynamo_inline",
    "_torchdynamo_orig_callable",
    "_torchdynamo_wrapper_id",
    "_torchdynamo_disable_recursive",
    "__script_if_tracing_wrapper",
    "__original_fn",
)


def mark_opaque_to_dynamo(func: Callable[..., Any], reason: str) -> None:
    """Mark ``func`` as ``torch.compiler.disable`` does, without importing dynamo:
    ``func._torchdynamo_disable = True`` and ``func._torchdynamo_disable_msg = reason``
    (dynamo honours them in every supported torch; the message from torch 2.6), and drop
    the attributes ``functools.wraps`` copied that send dynamo or TorchScript to the
    wrapped function instead (``_torchdynamo_orig_callable``, ...).  Where a torch
    ignores them, tracing ``func`` is not a graph break."""
    # functools.wraps copied the wrapped function's attributes: ones that send
    # dynamo (or TorchScript) to the original would skip the wrapper, and its
    # block, altogether (a compiled or script_if_tracing function decorated).
    attributes = func.__dict__
    for name in _REDIRECTS:
        attributes.pop(name, None)
    attributes["_torchdynamo_disable"] = True
    attributes["_torchdynamo_disable_msg"] = reason


# -- one op's call exempted from the deterministic check (core/exempt.py) ----------------
#
# torch checks ``use_deterministic_algorithms`` inside its kernels and keeps the flag
# process-wide, so an op is exempted by turning the flag off for exactly its call.  The
# call is intercepted in the dispatcher, not by a dispatch mode (a Python call for every
# op of a step, several times a small model's step): a Python kernel is registered, once
# per exempted overload, at the ``PreDispatch`` key, where every other op runs torch's
# own no-op fallback (one C++ redispatch).  That key is in no tensor's key set: it is
# reached only while a thread *includes* it (:func:`include_exemption`), which an
# exemption does while it is open.  The included keys are part of the thread-local state
# autograd hands to its engine threads, so the backward kernels of a ``backward()`` called
# inside an exemption (CUDA runs them on those threads) reach the kernel too.


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


_key: Any = None
_included: Any = None
_set_included: Any = None
_after: Any = None


def _probe_exemption() -> None:
    global _key, _included, _set_included, _after
    if _key is None and SCOPED_EXEMPTION.available:
        _key, _included, _set_included, _after = SCOPED_EXEMPTION.value


#: The libraries that hold the kernels, by namespace (one per namespace: a
#: ``torch.library.Library`` registers only in its own), and the overloads done.
_libraries: dict[str, Any] = {}
_installed: set[OpOverload] = set()
_install_lock = threading.Lock()


def require_exemption() -> None:
    """Raise ``TorchFeatureError`` where this torch cannot intercept one op's call."""
    _probe_exemption()
    if _key is None:
        raise TorchFeatureError(
            f"allow_nondeterministic needs {SCOPED_EXEMPTION.reads} (torch >= "
            f"{SCOPED_EXEMPTION.since}); this torch lacks it, so no op can be exempted: turn "
            f"deterministic algorithms off around the op, or use warn_only=True"
        )


def install_exemption(op: OpOverload, kernel: Callable[..., Any]) -> None:
    """Register ``kernel(keyset, *args, **kwargs)`` in front of ``op``, once per
    process.  ``TorchFeatureError`` where this torch cannot, or where torch put
    a kernel of its own there (``torch.export``'s pre-dispatch tracing does for
    a few ops): that one is never replaced."""
    require_exemption()
    with _install_lock:
        if op in _installed:
            return
        name = op_label(op)
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, _key):
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


def exemption_included() -> bool:
    """Whether the calling thread's ops reach the kernels now."""
    now: bool = _included(_key)
    return now


def include_exemption(on: bool) -> None:
    """Make the calling thread's ops reach the kernels (``on``) or not."""
    _set_included(_key, on)


def redispatch_exempted(
    op: OpOverload, keyset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``op`` as if the kernel were not there: what torch's fallback does."""
    return op.redispatch(keyset & _after, *args, **kwargs)
