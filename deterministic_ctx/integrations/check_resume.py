"""What a training run tells ``deterministic-ctx check-resume``: one record per step, and when
a checkpoint is on disk.

``check-resume`` runs a script several times, each time with
:data:`RECORDS_VAR` naming a file of its own, and once per ``--at K`` with
:data:`KILL_AT_VAR` set to ``K``.  The script (through the Lightning and
transformers callbacks, or two lines of a plain loop) calls:

* :func:`record_step` after each training step: the step number, the loss's
  bits, a fingerprint of the batch and one of the random state;
* :func:`checkpoint_saved` once a checkpoint of a step is on disk: when that
  step is the one to kill at, the process ends itself with ``SIGKILL`` right
  there, a real crash that runs no ``finally`` and no ``atexit``.

Both do nothing (and import nothing) unless :data:`RECORDS_VAR` is set, so the
calls can stay in a script for good.  The records are JSON lines, each appended
with one write, so that a killed run leaves every record it made.

The other side is here too: :func:`check_resume` runs the script (each run in
a fresh empty working directory, its records in a file of its own), reads the
records (:func:`read_records`) and compares them (:func:`compare_resume`,
:func:`first_difference`): the interrupted run's records up to ``K`` and the
resumed run's, together, against the uninterrupted run's, step by step, the
first difference named by what differs (data, then RNG state, then loss) or
as missing or extra steps.

This module imports only the standard library: the command line runs and
compares without loading torch.  The fingerprints of a run's records use
NumPy and torch when the script has imported them, never importing them
itself.

Example:
    >>> from deterministic_ctx import checkpoint_saved, record_step
    >>> record_step(1, loss=0.5)  # check-resume is not running: nothing happens
    >>> checkpoint_saved(1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "FIELDS",
    "KILLED_STATUS",
    "KILL_AT_VAR",
    "RECORDS_VAR",
    "CheckResume",
    "Difference",
    "ResumeResult",
    "Run",
    "StepRecord",
    "check_resume",
    "checkpoint_saved",
    "compare_resume",
    "first_difference",
    "read_records",
    "record_step",
]

#: The file (JSON lines) a run appends its records to; unset: records are not kept.
RECORDS_VAR = "DETERMINISTIC_CTX_RESUME_RECORDS"
#: The step whose checkpoint ends the run with ``SIGKILL`` once it is on disk.
KILL_AT_VAR = "DETERMINISTIC_CTX_RESUME_KILL_AT"
#: Where there is no ``SIGKILL`` (Windows): the status a run killed at its checkpoint exits with.
KILLED_STATUS = 137


def _step(step: object) -> int:
    """``step`` as a non-negative ``int`` (an integer tensor or NumPy integer too; ``True``
    is not a step)."""
    try:
        if isinstance(step, bool):
            raise TypeError
        import operator

        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"step must be a non-negative int, got {type(step).__name__} {step!r:.80}"
        ) from None
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    return int(value)


def _write(record: Mapping[str, Any]) -> None:
    path = os.environ.get(RECORDS_VAR)
    if not path:
        return
    line = json.dumps(record, sort_keys=True) + "\n"
    # One write of one line, appended: once os.write returns, the line is the kernel's, so a
    # process killed right after leaves it whole.  No fsync: it guards against the machine
    # going down, not the process, and would cost a disk flush every step.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _hash_into(digest: Any, value: object) -> None:
    """Feed ``value`` (tensors, arrays, numbers, strings, bytes and containers of them) into
    ``digest``: bits, shapes and dtypes, never ``repr``s that round."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        digest.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode())
        if t.layout is torch.strided and t.device.type != "meta":
            t = t.cpu().contiguous()
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return
    if np is not None and isinstance(value, np.ndarray):
        digest.update(f"array:{value.dtype.str}:{value.shape}:".encode())
        if value.dtype != object:
            digest.update(np.ascontiguousarray(value).tobytes())
            return
        value = value.tolist()
    if isinstance(value, Mapping):
        digest.update(f"map:{len(value)}:".encode())
        for key, item in value.items():
            _hash_into(digest, key)
            _hash_into(digest, item)
        return
    if isinstance(value, (list, tuple)):
        digest.update(f"seq:{len(value)}:".encode())
        for item in value:
            _hash_into(digest, item)
        return
    if isinstance(value, float):
        digest.update(f"float:{value.hex()}".encode())
        return
    if isinstance(value, bytes):
        digest.update(b"bytes:" + value)
        return
    if np is not None and isinstance(value, np.generic):
        digest.update(f"scalar:{value.dtype.str}:".encode() + value.tobytes())
        return
    digest.update(f"{type(value).__name__}:{value!r}".encode())


