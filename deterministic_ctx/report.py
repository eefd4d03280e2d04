"""``report()``: what this process does for determinism, and what may go wrong.

A structured, JSON-serializable :class:`DeterminismReport` with a readable
``str``: library versions, the determinism flags, the relevant environment
variables, which RNGs look seeded, CUDA facts, and a list of known problems
(``cudnn.benchmark`` on, ``CUBLAS_WORKSPACE_CONFIG`` missing or set after CUDA
started, ``PYTHONHASHSEED`` unset with spawned workers, nondeterministic
algorithms allowed, ...).

Reading the report changes nothing: it never initializes CUDA (device facts
are read only once ``torch.cuda.is_initialized()``), never imports
``torch._inductor``, never draws from an RNG and never fixes the
multiprocessing start method.  This module imports only the standard library
at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DeterminismReport", "Problem", "RngStatus", "report"]

#: torch's fixed default seed of a fresh generator (CUDA default generators start from it).
TORCH_DEFAULT_SEED = 67280421310721
#: Shown after the managed variables: not restored by blocks (they choose devices, threads and
#: precision, read once at start-up), but they explain results.
_EXTRA_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def _env_names() -> tuple[str, ...]:
    """The environment section: every variable blocks manage (``managed_env_vars()``, registered
    ones included), then :data:`_EXTRA_ENV_NAMES`."""
    from .sources.environ import managed_env_vars

    managed = managed_env_vars()
    return (*managed, *(n for n in _EXTRA_ENV_NAMES if n not in managed))


def _startup_names() -> tuple[str, ...]:
    """The variables whose values at process start the report reads: the managed ones."""
    from .sources.environ import managed_env_vars

    return managed_env_vars()


@dataclasses.dataclass(frozen=True)
class Problem:
    """One known problem: ``level`` is ``"warning"`` (can break reproducibility) or ``"note"``.

    ``code`` is a stable short identifier (e.g. ``"cudnn-benchmark"``) for tools.
    """

    level: str
    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class RngStatus:
    """What can be said about one RNG.

    ``seeded`` is ``True`` when there is evidence of explicit seeding, ``False``
    when it runs from a default, ``None`` when its state cannot tell (Python's
    and NumPy's Mersenne Twisters cannot be traced back to a seed once drawn
    from).  ``seed`` is the seed when known.
    """

    name: str
    seeded: bool | None
    seed: int | None
    detail: str


@dataclasses.dataclass(frozen=True)
class DeterminismReport:
    """The determinism setup of this process; see :func:`report`.

    ``str(r)`` is for people, ``r.to_dict()`` for tools (JSON-serializable).
    ``warnings`` lists the problems of level ``"warning"``.
    """

    versions: dict[str, str | None]
    in_block: bool
    flags: dict[str, Any]
    env: dict[str, str | None]
    rngs: tuple[RngStatus, ...]
    cuda: dict[str, Any]
    process: dict[str, Any]
    problems: tuple[Problem, ...]

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.level == "warning")

    def to_dict(self) -> dict[str, Any]:
        """Plain data only (dicts, lists, str, int, float, bool, None).

        Example:
            >>> import json
            >>> from deterministic_ctx.report import report
            >>> data = report().to_dict()
            >>> json.loads(json.dumps(data)) == data
            True
        """
        out = _plain(dataclasses.asdict(self))
        assert isinstance(out, dict)
        return out

    def __str__(self) -> str:
        lines = ["Determinism report"]
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in self.versions.items() if v))
        lines.append(f"  inside a deterministic block: {'yes' if self.in_block else 'no'}")
        lines += _section("Flags", self.flags)
        lines += _section(
            "Environment", {k: "(unset)" if v is None else v for k, v in self.env.items()}
        )
        lines.append("RNGs")
        width = max((len(r.name) for r in self.rngs), default=0)
        for rng in self.rngs:
            seeded = {True: "seeded", False: "not seeded", None: "unknown"}[rng.seeded]
            seed = f" (seed {rng.seed})" if rng.seed is not None else ""
            lines.append(f"  {rng.name:<{width}}  {seeded}{seed}: {rng.detail}")
        lines += _section("CUDA", self.cuda)
        lines += _section("Process", self.process)
        counts = [
            f"{n} {level}(s)"
            for level in ("warning", "note")
            if (n := sum(p.level == level for p in self.problems))
        ]
        lines.append(f"Problems: {', '.join(counts) if counts else 'none found'}")
        for p in self.problems:
            lines.append(f"  {p.level} [{p.code}] {p.message}")
        return "\n".join(lines)


def _section(title: str, values: Mapping[str, Any]) -> list[str]:
    width = max((len(k) for k in values), default=0)
    return [title] + [f"  {k:<{width}}  {_show(v)}" for k, v in values.items()]


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_show(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return "; ".join(_show(v) for v in value) or "-"
    return str(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# --- facts --------------------------------------------------------------------------------------


def _startup_env() -> dict[str, str | None] | None:
    """The relevant variables as the process started with them (Linux), else ``None``."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    found: dict[str, str | None] = dict.fromkeys(_startup_names())
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        # Decoded as os.environ decodes, so that a value compares equal to os.environ's.
        key = os.fsdecode(name)
        if sep and key in found:
            found[key] = os.fsdecode(value)
    return found


