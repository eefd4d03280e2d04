"""The facts of this process that decide results: versions, devices, threads, flags, the CPU.

:func:`environment` reads them as flat ``{name: value}`` for a trace to record
(see :mod:`deterministic_ctx.trace`), without ever initializing CUDA.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from collections.abc import Callable, Mapping

import torch

#: A fact of the environment: plain JSON scalars only.
Fact = str | int | float | bool | None


def environment() -> dict[str, Fact]:
    """The facts of this process that decide results, as flat ``{name: value}``.

    Most come from :func:`~deterministic_ctx.reporting.report` (its versions,
    flags, environment variables, CUDA facts, process facts and torch.compile
    settings; not its RNG statuses and problems), flattened to names like
    ``"flags.deterministic_algorithms"`` and ``"cuda.devices[0].name"``; then
    what a report does not show: the CPU model, vector instruction set
    (``cpu.capability``), core count, BLAS and parallel backend, the
    inter-op thread count, torch's git revision and, once CUDA is initialized,
    each device's SM count.  Never initializes CUDA.

    Example:
        >>> facts = environment()
        >>> sorted(k for k in facts if k.startswith("cpu."))[:2]
        ['cpu.blas', 'cpu.capability']
    """
    from ..reporting import report

    data = report().to_dict()
    cuda = torch.cuda
    if cuda.is_initialized():  # type: ignore[no-untyped-call]  # only then: asking otherwise would initialize CUDA
        for device in data["cuda"].get("devices", ()):
            props = cuda.get_device_properties(device["index"])
            device["sm_count"] = props.multi_processor_count
    versions = data["versions"]
    versions["torch_git"] = getattr(torch.version, "git_version", None)
    facts: dict[str, Fact] = {}
    for section in ("versions", "cuda", "process", "flags", "env", "torch_compile"):
        _flatten(data.get(section), section, facts)
    facts["process.num_interop_threads"] = torch.get_num_interop_threads()
    facts.update(_cpu_facts())
    return facts


def _flatten(value: object, name: str, into: dict[str, Fact]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, f"{name}.{key}", into)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, f"{name}[{i}]", into)
    elif value is None or isinstance(value, (bool, int, float, str)):
        into[name] = value
    else:
        into[name] = str(value)


def _cpu_facts() -> dict[str, Fact]:
    """The CPU and the CPU kernels torch picks on it."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)
    config = _blas()
    backend = _search(r"ATen parallel backend: (.+)", torch.__config__.parallel_info)
    return {
        "cpu.model": _cpu_model(),
        "cpu.machine": platform.machine(),
        "cpu.count": os.cpu_count(),
        "cpu.capability": capability(),
        "cpu.blas": config,
        "cpu.parallel_backend": backend,
    }


@functools.cache
def _blas() -> str | None:
    """The BLAS torch was built with (constant per process)."""
    if (torch.version.cuda or torch.version.hip) and not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # ``torch.__config__.show()`` asks the CUDA runtime for a device count
        # on CUDA builds, which starts CUDA: a trace never does that.
        return "mkl" if torch.backends.mkl.is_available() else None  # type: ignore[no-untyped-call]
    return _search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show)


def _search(pattern: str, text: Callable[[], str]) -> str | None:
    try:
        found = re.search(pattern, text())
    except Exception:  # a build without the information: the fact is unknown, not an error
        return None
    return found.group(1).strip() if found else None


def _cpu_model() -> str | None:
    """The CPU's model name: ``/proc/cpuinfo`` on Linux (``platform.processor()`` is empty
    there), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None
