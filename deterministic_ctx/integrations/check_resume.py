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
calls can stay in a script for good.  The records are JSON lines, written and
flushed one by one so that a killed run leaves every record it made.

This module imports only the standard library: the command line reads the
records without loading torch.  The fingerprints are computed with torch and
NumPy, imported when the first record is made.

Example:
    >>> from deterministic_ctx import checkpoint_saved, record_step
    >>> record_step(1, loss=0.5)  # check-resume is not running: nothing happens
    >>> checkpoint_saved(1)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["KILL_AT_VAR", "RECORDS_VAR", "checkpoint_saved", "record_step"]

#: The file (JSON lines) a run appends its records to; unset: records are not kept.
RECORDS_VAR = "DETERMINISTIC_CTX_RESUME_RECORDS"
#: The step whose checkpoint ends the run with ``SIGKILL`` once it is on disk.
KILL_AT_VAR = "DETERMINISTIC_CTX_RESUME_KILL_AT"


def _step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        try:
            import operator

            value = operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"step must be a non-negative int, got {type(step).__name__} {step!r:.80}"
            ) from None
    else:
        value = step
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    return int(value)


def _write(record: Mapping[str, Any]) -> None:
    path = os.environ.get(RECORDS_VAR)
    if not path:
        return
    line = json.dumps(record, sort_keys=True) + "\n"
    # One write of one line, appended and synced: a run killed right after leaves it whole.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
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


def _loss_bits(loss: object) -> str | None:
    """The loss's exact bits: a float's ``hex()``, a tensor's bytes in hex with its dtype."""
    if loss is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(loss, torch.Tensor):
        t = loss.detach().cpu().contiguous()
        data: bytes = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{t.dtype}:{data.hex()}"
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss).hex()
    raise TypeError(
        f"loss must be a float or a tensor (or None), got {type(loss).__name__} {loss!r:.80}"
    )


def _rng_fingerprint() -> str:
    """A fingerprint of the random state a step leaves: Python's ``random``, NumPy's global
    RNG, torch's CPU generator and each initialized accelerator generator."""
    import random

    import numpy as np
    import torch

    state: list[object] = [random.getstate(), np.random.get_state(), torch.get_rng_state()]
    # Never initializes CUDA: only generators a run already uses are read.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state.append(torch.cuda.get_rng_state_all())
    return _fingerprint(state)


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
    bits = _loss_bits(loss)
    if not os.environ.get(RECORDS_VAR):
        return
    _write(
        {
            "step": number,
            "loss": bits,
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
        os.kill(os.getpid(), signal.SIGKILL)
