"""The report's problems: one function per rule, listed in :data:`RULES`.

:func:`problems` is a pure function of the facts, so each rule is testable
on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .collectives import COLLNET_ALGORITHMS, NVLS_ALGORITHMS, PER_COMMUNICATOR, may_use
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
    #: The collectives section (see :func:`.collectives.collective_facts`); empty: no facts.
    collectives: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        """Whether CUDA can be used here: GPU-only problems are not reported otherwise."""
        return bool(self.cuda.get("built") or self.cuda.get("initialized"))

    @property
    def cublas(self) -> str | None:
        """``CUBLAS_WORKSPACE_CONFIG`` now."""
        return self.env.get("CUBLAS_WORKSPACE_CONFIG")


def _when(applies: object, level: str, code: str, message: str) -> Problem | None:
    """A rule's answer: the problem where it ``applies``, else ``None``."""
    return Problem(level, code, message) if applies else None


def _nondeterministic_algorithms(f: Facts) -> Problem | None:
    return _when(
        not f.flags["deterministic_algorithms"],
        "warning",
        "nondeterministic-algorithms",
        "torch.use_deterministic_algorithms is off: operations with nondeterministic kernels "
        "(scatter_add_, index_add_, embedding backward, ... mostly on CUDA) may differ run to run",
    )


def _warn_only(f: Facts) -> Problem | None:
    # torch reads warn_only only with deterministic algorithms on.
    return _when(
        f.flags["deterministic_algorithms"] and f.flags["deterministic_warn_only"],
        "note",
        "warn-only",
        "nondeterministic operations only warn (warn_only=True) instead of raising",
    )


def _uninitialized_memory(f: Facts) -> Problem | None:
    # Like warn_only, torch reads this flag only with deterministic algorithms on; and of
    # these three rules, only the first that applies reports.
    flags = f.flags
    return _when(
        flags["deterministic_algorithms"]
        and not flags["deterministic_warn_only"]
        and flags["fill_uninitialized_memory"] is False,  # None: this torch lacks it
        "note",
        "uninitialized-memory",
        "fill_uninitialized_memory is off: torch.empty() may expose whatever the memory held "
        "before",
    )


def _cudnn_benchmark(f: Facts) -> Problem | None:
    return _when(
        f.flags["cudnn_benchmark"],
        "warning",
        "cudnn-benchmark",
        "torch.backends.cudnn.benchmark is on: cuDNN times several algorithms at first use and "
        "may choose a different one in each run",
    )


def _cudnn_nondeterministic(f: Facts) -> Problem | None:
    # Deterministic algorithms make cuDNN deterministic too, whatever its own flag says.
    flags = f.flags
    return _when(
        f.gpu and not (flags["cudnn_deterministic"] or flags["deterministic_algorithms"]),
        "warning",
        "cudnn-nondeterministic",
        "torch.backends.cudnn.deterministic is off (and deterministic algorithms too): cuDNN may "
        "pick nondeterministic convolution algorithms",
    )


