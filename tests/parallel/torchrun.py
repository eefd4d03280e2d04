"""Run a program as a real multi-node ``torchrun`` job on this machine, for tests.

:func:`torchrun` starts ``nnodes`` elastic agents (``python -m torch.distributed.run``), each
standing for one node, all on 127.0.0.1: they meet through c10d rendezvous on a free port, and
each starts ``nproc_per_node`` workers, exactly as on a cluster (``RANK``, ``LOCAL_RANK``,
``GROUP_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` exported to each worker;
``init_process_group("gloo")`` needs no other argument).  A worker hands back what it found
with :func:`report`; the caller gets it by global rank::

    from tests.parallel.torchrun import report, torchrun

    # in the launched module (``python -m tests.my_ranks`` in each worker):
    report({"rank": int(os.environ["RANK"]), "draws": [random.random()]})

    # in the test:
    launch = torchrun("tests.my_ranks", module=True, nnodes=2, nproc_per_node=2)
    launch.results[3]["draws"]

Bounded and clean: the whole job must finish within ``timeout`` seconds, a failing agent brings
the others down after a short grace, and on every way out (success, failure, timeout,
``KeyboardInterrupt``) every process of the launch is killed: the agents (each in its own
session), their workers (which torchrun starts in sessions of their own) and the workers'
children, found by a tag in their environment, so none escapes by being reparented.

Each launch costs seconds (every agent and worker imports torch): check many facts per launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Launch", "LaunchError", "free_port", "loopback", "report", "torchrun"]

#: Where :func:`report` writes (set for every worker of a launch).
RESULTS_VAR = "TORCHRUN_TEST_RESULTS"
#: A token unique to one launch, in the environment of all its processes.
LAUNCH_VAR = "TORCHRUN_TEST_LAUNCH"

#: Variables a surrounding launcher may have left; the agents must not inherit them.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)

#: How long the other agents get to finish after one failed, before they are killed.
FAILURE_GRACE = 10.0


@dataclass(frozen=True)
class Launch:
    """What a launch gave back."""

    #: By global rank: the value each worker passed to :func:`report`.
    results: tuple[Any, ...]
    #: Every agent's stdout and stderr, its workers' included, agent after agent.
    output: str
    #: Wall-clock seconds from the first agent's start to the last one's exit.
    seconds: float


class LaunchError(RuntimeError):
    """The job failed, timed out, or some rank reported nothing; ``output`` says why."""

    def __init__(self, message: str, output: str, tag: str) -> None:
        super().__init__(f"{message}\n{_tail(output)}")
        self.output = output
        #: The launch's :data:`LAUNCH_VAR` value, in the environment of all its processes.
        self.tag = tag


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback() -> str:
    """The name of the loopback interface, for ``GLOO_SOCKET_IFNAME``."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def report(value: Any) -> None:
    """In a worker of :func:`torchrun`: hand ``value`` back to the caller.

    ``value`` must be JSON data (floats survive exactly; convert tensors with ``.tolist()``).
    The last call of a rank wins.
    """
    directory, rank = os.environ.get(RESULTS_VAR), os.environ.get("RANK")
    if directory is None or rank is None:
        raise RuntimeError(
            "report() runs in a worker started by tests.parallel.torchrun.torchrun()"
        )
    path = Path(directory, f"rank{int(rank)}.json")
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value), encoding="utf-8")
    os.replace(partial, path)  # the caller never reads half a file


