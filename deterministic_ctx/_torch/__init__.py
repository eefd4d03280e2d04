"""The one home of the torch API that not every supported torch has.

``pyproject.toml`` promises torch 2.1 and later.  Each private or newer torch
attribute the library needs is named here once, as a :class:`Capability`:
what it reads, the first torch that has it, and what the library does
without it.  A capability is probed once, at its first use, never at
``import deterministic_ctx``; where one is missing, the feature it serves is
off and :func:`~deterministic_ctx.report` says so in one line.  An explicit
request for a missing feature (``compiled_rng="eager"``,
``fill_uninitialized_memory=False``) raises :class:`TorchFeatureError`, which
names the torch version it needs.

The ``since`` versions were checked at the corners of the support matrix
(``tools/compat.py``: torch 2.1.2, 2.6.0, 2.15.0); in between they follow
torch's history.  Nothing here compares version numbers: each probe looks
for the attribute itself.

Example:
    >>> from deterministic_ctx import _torch
    >>> _torch.FILL_UNINITIALIZED_MEMORY.name
    'fill_uninitialized_memory'
    >>> isinstance(_torch.FILL_UNINITIALIZED_MEMORY.available, bool)
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ._capability import (
    Capability,
    ProbeLater,
    TorchFeatureError,
    missing_capabilities,
)

__all__ = [
    "ACCELERATOR_API",
    "CONFIG_OVERRIDES",
    "DISPATCH_MODES",
    "FILL_UNINITIALIZED_MEMORY",
    "FP32_PRECISION",
    "FRAME_EXEC_STRATEGY",
    "INDUCTOR_FALLBACK_RANDOM",
    "IS_COMPILING",
    "LAZY_DEVICES",
    "MKLDNN_DETERMINISTIC",
    "ONEDNN_ALLOW_TF32",
    "SCOPED_EXEMPTION",
    "Capability",
    "ProbeLater",
    "TorchFeatureError",
    "accelerator_type",
    "default_device",
    "is_compiling",
    "lazy_device",
    "missing_capabilities",
    "release_of",
]


def _torch() -> Any:
    import torch

    return torch


def release_of(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string; ``(0, 0)`` when it has none.

    Example:
        >>> release_of("2.11.0+cu130"), release_of("2.13.0a0+gitcf30153"), release_of("2.13")
        ((2, 11), (2, 13), (2, 13))
    """
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "0")
    except (IndexError, ValueError):
        return (0, 0)


def _c_pair(getter: str, setter: str) -> Callable[[], tuple[Any, Any] | None]:
    def probe() -> tuple[Any, Any] | None:
        c = _torch()._C
        get, put = getattr(c, getter, None), getattr(c, setter, None)
        return (get, put) if get is not None and put is not None else None

    return probe


# -- determinism and precision flags (sources/flags.py) -------------------------------

FILL_UNINITIALIZED_MEMORY = Capability(
    "fill_uninitialized_memory",
    reads="torch._C._get/_set_deterministic_fill_uninitialized_memory "
    "(torch.utils.deterministic.fill_uninitialized_memory)",
    since="2.2",
    fallback="this torch never fills uninitialized memory; the flag is not captured or set",
    probe=_c_pair(
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
    ),
)
"""``(getter, setter)`` of ``torch.utils.deterministic.fill_uninitialized_memory``."""

