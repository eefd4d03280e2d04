"""The facts a report shows: flags, environment, process and CUDA, read without changing them.

Nothing here initializes CUDA (device facts are read only once
``torch.cuda.is_initialized()``) or fixes the multiprocessing start method.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["cuda_facts", "env_names", "flags", "start_method", "startup_env"]

#: Shown after the managed variables: not restored by blocks (they choose devices, threads and
#: precision, read once at start-up), but they explain results.
_EXTRA_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def env_names() -> tuple[str, ...]:
    """The environment section: every variable blocks manage (``managed_env_vars()``, registered
    ones included), then :data:`_EXTRA_ENV_NAMES`."""
    from ..internal import managed_env_vars

    managed = managed_env_vars()
    return (*managed, *(n for n in _EXTRA_ENV_NAMES if n not in managed))


def startup_env() -> dict[str, str | None] | None:
    """The managed variables as the process started with them (Linux), else ``None``."""
    from ..internal import managed_env_vars

    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    found: dict[str, str | None] = dict.fromkeys(managed_env_vars())
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        # Decoded as os.environ decodes, so that a value compares equal to os.environ's.
        key = os.fsdecode(name)
        if sep and key in found:
            found[key] = os.fsdecode(value)
    return found


def start_method() -> tuple[str, bool]:
    """The multiprocessing start method and whether it was set explicitly.

    Never calls ``get_start_method()`` without ``allow_none``: that would fix the
    method for the rest of the process.
    """
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)
    if method is not None:
        return method, True
    return multiprocessing.get_all_start_methods()[0], False  # the platform default


def flags(torch: Any, snapshot: Any) -> dict[str, Any]:
    from ..internal import PRECISION_OPS, UNSUPPORTED_FLAGS

    state = snapshot.state_of("torch.flags")  # a named tuple or dataclass of flag values
    flags = dict(state._asdict()) if hasattr(state, "_asdict") else dataclasses.asdict(state)
    for name in UNSUPPORTED_FLAGS:  # this torch lacks them: a problem note says so
        flags[name] = None
    precision = flags.pop("fp32_precision", ())
    # What restoring needs, not what a reader asks: the entries' own values
    # (the effective ones are shown below) and inductor's raw override (its
    # value is ``inductor_deterministic``).
    flags.pop("fp32_precision_own", None)
    flags.pop("inductor_override", None)
    flags["cudnn_enabled"] = bool(torch.backends.cudnn.enabled)
    flags["fp32_precision"] = {
        f"{backend}.{op}": v for (backend, op), v in zip(PRECISION_OPS, precision, strict=False)
    }
    return flags


def cuda_facts(torch: Any) -> dict[str, Any]:
    from .._torch.internals import bad_fork_check

    cuda = torch.cuda
    # Whether this is a child forked after CUDA initialized (it cannot use CUDA).
    in_bad_fork = bad_fork_check(cuda)
    facts: dict[str, Any] = {
        "built": bool(torch.backends.cuda.is_built()),
        "compiled_version": torch.version.cuda or getattr(torch.version, "hip", None),
        "cudnn_built": bool(torch.backends.cudnn.is_available()),
        "initialized": bool(cuda.is_initialized()),
        "bad_fork": bool(in_bad_fork()) if in_bad_fork is not None else False,
    }
    if not facts["initialized"]:
        return facts  # querying devices would initialize CUDA: never here
    count = cuda.device_count()
    facts["device_count"] = count
    facts["current_device"] = cuda.current_device()
    facts["devices"] = [
        {
            "index": i,
            "name": cuda.get_device_name(i),
            "capability": ".".join(map(str, cuda.get_device_capability(i))),
        }
        for i in range(count)
    ]
    facts["cudnn_version"] = torch.backends.cudnn.version() if facts["cudnn_built"] else None
    return facts
