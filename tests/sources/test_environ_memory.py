"""Issue 44: blocks and ``seed_everything`` with ever new seeds do not grow the process.

glibc's ``setenv`` (behind ``os.putenv``) keeps every distinct ``NAME=value``
string it was given; a block writes ``PYTHONHASHSEED=<seed>`` and
``seed_everything`` ``DETERMINISTIC_CTX_SEED=<seed>`` too.  With the fast
paths on, those two are written into entries the process owns, so the C
environment's entry for them is one of two fixed buffers whatever the seed.
The guard here counts the distinct addresses the C library's ``getenv``
returns over many distinct seeds (no timing, no RSS): the code before the
fix gave a new address for every seed.

Whatever the path, ``os.environ`` and the C environment agree before, inside
and after blocks, nested or not, with caller values that fit an owned entry
and values that do not, and after the body writes the variable itself.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from deterministic_ctx import deterministic, seed_everything
from deterministic_ctx.base import fast_paths as _memory
from deterministic_ctx.base.settings import Settings
from deterministic_ctx.sources import environ as environ_mod
from deterministic_ctx.sources import source_named
from deterministic_ctx.sources.environ import SLOT_CHARS, EnvironSource

HASHSEED, SEED = "PYTHONHASHSEED", "DETERMINISTIC_CTX_SEED"

_libc = ctypes.CDLL(None) if os.name == "posix" else None
owned_only = pytest.mark.skipif(
    not _memory.ENABLED,
    reason="the fast paths are off: os.environ's setenv keeps a string per distinct "
    "value, as documented",
)
posix_only = pytest.mark.skipif(_libc is None, reason="reads the C environment with getenv")


def c_address(name: str) -> int | None:
    """Where the C environment's value of ``name`` lies, or ``None`` if unset."""
    assert _libc is not None
    getenv = _libc.getenv
    getenv.argtypes, getenv.restype = [ctypes.c_char_p], ctypes.c_void_p
    address: int | None = getenv(os.fsencode(name))
    return address


def c_value(name: str) -> str | None:
    address = c_address(name)
    return None if address is None else os.fsdecode(ctypes.string_at(address))


def agree(*names: str) -> None:
    for name in names:
        assert c_value(name) == os.environ.get(name), name


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, restore_world: None) -> pytest.MonkeyPatch:
    """Both names start unset; everything is put back afterwards."""
    for name in (HASHSEED, SEED):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- the guard: a fixed entry whatever the seed ------------------------------------------------


@posix_only
@owned_only
def test_blocks_with_distinct_seeds_reuse_two_entries(env):
    addresses = set()
    for seed in range(1000, 1200):
        with deterministic(seed=seed):
            assert c_value(HASHSEED) == str(seed)
            addresses.add(c_address(HASHSEED))
    assert c_address(HASHSEED) is None  # absent again after each block
    assert len(addresses) <= 2


@posix_only
@owned_only
def test_nested_blocks_put_distinct_outer_seeds_back_in_the_same_entries(env):
    addresses = set()
    for seed in range(2000, 2100):
        with deterministic(seed=seed):
            with deterministic(seed=seed + 10**6):
                addresses.add(c_address(HASHSEED))
            assert c_value(HASHSEED) == str(seed)  # the outer seed, written back
            addresses.add(c_address(HASHSEED))
    assert len(addresses) <= 2


@posix_only
@owned_only
def test_seed_everything_with_distinct_seeds_reuses_two_entries_per_name(env):
    addresses: dict[str, set[int | None]] = {HASHSEED: set(), SEED: set()}
    for seed in range(3000, 3200):
        seed_everything(seed)
        for name, seen in addresses.items():
            assert c_value(name) == os.environ[name] == str(seed)
            seen.add(c_address(name))
    assert all(len(seen) <= 2 for seen in addresses.values())


