"""This process's global rank, as ``torch.distributed`` and its launchers tell it.

What ``rank="auto"`` stands for (:func:`process_rank`): the rank in the
default process group where one is initialized, else the launcher's
``RANK`` (``torchrun``'s environment contract), else 0.  It lives with the
torch API that not every torch has (``torch.distributed`` is missing from
some builds: ``dist.is_available()``), below the settings that resolve
``rank="auto"`` when a block starts, and it never imports
``torch.distributed`` itself.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .._errors import StateWarning

__all__ = ["launcher_variables", "process_rank"]


#: (group, launcher) pairs already warned about by :func:`process_rank`.
_WARNED: set[tuple[tuple[int, int], tuple[int, int]]] = set()


def process_rank() -> int:
    """The global rank of this process: what ``rank="auto"`` stands for.

    In this order:

    * the rank in torch.distributed's default process group, where one is
      initialized;
    * else the launcher's ``RANK``: ``torchrun`` (like
      ``torch.distributed.launch``, DeepSpeed and accelerate) exports it with
      ``WORLD_SIZE`` before the script starts, so a block or
      ``seed_everything`` that runs before ``init_process_group`` seeds what
      it would seed after it;
    * else 0: one process.

    Only the global rank counts.  The local rank (``LOCAL_RANK``: which
    device the process drives) and the node rank (``GROUP_RANK``) never
    enter a seed, so a global rank draws the same numbers whether the world
    is laid out as 1 node x 4 processes or 2 x 2.

    Before a process group exists, the launcher's variables are checked
    (``ValueError`` naming the variable): decimal ints with ``0 <= RANK <
    WORLD_SIZE``, and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK``, where set, must fit them.  Only one of ``RANK`` and
    ``WORLD_SIZE`` set (Lightning's launcher exports ``WORLD_SIZE`` without
    ``RANK`` and passes the rank to ``init_process_group``): the rank cannot
    be known yet, so it is 0, with a :class:`StateWarning` once.  Once a process
    group exists it is the truth: the variables are not checked any more,
    and where ``RANK`` and ``WORLD_SIZE`` are both set and differ from the
    group's, a :class:`StateWarning` (once per pair) says that ``"auto"`` meant
    another rank before ``init_process_group`` (the process inherited them,
    say from a torchrun worker that spawned it).

    Never imports ``torch.distributed`` itself: if it was never imported, no
    process group can exist.

    Example:
        >>> process_rank()  # no process group, no launcher
        0
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return _group_rank(dist)
    found = launcher_variables(strict=True)
    return 0 if found is None else found["RANK"]


def _group_rank(dist: Any) -> int:
    """:func:`process_rank` where a process group exists: the group's rank."""
    group = (int(dist.get_rank()), int(dist.get_world_size()))
    found = launcher_variables(strict=False)
    launcher = None if found is None else (found["RANK"], found["WORLD_SIZE"])
    if launcher is not None and group != launcher and (group, launcher) not in _WARNED:
        # The group is the truth now; the variables were inherited (a process a
        # torchrun worker started itself, say).  Raising would break such programs,
        # which worked before; a silent switch would hide that rank='auto' meant
        # another rank before init_process_group.  So: the group wins, said once.
        _WARNED.add((group, launcher))
        warnings.warn(
            f"rank='auto': the process group says rank {group[0]} of {group[1]}, but the "
            f"environment says RANK={launcher[0]}, WORLD_SIZE={launcher[1]}, which this "
            f"process inherited from a launcher it did not come from; the group's rank is "
            f"used, so rank='auto' before init_process_group meant rank {launcher[0]}. "
            f"Remove RANK and WORLD_SIZE from the environment of processes you start "
            f"yourself, or pass rank= explicitly",
            StateWarning,
            stacklevel=2,
        )
    return group[0]


