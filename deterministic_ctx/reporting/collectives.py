"""The report's collectives section: the process group, NCCL's variables and what they mean.

NCCL decides the order in which a reduction sums (its algorithm, protocol,
NVLink SHARP, CollNet, channels, chunk size, topology, tuner plugin) from
environment variables it reads when it creates a communicator (``NCCL_ALGO``,
``NCCL_PROTO``, ``NCCL_COLLNET_ENABLE``, ``NCCL_TOPO_FILE``) or once per
process, at its first use (the others: NCCL caches them).  PyTorch creates a
process group's NCCL communicators at its first collective, or in
``init_process_group`` itself when given ``device_id``; ``new_group`` creates
more later.  So the values that count are those of that moment: set them
before ``init_process_group``.

What a report can tell, and what it cannot.  Python offers no record of the
environment at the moment NCCL read it, and this module patches nothing in
torch to make one.  Instead it remembers what it saw.  A group is *in use*
once NCCL has read its variables: its communicators exist (PyTorch says so
through a private method, read defensively), or, where that cannot be told or
the backend is not NCCL, from its start.  The report remembers the NCCL
variables at its latest look before the current group was in use (no group
yet, or its communicators not created yet: NCCL has read nothing then), and at
its first look once it was.  From that:

* a variable that differs from its value at the first look in use **was
  changed after NCCL read it**: that is certain (rule ``nccl-env-late``);
* a variable that differs between the last look before use (else the
  environment the process started with, read from ``/proc/self/environ`` on
  Linux) and the first look in use **changed at a time the report cannot
  place**, before or after NCCL read it (rule ``nccl-env-changed``, a note);
* a change made after NCCL read it and undone before a report looks, a change
  before the first report on a platform without ``/proc``, and what NCCL
  communicators of other groups read, go unseen.

Values from NCCL's configuration files (``NCCL_CONF_FILE`` or
``~/.nccl.conf``, then ``/etc/nccl.conf``) are shown as well: NCCL applies them
to the variables the environment leaves unset, into its own C environment,
which ``os.environ`` never sees.

Reading the section initializes nothing: no CUDA, no process group, no NCCL
communicator (the NCCL version is a constant of the library).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "DETERMINISTIC_COLLECTIVES",
    "collective_facts",
    "may_use",
    "meaning",
    "nccl_env_names",
    "observe",
]

#: Environment values for reproducible NCCL reductions, to set before
#: ``torch.distributed.init_process_group`` (in the launcher's environment, or
#: ``os.environ.update(DETERMINISTIC_COLLECTIVES)`` first thing in the script):
#: NCCL reads them when it creates a communicator, or once per process.
#: A deterministic block never sets them (see :mod:`deterministic_ctx.sources.environ`).
#:
#: * ``NCCL_ALGO=Ring``: NCCL's ring sums every element in an order fixed by
#:   the ring, whatever the message size (NCCL's tuner otherwise switches
#:   between Ring, Tree, NVLS, CollNet and PAT by size and topology, and its
#:   thresholds change between versions); Megatron-LM's deterministic mode
#:   makes the same choice.  Cost: Tree's lower latency for small messages
#:   across many nodes, and NVLS's switch offload.
#: * ``NCCL_NVLS_ENABLE=0``: NVLink SHARP reduces inside the NVSwitch, in an
#:   order that is not fixed from one call to the next (NCCL issue 1497); ``0``
#:   also allocates no NVLS memory.  Cost: NVLS bandwidth on NVSwitch systems
#:   with Hopper or later GPUs.
#: * ``NCCL_COLLNET_ENABLE=0``: CollNet reduces in the network (SHARP
#:   switches), outside NCCL's control.  Already NCCL's default; set so that an
#:   ``nccl.conf`` file cannot turn it on (NCCL applies those files only to
#:   variables the environment leaves unset).
#:
#: ``NCCL_ALGO=Ring`` alone already excludes NVLS and CollNet; the other two
#: keep them off if ``NCCL_ALGO`` is changed later.  ``NCCL_PROTO`` is left to
#: NCCL: its protocol choice depends only on message size and topology, and
#: NCCL's documentation advises against setting it.
DETERMINISTIC_COLLECTIVES: Mapping[str, str] = MappingProxyType(
    {"NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}
)

#: NCCL reads these when it creates each communicator (NCCL 2.2x); the other
#: managed ``NCCL_*`` variables once per process, at its first use.
PER_COMMUNICATOR = frozenset({"NCCL_ALGO", "NCCL_PROTO", "NCCL_COLLNET_ENABLE", "NCCL_TOPO_FILE"})
#: Algorithm names of ``NCCL_ALGO`` that reduce outside NCCL's own fixed order.
NVLS_ALGORITHMS = frozenset({"nvls", "nvlstree"})
COLLNET_ALGORITHMS = frozenset({"collnetdirect", "collnetchain"})
#: ``NCCL_ALGO`` names that stand for several algorithms: CollNet's name before NCCL 2.14.
_ALIASES = {"collnet": COLLNET_ALGORITHMS}
#: The collectives that sum (NCCL's function names, lower case): the others only copy.
_REDUCTIONS = ("allreduce", "reducescatter", "reduce")
#: The largest configuration file read: NCCL's own are a few lines.
_MAX_CONFIG_BYTES = 1 << 20


def nccl_env_names() -> tuple[str, ...]:
    """The ``NCCL_*`` names blocks manage (registered ones included), in capture order.

    Example:
        >>> nccl_env_names()[:2]
        ('NCCL_ALGO', 'NCCL_PROTO')
    """
    from ..internal import managed_env_vars

    return tuple(name for name in managed_env_vars() if name.startswith("NCCL_"))


# --- what the report remembers ---------------------------------------------------------------


@dataclasses.dataclass
class _Memory:
    """What reports saw: the NCCL values at the latest look before the current group was in
    use, the group, and the values at the first look once it was."""

    before: dict[str, str | None] | None = None
    #: Tells whether a group is the one remembered: a weak reference where the group
    #: takes one (a destroyed group must not be kept alive), else its ``id``.
    group: Callable[[object], bool] | None = None
    in_use: dict[str, str | None] | None = None


_memory = _Memory()
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A fork while another thread reads the memory would leave the child's lock held forever.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def _identity(group: object) -> Callable[[object], bool]:
    try:
        ref = weakref.ref(group)
    except TypeError:  # a group type without weak references: its id (reused only once freed)
        key = id(group)
        return lambda other: id(other) == key
    return lambda other: ref() is other


def _remember(
    group: object | None, in_use: bool, env: dict[str, str | None]
) -> tuple[dict[str, str | None] | None, dict[str, str | None] | None]:
    """Record this look at ``group`` (``None``: no group), ``in_use`` or not yet; the values
    at the latest look before use and at the first look in use (``None``: no such look)."""
    with _lock:
        memory = _memory
        if group is None:
            memory.group, memory.in_use = None, None
        elif memory.group is None or not memory.group(group):  # another group than before
            memory.group, memory.in_use = _identity(group), None
        if memory.in_use is None:
            if group is not None and in_use:
                memory.in_use = dict(env)
            else:  # NCCL has read nothing yet: as good as a look before the group
                memory.before = dict(env)
        return memory.before, memory.in_use


def observe() -> None:
    """Remember NCCL's variables now, and whether a process group exists, as a report does.

    For code that sets NCCL's variables before ``init_process_group``
    (``deterministic-ctx run --deterministic-collectives`` does): a report made
    once the group runs then knows they were set in time.

    Example:
        >>> observe()
    """
    import torch

    collective_facts(torch)  # the look a report makes; only what it remembers counts


# --- the facts ---------------------------------------------------------------------------------


def collective_facts(
    torch: Any, startup_env: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
    """The collectives section: plain data (see the module's docstring for what it can tell).

    ``startup_env`` is the environment the process started with (the report's
    ``process["env_at_start"]``), the fallback for "before the group" when no
    report looked earlier.

    Example:
        >>> import torch
        >>> facts = collective_facts(torch)
        >>> facts["process_group"]["initialized"]
        False
        >>> "NCCL_ALGO" in facts["env"] and "NCCL_ALGO" in facts["meaning"]
        True
    """
    dist = getattr(torch, "distributed", None)
    names = nccl_env_names()
    env = {name: os.environ.get(name) for name in names}
    group_facts, group = _process_group(dist)
    # NCCL has read the group's variables once its communicators exist, or where that cannot
    # be told (then, to be safe, from the start), or where its backend is not NCCL.
    read = group_facts["initialized"] and group_facts.get("nccl_communicators") is not False
    before, in_use = _remember(group, read, env)
    before_source = "a look before NCCL read them (report() or observe())"
    if before is None and startup_env is not None:
        before = {name: startup_env.get(name) for name in names}
        before_source = "the environment the process started with"
    config = _config_files(names)
    effective: dict[str, str | None] = {}
    meanings: dict[str, str] = {}
    for name, value in env.items():
        # An unset variable's value comes from a file: in NCCL's order, the first to set it.
        path = next((p for p, values in config.items() if value is None and name in values), None)
        effective[name] = value if path is None else config[path][name]
        meanings[name] = meaning(name, effective[name]) + ("" if path is None else f" ({path})")
    return {
        "process_group": group_facts,
        "nccl_available": _nccl_available(dist),
        "nccl_version": _nccl_version(torch, dist),
        "env": env,
        "meaning": meanings,
        "config_files": config,
        "effective": effective,
        "env_before_use": None
        if in_use is None or before is None
        else {"source": before_source, "env": before},
        "env_first_seen_in_use": in_use,
    }


def _process_group(dist: Any) -> tuple[dict[str, Any], object | None]:
    """The default group's facts, and the group itself (``None`` when there is none)."""
    if dist is None or not dist.is_available():
        return {"initialized": False, "available": False}, None
    if not dist.is_initialized():
        return {"initialized": False, "available": True}, None
    group = dist.group.WORLD
    backend = str(dist.get_backend())
    # "cpu:gloo,cuda:nccl" when init_process_group() picked a backend per device.
    get_config = getattr(dist, "get_backend_config", None)
    config = str(get_config()) if get_config is not None else backend
    uses_nccl = "nccl" in backend.lower() or "nccl" in config.lower()
    facts: dict[str, Any] = {
        "initialized": True,
        "available": True,
        "backend": backend,
        "backend_config": config,
        "rank": int(dist.get_rank()),
        "world_size": int(dist.get_world_size()),
        "uses_nccl": uses_nccl,
        "nccl_communicators": _nccl_communicators(group) if uses_nccl else None,
    }
    return facts, group


def _nccl_communicators(group: Any) -> bool | None:
    """Whether the group's NCCL communicators exist yet (PyTorch creates them at the first
    collective unless ``init_process_group`` had a ``device_id``); ``None`` if torch does
    not say.  A private torch method, read defensively: it creates nothing."""
    try:
        import torch

        backend = group._get_backend(torch.device("cuda"))
        return bool(backend._is_initialized())
    except Exception:
        return None


def _nccl_available(dist: Any) -> bool:
    try:
        return bool(dist is not None and dist.is_available() and dist.is_nccl_available())
    except Exception:
        return False


def _nccl_version(torch: Any, dist: Any) -> str | None:
    """NCCL's version where torch is built with it: a constant of the library, read without
    initializing CUDA or NCCL."""
    if not _nccl_available(dist):
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(version, tuple):
        return ".".join(map(str, version))
    return str(version)


# --- NCCL's configuration files -----------------------------------------------------------------


def _config_paths() -> tuple[str, ...]:
    """The files NCCL reads its static configuration from, in the order it applies them
    (the first to set a variable wins): ``NCCL_CONF_FILE`` (NCCL 2.23+) or
    ``~/.nccl.conf``, then ``/etc/nccl.conf``."""
    first = os.environ.get("NCCL_CONF_FILE")
    if not first:
        home = os.environ.get("HOME")
        first = os.path.join(home, ".nccl.conf") if home else None
    return (*((first,) if first else ()), "/etc/nccl.conf")


def _config_files(names: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``{path: {name: value}}``: the variables of ``names`` each existing configuration
    file sets, parsed as NCCL parses them (``NAME=value`` lines, ``#`` comments)."""
    wanted = set(names)
    found: dict[str, dict[str, str]] = {}
    for path in _config_paths():
        try:
            with open(path, "rb") as f:
                raw = f.read(_MAX_CONFIG_BYTES)
        except OSError:
            continue
        values: dict[str, str] = {}
        for line in raw.decode("utf-8", "surrogateescape").split("\n"):
            line = line.removesuffix("\r")
            name, sep, value = line.partition("=")
            if line.startswith("#") or not sep or name not in wanted:
                continue
            values.setdefault(name, value)  # NCCL: the first line that sets a name wins
        if values:
            found[path] = values
    return found


# --- what a value means ---------------------------------------------------------------------------


def may_use(algo: str | None, algorithms: frozenset[str]) -> bool:
    """Whether ``NCCL_ALGO=algo`` lets NCCL use one of ``algorithms`` (lower case) for some
    reduction (AllReduce, ReduceScatter or Reduce); ``None`` (unset) lets it use every one.

    Reads both syntaxes: a comma-separated list, ``^`` in front to exclude
    (NCCL 2.5+), and ``function:list`` entries separated by ``;`` (2.24+),
    where a list without a function applies to the functions not listed, and
    a function not listed without one keeps NCCL's default (every algorithm).

    Example:
        >>> may_use("Ring", NVLS_ALGORITHMS), may_use("^NVLS,NVLSTree", NVLS_ALGORITHMS)
        (False, False)
        >>> may_use(None, NVLS_ALGORITHMS), may_use("ring;allreduce:nvls", NVLS_ALGORITHMS)
        (True, True)
    """
    if algo is None or not algo.strip():
        return True
    lists: dict[str | None, str] = {}
    for entry in algo.split(";"):
        function, sep, listed = entry.rpartition(":")
        lists[function.strip().lower() if sep else None] = listed.strip()  # parsed in order
    for function in _REDUCTIONS:
        chosen = lists.get(function, lists.get(None))
        if chosen is None:  # neither listed nor covered by a list for all: NCCL's default
            return True
        exclude = chosen.startswith("^")
        tokens: set[str] = set()
        for token in chosen.lstrip("^").split(","):
            token = token.strip().lower()
            tokens |= _ALIASES.get(token, {token} if token else set())
        if (not algorithms <= tokens) if exclude else bool(algorithms & tokens):
            return True
    return False


def _restriction(value: str, what: str) -> str:
    if ":" in value or ";" in value:
        return f"{what} chosen per collective as {value!r} (NCCL 2.24+ syntax)"
    if value.startswith("^"):
        return f"every {what} but {value[1:]}"
    return f"only {value}"


def _count(value: str | None, bound: str, what: str) -> str:
    if value is None:
        return f"NCCL's choice from topology and message size; another {what} count, another order"
    return f"{bound} {value} {what}s; another count sums in another order"


_MEANINGS: dict[str, Callable[[str | None], str]] = {
    "NCCL_ALGO": lambda v: (
        "NCCL chooses per call from message size and topology among Ring, Tree and, where "
        "available, NVLS, CollNet and PAT"
        if v is None
        else _restriction(v, "algorithm")
    ),
    "NCCL_PROTO": lambda v: (
        "NCCL chooses LL, LL128 or Simple per call from message size (fixed for a given size "
        "and topology)"
        if v is None
        else _restriction(v, "protocol")
    ),
    "NCCL_NVLS_ENABLE": lambda v: (
        "NVLink SHARP off"
        if v == "0"
        else "NVLink SHARP on where the hardware has it (NVSwitch, Hopper or later): "
        "reductions in the switch, in an order not fixed from call to call"
        + (" (NCCL's default)" if v is None else "")
    ),
    "NCCL_COLLNET_ENABLE": lambda v: (
        "CollNet on: reductions in network switches (SHARP), in an order NCCL does not control"
        if v == "1"
        else "CollNet off" + (" (NCCL's default)" if v is None else "")
    ),
    "NCCL_MIN_NCHANNELS": lambda v: _count(v, "at least", "channel"),
    "NCCL_MAX_NCHANNELS": lambda v: _count(v, "at most", "channel"),
    "NCCL_MIN_CTAS": lambda v: _count(v, "at least", "CTA"),
    "NCCL_MAX_CTAS": lambda v: _count(v, "at most", "CTA"),
    "NCCL_BUFFSIZE": lambda v: (
        "NCCL's default buffer (4 MiB); the chunk size follows it"
        if v is None
        else f"{v}-byte buffers; the chunk size follows, and with it where each sum starts"
    ),
    "NCCL_TOPO_FILE": lambda v: (
        "topology detected on this machine; rings follow it"
        if v is None
        else f"topology read from {v}; rings follow it"
    ),
    "NCCL_TUNER_PLUGIN": lambda v: (
        "libnccl-tuner.so if installed, else NCCL's built-in model"
        if v is None
        else "NCCL's built-in model"
        if v.lower() == "none"
        else f"tuner plugin {v!r}: it may choose algorithm, protocol and channels per call"
    ),
}


def meaning(name: str, value: str | None) -> str:
    """What ``name=value`` means for the order of NCCL's reductions (``None``: unset).

    Example:
        >>> meaning("NCCL_NVLS_ENABLE", "0")
        'NVLink SHARP off'
        >>> meaning("NCCL_ALGO", "Ring")
        'only Ring'
    """
    explain = _MEANINGS.get(name)
    if explain is None:
        return "registered with register_env_var" if value is None else f"set to {value!r}"
    return explain(value)
