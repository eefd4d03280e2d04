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
at import time: :mod:`deterministic_ctx.internal` imports torch and NumPy, so
it is imported inside the functions that need it.

The module reads top to bottom as the report is made: the report's types and
their rendering, the facts (flags, environment, CUDA, process), the RNG
section (one function per RNG family, listed in :data:`_RNG_FAMILIES`), the
problems (one function per rule, listed in :data:`_RULES`), and
:func:`report`, which puts them together.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
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


# --- the report and its rendering ----------------------------------------------------------------


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
        """The problems of level ``"warning"``, in report order."""
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
        """The report for people: one titled section per kind of fact, then the problems."""
        lines = ["Determinism report"]
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in self.versions.items() if v))
        lines.append(f"  inside a deterministic block: {'yes' if self.in_block else 'no'}")
        lines += _section("Flags", self.flags)
        lines += _section(
            "Environment", {k: "(unset)" if v is None else v for k, v in self.env.items()}
        )
        lines += _rng_section(self.rngs)
        lines += _section("CUDA", self.cuda)
        lines += _section("Process", self.process)
        lines += _problem_section(self.problems)
        return "\n".join(lines)


def _section(title: str, values: Mapping[str, Any]) -> list[str]:
    width = max((len(k) for k in values), default=0)
    return [title] + [f"  {k:<{width}}  {_show(v)}" for k, v in values.items()]


def _rng_section(rngs: tuple[RngStatus, ...]) -> list[str]:
    width = max((len(r.name) for r in rngs), default=0)
    lines = ["RNGs"]
    for rng in rngs:
        seeded = {True: "seeded", False: "not seeded", None: "unknown"}[rng.seeded]
        seed = f" (seed {rng.seed})" if rng.seed is not None else ""
        lines.append(f"  {rng.name:<{width}}  {seeded}{seed}: {rng.detail}")
    return lines


def _problem_section(problems: tuple[Problem, ...]) -> list[str]:
    counts = [
        f"{n} {level}(s)"
        for level in ("warning", "note")
        if (n := sum(p.level == level for p in problems))
    ]
    return [f"Problems: {', '.join(counts) if counts else 'none found'}"] + [
        f"  {p.level} [{p.code}] {p.message}" for p in problems
    ]


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


def _env_names() -> tuple[str, ...]:
    """The environment section: every variable blocks manage (``managed_env_vars()``, registered
    ones included), then :data:`_EXTRA_ENV_NAMES`."""
    from .internal import managed_env_vars

    managed = managed_env_vars()
    return (*managed, *(n for n in _EXTRA_ENV_NAMES if n not in managed))


def _startup_env() -> dict[str, str | None] | None:
    """The managed variables as the process started with them (Linux), else ``None``."""
    from .internal import managed_env_vars

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


def _flags(torch: Any, snapshot: Any) -> dict[str, Any]:
    from .internal import PRECISION_OPS

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


# --- the RNG section: one function per RNG family -----------------------------------------------

_BLOCK_SEEDED = "seeded on entry to the enclosing deterministic block"


@dataclasses.dataclass(frozen=True)
class _RngFacts:
    """What every RNG family's status is judged from."""

    torch: Any
    np: Any
    snapshot: Any
    in_block: bool
    #: ``torch.initial_seed()``: the seed of torch's global generator.
    cpu_seed: int

    @property
    def chosen_seed(self) -> int | None:
        """The CPU seed when a program could have chosen it, else ``None``.

        An unseeded torch starts from a random 64-bit value, which falls in the
        range ``seed_everything`` and blocks accept (up to ``MAX_SEED``, 32 bits)
        with odds of 1 in 2**32: a seed in that range was chosen.
        """
        from .internal import MAX_SEED

        return self.cpu_seed if self.cpu_seed <= MAX_SEED else None


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


