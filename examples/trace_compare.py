"""Same seed, other results elsewhere: record a trace on each machine, then compare them.

Run:  python examples/trace_compare.py

A training step (a small MLP, an MSE loss over a million elements, backward and an
SGD step) is recorded twice with ``record_trace``, each time in a fresh Python
process standing in for another machine: once with one CPU thread, once with two.
Both runs use seed 0 and are each perfectly reproducible, yet the two traces
differ: the comparison names the first module call whose fingerprints differ (the
loss, a reduction that torch splits across threads, so the float sums round
differently) and the environment fact that differs (``process.num_threads``).

On real machines, record on each and bring the files together::

    python examples/trace_compare.py --record a.trace       # on machine A
    python examples/trace_compare.py --record b.trace       # on machine B
    deterministic-ctx trace compare a.trace b.trace

or, for an unmodified script, ``deterministic-ctx trace record a.trace -- train.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from deterministic_ctx import compare_traces, record_trace


def train_step() -> float:
    """One step from scratch: everything is built inside, from the block's seed."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16384, 64), torch.randn(16384, 64)
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def record(path: str, threads: int | None) -> None:
    """Record the step's trace in this process (with ``threads`` CPU threads, if given)."""
    if threads is not None:
        torch.set_num_threads(threads)
    trace = record_trace(train_step, path=path, seed=0, backward=True)
    print(f"recorded {path}: {trace.calls} module calls, {len(trace.events)} events")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", metavar="PATH", help="only record this process's trace")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads before recording")
    args = parser.parse_args()
    if args.record:
        record(args.record, args.threads)
        return

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, threads in (("a", 1), ("b", 2)):  # two "machines": one thread, two
            paths[name] = str(Path(tmp) / f"{name}.trace")
            command = [__file__, "--record", paths[name], "--threads", str(threads)]
            subprocess.run([sys.executable, *command], check=True)
        print()
        report = compare_traces(paths["a"], paths["b"])
        print(report)
        print()
        print("as JSON, for tools:", sorted(report.to_dict()))
        status = 0 if report.agree else 1
        print(f"`deterministic-ctx trace compare` would exit with status {status}")


if __name__ == "__main__":
    main()
