"""The report's problems: one function per rule, listed in :data:`RULES`.

:func:`problems` is a pure function of the facts, so each rule is testable
on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .model import Problem, RngStatus

__all__ = ["RULES", "Facts", "problems"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the rules read (see :func:`problems`)."""

    flags: Mapping[str, Any]
    env: Mapping[str, str | None]
    startup_env: Mapping[str, str | None] | None
    cuda: Mapping[str, Any]
    start_method: str
    rngs: tuple[RngStatus, ...]
    #: ``{"module.key": value}`` of torch.compile's random-number settings, for the config
    #: modules already imported (empty when none is: torch.compile has not been used).
    torch_compile: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        """Whether CUDA can be used here: GPU-only problems are not reported otherwise."""
        return bool(self.cuda.get("built") or self.cuda.get("initialized"))

    @property
    def cublas(self) -> str | None:
        """``CUBLAS_WORKSPACE_CONFIG`` now."""
        return self.env.get("CUBLAS_WORKSPACE_CONFIG")


def _nondeterministic_algorithms(f: Facts) -> Problem | None:
    if f.flags["deterministic_algorithms"]:
        return None
    return Problem(
        "warning",
        "nondeterministic-algorithms",
        "torch.use_deterministic_algorithms is off: operations with nondeterministic kernels "
        "(scatter_add_, index_add_, embedding backward, ... mostly on CUDA) may differ run to run",
    )


def _warn_only(f: Facts) -> Problem | None:
    # torch reads warn_only only with deterministic algorithms on.
    if not (f.flags["deterministic_algorithms"] and f.flags["deterministic_warn_only"]):
        return None
    return Problem(
        "note",
        "warn-only",
        "nondeterministic operations only warn (warn_only=True) instead of raising",
    )


def _uninitialized_memory(f: Facts) -> Problem | None:
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


def _cudnn_benchmark(f: Facts) -> Problem | None:
    if not f.flags["cudnn_benchmark"]:
        return None
    return Problem(
        "warning",
        "cudnn-benchmark",
        "torch.backends.cudnn.benchmark is on: cuDNN times several algorithms at first use and "
        "may choose a different one in each run",
    )


def _cudnn_nondeterministic(f: Facts) -> Problem | None:
    # Deterministic algorithms make cuDNN deterministic too, whatever its own flag says.
    if not f.gpu or f.flags["cudnn_deterministic"] or f.flags["deterministic_algorithms"]:
        return None
    return Problem(
        "warning",
        "cudnn-nondeterministic",
        "torch.backends.cudnn.deterministic is off (and deterministic algorithms too): cuDNN may "
        "pick nondeterministic convolution algorithms",
    )


def _cublas_workspace(f: Facts) -> Problem | None:
    from ..internal import CUBLAS_VALID

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


def _cublas_workspace_late(f: Facts) -> Problem | None:
    # A valid value that the process did not start with (an invalid one is the rule
    # above's; initialized CUDA implies f.gpu).  Unknown start environment: no claim.
    from ..internal import CUBLAS_VALID

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


def _pythonhashseed_spawn(f: Facts) -> Problem | None:
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


def _cuda_bad_fork(f: Facts) -> Problem | None:
    if not f.cuda.get("bad_fork"):
        return None
    return Problem(
        "warning",
        "cuda-bad-fork",
        "this is a forked child of a process that had initialized CUDA: CUDA cannot be used here",
    )


def _tf32(f: Facts) -> Problem | None:
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


def _inductor(f: Facts) -> Problem | None:
    # ``None`` when torch._inductor is not imported: the report never imports it to ask.
    if f.flags.get("inductor_deterministic") is not False:
        return None
    return Problem(
        "note",
        "inductor",
        "torch._inductor.config.deterministic is off: torch.compile may autotune and pick "
        "different kernels in each run",
    )


_FALLBACK_RANDOM = "torch._inductor.config.fallback_random"
_ALIGN_RANDOM_EAGER = "torch._inductor.config.align_random_eager"
_NUMPY_RANDOM_STREAM = "torch._dynamo.config.use_numpy_random_stream"


def _compiled_rng(f: Facts) -> Problem | None:
    # Absent when torch._inductor is not imported: nothing was compiled by inductor then.
    # A note, not a warning: compiled numbers are reproducible run to run; they are only
    # not eager's (as TF32 results are reproducible, only not another GPU's).
    if f.torch_compile.get(_FALLBACK_RANDOM) is not False:
        return None
    # align_random_eager changes only torch.rand-based ops, and only on CUDA (inductor's
    # replace_random pass): the note stays, and says why.
    aligned = (
        " (align_random_eager, on here, aligns only some random ops with eager, and only on CUDA)"
        if f.torch_compile.get(_ALIGN_RANDOM_EAGER) is True
        else ""
    )
    return Problem(
        "note",
        "compiled-rng",
        "torch._inductor.config.fallback_random is off: code compiled by torch.compile's "
        "inductor backend draws its random numbers (dropout, torch.rand, ...) with inductor's "
        "own generator, reproducible run to run but not equal to eager's under the same seed"
        + aligned
        + '; for eager\'s numbers use deterministic(seed, compiled_rng="eager") or '
        "torch._inductor.config.fallback_random = True, in effect when the compiled code first "
        "runs (code compiled before keeps its numbers until torch._dynamo.reset()); random ops "
        "then run eager's kernels, unfused: slower",
    )


def _compiled_numpy_rng(f: Facts) -> Problem | None:
    # Absent when torch._dynamo is not imported.  Dynamo traces np.random calls into
    # torch._numpy.random, which draws from torch's generator unless told otherwise.
    if f.torch_compile.get(_NUMPY_RANDOM_STREAM) is not False:
        return None
    return Problem(
        "note",
        "compiled-numpy-rng",
        "torch._dynamo.config.use_numpy_random_stream is off: np.random calls inside code "
        "compiled with torch.compile draw from torch's generator, not NumPy's (other numbers "
        "than eager, and NumPy's state does not advance); set it to True to keep NumPy's "
        "stream (each such call is then a graph break)",
    )


def _unseeded(f: Facts) -> Problem | None:
    if not any(r.name == "torch.cpu" and r.seeded is False for r in f.rngs):
        return None
    return Problem(
        "note",
        "unseeded",
        "torch's global generator was never seeded in this process: use "
        "deterministic(seed=...) or seed_everything(...)",
    )


#: The rules, in report order: each gives its problem, or ``None`` when the facts are fine.
RULES: tuple[Callable[[Facts], Problem | None], ...] = (
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
    _compiled_rng,
    _compiled_numpy_rng,
    _unseeded,
)


def problems(
    *,
    flags: Mapping[str, Any],
    env: Mapping[str, str | None],
    startup_env: Mapping[str, str | None] | None,
    cuda: Mapping[str, Any],
    start_method: str,
    rngs: tuple[RngStatus, ...],
    torch_compile: Mapping[str, Any] | None = None,
) -> tuple[Problem, ...]:
    """Known problems, from the facts alone (a pure function, so each rule is testable)."""
    facts = Facts(flags, env, startup_env, cuda, start_method, rngs, torch_compile or {})
    return tuple(problem for rule in RULES if (problem := rule(facts)) is not None)
