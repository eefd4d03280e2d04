"""Import cost of the package, its engine and its integrations, against ``import torch, numpy``.

Run:  python benchmarks/bench_import.py [--repeats N]

Every sample is a fresh interpreter (``python -c``): it runs a row's setup
untimed, then times the row's step alone with ``time.perf_counter``, so neither
interpreter start-up nor the setup is counted and nothing is already in
``sys.modules``.  The rows, each against the baseline ``import torch, numpy``
measured in the same run:

* ``import deterministic_ctx`` alone: the lazy package (PEP 562), which must
  load neither torch nor NumPy;
* ``import deterministic_ctx.integrations.cli``: what ``deterministic-ctx run`` loads in the
  interpreter it throws away when it restarts for ``PYTHONHASHSEED``;
* the first use of ``deterministic_ctx.deterministic``, with torch and NumPy
  already imported: the engine and its sources;
* the first use of ``locate_divergence``, ``assert_reproducible`` and
  ``report``, with the engine already loaded: each integration's
  own cost on top of it.

The rows take turns within each repeat, so the shared machine's noise hits
every row alike; the table shows medians in milliseconds and the ratio to the
baseline, and which of torch and NumPy each step left imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

#: What a child runs: the row's setup, then its timed step; it prints
#: ``[seconds, torch imported, numpy imported]`` as JSON.
CHILD = """\
import json, sys, time
{setup}
start = time.perf_counter()
{step}
elapsed = time.perf_counter() - start
print(json.dumps([elapsed, "torch" in sys.modules, "numpy" in sys.modules]))
"""

TORCH_NUMPY = "import torch, numpy"
#: NumPy 2 loads ``numpy.random`` (~10 ms) on first use; most programs have by then.
ENGINE_AFTER_RANDOM = "engine, numpy.random already loaded"
#: Issue 15: the engine's first use, after torch and NumPy, in at most this many ms.
ENGINE_TARGET_MS = 25.0
ENGINE = "import torch, numpy, deterministic_ctx\ndeterministic_ctx.deterministic"


class Row(NamedTuple):
    """One line of the table: ``step`` is timed in a fresh interpreter after ``setup``."""

    label: str
    setup: str
    step: str


BASELINE = Row("import torch, numpy (baseline)", "", TORCH_NUMPY)
ROWS = (
    BASELINE,
    Row("import deterministic_ctx", "", "import deterministic_ctx"),
    Row(
        "import deterministic_ctx.integrations.cli", "", "import deterministic_ctx.integrations.cli"
    ),
    Row(
        "engine: first deterministic_ctx.deterministic",
        "import torch, numpy, deterministic_ctx",
        "deterministic_ctx.deterministic",
    ),
    Row(
        ENGINE_AFTER_RANDOM,
        "import torch, numpy, numpy.random, deterministic_ctx",
        "deterministic_ctx.deterministic",
    ),
    *(
        Row(f"integration: first {name}", ENGINE, f"deterministic_ctx.{name}")
        for name in ("locate_divergence", "assert_reproducible", "report")
    ),
)


class Sample(NamedTuple):
    """One child's measurement."""

    seconds: float
    torch: bool
    numpy: bool


def sample(row: Row) -> Sample:
    """Time ``row`` once in a fresh interpreter that imports this checkout."""
    # Bytecode caches as users have them: an environment that forbids writing
    # them (PYTHONDONTWRITEBYTECODE, set on some CI machines) would time the
    # compiler instead, every run.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTHONPROFILEIMPORT") and k != "PYTHONDONTWRITEBYTECODE"
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(setup=row.setup, step=row.step)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{row.label!r} failed:\n{proc.stderr}")
    seconds, torch, numpy = json.loads(proc.stdout.splitlines()[-1])
    return Sample(seconds, torch, numpy)


def measure(repeats: int) -> dict[Row, list[Sample]]:
    """``repeats`` samples of every row, the rows taking turns, after one discarded round
    (it writes bytecode caches and warms the OS file cache)."""
    for row in ROWS:
        sample(row)
    samples: dict[Row, list[Sample]] = {row: [] for row in ROWS}
    for _ in range(repeats):
        for row in ROWS:
            samples[row].append(sample(row))
    return samples


def _loaded(samples: list[Sample]) -> str:
    """Which of torch and NumPy the step's interpreter held afterwards, in any sample."""
    torch, numpy = (any(getattr(s, name) for s in samples) for name in ("torch", "numpy"))
    return ", ".join(name for name, held in (("torch", torch), ("numpy", numpy)) if held) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="samples per row (default: 11)")
    args = parser.parse_args(argv)

    samples = measure(args.repeats)
    medians = {
        row: statistics.median(s.seconds for s in rows) * 1e3 for row, rows in samples.items()
    }
    baseline = medians[BASELINE]

    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("torch", "numpy")
    )
    print(f"Python {sys.version.split()[0]}, {versions}, {os.cpu_count()} CPUs")
    print(f"median of {args.repeats} fresh interpreters per row, ms\n")
    width = max(len(row.label) for row in ROWS)
    print(f"  {'step':<{width}}  {'ms':>8}  {'/ baseline':>10}  loaded afterwards")
    for row in ROWS:
        ratio = medians[row] / baseline
        loaded = _loaded(samples[row])
        print(f"  {row.label:<{width}}  {medians[row]:8.1f}  {ratio:10.3f}  {loaded}")
    engine = next(row for row in ROWS if row.label.startswith("engine: first"))
    print("\ntargets (issue 15):")
    for row in (engine, next(row for row in ROWS if row.label == ENGINE_AFTER_RANDOM)):
        verdict = "ok" if medians[row] <= ENGINE_TARGET_MS else "MISSED"
        target = f"(target <= {ENGINE_TARGET_MS:g}) {verdict}"
        print(f"  {row.label:<{width}}  {medians[row]:8.1f} ms  {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