def _mersenne_status(name: str, facts: _RngFacts, fresh: Callable[[int], bool]) -> RngStatus:
    """Python's or NumPy's global Mersenne Twister.

    Its state cannot be traced back to a seed, so the only evidence of seeding
    is a state equal to the one seeding with torch's seed gives (what
    ``seed_everything`` does), before any draw.
    """
    if facts.in_block:  # seeded with the block's seed, or a per-rank seed derived from it
        return RngStatus(name, True, None, _BLOCK_SEEDED)
    seed = facts.chosen_seed
    if seed is not None and fresh(seed):
        detail = "in the state seeding with torch's seed gives; no draws since"
        return RngStatus(name, True, seed, detail)
    return RngStatus(name, None, None, "its state cannot tell whether or how it was seeded")


def _python_rng(facts: _RngFacts) -> tuple[RngStatus, ...]:
    return (_mersenne_status("random", facts, _fresh_python_state),)


def _numpy_rng(facts: _RngFacts) -> tuple[RngStatus, ...]:
    np = facts.np
    status = _mersenne_status("numpy", facts, functools.partial(_fresh_numpy_state, np))
    if np.random.mtrand._rand._bit_generator.__class__.__name__ != "MT19937":
        replaced = status.detail + "; the global bit generator was replaced"
        status = dataclasses.replace(status, detail=replaced)
    return (status,)


def _torch_cpu_rng(facts: _RngFacts) -> tuple[RngStatus, ...]:
    if facts.in_block:
        return (RngStatus("torch.cpu", True, facts.cpu_seed, _BLOCK_SEEDED),)
    if facts.chosen_seed is not None:
        detail = "torch.initial_seed() is a seed a program chose"
        return (RngStatus("torch.cpu", True, facts.cpu_seed, detail),)
    detail = "torch.initial_seed() is a random 64-bit startup value: never seeded"
    return (RngStatus("torch.cpu", False, facts.cpu_seed, detail),)


def _cuda_rng(facts: _RngFacts) -> tuple[RngStatus, ...]:
    """The CUDA default generators: read once CUDA started, else what they will start from.

    Nothing on a build without CUDA.
    """
    torch = facts.torch
    if torch.cuda.is_initialized():
        return (_started_cuda_rng(facts),)
    if torch.backends.cuda.is_built() and "torch.cuda" in facts.snapshot.sources:
        return (_pending_cuda_rng(facts),)
    return ()


def _started_cuda_rng(facts: _RngFacts) -> RngStatus:
    seeds = [int(g.initial_seed()) for g in facts.torch.cuda.default_generators]
    seeded = facts.in_block or any(s != TORCH_DEFAULT_SEED for s in seeds)
    detail = f"initial seed per device: {seeds}" + ("" if seeded else " (torch's fixed default)")
    return RngStatus("torch.cuda", seeded, seeds[0] if len(set(seeds)) == 1 else None, detail)


def _pending_cuda_rng(facts: _RngFacts) -> RngStatus:
    """CUDA not started: reading its generators would start it, so the snapshot tells instead."""
    lazy = facts.snapshot.state_of("torch.cuda")
    queued = any(getattr(lazy, name, None) is not None for name in ("seed_all", "seed_one"))
    if facts.in_block:
        detail = "not initialized; if CUDA starts inside the block it starts from the block's seed"
    elif queued:
        detail = "not initialized; a queued seed applies when CUDA starts"
    else:
        detail = (
            f"not initialized; it would start from torch's fixed default seed {TORCH_DEFAULT_SEED}"
        )
    return RngStatus("torch.cuda", facts.in_block or queued, None, detail)


def _user_rngs(facts: _RngFacts) -> tuple[RngStatus, ...]:
    from .internal import registered_rngs

    return tuple(
        RngStatus(
            f"user:{key}",
            True if facts.in_block else None,
            None,
            f"registered {type(obj).__qualname__}, seeded inside every deterministic block",
        )
        for key, obj in registered_rngs()
    )