_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _raw_reader() -> Callable[[], tuple[object, ...]]:
    """Reads the launcher's variables raw: from ``os.environ``'s own dict under
    encoded keys where it has one (what ``os.environ[name]`` reads, without the
    ``KeyError`` that ``get`` raises and catches for each absent name, about
    1 µs each), else through ``os.environ.get``."""
    env = os.environ
    data, encodekey = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if type(data) is dict and callable(encodekey):
        keys = tuple(map(encodekey, _LAUNCHER_NAMES))
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(map(env.get, _LAUNCHER_NAMES))


_launcher_env = _raw_reader()


def launcher_variables(*, strict: bool = True) -> dict[str, int] | None:
    """The launcher's ``RANK``, ``WORLD_SIZE`` and, where set, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``, as ints; ``None`` where neither
    ``RANK`` nor ``WORLD_SIZE`` is set, or only one of them is (then, if
    ``strict``, with a :class:`StateWarning` once: the rank cannot be known).

    ``strict``: malformed or contradictory values raise ``ValueError`` naming
    the variable; otherwise they give ``None`` (a process group is the truth
    then, and a variable it does not need must not stop the program).
    """
    raw = _launcher_env()
    if raw[0] is None and raw[1] is None:
        return None
    try:
        # Parsed once per distinct set of values: ``rank="auto"`` asks at every block.
        found = _checked_launcher_variables(raw)
    except ValueError:
        if strict:
            raise
        return None
    if found:
        return dict(found)
    given, missing = ("RANK", "WORLD_SIZE") if raw[1] is None else ("WORLD_SIZE", "RANK")
    if strict and given not in _WARNED_PARTIAL:
        _WARNED_PARTIAL.add(given)
        warnings.warn(
            f"rank='auto': the environment variable {given} is set but "
            f"{missing} is not (Lightning's launcher, for one, exports WORLD_SIZE "
            f"and passes the rank to init_process_group), so this process's global rank "
            f"cannot be known before init_process_group: 0 is used until a process group "
            f"exists.  Seed after init_process_group, or pass rank= explicitly",
            StateWarning,
            stacklevel=3,
        )
    return None


#: Variables already warned about by :func:`launcher_variables`.
_WARNED_PARTIAL: set[str] = set()


@functools.lru_cache(maxsize=16)
def _checked_launcher_variables(raw: tuple[object, ...]) -> dict[str, int]:
    environ = dict(zip(_LAUNCHER_NAMES, raw, strict=True))

    def number(name: str, least: int = 0) -> int | None:
        value = environ[name]
        if value is None:
            return None
        text = os.fsdecode(value)  # type: ignore[arg-type]  # as os.environ decodes it
        # Decimal digits only: int() also takes " 3", "+3", "1_0" and
        # non-ASCII digits, none of which a launcher writes.
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise ValueError(
                f"the environment variable {name}={text!r:.40} is not "
                f"{'a positive' if least else 'a non-negative'} int; rank='auto' reads "
                f"the launcher's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
                f"GROUP_RANK variables"
            )
        return int(text)

    rank, world = number("RANK"), number("WORLD_SIZE", 1)
    if rank is None or world is None:  # only one of them is set: no rank, said by the caller
        return {}
    found = {"RANK": rank, "WORLD_SIZE": world}
    for name, least in (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1), ("GROUP_RANK", 0)):
        if (value := number(name, least)) is not None:
            found[name] = value
    problems = [
        f"{low}={found[low]} {'exceeds' if size else 'is not below'} {high}={found[high]}"
        for low, high, size in _LIMITS
        if low in found and high in found and found[low] >= found[high] + size
    ]
    if problems:
        raise ValueError("the launcher's environment variables disagree: " + "; ".join(problems))
    return found


#: ``(a, b, size)``: variable ``a`` must be below ``b`` (at most ``b`` where ``a`` is a size).
_LIMITS = (
    ("RANK", "WORLD_SIZE", False),
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", False),
    ("LOCAL_WORLD_SIZE", "WORLD_SIZE", True),
    ("GROUP_RANK", "WORLD_SIZE", False),
)
