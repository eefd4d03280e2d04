"""``report()``: what this process does for determinism, and what may go wrong.

A structured, JSON-serializable :class:`DeterminismReport` with a readable
``str``: library versions, the determinism flags, the relevant environment
variables, which RNGs look seeded, torch.compile's random-number settings
(once torch.compile is in use), CUDA facts, the process group and NCCL's
variables (with what each value means), and a list of known problems
(``cudnn.benchmark`` on, ``CUBLAS_WORKSPACE_CONFIG`` missing or set after CUDA
started, ``PYTHONHASHSEED`` unset with spawned workers, nondeterministic
algorithms allowed, compiled random numbers that differ from eager ones, NCCL
variables changed after the process group started, ...).

Reading the report changes nothing: it never initializes CUDA (device facts
are read only once ``torch.cuda.is_initialized()``), never imports
``torch._inductor``, never draws from an RNG and never fixes the
multiprocessing start method.  This module imports only the standard library
at import time: :mod:`deterministic_ctx.internal` imports torch and NumPy, so
it is imported inside the functions that need it.

One module per step of making the report: :mod:`.model` (the report's
types and their rendering), :mod:`.facts` (flags, environment, CUDA,
process), :mod:`.collectives` (process group, NCCL), :mod:`.rngs` (one
function per RNG family) and :mod:`.rules` (one function per problem);
:func:`report` here puts them together.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import collectives as _collectives
from . import facts as _facts
from . import rngs as _rngs
from . import rules as _rules
from .model import DeterminismReport, Problem, RngStatus

__all__ = ["DeterminismReport", "Problem", "RngStatus", "report"]


def report() -> DeterminismReport:
    """Describe the determinism setup of this process, with warnings for known problems.

    Safe anywhere, including inside a deterministic block (it then shows the
    block's settings) and before CUDA starts (it never initializes CUDA).
    ``fast_paths`` says which fast paths blocks use (all off where the process
    started with ``DETERMINISTIC_CTX_NO_FAST_PATHS=1``).

    Example:
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx import report
        >>> with deterministic(seed=0):
        ...     r = report()
        >>> r.in_block, r.flags["deterministic_algorithms"]
        (True, True)
        >>> "nondeterministic-algorithms" in [p.code for p in r.problems]
        False
        >>> r.fast_paths["random.Random: state copied as memory"] in (True, False)
        True
    """
    import platform

    import numpy as np
    import torch

    from .._torch import missing_capabilities
    from ..base.version import __version__ as VERSION
    from ..internal import active_exemptions, compiled_settings, fast_paths, inside_block
    from ..state.snapshot import Snapshot

    snapshot = Snapshot.capture()
    in_block = inside_block()
    flags = _facts.flags(torch, snapshot)
    env = {name: os.environ.get(name) for name in _facts.env_names()}
    cuda = _facts.cuda_facts(torch)
    method, explicit = _facts.start_method()
    rngs = _rngs.rng_statuses(torch, np, snapshot, in_block)
    torch_compile = compiled_settings()  # only the config modules imported already
    process: dict[str, Any] = {
        "start_method": method,
        "start_method_explicit": explicit,
        "hash_randomization": bool(sys.flags.hash_randomization),
        "num_threads": torch.get_num_threads(),
        "env_at_start": _facts.startup_env(),
    }
    collectives = _collectives.collective_facts(torch, process["env_at_start"])
    versions = {
        "deterministic-ctx": VERSION,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
    problems = _rules.problems(
        flags=flags,
        env=env,
        startup_env=process["env_at_start"],
        cuda=cuda,
        start_method=method,
        rngs=rngs,
        torch_compile=torch_compile,
        collectives=collectives,
    )
    # What this torch lacks, one note each: the feature it serves is off.
    problems += tuple(
        Problem("note", f"torch-lacks-{c.name.replace('_', '-')}", c.describe())
        for c in missing_capabilities()
    )
    return DeterminismReport(
        versions,
        in_block,
        flags,
        env,
        rngs,
        cuda,
        process,
        problems,
        torch_compile,
        collectives,
        fast_paths(),
        active_exemptions(),
    )
