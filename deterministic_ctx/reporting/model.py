"""The report's value types and their rendering as text and as plain (JSON) data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["DeterminismReport", "Problem", "RngStatus"]


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
    ``warnings`` lists the problems of level ``"warning"``.  ``torch_compile``
    holds torch.compile's random-number settings as ``{"module.key": value}``
    (``"torch._inductor.config.fallback_random": False``, ...), for the config
    modules already imported: empty when torch.compile has not been used.
    ``collectives`` holds the process group (``process_group``), NCCL's
    variables (``env``) with what each value means (``meaning``), the values
    NCCL's configuration files give unset ones (``config_files``,
    ``effective``), and what reports saw before NCCL read them and at the
    first look after (``env_before_use``, ``env_first_seen_in_use``).
    """

    versions: dict[str, str | None]
    in_block: bool
    flags: dict[str, Any]
    env: dict[str, str | None]
    rngs: tuple[RngStatus, ...]
    cuda: dict[str, Any]
    process: dict[str, Any]
    problems: tuple[Problem, ...]
    # Last, with a default: reports built positionally before it existed still build.
    torch_compile: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The process group and NCCL's variables (see :mod:`.collectives`); empty in reports
    #: built before it existed.
    collectives: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Which fast paths blocks use (``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` turns them
    #: off); empty in reports built before it existed.
    fast_paths: dict[str, bool] = dataclasses.field(default_factory=dict)
    #: The ops an open ``allow_nondeterministic`` exempts from the deterministic check
    #: (any thread), as torch names them; empty in reports built before it existed.
    exempted_ops: tuple[str, ...] = ()

    @property
    def warnings(self) -> tuple[Problem, ...]:
        """The problems of level ``"warning"``, in report order."""
        return tuple(p for p in self.problems if p.level == "warning")

    def to_dict(self) -> dict[str, Any]:
        """Plain data only (dicts, lists, str, int, float, bool, None).

        Example:
            >>> import json
            >>> from deterministic_ctx import report
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
        if self.exempted_ops:
            lines.append(
                "  exempted from the check (allow_nondeterministic): "
                + ", ".join(self.exempted_ops)
            )
        lines += _section(
            "Environment", {k: "(unset)" if v is None else v for k, v in self.env.items()}
        )
        # One aligned row per RNG, as every other section.
        seeded = {True: "seeded", False: "not seeded", None: "unknown"}
        seeds = {r.name: "" if r.seed is None else f" (seed {r.seed})" for r in self.rngs}
        lines += _section(
            "RNGs", {r.name: f"{seeded[r.seeded]}{seeds[r.name]}: {r.detail}" for r in self.rngs}
        )
        lines += _compile_section(self.torch_compile)
        lines += _section("CUDA", self.cuda)
        lines += _collectives_section(self.collectives)
        lines += _section("Process", self.process)
        if self.fast_paths:
            lines += _section(
                "Fast paths (DETERMINISTIC_CTX_NO_FAST_PATHS=1 turns them off)",
                {k: "on" if v else "off" for k, v in self.fast_paths.items()},
            )
        lines += _problem_section(self.problems)
        return "\n".join(lines)


def _section(title: str, values: Mapping[str, Any]) -> list[str]:
    width = max((len(k) for k in values), default=0)
    return [title] + [f"  {k:<{width}}  {_show(v)}" for k, v in values.items()]


def _compile_section(settings: Mapping[str, Any]) -> list[str]:
    from .._torch.internals import INDUCTOR, INDUCTOR_CONFIG

    lines = _section("torch.compile", settings)
    if not any(name.startswith(INDUCTOR_CONFIG) for name in settings):
        # The report never imports inductor to ask (that costs about a second).
        lines.append(f"  not used in this process: {INDUCTOR} is not imported")
    return lines


def _collectives_section(facts: Mapping[str, Any]) -> list[str]:
    if not facts:
        return []
    group = facts.get("process_group", {})
    if not group.get("available", True):
        shown = "torch.distributed not available"
    elif not group.get("initialized"):
        shown = "not initialized"
    else:
        communicators = {True: "created", False: "not yet created", None: "unknown"}
        shown = (
            f"{group['backend']} ({group['backend_config']}), rank {group['rank']} of "
            f"{group['world_size']}"
        )
        if group.get("uses_nccl"):
            shown += f"; NCCL communicators {communicators[group.get('nccl_communicators')]}"
    rows: dict[str, Any] = {
        "process group": shown,
        "NCCL": facts.get("nccl_version")
        or ("built in" if facts.get("nccl_available") else "not in this torch build"),
    }
    env, meaning = facts.get("env", {}), facts.get("meaning", {})
    effective = facts.get("effective", env)
    # Every variable's meaning where NCCL can run; elsewhere only the ones set.
    everything = facts.get("nccl_available") or group.get("uses_nccl")
    unset = []
    for name, value in env.items():
        if everything or effective.get(name) is not None:
            rows[name] = f"{'(unset)' if value is None else value}: {meaning.get(name, '')}"
        else:
            unset.append(name)
    if unset:
        rows["unset"] = ", ".join(unset)
    for path, values in facts.get("config_files", {}).items():
        rows[f"from {path}"] = values
    return _section("Collectives", rows)


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