def torchrun(
    target: str | os.PathLike[str],
    *args: str,
    module: bool = False,
    no_python: bool = False,
    nnodes: int = 2,
    nproc_per_node: int = 2,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Launch:
    """Run ``target`` with ``args`` as ``nnodes`` x ``nproc_per_node`` torchrun workers.

    Args:
        target: a script path; with ``module=True`` a module name (``python -m target`` in
            each worker); with ``no_python=True`` an executable (``sleep``).
        nnodes: how many agents, one per pretended node, each in its own process session.
        nproc_per_node: workers per agent.
        timeout: seconds for the whole job, agents' start included; past it everything is
            killed and :class:`LaunchError` raised.
        env: variables added to the environment of the agents and their workers.
            ``GLOO_SOCKET_IFNAME`` (the loopback interface) and ``OMP_NUM_THREADS=1`` are set
            unless given here; the repository root is put first on ``PYTHONPATH``.
        cwd: the working directory of every process (default: the repository root).

    Returns:
        The :class:`Launch`: each global rank's :func:`report` value, and the output.

    Raises:
        LaunchError: an agent exited with an error, the job ran past ``timeout``, or a rank
            did not report (``no_python`` jobs report nothing, and are not asked to).
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes}, {nproc_per_node}")
    root = Path(__file__).resolve().parents[2]  # the repository root
    tag = uuid.uuid4().hex
    world = nnodes * nproc_per_node
    with tempfile.TemporaryDirectory(prefix="torchrun-") as scratch:
        results_dir = Path(scratch, "results")
        results_dir.mkdir()
        child_env = _environment(root, tag, results_dir, env)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={tag}",
            # Workers find rank 0's agent (MASTER_ADDR) at this address, not the host name.
            "--local-addr=127.0.0.1",
            f"--rdzv-conf=join_timeout={max(1, int(timeout))}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            *(["--module"] if module else []),
            *(["--no-python"] if no_python else []),
            str(target),
            *args,
        ]
        logs = [Path(scratch, f"agent{i}.log") for i in range(nnodes)]
        agents: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        try:
            for log in logs:
                with log.open("wb") as sink:  # the agent keeps its own descriptor
                    agents.append(
                        subprocess.Popen(
                            command,
                            env=child_env,
                            cwd=root if cwd is None else cwd,
                            stdin=subprocess.DEVNULL,
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            failure = _wait(agents, start + timeout)
        finally:
            _kill_launch(agents, tag)
        seconds = time.monotonic() - start
        output = _output(logs, agents)
        if failure:
            raise LaunchError(f"torchrun {target}: {failure}", output, tag)
        if no_python:
            return Launch((), output, seconds)
        results = []
        for rank in range(world):
            path = results_dir / f"rank{rank}.json"
            if not path.exists():
                raise LaunchError(f"torchrun {target}: rank {rank} did not report", output, tag)
            results.append(json.loads(path.read_text(encoding="utf-8")))
        return Launch(tuple(results), output, seconds)


def _environment(
    root: Path, tag: str, results_dir: Path, extra: Mapping[str, str] | None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["GLOO_SOCKET_IFNAME"] = loopback()  # gloo's links on loopback, like the store
    env["OMP_NUM_THREADS"] = "1"  # torchrun would set it, with a warning per agent
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env[LAUNCH_VAR] = tag
    env[RESULTS_VAR] = str(results_dir)
    return env


def _wait(agents: Sequence[subprocess.Popen[bytes]], deadline: float) -> str:
    """Wait for every agent; ``""`` when all succeeded, else what went wrong."""
    give_up = deadline  # moved closer when an agent fails: the others get a grace
    while True:
        codes = [agent.poll() for agent in agents]
        now = time.monotonic()
        if all(code == 0 for code in codes):
            return ""
        bad = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            give_up = min(give_up, now + FAILURE_GRACE)
            if all(code is not None for code in codes) or now > give_up:
                return ", ".join(f"agent {i} exited with {code}" for i, code in bad)
        if now > deadline:
            return f"did not finish within the timeout (exit codes so far: {codes})"
        time.sleep(0.05)


def _kill_launch(agents: Sequence[subprocess.Popen[bytes]], tag: str) -> None:
    """Kill every process of the launch, and reap the agents."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent.pid, signal.SIGKILL)  # its own session: pgid == pid
    # Workers live in sessions of their own and outlive a killed agent (they are
    # reparented): find them, and their children, by the launch's tag.  Repeat
    # until none is left, in case one forked while the others were killed.
    for _ in range(50):
        stray = _tagged(tag)
        if not stray:
            break
        for pid in stray:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=10)


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries the launch's tag (Linux: ``/proc``)."""
    marker = f"{LAUNCH_VAR}={tag}".encode()
    found = []
    for entry in _proc_entries():
        try:
            environ = Path("/proc", entry, "environ").read_bytes()
            state = Path("/proc", entry, "stat").read_bytes().rpartition(b")")[2].split()[0]
        except OSError:  # gone, or not ours
            continue
        if state != b"Z" and marker in environ.split(b"\0"):
            found.append(int(entry))
    return found


def _proc_entries() -> Iterable[str]:
    try:
        return [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # no /proc: the agents' process groups were all we could kill
        return []


def _output(logs: Sequence[Path], agents: Sequence[subprocess.Popen[bytes]]) -> str:
    parts = []
    for i, (log, agent) in enumerate(zip(logs, agents, strict=False)):
        text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        parts.append(f"----- agent {i} (exit code {agent.returncode}) -----\n{text}")
    return "\n".join(parts)


def _tail(output: str, limit: int = 12_000) -> str:
    return output if len(output) <= limit else "[...]\n" + output[-limit:]