def _fingerprint(value: object) -> str:
    digest = hashlib.sha256()
    _hash_into(digest, value)
    return digest.hexdigest()[:32]


def _check_loss(loss: object) -> bool:
    """Whether ``loss`` is a tensor; ``TypeError`` unless it is one, a number or ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(loss, torch.Tensor):
        return True
    if loss is None or (isinstance(loss, (int, float)) and not isinstance(loss, bool)):
        return False
    raise TypeError(
        f"loss must be a float or a tensor (or None), got {type(loss).__name__} {loss!r:.80}"
    )


def _loss_bits(loss: object) -> str | None:
    """The loss's exact bits: a float's ``hex()``, a tensor's bytes in hex with its dtype."""
    if _check_loss(loss):
        torch = sys.modules["torch"]
        t = loss.detach().cpu().contiguous()  # type: ignore[attr-defined]
        data: bytes = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{t.dtype}:{data.hex()}"
    return None if loss is None else float(loss).hex()  # type: ignore[arg-type]


def _rng_fingerprint() -> str:
    """A fingerprint of the random state a step leaves: Python's ``random``, NumPy's global
    RNG, torch's CPU generator and each initialized accelerator generator.

    NumPy and torch are read only once the script imported them: a script that
    never did has no state there to lose, and the record costs it no import.
    """
    import array
    import random

    version, words, gauss = random.getstate()
    # 625 words as one bytes object: hashed in one call, not one per word.
    state: list[object] = [version, array.array("Q", words).tobytes(), gauss]
    np = sys.modules.get("numpy")
    if np is not None:
        state.append(np.random.get_state())
    torch = sys.modules.get("torch")
    if torch is not None:
        state.append(torch.get_rng_state())
        # Never initializes CUDA: only generators a run already uses are read.
        if torch.cuda.is_initialized():
            state.append(torch.cuda.get_rng_state_all())
    # Registered RNGs live in the sources: loaded, the script may have registered some (and
    # torch is loaded already, so reading them through the internal API costs no import).
    if "deterministic_ctx.sources" in sys.modules:
        from ..internal import registered_rngs

        state.extend((key, _rng_state(rng)) for key, rng in registered_rngs())
    return _fingerprint(state)


def _rng_state(rng: object) -> object:
    """The state of a registered RNG, through its public API (``random.Random``, NumPy's
    ``RandomState`` and ``Generator``, ``torch.Generator``; another kind: none read)."""
    bit_generator = getattr(rng, "bit_generator", None)
    if bit_generator is not None:
        return bit_generator.state
    for name in ("get_state", "getstate"):
        method = getattr(rng, name, None)
        if callable(method):
            return method()
    return type(rng).__qualname__


def record_step(step: int, *, loss: object = None, batch: object = None) -> None:
    """Record training step ``step`` for ``deterministic-ctx check-resume``; call it after the
    step, once its loss is known.

    The record holds the step number, the loss's exact bits, a fingerprint of
    ``batch`` (tensors, arrays and containers of them, by their bits) and one
    of the random state the step left (Python's ``random``, NumPy's global
    RNG, torch's generators).  Outside ``check-resume`` it does nothing.

    Args:
        step: the step's number, counted as the checkpoints count them (the
            number of optimizer steps taken, after this one).
        loss: the step's loss, a float or a tensor (its bits are kept).
        batch: what the step trained on.

    Example:
        >>> import torch
        >>> from deterministic_ctx import record_step
        >>> record_step(3, loss=torch.tensor(0.25), batch={"x": torch.zeros(2)})
    """
    number = _step(step)
    # Checked always, read only under check-resume: reading a GPU tensor's bits waits for
    # the device, which a training step outside check-resume must not pay for.
    _check_loss(loss)
    if not os.environ.get(RECORDS_VAR):
        return
    _write(
        {
            "step": number,
            "loss": _loss_bits(loss),
            "data": None if batch is None else _fingerprint(batch),
            "rng": _rng_fingerprint(),
        }
    )