MKLDNN_DETERMINISTIC = Capability(
    "mkldnn_deterministic",
    reads="torch._C._get/_set_mkldnn_deterministic (torch.backends.mkldnn.deterministic)",
    since="2.5",
    fallback="oneDNN has no determinism flag of its own here; it is not captured or set",
    probe=_c_pair("_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
)
"""``(getter, setter)`` of ``torch.backends.mkldnn.deterministic``."""

FP32_PRECISION = Capability(
    "fp32_precision",
    reads="torch._C._get_fp32_precision_getter/_set_fp32_precision_setter "
    "(torch.backends.*.fp32_precision)",
    since="2.7",
    fallback="only the legacy TF32 flags and float32_matmul_precision are captured",
    probe=_c_pair("_get_fp32_precision_getter", "_set_fp32_precision_setter"),
)
"""``(getter, setter)`` of the per-backend ``fp32_precision`` entries."""


def _onednn() -> tuple[Any, Any] | None:
    c = _torch()._C
    get = getattr(c, "_get_onednn_allow_tf32", None)
    # Only XPU builds keep the flag: elsewhere the getter returns None and the
    # setter warns and ignores it.
    if get is None or not isinstance(get(), bool):
        return None
    return get, c._set_onednn_allow_tf32


ONEDNN_ALLOW_TF32 = Capability(
    "onednn_allow_tf32",
    reads="torch._C._get/_set_onednn_allow_tf32 returning a bool",
    since="2.7 (XPU builds only)",
    fallback="no oneDNN TF32 flag to capture",
    probe=_onednn,
    quiet=True,  # a property of the build, not of the version
)
"""``(getter, setter)`` of the oneDNN TF32 flag, on builds that keep it."""


# -- accelerators (sources/accelerators.py, streams.py, sync.py) ----------------------

#: What a lazily initialized device module must have for its generators to be
#: captured before and after initialization.
LAZY_REQUIRED = ("is_initialized", "_lazy_seed_tracker", "_queued_calls", "default_generators")
LAZY_TRACKER_FIELDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")


def _lazy_probe(device_type: str) -> Callable[[], ModuleType | None]:
    def probe() -> ModuleType | None:
        module = getattr(_torch(), device_type, None)
        tracker = getattr(module, "_lazy_seed_tracker", None)
        if not all(hasattr(module, a) for a in LAZY_REQUIRED):
            return None
        if not all(hasattr(tracker, f) for f in LAZY_TRACKER_FIELDS):
            return None
        return module

    return probe


#: ``{device type: Capability}`` whose value is the device's torch module.
LAZY_DEVICES: dict[str, Capability] = {
    device_type: Capability(
        f"{device_type}_generators",
        reads=f"torch.{device_type}.{{{', '.join(LAZY_REQUIRED)}}} and the lazy seed "
        f"tracker's {{{', '.join(LAZY_TRACKER_FIELDS)}}}",
        since=since,
        fallback=f"torch.{device_type}'s generators are not captured, seeded or restored",
        probe=_lazy_probe(device_type),
    )
    for device_type, since in (("cuda", "2.1"), ("xpu", "2.4"), ("mtia", "2.7"))
}


def lazy_device(device_type: str) -> ModuleType | None:
    """``torch.cuda``, ``torch.xpu`` or ``torch.mtia`` where its lazily seeded
    generators can be captured (see :data:`LAZY_REQUIRED`), else ``None``."""
    capability = LAZY_DEVICES.get(device_type)
    return None if capability is None else capability.value


ACCELERATOR_API = Capability(
    "accelerator_api",
    reads="torch.accelerator.current_accelerator",
    since="2.6",
    fallback="the current accelerator is CUDA on a CUDA build, else none",
    probe=lambda: getattr(getattr(_torch(), "accelerator", None), "current_accelerator", None),
)
"""``torch.accelerator.current_accelerator``."""


def accelerator_type() -> str:
    """The device type of this build's accelerator (``"cuda"``, ``"xpu"``, ...),
    ``""`` for none; never initializes a device.

    torch 2.6's ``current_accelerator()`` raises where no device is present
    (later ones return ``None``); there, and before torch 2.6, the answer is
    ``"cuda"`` on a CUDA build, ``""`` elsewhere.
    """
    current = ACCELERATOR_API.value
    if current is not None:
        try:
            device = current()
        except RuntimeError:  # torch 2.6 without a device
            pass
        else:
            return "" if device is None else str(device.type)
    cuda = _torch().cuda
    compiled = getattr(cuda, "_is_compiled", None)
    return "cuda" if compiled is not None and compiled() else ""


# -- torch.compile (_torch/compiler.py, sources/compiler.py, sources/flags.py) ---------


IS_COMPILING = Capability(
    "is_compiling",
    reads="torch.compiler.is_compiling",
    since="2.3",
    fallback="torch._dynamo.external_utils.is_compiling once dynamo is imported",
    probe=lambda: getattr(getattr(_torch(), "compiler", None), "is_compiling", None),
)
"""``torch.compiler.is_compiling``."""


def is_compiling() -> bool:
    """Whether torch is compiling (tracing) the calling code.

    ``torch.compiler.is_compiling()`` (torch >= 2.3); before it, dynamo's own
    ``external_utils.is_compiling()``, only once dynamo is imported (nothing
    compiles without it).
    """
    found = IS_COMPILING.value
    if found is not None:
        return bool(found())
    utils = sys.modules.get("torch._dynamo.external_utils")
    check = getattr(utils, "is_compiling", None)
    return bool(check()) if check is not None else False


def _dispatch_modes() -> tuple[Any, tuple[Any, ...]] | None:
    c = _torch()._C
    get = getattr(c, "_get_dispatch_mode", None)
    keys = getattr(c, "_TorchDispatchModeKey", None)
    found = tuple(k for name in ("FAKE", "PROXY") if (k := getattr(keys, name, None)) is not None)
    return (get, found) if get is not None and found else None


DISPATCH_MODES = Capability(
    "dispatch_modes",
    reads="torch._C._get_dispatch_mode and torch._C._TorchDispatchModeKey.FAKE/PROXY",
    since="2.2",
    fallback="a compile in another thread also refuses this thread's blocks "
    "(is_compiling() alone is process-wide)",
    probe=_dispatch_modes,
)
"""``(torch._C._get_dispatch_mode, (FAKE, PROXY))``: a thread's tracer modes."""


def _scoped_exemption() -> tuple[Any, Any, Any, Any] | None:
    torch = _torch()
    c = torch._C
    key = getattr(getattr(c, "DispatchKey", None), "PreDispatch", None)
    included: Any = getattr(c, "_dispatch_tls_is_dispatch_key_included", None)
    include: Any = getattr(c, "_dispatch_tls_set_dispatch_key_included", None)
    after: Any = getattr(c, "_dispatch_keyset_full_after", None)
    if key is None or included is None or include is None or after is None:
        return None
    import inspect

    try:  # Library.impl's with_keyset: the kernel is handed the keyset to redispatch with
        keyset = "with_keyset" in inspect.signature(torch.library.Library.impl).parameters
    except (TypeError, ValueError):
        keyset = False
    if not keyset:
        return None
    return key, included, include, after(key)


SCOPED_EXEMPTION = Capability(
    "scoped_exemption",
    reads="torch._C.DispatchKey.PreDispatch, torch._C._dispatch_tls_is/set_dispatch_key_included, "
    "torch._C._dispatch_keyset_full_after and torch.library.Library.impl(with_keyset=)",
    since="2.2",
    fallback="allow_nondeterministic cannot exempt an op (it raises TorchFeatureError)",
    probe=_scoped_exemption,
)
"""``(PreDispatch, is_included, set_included, keyset after PreDispatch)``: what
:mod:`deterministic_ctx._torch.exempt` puts a kernel in front of an op with."""


def _frame_strategy() -> tuple[Any, Any, Any] | None:
    frame = getattr(getattr(_torch()._C, "_dynamo", None), "eval_frame", None)
    parts = tuple(
        getattr(frame, name, None)
        for name in ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction")
    )
    return parts if all(p is not None for p in parts) else None  # type: ignore[return-value]


FRAME_EXEC_STRATEGY = Capability(
    "frame_exec_strategy",
    reads="torch._C._dynamo.eval_frame.set_code_exec_strategy, _FrameExecStrategy, _FrameAction",
    since="2.7",
    fallback="a decorated function called from compiled code is skipped by dynamo, "
    "but the frames it calls are compiled",
    probe=_frame_strategy,
)
"""``(set_code_exec_strategy, _FrameExecStrategy, _FrameAction)`` of dynamo's C frame hook."""


def _fallback_random() -> object | None:
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        raise ProbeLater
    return config if hasattr(config, "fallback_random") else None


INDUCTOR_FALLBACK_RANDOM = Capability(
    "inductor_fallback_random",
    reads="torch._inductor.config.fallback_random",
    since="2.0",
    fallback="compiled random numbers cannot be made equal to eager ones (compiled_rng='eager')",
    probe=_fallback_random,
)
"""``torch._inductor.config`` where it has ``fallback_random`` (probed once inductor is
imported)."""


def _config_overrides() -> object | None:
    import importlib

    module = importlib.import_module("torch.utils._config_module")
    return getattr(module, "_UNSET_SENTINEL", None)


CONFIG_OVERRIDES = Capability(
    "config_user_overrides",
    reads="torch.utils._config_module._UNSET_SENTINEL (a config entry's user override)",
    since="2.6",
    fallback="torch.compile's config entries are restored by value: one written back "
    "reads as set by the user",
    probe=_config_overrides,
)
"""torch's "nobody set it" sentinel of config entries (``sources/config_entries.py`` reads it
from ``sys.modules``; this probe is for the report and the tests)."""


# -- torch's process defaults (tests/_oracle.py) ---------------------------------------


def default_device() -> Any:
    """The device a factory function puts a new tensor on: what
    ``torch.get_default_device()`` (torch >= 2.3) answers, read the one way every
    supported torch has (torch 2.6's ``get_default_device()`` even raises
    ``AttributeError`` after ``torch.set_default_device(None)``)."""
    return _torch().empty(0).device


# -- torch.distributed (state/dcp.py) ----------------------------------------------


def _dcp_stateful() -> type | None:
    import importlib

    if not _torch().distributed.is_available():
        return None
    dcp = importlib.import_module("torch.distributed.checkpoint")
    if not (hasattr(dcp, "save") and hasattr(dcp, "load")):
        return None
    stateful: type = importlib.import_module("torch.distributed.checkpoint.stateful").Stateful
    return stateful


DCP_STATEFUL = Capability(
    "dcp_stateful",
    reads="torch.distributed.checkpoint.save/load and torch.distributed.checkpoint.stateful",
    since="2.2",
    fallback="deterministic_ctx.RngState refuses to be made: this torch's "
    "save_state_dict would pickle it instead of calling its state_dict()",
    probe=_dcp_stateful,
)
"""``torch.distributed.checkpoint.stateful.Stateful``: DCP calls ``state_dict()`` and
``load_state_dict()`` of the objects it saves and loads (``deterministic_ctx.RngState``)."""
