"""Cost of the environ source: 17+ managed variables against the 2 it managed before.

Run:  python benchmarks/bench_environ.py [--repeats N] [--number N] [--extra N]

Measures, in one run and interleaved (medians, µs per call), with the process's environment as
it is and then with ``--extra`` (default 10 000) more variables:

* the source's ``capture()``, ``capture()`` + ``restore()`` with nothing changed, and the block's
  cycle ``capture()`` + ``apply()`` + ``restore()`` (which sets and puts back
  ``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED``);
* the same for the previous source (two names, read one at a time), kept below as the baseline;
* two other ways to capture: ``os.environ.get`` per managed name (the public API) and
  ``dict(os.environ)`` (everything, which grows with the environment);
* a whole ``with deterministic(seed=0): pass`` with the current source and with the previous one.

Then the ratios: current / previous, and huge / small environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch

from deterministic_ctx import deterministic, managed_env_vars
from deterministic_ctx import sources as _sources
from deterministic_ctx.base.settings import Settings
from deterministic_ctx.sources._base import SettingSource
from deterministic_ctx.sources.environ import CUBLAS_VALID, EnvironSource

CUBLAS, HASHSEED = "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED"


class PreviousEnvironSource(SettingSource):
    """The source as it was before the managed list (two names), for the baseline."""

    name = "environ"
    _names = (CUBLAS, HASHSEED)

    def __init__(self) -> None:
        env = os.environ
        data, keys, decode = env._data, {n: env.encodekey(n) for n in self._names}, env.decodevalue

        def get(name: str) -> str | None:
            value = data.get(keys[name])
            return None if value is None else str(decode(value))

        self._env, self._get = env, get

    def capture(self) -> tuple[str | None, ...]:
        get = self._get
        return (get(CUBLAS), get(HASHSEED))

    def apply(self, settings: Settings) -> None:
        env, get = self._env, self._get
        if get(CUBLAS) not in CUBLAS_VALID:
            env[CUBLAS] = CUBLAS_VALID[0]
        seed = str(settings.seed)
        if get(HASHSEED) != seed:
            env[HASHSEED] = seed

    def restore(self, state: tuple[str | None, ...]) -> None:
        env, get = self._env, self._get
        for name, value in zip(self._names, state, strict=True):
            if get(name) == value:
                continue
            if value is None:
                del env[name]
            else:
                env[name] = value


SETTINGS = Settings(0, False).resolved()


def source_cases(label: str, source: Any) -> dict[str, Callable[[], None]]:
    def capture() -> None:
        source.capture()

    def unchanged() -> None:
        source.restore(source.capture())

    def cycle() -> None:
        state = source.capture()
        source.apply(SETTINGS)
        source.restore(state)

    return {
        f"{label} capture": capture,
        f"{label} capture+restore, unchanged": unchanged,
        f"{label} capture+apply+restore": cycle,
    }


def other_cases() -> dict[str, Callable[[], None]]:
    names = managed_env_vars()
    get = os.environ.get

    def public_api() -> None:
        tuple(map(get, names))

    def copy_all() -> None:
        dict(os.environ)

    return {
        f"os.environ.get x {len(names)} (public API)": public_api,
        "dict(os.environ) (capture everything)": copy_all,
    }


_block = deterministic(seed=0)


def block() -> None:
    with _block:
        pass


def with_source(source: Any) -> Callable[[], None]:
    """A block whose environ source is ``source`` (the sources tuple is read at every block)."""
    current = _sources.SOURCES
    swapped = tuple(source if s.name == "environ" else s for s in current)

    def run() -> None:
        _sources.SOURCES = swapped
        try:
            block()
        finally:
            _sources.SOURCES = current

    return run


def add_extra(count: int) -> list[str]:
    names = [f"DCTX_BENCH_EXTRA_{i}" for i in range(count)]
    for name in names:
        os.environ[name] = "x" * 20
    return names


def remove(names: list[str]) -> None:
    for name in names:
        os.environ.pop(name, None)


def measure(
    cases: dict[str, Callable[[], None]], repeats: int, number: int, extra: int
) -> tuple[dict[str, float], dict[str, float], int, int]:
    """Medians with the environment as it is ("small") and with ``extra`` more variables
    ("huge"), interleaved repeat by repeat so that machine noise hits both alike."""
    samples: dict[str, dict[str, list[float]]] = {
        size: {name: [] for name in cases} for size in ("small", "huge")
    }
    sizes = {}
    for fn in cases.values():  # warm up: imports, caches
        for _ in range(200):
            fn()
    for _ in range(repeats):
        for size in ("small", "huge"):
            added = add_extra(extra) if size == "huge" else []
            try:
                sizes[size] = len(os.environ)
                for name, fn in cases.items():
                    samples[size][name].append(timeit.timeit(fn, number=number) / number * 1e6)
            finally:
                remove(added)
    small, huge = (
        {name: statistics.median(v) for name, v in samples[size].items()}
        for size in ("small", "huge")
    )
    return small, huge, sizes["small"], sizes["huge"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--extra", type=int, default=10_000, help="variables added for 'huge'")
    args = parser.parse_args(argv)

    for name in managed_env_vars():  # the usual case: the managed variables are unset
        os.environ.pop(name, None)
    current, previous = EnvironSource(), PreviousEnvironSource()
    cases = {
        **source_cases("current", current),
        **source_cases("previous", previous),
        **other_cases(),
        "block, current source": with_source(current),
        "block, previous source": with_source(previous),
    }
    small, huge, size_small, size_huge = measure(cases, args.repeats, args.number, args.extra)

    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{len(managed_env_vars())} managed variables"
    )
    print(f"median of {args.repeats} repeats x {args.number} calls, µs per call\n")
    width = max(map(len, small))
    print(f"  {'':<{width}}  {f'{size_small} vars':>10}  {f'{size_huge} vars':>11}  huge/small")
    for name in small:
        print(
            f"  {name:<{width}}  {small[name]:10.2f}  {huge[name]:11.2f}  "
            f"{huge[name] / small[name]:10.2f}"
        )

    print("\nratios current / previous:")
    for env, values in (("small", small), ("huge", huge)):
        for what in ("capture", "capture+restore, unchanged", "capture+apply+restore"):
            r = values[f"current {what}"] / values[f"previous {what}"]
            print(f"  {env:<6}{what:<32}{r:6.2f}")
        now, before = values["block, current source"], values["block, previous source"]
        print(f"  {env:<6}{'whole block':<32}{now / before:6.2f}  ({now - before:+.2f} µs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