def checkpoint_saved(step: int) -> None:
    """Tell ``deterministic-ctx check-resume`` that the checkpoint of step ``step`` is on disk.

    When ``check-resume`` asked to crash at this step, the process ends here
    with ``SIGKILL``.  Outside ``check-resume`` it does nothing.

    Example:
        >>> from deterministic_ctx import checkpoint_saved
        >>> checkpoint_saved(10)
    """
    number = _step(step)
    if not os.environ.get(RECORDS_VAR):
        return
    _write({"checkpoint": number})
    if os.environ.get(KILL_AT_VAR, "").strip() == str(number):
        sys.stdout.flush()
        sys.stderr.flush()
        if os.name == "nt":  # pragma: no cover - no SIGKILL: end as abruptly, with its status
            os._exit(KILLED_STATUS)
        os.kill(os.getpid(), signal.SIGKILL)


# --- the parent side: run the script, read its records, compare ----------------------------------


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One :func:`record_step` record: the step number and its three fingerprints."""

    step: int
    loss: str | None = None
    data: str | None = None
    rng: str | None = None


#: What a step record holds, in the order a difference is named (the first is the likeliest cause).
FIELDS = (("data", "the data"), ("rng", "the RNG state"), ("loss", "the loss"))


def read_records(path: str | os.PathLike[str]) -> tuple[list[StepRecord], list[int]]:
    """The step records of a records file, in order, and the checkpoints it reports.

    A file that does not exist holds none (a run that never called
    :func:`record_step`).

    Raises:
        ValueError: a line that is not a record.
    """
    steps: list[StepRecord] = []
    checkpoints: list[int] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return steps, checkpoints
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "checkpoint" in record:
                checkpoints.append(_step(record["checkpoint"]))
            else:
                steps.append(
                    StepRecord(
                        _step(record["step"]),
                        *(_optional_str(record.get(name)) for name in ("loss", "data", "rng")),
                    )
                )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(
                f"{os.fspath(path)}:{number}: not a check-resume record: {exc}"
            ) from None
    return steps, checkpoints


def _optional_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"a fingerprint must be a string or null, got {value!r:.40}")
    return value


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first step at which a run's records differ from the uninterrupted run's.

    ``kind`` is ``"data"``, ``"rng"`` or ``"loss"`` (the first that differs in
    that order; ``fields`` lists every one that does), ``"missing"`` (the
    uninterrupted run has more records of the step) or ``"extra"`` (fewer).
    """

    step: int
    kind: str
    fields: tuple[str, ...] = ()
    #: Which of the step's records (0 unless a step has several: gradient accumulation).
    index: int = 0
    expected: int = 0
    actual: int = 0

    def __str__(self) -> str:
        if self.kind == "missing":
            if self.actual == 0:
                return f"step {self.step} is missing"
            return (
                f"step {self.step} has {self.actual} records, the uninterrupted run {self.expected}"
            )
        if self.kind == "extra":
            if self.expected == 0:
                return f"step {self.step} is extra: the uninterrupted run has no step {self.step}"
            return (
                f"step {self.step} was recorded {self.actual} times, "
                f"in the uninterrupted run {self.expected}"
            )
        names = dict(FIELDS)
        which = f" (record {self.index + 1} of the step)" if self.index else ""
        text = f"step {self.step}{which}: {names[self.kind]} differs"
        if len(self.fields) > 1:
            text += f" (and {_and([names[f] for f in self.fields[1:]])})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _by_step(records: Sequence[StepRecord]) -> dict[int, list[StepRecord]]:
    groups: dict[int, list[StepRecord]] = {}
    for record in records:
        groups.setdefault(record.step, []).append(record)
    return groups


def first_difference(
    expected: Sequence[StepRecord], actual: Sequence[StepRecord]
) -> Difference | None:
    """The first step, in step order, whose records in ``actual`` differ from ``expected``'s;
    ``None`` when every step has the same records.

    A step may have several records (one per micro-batch under gradient
    accumulation): they are compared in the order they were made.

    Example:
        >>> a = [StepRecord(1, loss="1"), StepRecord(2, loss="2")]
        >>> print(first_difference(a, [StepRecord(1, loss="1"), StepRecord(2, loss="3")]))
        step 2: the loss differs
        >>> print(first_difference(a, a[:1]))
        step 2 is missing
    """
    want, got = _by_step(expected), _by_step(actual)
    for step in sorted(want.keys() | got.keys()):
        mine, theirs = want.get(step, []), got.get(step, [])
        for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            fields = tuple(name for name, _ in FIELDS if getattr(a, name) != getattr(b, name))
            if fields:
                return Difference(step, fields[0], fields, index, len(mine), len(theirs))
        if len(mine) != len(theirs):
            kind = "missing" if len(mine) > len(theirs) else "extra"
            return Difference(step, kind, (), min(len(mine), len(theirs)), len(mine), len(theirs))
    return None