#: The RNG section, in report order: each family gives its statuses (none where it does not apply).
_RNG_FAMILIES: tuple[Callable[[_RngFacts], tuple[RngStatus, ...]], ...] = (
    _python_rng,
    _numpy_rng,
    _torch_cpu_rng,
    _cuda_rng,
    _user_rngs,
)


def _rngs(torch: Any, np: Any, snapshot: Any, in_block: bool) -> tuple[RngStatus, ...]:
    facts = _RngFacts(torch, np, snapshot, in_block, int(torch.initial_seed()))
    return tuple(status for family in _RNG_FAMILIES for status in family(facts))


# --- problems: one function per rule ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What the rules read (see :func:`_problems`)."""

    flags: Mapping[str, Any]
    env: Mapping[str, str | None]
    startup_env: Mapping[str, str | None] | None
    cuda: Mapping[str, Any]
    start_method: str
    rngs: tuple[RngStatus, ...]

    @property
    def gpu(self) -> bool:
        """Whether CUDA can be used here: GPU-only problems are not reported otherwise."""
        return bool(self.cuda.get("built") or self.cuda.get("initialized"))

    @property
    def cublas(self) -> str | None:
        """``CUBLAS_WORKSPACE_CONFIG`` now."""
        return self.env.get("CUBLAS_WORKSPACE_CONFIG")


def _nondeterministic_algorithms(f: _Facts) -> Problem | None:
    if f.flags["deterministic_algorithms"]:
        return None
    return Problem(
        "warning",
        "nondeterministic-algorithms",
        "torch.use_deterministic_algorithms is off: operations with nondeterministic kernels "
        "(scatter_add_, index_add_, embedding backward, ... mostly on CUDA) may differ run to run",
    )


def _warn_only(f: _Facts) -> Problem | None:
    # torch reads warn_only only with deterministic algorithms on.
    if not (f.flags["deterministic_algorithms"] and f.flags["deterministic_warn_only"]):
        return None
    return Problem(
        "note",
        "warn-only",
        "nondeterministic operations only warn (warn_only=True) instead of raising",
    )


def _uninitialized_memory(f: _Facts) -> Problem | None:
    # Like warn_only, torch reads this flag only with deterministic algorithms on; and of
    # these three rules, only the first that applies reports.
    flags = f.flags
    if (
        not flags["deterministic_algorithms"]
        or flags["deterministic_warn_only"]
        or flags["fill_uninitialized_memory"]
    ):
        return None
    return Problem(
        "note",
        "uninitialized-memory",
        "fill_uninitialized_memory is off: torch.empty() may expose whatever the memory held "
        "before",
    )


def _cudnn_benchmark(f: _Facts) -> Problem | None:
    if not f.flags["cudnn_benchmark"]:
        return None
    return Problem(
        "warning",
        "cudnn-benchmark",
        "torch.backends.cudnn.benchmark is on: cuDNN times several algorithms at first use and "
        "may choose a different one in each run",
    )


def _cudnn_nondeterministic(f: _Facts) -> Problem | None:
    # Deterministic algorithms make cuDNN deterministic too, whatever its own flag says.
    if not f.gpu or f.flags["cudnn_deterministic"] or f.flags["deterministic_algorithms"]:
        return None
    return Problem(
        "warning",
        "cudnn-nondeterministic",
        "torch.backends.cudnn.deterministic is off (and deterministic algorithms too): cuDNN may "
        "pick nondeterministic convolution algorithms",
    )


def _cublas_workspace(f: _Facts) -> Problem | None:
    from .internal import CUBLAS_VALID

    if not f.gpu or f.cublas in CUBLAS_VALID:
        return None
    shown = "unset" if f.cublas is None else repr(f.cublas)
    return Problem(
        "warning",
        "cublas-workspace",
        f"CUBLAS_WORKSPACE_CONFIG is {shown}: cuBLAS is only deterministic with "
        f"{' or '.join(CUBLAS_VALID)} (with deterministic algorithms on, cuBLAS calls raise); "
        "set it before starting Python",
    )