def _start_method() -> tuple[str, bool]:
    """The multiprocessing start method and whether it was set explicitly.

    Never calls ``get_start_method()`` without ``allow_none``: that would fix the
    method for the rest of the process.
    """
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)
    if method is not None:
        return method, True
    return multiprocessing.get_all_start_methods()[0], False  # the platform default


def _in_block() -> bool:
    from ._lock import LOCK

    return LOCK.depth > 0 and LOCK.owner == threading.get_ident()


def _flags(torch: Any, snapshot: Any) -> dict[str, Any]:
    from .sources.flags import PRECISION_OPS

    state = snapshot.state_of("torch.flags")  # a named tuple or dataclass of flag values
    flags = dict(state._asdict()) if hasattr(state, "_asdict") else dataclasses.asdict(state)
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


def _cuda(torch: Any) -> dict[str, Any]:
    cuda = torch.cuda
    facts: dict[str, Any] = {
        "built": bool(torch.backends.cuda.is_built()),
        "compiled_version": torch.version.cuda or getattr(torch.version, "hip", None),
        "cudnn_built": bool(torch.backends.cudnn.is_available()),
        "initialized": bool(cuda.is_initialized()),
        "bad_fork": bool(getattr(cuda, "_is_in_bad_fork", lambda: False)()),
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


def _fresh_python_state(seed: int) -> bool:
    import random

    return random.getstate() == random.Random(seed).getstate()


def _fresh_numpy_state(np: Any, seed: int) -> bool:
    state = np.random.get_state(legacy=False)
    if state["bit_generator"] != "MT19937":
        return False
    ref = np.random.RandomState(seed).get_state(legacy=False)
    return bool(
        state["state"]["pos"] == ref["state"]["pos"]
        and state["has_gauss"] == ref["has_gauss"]
        and (state["state"]["key"] == ref["state"]["key"]).all()
    )


def _rngs(torch: Any, np: Any, snapshot: Any, in_block: bool) -> tuple[RngStatus, ...]:
    from ._seed import MAX_SEED
    from .sources import registered_rngs

    block = "seeded on entry to the enclosing deterministic block"
    cpu_seed = int(torch.initial_seed())
    small = cpu_seed if cpu_seed <= MAX_SEED else None
    out: list[RngStatus] = []

    fresh_checks: tuple[tuple[str, Callable[[int], bool]], ...] = (
        ("random", _fresh_python_state),
        ("numpy", functools.partial(_fresh_numpy_state, np)),
    )
    for name, fresh in fresh_checks:
        if in_block:  # seeded with the block's seed, or a per-rank seed derived from it
            out.append(RngStatus(name, True, None, block))
        elif small is not None and fresh(small):
            out.append(
                RngStatus(
                    name,
                    True,
                    small,
                    "in the state seeding with torch's seed gives; no draws since",
                )
            )
        else:
            out.append(
                RngStatus(name, None, None, "its state cannot tell whether or how it was seeded")
            )
    if np.random.mtrand._rand._bit_generator.__class__.__name__ != "MT19937":
        out[-1] = dataclasses.replace(
            out[-1], detail=out[-1].detail + "; the global bit generator was replaced"
        )

    if in_block or small is not None:
        detail = block if in_block else "torch.initial_seed() is a seed a program chose"
        out.append(RngStatus("torch.cpu", True, cpu_seed, detail))
    else:
        out.append(
            RngStatus(
                "torch.cpu",
                False,
                cpu_seed,
                "torch.initial_seed() is a random 64-bit startup value: never seeded",
            )
        )

    if torch.cuda.is_initialized():
        seeds = [int(g.initial_seed()) for g in torch.cuda.default_generators]
        seeded = in_block or any(s != TORCH_DEFAULT_SEED for s in seeds)
        out.append(
            RngStatus(
                "torch.cuda",
                seeded,
                seeds[0] if seeds and len(set(seeds)) == 1 else None,
                f"initial seed per device: {seeds}"
                + ("" if seeded else " (torch's fixed default)"),
            )
        )
    elif torch.backends.cuda.is_built() and "torch.cuda" in snapshot.sources:
        lazy = snapshot.state_of("torch.cuda")
        queued = (
            getattr(lazy, "seed_all", None) is not None
            or getattr(lazy, "seed_one", None) is not None
        )
        if in_block:
            detail = (
                "not initialized; if CUDA starts inside the block it starts from the block's seed"
            )
        elif queued:
            detail = "not initialized; a queued seed applies when CUDA starts"
        else:
            detail = (
                "not initialized; it would start from torch's fixed default seed "
                f"{TORCH_DEFAULT_SEED}"
            )
        out.append(RngStatus("torch.cuda", in_block or queued, None, detail))

    for key, obj in registered_rngs():
        out.append(
            RngStatus(
                f"user:{key}",
                True if in_block else None,
                None,
                f"registered {type(obj).__qualname__}, seeded inside every deterministic block",
            )
        )
    return tuple(out)


# --- problems ----------------------------------------------------------------------------------


def _problems(
    *,
    flags: Mapping[str, Any],
    env: Mapping[str, str | None],
    startup_env: Mapping[str, str | None] | None,
    cuda: Mapping[str, Any],
    start_method: str,
    rngs: tuple[RngStatus, ...],
) -> tuple[Problem, ...]:
    """Known problems, from the facts alone (a pure function, so each rule is testable)."""
    from .sources.environ import CUBLAS_VALID

    out: list[Problem] = []

    def warn(code: str, message: str) -> None:
        out.append(Problem("warning", code, message))

    def note(code: str, message: str) -> None:
        out.append(Problem("note", code, message))

    gpu = bool(cuda.get("built") or cuda.get("initialized"))
    if not flags["deterministic_algorithms"]:
        warn(
            "nondeterministic-algorithms",
            "torch.use_deterministic_algorithms is off: operations with nondeterministic kernels "
            "(scatter_add_, index_add_, embedding backward, ... mostly on CUDA) may differ run "
            "to run",
        )
    elif flags["deterministic_warn_only"]:
        note(
            "warn-only", "nondeterministic operations only warn (warn_only=True) instead of raising"
        )
    elif not flags["fill_uninitialized_memory"]:
        note(
            "uninitialized-memory",
            "fill_uninitialized_memory is off: torch.empty() may expose whatever the memory held "
            "before",
        )
    if flags["cudnn_benchmark"]:
        warn(
            "cudnn-benchmark",
            "torch.backends.cudnn.benchmark is on: cuDNN times several algorithms at first use and "
            "may choose a different one in each run",
        )
    if gpu and not flags["cudnn_deterministic"] and not flags["deterministic_algorithms"]:
        warn(
            "cudnn-nondeterministic",
            "torch.backends.cudnn.deterministic is off (and deterministic algorithms too): "
            "cuDNN may "
            "pick nondeterministic convolution algorithms",
        )
    cublas = env.get("CUBLAS_WORKSPACE_CONFIG")
    if gpu and cublas not in CUBLAS_VALID:
        warn(
            "cublas-workspace",
            f"CUBLAS_WORKSPACE_CONFIG is {'unset' if cublas is None else repr(cublas)}: cuBLAS is "
            f"only deterministic with {' or '.join(CUBLAS_VALID)} (with deterministic algorithms "
            "on, cuBLAS calls raise); set it before starting Python",
        )
    elif (
        cuda.get("initialized")
        and startup_env is not None
        and startup_env.get("CUBLAS_WORKSPACE_CONFIG") != cublas
    ):
        warn(
            "cublas-workspace-late",
            "CUBLAS_WORKSPACE_CONFIG was set after the process started and CUDA is initialized: "
            "cuBLAS reads it when it creates its first handle, so it may have no effect in this "
            "process; set it before starting Python",
        )
    hashseed = env.get("PYTHONHASHSEED")
    if start_method in ("spawn", "forkserver") and hashseed in (None, "random"):
        warn(
            "pythonhashseed-spawn",
            f"PYTHONHASHSEED is {'unset' if hashseed is None else 'random'} and new processes "
            "start "
            f"with {start_method!r}: DataLoader workers and other child processes hash str and "
            "bytes differently in each run (set iteration order changes); deterministic blocks "
            "set it for their duration, or set it before starting Python",
        )
    if cuda.get("bad_fork"):
        warn(
            "cuda-bad-fork",
            "this is a forked child of a process that had initialized CUDA: CUDA cannot be used "
            "here",
        )
    if gpu and (
        flags["float32_matmul_precision"] != "highest"
        or "tf32" in flags.get("fp32_precision", {}).values()
    ):
        note(
            "tf32",
            "TF32 is allowed for float32 math: deterministic on one GPU model, but results differ "
            "between GPU generations and from CPU results",
        )
    if flags.get("inductor_deterministic") is False:
        note(
            "inductor",
            "torch._inductor.config.deterministic is off: torch.compile may autotune and pick "
            "different kernels in each run",
        )
    for rng in rngs:
        if rng.name == "torch.cpu" and rng.seeded is False:
            note(
                "unseeded",
                "torch's global generator was never seeded in this process: use "
                "deterministic(seed=...) or seed_everything(...)",
            )
    return tuple(out)


def report() -> DeterminismReport:
    """Describe the determinism setup of this process, with warnings for known problems.

    Safe anywhere, including inside a deterministic block (it then shows the
    block's settings) and before CUDA starts (it never initializes CUDA).

    Example:
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx.report import report
        >>> with deterministic(seed=0):
        ...     r = report()
        >>> r.in_block, r.flags["deterministic_algorithms"]
        (True, True)
        >>> "nondeterministic-algorithms" in [p.code for p in r.problems]
        False
    """
    import platform

    import numpy as np
    import torch

    from . import __version__
    from .snapshot import Snapshot

    snapshot = Snapshot.capture()
    in_block = _in_block()
    flags = _flags(torch, snapshot)
    env = {name: os.environ.get(name) for name in _env_names()}
    cuda = _cuda(torch)
    method, explicit = _start_method()
    rngs = _rngs(torch, np, snapshot, in_block)
    process: dict[str, Any] = {
        "start_method": method,
        "start_method_explicit": explicit,
        "hash_randomization": bool(sys.flags.hash_randomization),
        "num_threads": torch.get_num_threads(),
        "env_at_start": _startup_env(),
    }
    versions = {
        "deterministic-ctx": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
    problems = _problems(
        flags=flags,
        env=env,
        startup_env=process["env_at_start"],
        cuda=cuda,
        start_method=method,
        rngs=rngs,
    )
    return DeterminismReport(versions, in_block, flags, env, rngs, cuda, process, problems)
