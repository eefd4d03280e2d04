"""The report's problems: one rule per problem, listed in :data:`RULES`.

Most rules have one shape, a condition and a message (a :class:`_Rule` row of
the table); the rest are functions.  :func:`problems` is a pure function of
the facts, so each rule is testable on its own.
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


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A rule of the common shape: its problem where ``applies``, else ``None``.

    ``message`` is the text, or makes it from the facts.
    """

    level: str
    code: str
    applies: Callable[[Facts], object]
    message: str | Callable[[Facts], str]

    def __call__(self, f: Facts) -> Problem | None:
        if not self.applies(f):
            return None
        message = self.message if isinstance(self.message, str) else self.message(f)
        return Problem(self.level, self.code, message)


def _internal() -> Any:
    """:mod:`deterministic_ctx.internal`, for its constants: imported when a rule runs, since
    it imports torch and this module must not."""
    from .. import internal

    return internal


def _configs() -> Any:
    """:mod:`deterministic_ctx._torch.internals`, for the names of torch's config modules:
    imported when a rule runs, for the same reason."""
    from .._torch import internals

    return internals


def _compiled_rng(f: Facts) -> Problem | None:
    from .._torch.internals import DYNAMO, INDUCTOR_CONFIG

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


#: The rules, in report order: each gives its problem, or ``None`` when the facts are fine.
RULES: tuple[Callable[[Facts], Problem | None], ...] = (
    _Rule(
        "warning",
        "nondeterministic-algorithms",
        lambda f: not f.flags["deterministic_algorithms"],
        "torch.use_deterministic_algorithms is off: operations with nondeterministic kernels "
        "(scatter_add_, index_add_, embedding backward, ... mostly on CUDA) may differ run to run",
    ),
    # torch reads warn_only only with deterministic algorithms on.
    _Rule(
        "note",
        "warn-only",
        lambda f: f.flags["deterministic_algorithms"] and f.flags["deterministic_warn_only"],
        "nondeterministic operations only warn (warn_only=True) instead of raising",
    ),
    # Like warn_only, torch reads this flag only with deterministic algorithms on; and of
    # these three rules, only the first that applies reports.
    _Rule(
        "note",
        "uninitialized-memory",
        lambda f: (
            f.flags["deterministic_algorithms"]
            and not f.flags["deterministic_warn_only"]
            and f.flags["fill_uninitialized_memory"] is False  # None: this torch lacks it
        ),
        "fill_uninitialized_memory is off: torch.empty() may expose whatever the memory held "
        "before",
    ),
    _Rule(
        "warning",
        "cudnn-benchmark",
        lambda f: f.flags["cudnn_benchmark"],
        "torch.backends.cudnn.benchmark is on: cuDNN times several algorithms at first use and "
        "may choose a different one in each run",
    ),
    # Deterministic algorithms make cuDNN deterministic too, whatever its own flag says.
    _Rule(
        "warning",
        "cudnn-nondeterministic",
        lambda f: (
            f.gpu and not (f.flags["cudnn_deterministic"] or f.flags["deterministic_algorithms"])
        ),
        "torch.backends.cudnn.deterministic is off (and deterministic algorithms too): cuDNN may "
        "pick nondeterministic convolution algorithms",
    ),
    _Rule(
        "warning",
        "cublas-workspace",
        lambda f: f.gpu and f.cublas not in _internal().CUBLAS_VALID,
        lambda f: (
            f"CUBLAS_WORKSPACE_CONFIG is {_value(f.cublas)}: cuBLAS is only deterministic with "
            f"{' or '.join(_internal().CUBLAS_VALID)} (with deterministic algorithms on, cuBLAS "
            "calls raise); set it before starting Python"
        ),
    ),
    # A valid value that the process did not start with (an invalid one is the rule
    # above's; initialized CUDA implies f.gpu).  Unknown start environment: no claim.
    _Rule(
        "warning",
        "cublas-workspace-late",
        lambda f: (
            f.cuda.get("initialized")
            and f.cublas in _internal().CUBLAS_VALID
            and f.startup_env is not None
            and f.startup_env.get("CUBLAS_WORKSPACE_CONFIG") != f.cublas
        ),
        "CUBLAS_WORKSPACE_CONFIG was set after the process started and CUDA is initialized: "
        "cuBLAS reads it when it creates its first handle, so it may have no effect in this "
        "process; set it before starting Python",
    ),
    # Forked children inherit the parent's hash secret; spawned ones draw a new one.
    _Rule(
        "warning",
        "pythonhashseed-spawn",
        lambda f: (
            f.start_method in ("spawn", "forkserver")
            and f.env.get("PYTHONHASHSEED") in (None, "random")
        ),
        lambda f: (
            f"PYTHONHASHSEED is {f.env.get('PYTHONHASHSEED') or 'unset'} and new processes "
            f"start with {f.start_method!r}: DataLoader workers and other child processes hash str "
            "and bytes differently in each run (set iteration order changes); deterministic blocks "
            "set it for their duration, or set it before starting Python"
        ),
    ),
    _Rule(
        "warning",
        "cuda-bad-fork",
        lambda f: f.cuda.get("bad_fork"),
        "this is a forked child of a process that had initialized CUDA: CUDA cannot be used here",
    ),
    _Rule(
        "note",
        "tf32",
        lambda f: (
            f.gpu
            and (
                f.flags["float32_matmul_precision"] != "highest"
                or "tf32" in f.flags.get("fp32_precision", {}).values()
            )
        ),
        "TF32 is allowed for float32 math: deterministic on one GPU model, but results differ "
        "between GPU generations and from CPU results",
    ),
    # ``None`` when torch._inductor is not imported: the report never imports it to ask.
    _Rule(
        "note",
        "inductor",
        lambda f: f.flags.get("inductor_deterministic") is False,
        lambda f: (
            f"{_configs().INDUCTOR_CONFIG}.deterministic is off: torch.compile may "
            "autotune and pick different kernels in each run"
        ),
    ),
    _compiled_rng,
    # Absent when torch._dynamo is not imported.  Dynamo traces np.random calls into
    # torch._numpy.random, which draws from torch's generator unless told otherwise.
    _Rule(
        "note",
        "compiled-numpy-rng",
        lambda f: (
            f.torch_compile.get(f"{_configs().DYNAMO_CONFIG}.use_numpy_random_stream") is False
        ),
        lambda f: (
            f"{_configs().DYNAMO_CONFIG}.use_numpy_random_stream is off: np.random calls inside "
            "code compiled with torch.compile draw from torch's generator, not NumPy's (other "
            "numbers than eager, and NumPy's state does not advance); set it to True to keep "
            "NumPy's stream (each such call is then a graph break)"
        ),
    ),
    _nccl_env_late,
    _nccl_env_changed,
    _nccl_nvls,
    _Rule(
        "warning",
        "nccl-collnet",
        lambda f: (
            _nccl_in_network(
                f,
                "NCCL_COLLNET_ENABLE",
                COLLNET_ALGORITHMS,
                f.collectives.get("effective", {}).get("NCCL_COLLNET_ENABLE") == "1",
            )
            and (f.collectives.get("nccl_available") or _group(f).get("uses_nccl"))
        ),
        "NCCL_COLLNET_ENABLE is '1': NCCL may reduce in the network's switches (SHARP), in an "
        "order it does not control; set NCCL_COLLNET_ENABLE=0 (or NCCL_ALGO=Ring) before "
        "init_process_group",
    ),
    _Rule(
        "note",
        "unseeded",
        lambda f: any(r.name == "torch.cpu" and r.seeded is False for r in f.rngs),
        "torch's global generator was never seeded in this process: use "
        "deterministic(seed=...) or seed_everything(...)",
    ),
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