def _cublas_workspace_late(f: _Facts) -> Problem | None:
    # A valid value that the process did not start with (an invalid one is the rule
    # above's; initialized CUDA implies f.gpu).  Unknown start environment: no claim.
    from .internal import CUBLAS_VALID

    if (
        not f.cuda.get("initialized")
        or f.cublas not in CUBLAS_VALID
        or f.startup_env is None
        or f.startup_env.get("CUBLAS_WORKSPACE_CONFIG") == f.cublas
    ):
        return None
    return Problem(
        "warning",
        "cublas-workspace-late",
        "CUBLAS_WORKSPACE_CONFIG was set after the process started and CUDA is initialized: "
        "cuBLAS reads it when it creates its first handle, so it may have no effect in this "
        "process; set it before starting Python",
    )


def _pythonhashseed_spawn(f: _Facts) -> Problem | None:
    # Forked children inherit the parent's hash secret; spawned ones draw a new one.
    hashseed = f.env.get("PYTHONHASHSEED")
    if f.start_method not in ("spawn", "forkserver") or hashseed not in (None, "random"):
        return None
    return Problem(
        "warning",
        "pythonhashseed-spawn",
        f"PYTHONHASHSEED is {'unset' if hashseed is None else 'random'} and new processes start "
        f"with {f.start_method!r}: DataLoader workers and other child processes hash str and "
        "bytes differently in each run (set iteration order changes); deterministic blocks set "
        "it for their duration, or set it before starting Python",
    )


def _cuda_bad_fork(f: _Facts) -> Problem | None:
    if not f.cuda.get("bad_fork"):
        return None
    return Problem(
        "warning",
        "cuda-bad-fork",
        "this is a forked child of a process that had initialized CUDA: CUDA cannot be used here",
    )


def _tf32(f: _Facts) -> Problem | None:
    tf32 = (
        f.flags["float32_matmul_precision"] != "highest"
        or "tf32" in f.flags.get("fp32_precision", {}).values()
    )
    if not (f.gpu and tf32):
        return None
    return Problem(
        "note",
        "tf32",
        "TF32 is allowed for float32 math: deterministic on one GPU model, but results differ "
        "between GPU generations and from CPU results",
    )


def _inductor(f: _Facts) -> Problem | None:
    # ``None`` when torch._inductor is not imported: the report never imports it to ask.
    if f.flags.get("inductor_deterministic") is not False:
        return None
    return Problem(
        "note",
        "inductor",
        "torch._inductor.config.deterministic is off: torch.compile may autotune and pick "
        "different kernels in each run",
    )


def _unseeded(f: _Facts) -> Problem | None:
    if not any(r.name == "torch.cpu" and r.seeded is False for r in f.rngs):
        return None
    return Problem(
        "note",
        "unseeded",
        "torch's global generator was never seeded in this process: use "
        "deterministic(seed=...) or seed_everything(...)",
    )


#: The rules, in report order: each gives its problem, or ``None`` when the facts are fine.
_RULES: tuple[Callable[[_Facts], Problem | None], ...] = (
    _nondeterministic_algorithms,
    _warn_only,
    _uninitialized_memory,
    _cudnn_benchmark,
    _cudnn_nondeterministic,
    _cublas_workspace,
    _cublas_workspace_late,
    _pythonhashseed_spawn,
    _cuda_bad_fork,
    _tf32,
    _inductor,
    _unseeded,
)


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
    facts = _Facts(flags, env, startup_env, cuda, start_method, rngs)
    return tuple(problem for rule in _RULES if (problem := rule(facts)) is not None)


# --- the report ----------------------------------------------------------------------------------


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

    from .internal import VERSION, inside_block
    from .snapshot import Snapshot

    snapshot = Snapshot.capture()
    in_block = inside_block()
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
        "deterministic-ctx": VERSION,
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