@posix_only
@owned_only
def test_a_caller_value_that_fits_is_written_back_into_the_owned_entries(env):
    addresses = set()
    for seed in range(4000, 4050):
        env.setenv(HASHSEED, str(seed))  # os.putenv: a setenv copy of its own
        with deterministic(seed=seed + 1):
            addresses.add(c_address(HASHSEED))
        addresses.add(c_address(HASHSEED))
        assert c_value(HASHSEED) == os.environ[HASHSEED] == str(seed)
    assert len(addresses) <= 2


@posix_only
@owned_only
def test_an_entry_is_never_rewritten_while_a_reader_may_hold_it(env):
    # A C reader that took getenv's pointer before a write still reads a
    # complete string after it: the buffer it points to is not the one written.
    previous: tuple[int | None, str] | None = None
    for seed in (1, 22, 333, 4444, 55555, 7):
        with deterministic(seed=seed):
            if previous is not None:
                address, value = previous
                assert address is not None and address != c_address(HASHSEED)
                assert ctypes.string_at(address).decode() == value
            previous = (c_address(HASHSEED), str(seed))


def test_without_the_probe_the_public_path_is_taken(monkeypatch):
    monkeypatch.setattr(environ_mod, "_LIBC", None)
    access = environ_mod._access(os.environ)
    assert access.fast is _memory.ENABLED
    assert not access.owned
    assert not EnvironSource().owned


def test_the_owned_path_is_chosen_with_the_fast_paths():
    source = source_named("environ")
    if _memory.ENABLED and os.name == "posix":
        assert source.owned  # type: ignore[attr-defined]
    if not _memory.ENABLED:
        assert not source.owned  # type: ignore[attr-defined]
        assert environ_mod._LIBC is None


# --- os.environ and the C environment agree -----------------------------------------------------

CALLER_VALUES = [None, "0", "123", "x" * SLOT_CHARS, "y" * (SLOT_CHARS + 1), "ünï\udcff"]


@posix_only
@pytest.mark.parametrize("before", CALLER_VALUES)
def test_os_environ_and_the_c_environment_agree_around_blocks(env, before):
    for name in (HASHSEED, SEED):
        if before is not None:
            env.setenv(name, before)
    for seed in (5, 6, 4_294_967_293, 5):
        agree(HASHSEED, SEED)
        with deterministic(seed=seed):
            agree(HASHSEED, SEED)
            assert os.environ[HASHSEED] == str(seed)
            with deterministic(seed=seed + 1):
                agree(HASHSEED, SEED)
                seed_everything(seed + 2)
                agree(HASHSEED, SEED)
            agree(HASHSEED, SEED)
            assert os.environ[HASHSEED] == str(seed)
        agree(HASHSEED, SEED)
        assert os.environ.get(HASHSEED) == before
        assert os.environ.get(SEED) == before


@posix_only
def test_a_body_that_writes_the_variable_itself_is_undone_and_agrees(env):
    with deterministic(seed=7):
        os.environ[HASHSEED] = "body"  # setenv replaces the owned entry
        agree(HASHSEED)
    agree(HASHSEED)
    assert HASHSEED not in os.environ
    with deterministic(seed=8):
        agree(HASHSEED)
        assert os.environ[HASHSEED] == "8"
        del os.environ[HASHSEED]
        agree(HASHSEED)
        with deterministic(seed=9):
            agree(HASHSEED)
            assert os.environ[HASHSEED] == "9"
        agree(HASHSEED)
        assert HASHSEED not in os.environ
    agree(HASHSEED)
    assert HASHSEED not in os.environ


@posix_only
def test_the_source_writes_agree_for_any_value(env):
    source = EnvironSource()
    state = source.capture()
    for seed in (0, 1, 22, 333, 4_294_967_295, 1):
        source.apply(Settings(seed, False))
        agree(HASHSEED)
        assert os.environ[HASHSEED] == str(seed)
    source.restore(state)
    agree(HASHSEED)
    assert HASHSEED not in os.environ