def _cublas_workspace(f: Facts) -> Problem | None:
    from ..internal import CUBLAS_VALID

    shown = "unset" if f.cublas is None else repr(f.cublas)
    return _when(
        f.gpu and f.cublas not in CUBLAS_VALID,
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

    return _when(
        f.cuda.get("initialized")
        and f.cublas in CUBLAS_VALID
        and f.startup_env is not None
        and f.startup_env.get("CUBLAS_WORKSPACE_CONFIG") != f.cublas,
        "warning",
        "cublas-workspace-late",
        "CUBLAS_WORKSPACE_CONFIG was set after the process started and CUDA is initialized: "
        "cuBLAS reads it when it creates its first handle, so it may have no effect in this "
        "process; set it before starting Python",
    )


def _pythonhashseed_spawn(f: Facts) -> Problem | None:
    # Forked children inherit the parent's hash secret; spawned ones draw a new one.
    hashseed = f.env.get("PYTHONHASHSEED")
    return _when(
        f.start_method in ("spawn", "forkserver") and hashseed in (None, "random"),
        "warning",
        "pythonhashseed-spawn",
        f"PYTHONHASHSEED is {'unset' if hashseed is None else 'random'} and new processes start "
        f"with {f.start_method!r}: DataLoader workers and other child processes hash str and "
        "bytes differently in each run (set iteration order changes); deterministic blocks set "
        "it for their duration, or set it before starting Python",
    )


def _cuda_bad_fork(f: Facts) -> Problem | None:
    return _when(
        f.cuda.get("bad_fork"),
        "warning",
        "cuda-bad-fork",
        "this is a forked child of a process that had initialized CUDA: CUDA cannot be used here",
    )


def _tf32(f: Facts) -> Problem | None:
    tf32 = (
        f.flags["float32_matmul_precision"] != "highest"
        or "tf32" in f.flags.get("fp32_precision", {}).values()
    )
    return _when(
        f.gpu and tf32,
        "note",
        "tf32",
        "TF32 is allowed for float32 math: deterministic on one GPU model, but results differ "
        "between GPU generations and from CPU results",
    )


def _inductor(f: Facts) -> Problem | None:
    from ..internal import INDUCTOR_CONFIG

    # ``None`` when torch._inductor is not imported: the report never imports it to ask.
    return _when(
        f.flags.get("inductor_deterministic") is False,
        "note",
        "inductor",
        f"{INDUCTOR_CONFIG}.deterministic is off: torch.compile may autotune and pick "
        "different kernels in each run",
    )


def _compiled_rng(f: Facts) -> Problem | None:
    from ..internal import DYNAMO, INDUCTOR_CONFIG

    # Absent when torch._inductor is not imported: nothing was compiled by inductor then.
    # A note, not a warning: compiled numbers are reproducible run to run; they are only
    # not eager's (as TF32 results are reproducible, only not another GPU's).
    if f.torch_compile.get(f"{INDUCTOR_CONFIG}.fallback_random") is not False:
        return None
    # align_random_eager changes only torch.rand-based ops, and only on CUDA (inductor's
    # replace_random pass): the note stays, and says why.
    aligned = (
        " (align_random_eager, on here, aligns only some random ops with eager, and only on CUDA)"
        if f.torch_compile.get(f"{INDUCTOR_CONFIG}.align_random_eager") is True
        else ""
    )
    return Problem(
        "note",
        "compiled-rng",
        f"{INDUCTOR_CONFIG}.fallback_random is off: code compiled by torch.compile's "
        "inductor backend draws its random numbers (dropout, torch.rand, ...) with inductor's "
        "own generator, reproducible run to run but not equal to eager's under the same seed"
        + aligned
        + '; for eager\'s numbers use deterministic(seed, compiled_rng="eager") or '
        f"{INDUCTOR_CONFIG}.fallback_random = True, in effect when the compiled code first "
        f"runs (code compiled before keeps its numbers until {DYNAMO}.reset()); random ops "
        "then run eager's kernels, unfused: slower",
    )


def _compiled_numpy_rng(f: Facts) -> Problem | None:
    from ..internal import DYNAMO_CONFIG

    # Absent when torch._dynamo is not imported.  Dynamo traces np.random calls into
    # torch._numpy.random, which draws from torch's generator unless told otherwise.
    return _when(
        f.torch_compile.get(f"{DYNAMO_CONFIG}.use_numpy_random_stream") is False,
        "note",
        "compiled-numpy-rng",
        f"{DYNAMO_CONFIG}.use_numpy_random_stream is off: np.random calls inside code "
        "compiled with torch.compile draw from torch's generator, not NumPy's (other numbers "
        "than eager, and NumPy's state does not advance); set it to True to keep NumPy's "
        "stream (each such call is then a graph break)",
    )


def _group(f: Facts) -> Mapping[str, Any]:
    """The process group's facts: ``{}`` when none is initialized."""
    group = f.collectives.get("process_group") or {}
    return group if group.get("initialized") else {}


def _changed(
    then: Mapping[str, str | None], now: Mapping[str, str | None], now_is: str = "now"
) -> str:
    """``"NAME ('a' then, unset now), ..."`` for the names whose values differ; ``""`` if none."""
    return ", ".join(
        f"{name} ({_value(then[name])} then, {_value(now[name])} {now_is})"
        for name in then
        if name in now and then[name] != now[name]
    )


def _value(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _nccl_env_late(f: Facts) -> Problem | None:
    # Certain: the value differs from the one a report saw once NCCL had read it (the group's
    # communicators created; for other backends, the group started).
    group, seen = _group(f), f.collectives.get("env_first_seen_in_use")
    if not group or seen is None:
        return None
    now = f.collectives.get("env", {})
    changed = _changed(seen, now)
    if not changed:
        return None
    advice = "; set NCCL variables before init_process_group"
    if not group.get("uses_nccl"):
        return Problem(
            "note",
            "nccl-env-late",
            f"{changed}: changed after the process group started; no effect on it (backend "
            f"{group.get('backend')!r} does not use NCCL), but NCCL groups created later would "
            "reduce in another order than ones created before" + advice,
        )
    names = [n for n in seen if n in now and seen[n] != now[n]]
    later = [n for n in names if n in PER_COMMUNICATOR]
    reach = (
        f"{', '.join(later)} will reach communicators created from now on (new_group), "
        "which then reduce in another order than the group's"
        if later
        else "NCCL reads them once per process: the change has no effect"
    )
    return Problem(
        "warning",
        "nccl-env-late",
        f"{changed}: changed after the process group started using NCCL: its communicators "
        f"keep the values NCCL read when it created them; {reach}" + advice,
    )


def _nccl_env_changed(f: Facts) -> Problem | None:
    # Uncertain: changed between a look before NCCL read them (a report, or the process
    # start) and the first look after.
    group = _group(f)
    before = f.collectives.get("env_before_use")
    seen = f.collectives.get("env_first_seen_in_use")
    if not group.get("uses_nccl") or before is None or seen is None:
        return None
    changed = _changed(before["env"], seen, "when a report first saw the group using NCCL")
    if not changed:
        return None
    return Problem(
        "note",
        "nccl-env-changed",
        f"{changed}: changed in this process since {before['source']}; NCCL sees a value only "
        "if it was set before it created the group's communicators (in init_process_group or "
        "at the first collective), and the report cannot tell when this one was set; set NCCL "
        "variables in the launcher's environment, or call report() once before "
        "init_process_group, for it to tell",
    )


def _nccl_in_network(f: Facts, name: str, algorithms: frozenset[str], on: bool) -> bool:
    """Whether NCCL may reduce with ``algorithms``, switched on by ``name``'s value."""
    effective = f.collectives.get("effective", {})
    return on and may_use(effective.get("NCCL_ALGO"), algorithms) and name in effective


def _nccl_nvls(f: Facts) -> Problem | None:
    effective = f.collectives.get("effective", {})
    value = effective.get("NCCL_NVLS_ENABLE")
    if not _nccl_in_network(f, "NCCL_NVLS_ENABLE", NVLS_ALGORITHMS, value != "0"):
        return None
    # Asked for (or NCCL_ALGO set without ruling it out) where NCCL exists: a warning.
    # Left to NCCL's default: a note, and only for a group that uses NCCL.
    chosen = value is not None or effective.get("NCCL_ALGO") is not None
    if chosen and (f.collectives.get("nccl_available") or _group(f).get("uses_nccl")):
        level = "warning"
    elif _group(f).get("uses_nccl"):
        level = "note"
    else:
        return None
    return Problem(
        level,
        "nccl-nvls",
        "NCCL may reduce with NVLink SHARP (NCCL_NVLS_ENABLE is "
        f"{_value(value)}, NCCL_ALGO {_value(effective.get('NCCL_ALGO'))}): on NVSwitch systems "
        "with Hopper or later GPUs the switch sums in an order not fixed from call to call; "
        "set NCCL_NVLS_ENABLE=0 (or NCCL_ALGO=Ring) before init_process_group",
    )


def _nccl_collnet(f: Facts) -> Problem | None:
    effective = f.collectives.get("effective", {})
    value = effective.get("NCCL_COLLNET_ENABLE")
    return _when(
        _nccl_in_network(f, "NCCL_COLLNET_ENABLE", COLLNET_ALGORITHMS, value == "1")
        and (f.collectives.get("nccl_available") or _group(f).get("uses_nccl")),
        "warning",
        "nccl-collnet",
        "NCCL_COLLNET_ENABLE is '1': NCCL may reduce in the network's switches (SHARP), in an "
        "order it does not control; set NCCL_COLLNET_ENABLE=0 (or NCCL_ALGO=Ring) before "
        "init_process_group",
    )


def _unseeded(f: Facts) -> Problem | None:
    return _when(
        any(r.name == "torch.cpu" and r.seeded is False for r in f.rngs),
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
    _nccl_env_late,
    _nccl_env_changed,
    _nccl_nvls,
    _nccl_collnet,
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
    collectives: Mapping[str, Any] | None = None,
) -> tuple[Problem, ...]:
    """Known problems, from the facts alone (a pure function, so each rule is testable)."""
    facts = Facts(
        flags, env, startup_env, cuda, start_method, rngs, torch_compile or {}, collectives or {}
    )
    return tuple(problem for rule in RULES if (problem := rule(facts)) is not None)