def _spans(steps: Iterable[int]) -> str:
    """``1-3, 7`` for steps 1, 2, 3 and 7."""
    ordered = sorted(set(steps))
    if not ordered:
        return "none"
    runs = [[ordered[0], ordered[0]]]
    for step in ordered[1:]:
        if step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the script: how it ended (``None``: it ran past the timeout), its records
    and checkpoints, and where its working directory and output are."""

    name: str
    status: int | None
    steps: list[StepRecord]
    checkpoints: list[int]
    workdir: str
    log: str

    @property
    def killed(self) -> bool:
        """Whether it ended by ``SIGKILL`` (what :func:`checkpoint_saved` does)."""
        return self.status == (KILLED_STATUS if os.name == "nt" else -signal.SIGKILL)

    def ended(self) -> str:
        """How it ended, in words."""
        if self.status is None:
            return "ran past the timeout and was killed"
        if self.status == 0:
            return "exited normally (status 0)"
        if self.status < 0:
            try:
                name = signal.Signals(-self.status).name
            except ValueError:
                name = f"signal {-self.status}"
            return f"was killed by {name}"
        return f"exited with status {self.status}"

    def tail(self, lines: int = 15) -> str:
        """The end of its output (stdout and stderr), indented."""
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                text = f.read().rstrip().splitlines()[-lines:]
        except OSError:
            return ""
        if not text:
            return "    (no output)"
        return "\n".join(f"    | {line}" for line in text)


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    """The outcome for one ``--at K``: ``status`` is ``"ok"``, ``"differs"`` (the runs' records
    differ, or the resumed run failed) or ``"unchecked"`` (the interrupted run did not end at
    the checkpoint of step ``K``: nothing to compare)."""

    at: int
    status: str
    message: str
    difference: Difference | None = None
    #: Whether the records differ already before the restart, at or before step ``K``.
    before_restart: bool = False
    #: The steps the resumed run recorded, in order.
    resumed_steps: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    extra: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["difference"] = None if self.difference is None else self.difference.to_dict()
        out["resumed_steps"] = list(self.resumed_steps)
        out["missing"], out["extra"] = list(self.missing), list(self.extra)
        return out


#: What usually makes a resumed step differ in each field, when the step before matched.
_CAUSES = {
    "data": "the loader's position or the data's randomness is not restored: with a plain "
    "loop, SeededSampler's state_dict in the checkpoint and SeededDataset for augmentation; "
    "with the callbacks, randomness outside the dataset's __getitem__ (a collate_fn or data "
    "collator, a transform on whole batches), which is not keyed per sample",
    "rng": "the random state is not restored: with a plain loop, a Snapshot in the "
    "checkpoint, restored last, and a DataLoader with its own generator (seeded_generator)",
    "loss": "same data and random state, another loss: a random generator of your own "
    "(np.random.default_rng, torch.Generator, random.Random) that the checkpoint does not "
    "hold (register_rng it, or draw from the global ones), randomness drawn outside the "
    "training step, or the model's, optimizer's or scheduler's state not restored whole "
    "(or a nondeterministic kernel)",
}


def compare_resume(
    at: int,
    whole: Sequence[StepRecord],
    interrupted: Sequence[StepRecord],
    resumed: Sequence[StepRecord],
) -> ResumeResult:
    """Compare the records of a run interrupted after the checkpoint of step ``at`` and of
    its resumed run, together, with the uninterrupted run's (``whole``).

    Example:
        >>> whole = [StepRecord(s, loss=str(s)) for s in (1, 2, 3, 4)]
        >>> compare_resume(2, whole, whole[:2], whole[2:]).status
        'ok'
        >>> print(compare_resume(2, whole, whole[:2], []).message)
        steps 3-4 are missing: the resumed run recorded no step
    """
    joined = [*interrupted, *resumed]
    resumed_steps = tuple(r.step for r in resumed)
    want, got = _by_step(whole), _by_step(joined)
    missing = tuple(s for s in sorted(want) if len(got.get(s, ())) < len(want[s]))
    extra = tuple(s for s in sorted(got) if len(got[s]) > len(want.get(s, ())))
    # Up to K only: a run may record a later step before the checkpoint of K is on disk
    # (a checkpoint written in the background); those count with the resumed run's.
    early = first_difference(
        [r for r in whole if r.step <= at], [r for r in interrupted if r.step <= at]
    )
    difference = first_difference(whole, joined)
    if difference is None:
        count = len(want)
        trained = (
            f"trained steps {_spans(resumed_steps)}"
            if resumed_steps
            else "trained no step (the checkpoint was the run's last)"
        )
        return ResumeResult(
            at,
            "ok",
            f"{count} step{'s' * (count != 1)} match the uninterrupted run; the resumed run "
            f"{trained}",
            resumed_steps=resumed_steps,
        )
    notes: list[str] = []
    cause = ""
    if early is not None:
        difference = early
        text = (
            f"{early}, before the restart: the script is not reproducible even without a "
            "restart (the interrupted run differs from the uninterrupted one before it is killed)"
        )
    elif difference.kind in ("missing", "extra") and difference.fields == ():
        text = _count_message(at, difference, missing, extra, resumed_steps)
    else:
        after = difference.step - at
        text = f"{difference}: " + (
            "the first step after the restart"
            if after == 1
            else f"{after} steps after the restart"
            if after > 1
            else "a step the resumed run trained again"
        )
        if missing or extra:
            notes.append(_count_message(at, None, missing, extra, resumed_steps))
        cause = f"\n    likely cause: {_CAUSES[difference.kind]}"
    message = "; ".join([text, *notes]) + cause
    return ResumeResult(
        at,
        "differs",
        message,
        difference,
        before_restart=early is not None,
        resumed_steps=resumed_steps,
        missing=missing,
        extra=extra,
    )


def _count_message(
    at: int,
    difference: Difference | None,
    missing: Sequence[int],
    extra: Sequence[int],
    resumed: Sequence[int],
) -> str:
    """Which steps are missing or extra, and what the resumed run did instead."""
    parts: list[str] = []
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        parts.append(f"step{'s' * (len(missing) != 1)} {_spans(missing)} {verb} missing")
    if extra:
        verb = "is" if len(extra) == 1 else "are"
        parts.append(f"step{'s' * (len(extra) != 1)} {_spans(extra)} {verb} extra or repeated")
    text = " and ".join(parts) if parts else str(difference)
    if not resumed:
        return f"{text}: the resumed run recorded no step"
    first = resumed[0]
    if first <= at:
        return (
            f"{text}: the resumed run started at step {first}, not after step {at}: did it "
            "find and load its checkpoint?"
        )
    if first > at + 1:
        return f"{text}: the resumed run started at step {first}, not {at + 1}"
    return text


def _launch(
    name: str,
    command: Sequence[str],
    workdir: str,
    records: str,
    log: str,
    *,
    env: Mapping[str, str],
    kill_at: int | None,
    timeout: float | None,
) -> Run:
    """Run ``command`` in ``workdir`` until it ends (or the timeout), its output into ``log``."""
    child_env = {k: v for k, v in env.items() if k not in (RECORDS_VAR, KILL_AT_VAR)}
    child_env[RECORDS_VAR] = records
    if kill_at is not None:
        child_env[KILL_AT_VAR] = str(kill_at)
    # Output into a file is block-buffered: a run killed (at K, or at the timeout) would
    # lose what it printed last, which is what a failure's report shows.
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    posix = os.name != "nt"
    with open(log, "ab") as out:
        # A session of its own: what the script started (loader workers) ends with it.
        process = subprocess.Popen(
            list(command),
            cwd=workdir,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=posix,
        )
        status: int | None
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:  # the timeout, Ctrl-C, or the script's own leftover children
            if posix:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
            else:  # pragma: no cover
                process.kill()
            process.wait()
    steps, checkpoints = read_records(records)
    return Run(name, status, steps, checkpoints, workdir, log)


@dataclasses.dataclass
class CheckResume:
    """Everything ``check-resume`` found: the uninterrupted run, one result per ``--at``,
    and the exit status."""

    command: list[str]
    whole: Run | None = None
    results: list[ResumeResult] = dataclasses.field(default_factory=list)
    #: Why nothing could be compared (the uninterrupted run failed, or recorded nothing).
    error: str | None = None
    directory: str | None = None
    kept: bool = False

    @property
    def status(self) -> int:
        """0 every resume matches; 1 one differs; 2 one (or all) could not be checked."""
        if self.error is not None:
            return 2
        if any(r.status == "differs" for r in self.results):
            return 1
        return 2 if any(r.status == "unchecked" for r in self.results) else 0

    def __str__(self) -> str:
        lines: list[str] = []
        if self.whole is not None and self.whole.steps:
            w = self.whole
            steps = _spans(r.step for r in w.steps)
            lines.append(
                f"uninterrupted run: {len(_by_step(w.steps))} steps ({steps}), "
                f"checkpoints at steps {_spans(w.checkpoints)}"
            )
        if self.error is not None:
            lines.append(f"error: {self.error}")
        for r in self.results:
            label = {"ok": "OK", "differs": "DIFFERS", "unchecked": "NOT CHECKED"}[r.status]
            lines.append(f"--at {r.at}: {label}: {r.message}")
        if self.kept and self.directory:
            lines.append(f"working directories kept in {self.directory}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "command": self.command,
            "error": self.error,
            "steps": None if self.whole is None else len(_by_step(self.whole.steps)),
            "checkpoints": None if self.whole is None else self.whole.checkpoints,
            "results": [r.to_dict() for r in self.results],
            "directory": self.directory if self.kept else None,
        }


def check_resume(
    command: Sequence[str],
    at: Sequence[int],
    *,
    keep: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    progress: Any = None,
) -> CheckResume:
    """Run ``command`` uninterrupted, then for each step in ``at`` killed after the checkpoint
    of that step and resumed, each time in a fresh working directory, and compare the records.

    Args:
        command: the command line of the script, its path already absolute
            (the runs start in other directories).
        at: the steps whose checkpoints to crash after.
        keep: keep the working directories (and records and output) instead
            of removing them.
        timeout: the seconds each run may take; ``None``: no limit.
        env: the script's environment (default: this process's).
        progress: called with a line of text before each run (e.g. ``print``).
    """
    env = dict(os.environ if env is None else env)
    say = progress if progress is not None else (lambda _text: None)
    top = tempfile.mkdtemp(prefix="check-resume-")
    report = CheckResume(list(command), directory=top, kept=keep)

    def launch(label: str, name: str, kill_at: int | None, workdir: str) -> Run:
        os.makedirs(workdir, exist_ok=True)
        return _launch(
            label,
            command,
            workdir,
            os.path.join(top, f"{name}.records.jsonl"),
            os.path.join(top, f"{name}.log"),
            env=env,
            kill_at=kill_at,
            timeout=timeout,
        )

    try:
        say("running the script uninterrupted")
        whole = report.whole = launch(
            "uninterrupted run", "whole", None, os.path.join(top, "whole")
        )
        if whole.status != 0:
            report.error = f"the uninterrupted run {whole.ended()}:\n{whole.tail()}"
            return report
        if not whole.steps:
            report.error = (
                "the uninterrupted run recorded no step: call record_step(step, loss=..., "
                "batch=...) after each step and checkpoint_saved(step) once a checkpoint is on "
                "disk (or use the Lightning or transformers callback)"
            )
            return report
        for k in at:
            report.results.append(_check_at(k, whole, launch, say))
        return report
    finally:
        if not keep:
            shutil.rmtree(top, ignore_errors=True)


def _check_at(at: int, whole: Run, launch: Any, say: Any) -> ResumeResult:
    """Kill a run after the checkpoint of step ``at``, resume it, compare."""
    if at not in whole.checkpoints:
        return ResumeResult(
            at,
            "unchecked",
            f"the uninterrupted run reported no checkpoint of step {at} (its checkpoints: "
            f"steps {_spans(whole.checkpoints)}): nothing to crash after",
        )
    workdir = os.path.join(os.path.dirname(whole.workdir), f"at-{at}")
    say(f"--at {at}: running the script until the checkpoint of step {at} is on disk")
    first = launch(f"run killed at {at}", f"at-{at}.interrupted", at, workdir)
    if not first.killed or not first.checkpoints or first.checkpoints[-1] != at:
        if at not in first.checkpoints:
            why = f"it {first.ended()} without reporting a checkpoint of step {at}"
        else:
            why = f"it reported the checkpoint of step {at} but then {first.ended()}"
        return ResumeResult(
            at,
            "unchecked",
            f"the run to interrupt did not end by SIGKILL after the checkpoint of step {at}: "
            f"{why}\n{first.tail()}",
        )
    say(f"--at {at}: resuming it in the same directory")
    second = launch(f"run resumed after {at}", f"at-{at}.resumed", None, workdir)
    result = compare_resume(at, whole.steps, first.steps, second.steps)
    if second.status != 0:
        message = f"the resumed run {second.ended()}"
        if result.status == "differs":
            message += f"; {result.message}"
        return dataclasses.replace(result, status="differs", message=f"{message}\n{second.tail()}")
    return result
