"""Cost of ``RngStreams.fork``, and where it goes; optionally side by side with another revision.

Run:  python benchmarks/bench_streams.py [--repeats N] [--number N] [--wall]
                                         [--before PATH]

Times, per call (one fork object reused, CPU only):

* ``fork``: ``with streams.fork("x"): pass``;
* ``fork+draw``: the same with ``torch.rand(1)`` inside;
* ``fork in fork of another``: ``with fork("x"): with fork("y"): pass``;
* ``a block, a first fork in it``: ``with deterministic(seed=1), fork("x"): pass``
  (the block starts the streams over: the fork seeds the stream);
* ``torch.random.fork_rng(devices=[])``: torch's own swap of the CPU generator.

Then the parts of a fork: the generator work alone (two ``get_state``, two
``set_state``), the same through the engine's ``World.capture`` / ``restore``,
and a ``Block`` over the fork's sources with the stream's world restored and
captured inside; the rest of a fork is its own bookkeeping.

``--before PATH`` loads another revision's ``parallel/streams.py`` (``git show
REV:deterministic_ctx/parallel/streams.py > PATH``) next to this one and times
both in the same rounds, so that the machine's noise hits them alike.

Times are CPU time of this process (``time.process_time``) by default, medians
over repeats of the best of 3; ``--wall`` times wall-clock instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from deterministic_ctx import deterministic
from deterministic_ctx.internal import Block, World
from deterministic_ctx.parallel import streams as current


def _load(path: str) -> ModuleType:
    name = "deterministic_ctx.parallel._streams_before"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _cases(module: Any, key: str) -> tuple[dict[str, Callable[[], None]], Any]:
    streams = module.RngStreams(0, key=key)
    streams.add("x")
    streams.add("y")
    fx, fy = streams.fork("x"), streams.fork("y")

    def fork() -> None:
        with fx:
            pass

    def fork_draw() -> None:
        with fx:
            torch.rand(1)

    def nested() -> None:
        with fx, fy:
            pass

    block = deterministic(seed=1)

    def first_in_block() -> None:  # a block's world: the stream starts from its seed
        with block, fx:
            pass

    cases = {
        "fork": fork,
        "fork+draw": fork_draw,
        "fork in fork of another": nested,
        "a block, a first fork in it": first_in_block,
    }
    return cases, streams  # the streams stay registered while they are timed


def _parts() -> dict[str, Callable[[], None]]:
    gen = torch.default_generator
    sources = current._SOURCES
    world = World.capture(sources)

    def states() -> None:  # what any fork must do to the CPU generator
        a = gen.get_state()
        gen.set_state(a)
        b = gen.get_state()
        gen.set_state(b)

    def worlds() -> None:
        World.capture(sources)
        world.restore()
        World.capture(sources)
        world.restore()

    def block() -> None:
        b = Block(None, sources)
        b.start()
        world.restore()
        World.capture(sources)
        b.stop()

    def fork_rng() -> None:
        with torch.random.fork_rng(devices=[]):
            pass

    return {
        "torch.random.fork_rng(devices=[])": fork_rng,
        "part: 2 get_state + 2 set_state": states,
        "part: the same through World": worlds,
        "part: + the Block's start/stop": block,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--wall", action="store_true", help="wall-clock, not CPU time")
    parser.add_argument("--before", help="another revision's parallel/streams.py")
    args = parser.parse_args()
    timer = time.perf_counter if args.wall else time.process_time

    def timed(fn: Callable[[], None]) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=3, timer=timer)) / args.number

    after, _keep = _cases(current, "bench-after")
    before: dict[str, Callable[[], None]] = {}
    if args.before:
        before, _keep_before = _cases(_load(args.before), "bench-before")
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: both revisions see the same load
        for name, fn in after.items():
            rows.setdefault(name, []).append(timed(fn))
            if name in before:
                rows.setdefault(f"{name} (before)", []).append(timed(before[name]))
        for name, fn in _parts().items():
            rows.setdefault(name, []).append(timed(fn))
    clock = "wall" if args.wall else "CPU"
    print(f"median of {args.repeats} repeats, best of 3 x {args.number} calls, {clock} time")
    for name, times in rows.items():
        median = statistics.median(times) * 1e6
        line = f"{name:40s} {median:7.2f} us"
        if name.endswith(" (before)"):
            now = statistics.median(rows[name.removesuffix(" (before)")]) * 1e6
            line += f"   after/before {now / median:.2f}"
        print(line)


if __name__ == "__main__":
    main()
