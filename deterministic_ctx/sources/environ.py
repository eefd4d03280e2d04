"""Environment variables that decide seeding or determinism.

Two of them are *set* inside a block:

* ``CUBLAS_WORKSPACE_CONFIG``: cuBLAS is only deterministic with ``:4096:8``
  or ``:16:8``; a valid user value is kept, anything else is replaced inside
  the block.  cuBLAS reads it once, at its first use in the process: setting
  it after CUDA work has started may have no effect (the report says so).
* ``PYTHONHASHSEED``: set to the block's seed, so child processes started in
  the block (``spawn`` DataLoader workers, subprocesses) hash strings
  reproducibly.  It cannot change the running interpreter.

Every other name of :data:`ENV_VARS`, and every name given to
:func:`register_env_var`, is only captured and restored: seeding functions of
other libraries export their state there (Lightning's ``PL_GLOBAL_SEED``,
transformers' ``enable_full_determinism``), and a block must not leak it.
A variable that was absent is absent again after the block.

NCCL's variables that decide the order in which a reduction sums are only
captured and restored: NCCL reads them when it creates a communicator, or
once per process, so a value set in a block would outlive it (see
``docs/how-to/collectives.md`` and :data:`~deterministic_ctx.DETERMINISTIC_COLLECTIVES`).

Example:
    >>> import os
    >>> from deterministic_ctx import deterministic
    >>> from deterministic_ctx import DETERMINISTIC_COLLECTIVES
    >>> DETERMINISTIC_COLLECTIVES["NCCL_ALGO"]
    'Ring'
    >>> before = os.environ.get("NCCL_ALGO")
    >>> with deterministic(seed=0):
    ...     os.environ["NCCL_ALGO"] = "Tree"  # too late for NCCL anyway: restored on exit
    >>> os.environ.get("NCCL_ALGO") == before
    True

Memory: ``PYTHONHASHSEED`` and ``DETERMINISTIC_CTX_SEED`` take a new value
with every new seed, and glibc keeps every ``NAME=value`` string ``os.putenv``
was ever given.  So, where a probe at import proves it works, these two are
written into entries the process owns (:class:`_Slot`), with ``os.environ``
updated together; ``docs/explanation/performance.md`` ("Memory over many
seeds") says how, what it saves, and what other threads and child processes see.

Cost: one dict entry read per managed name, whatever the size of the
environment (:class:`_Access`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, MutableMapping
from itertools import compress
from operator import ne
from typing import Any, NamedTuple

from ..base import plain as _plain
from ..base.cache import BoundedCache
from ..base.fast_paths import ENABLED, FastPath
from ..base.settings import Settings
from ._base import SettingSource

__all__ = [
    "CUBLAS_VALID",
    "ENV_VARS",
    "SEED",
    "SLOT_CHARS",
    "EnvironSource",
    "export_env_var",
    "managed_env_vars",
    "register_env_var",
]

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
HASHSEED = "PYTHONHASHSEED"
CUBLAS_VALID = (":4096:8", ":16:8")
#: Where ``seed_everything`` exports its seed for child processes.
SEED = "DETERMINISTIC_CTX_SEED"

#: The variables every block captures and restores, each with why: the ones
#: that PyTorch, its accelerator and collective libraries, Lightning,
#: transformers and the training stacks built on them read or write to decide
#: seeds or whether results are deterministic.  (Left out, besides what
#: ``docs/explanation/captures.md`` names: NCCL's transport and debugging
#: variables and PyTorch's ``TORCH_NCCL_*``, which handle errors, streams,
#: timeouts and buffer registration but never choose how a reduction sums.)
ENV_VARS: tuple[tuple[str, str], ...] = (
    (CUBLAS, "cuBLAS is deterministic only with :4096:8 or :16:8 (set in a block)"),
    (HASHSEED, "str hash seed of child processes, spawn workers too (set in a block)"),
    ("PL_GLOBAL_SEED", "Lightning's exported seed: later seed_everything()/reset_seed() reuse it"),
    ("PL_SEED_WORKERS", "Lightning: every later Trainer adds its seeding worker_init_fn"),
    ("FLASH_ATTENTION_DETERMINISTIC", "transformers: deterministic flash-attention backward"),
    ("HCCL_DETERMINISTIC", "Ascend HCCL collectives in a fixed order (transformers sets it)"),
    ("CUDA_LAUNCH_BLOCKING", "synchronous CUDA launches (transformers' full determinism sets it)"),
    ("ASCEND_LAUNCH_BLOCKING", "synchronous Ascend launches, for its deterministic mode"),
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "Transformer Engine: 0 forbids nondeterministic kernels"),
    ("TF_DETERMINISTIC_OPS", "TensorFlow's deterministic kernels, in mixed TF/PyTorch stacks"),
    ("TF_CUDNN_DETERMINISTIC", "TensorFlow picks only deterministic cuDNN algorithms"),
    ("NCCL_ALGO", "NCCL's algorithm (Ring, Tree, NVLS) fixes the all-reduce summation order"),
    ("NCCL_PROTO", "NCCL's protocol (LL, LL128, Simple) changes how reductions are summed"),
    ("NCCL_NVLS_ENABLE", "NVLink SHARP reduces in the switch, in no fixed order"),
    ("NCCL_COLLNET_ENABLE", "CollNet (in-network SHARP) reductions, in no fixed order"),
    # A ring all-reduce sums each element starting at the rank that owns the
    # element's chunk; the chunk layout follows the channel count and the chunk
    # size, so these change the bits of a sum (though not its run-to-run stability).
    ("NCCL_MIN_NCHANNELS", "NCCL's channel count splits each reduction: sums in another order"),
    ("NCCL_MAX_NCHANNELS", "NCCL's channel count splits each reduction: sums in another order"),
    ("NCCL_MIN_CTAS", "NCCL 2.17+ name of the channel count (a CTA per channel): the same"),
    ("NCCL_MAX_CTAS", "NCCL 2.17+ name of the channel count (a CTA per channel): the same"),
    ("NCCL_BUFFSIZE", "NCCL's chunk size follows it: where each element's ring sum starts"),
    ("NCCL_TOPO_FILE", "the topology NCCL builds its rings from: another ring, another order"),
    ("NCCL_TUNER_PLUGIN", "an NCCL tuner plugin picks algorithm, protocol, channels per call"),
    ("TORCHINDUCTOR_DETERMINISTIC", "default of inductor's deterministic flag at its first import"),
    ("MKL_CBWR", "Intel MKL's conditional numerical reproducibility (torch's x86 CPU BLAS)"),
    (SEED, "seed_everything's exported seed: seed_everything() in a child process reuses it"),
)

_lock = threading.Lock()
if hasattr(os, "register_at_fork"):
    # A fork while another thread registers would leave the child's lock held forever.
    os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]
#: The managed names now: ``ENV_VARS``'s, then the registered ones.  Only ever
#: replaced (under ``_lock``), never mutated, so a capture that read it holds a
#: consistent tuple, and comparing by identity tells whether it changed.
_MANAGED: tuple[str, ...] = tuple(name for name, _ in ENV_VARS)


#: Far above any real environment variable, far below trouble (Linux refuses to
#: pass a single one longer than 128 KiB to a child process anyway).
MAX_ENV_CHARS = 1 << 20


def _env_text(value: object, path: str, *, name: bool = False) -> str:
    """A ``str`` that the environment can hold, as a value (or, with ``name=True``,
    a name); ``ValueError`` naming ``path`` and why otherwise.

    The environment holds bytes without NUL; ``os.environ`` encodes a str with
    ``os.fsencode``'s rules (the file-system encoding and ``surrogateescape``),
    which refuse surrogates other than the escaped bytes ``\\udc80``-``\\udcff``.
    A name must be non-empty and hold no ``=``.
    """
    what = "an environment variable name" if name else "an environment variable value"
    if type(value) is not str or len(value) > MAX_ENV_CHARS:
        raise ValueError(
            f"{path}: expected a string (at most {MAX_ENV_CHARS} characters) as {what}, "
            f"got {_plain.shown(value)}"
        )
    problem = None
    if "\0" in value:
        problem = "it holds a NUL character"
    elif name and not value:
        problem = "it is empty"
    elif name and "=" in value:
        problem = "it holds '='"
    else:
        try:
            os.fsencode(value)
        except UnicodeEncodeError as exc:
            problem = f"it cannot be encoded ({exc.reason} at index {exc.start})"
    if problem is not None:
        raise ValueError(
            f"{path}: expected a string usable as {what}, got {_plain.shown(value)}; {problem}"
        )
    return value


def register_env_var(name: str) -> None:
    """Capture and restore the environment variable ``name`` in every block from now on.

    For variables that decide seeding or determinism in your own code or in a
    library not covered by :func:`managed_env_vars`.  Inside a block the
    variable is left as it is; after the block it is exactly as before (absent
    if it was absent).  Registering a name twice does nothing; a snapshot taken
    before the registration restores only the names it captured.  Raises
    ``TypeError`` if ``name`` is not a str and ``ValueError`` if it is empty or
    holds ``=``, NUL or characters the environment cannot encode.

    Example:
        >>> import os
        >>> from deterministic_ctx import deterministic, managed_env_vars, register_env_var
        >>> register_env_var("MY_APP_SEED")
        >>> "MY_APP_SEED" in managed_env_vars()
        True
        >>> with deterministic(seed=0):
        ...     os.environ["MY_APP_SEED"] = "42"
        >>> "MY_APP_SEED" in os.environ
        False
    """
    global _MANAGED
    if not isinstance(name, str):
        raise TypeError(f"an environment variable name must be a str, got {type(name).__name__}")
    # An exact str: a subclass's methods could say anything later.
    name = _env_text(str.__str__(name), "register_env_var(name)", name=True)
    with _lock:
        if name not in _MANAGED:  # a few dozen names, registered once each
            _MANAGED = (*_MANAGED, name)


def managed_env_vars() -> tuple[str, ...]:
    """The environment variables every block captures and restores, in capture order.

    The names of :data:`ENV_VARS` (see its reasons), then those given to
    :func:`register_env_var`.  Only ``CUBLAS_WORKSPACE_CONFIG`` and
    ``PYTHONHASHSEED`` are changed inside a block.

    Example:
        >>> from deterministic_ctx import managed_env_vars
        >>> managed_env_vars()[:2]
        ('CUBLAS_WORKSPACE_CONFIG', 'PYTHONHASHSEED')
        >>> "PL_GLOBAL_SEED" in managed_env_vars()
        True
    """
    return _MANAGED


def export_env_var(name: str, value: str) -> None:
    """Set the managed variable ``name`` to ``value`` in ``os.environ`` and the C
    environment, through its owned entry where it has one (:data:`OWNED`), so that
    a new value each time does not grow the process.  For the library's own
    exports (``seed_everything``'s seed); ``value`` must be a str the environment
    can hold.

    Example:
        >>> import os
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx.sources.environ import SEED, export_env_var
        >>> with deterministic(seed=0):  # the variable is restored on exit
        ...     export_env_var(SEED, "5")
        ...     os.environ[SEED]
        '5'
    """
    global _os
    access = _os
    if access is None:
        access = _os = _access(os.environ)
    access.put(access.encodekey(name), access.encode(value))


#: ``os.environ``'s access for :func:`export_env_var`, made at its first call.
_os: _Access | None = None


# A captured state: the names, and each one's raw value (``None`` if unset) in
# the form the environment stores it (bytes in ``os.environ`` on POSIX).
EnvState = tuple[tuple[str, ...], tuple[Any, ...]]


class _Access(NamedTuple):
    """How a source reads and writes one environment mapping: raw values by
    encoded key (``get``, ``put(key, raw)``, ``delete(key)``) and the codecs.

    For ``os.environ`` (an ``os._Environ``), raw values are read straight from
    its ``_data`` dict under encoded keys: ``os.environ.get`` goes through
    ``Mapping.get``, which raises and catches a ``KeyError`` for every absent
    variable (~0.7 µs, and these variables are usually absent), while
    ``_data.get`` is ~0.05 µs and runs in C under ``map``.  That path is used
    only after proving, on a probe variable set and deleted through the public
    API, that it reads what ``os.environ`` reads and encodes values the way
    ``os.environ`` stores them.  Writes then do what ``os._Environ``'s own
    ``__setitem__`` / ``__delitem__`` do, with keys and values already
    encoded: ``os.putenv`` / ``os.unsetenv`` and the same ``_data`` entry
    (~0.25 µs instead of ~0.6 µs).  Any other mapping is read through its own
    ``get`` and written through its own item assignment, values as they are.
    """

    #: Whether the proven path (``_data`` and ``putenv``) is in use.
    fast: bool
    get: Callable[[Any], Any]
    encodekey: Callable[[str], Any]
    encode: Callable[[str], Any]
    decode: Callable[[Any], str]
    put: Callable[[Any, Any], None]
    delete: Callable[[Any], None]
    #: Whether :data:`OWNED`'s names are written into owned entries (see the module docstring).
    owned: bool = False

    def keys(self, names: tuple[str, ...]) -> tuple[Any, ...]:
        return tuple(map(self.encodekey, names))


# -- entries the process owns ----------------------------------------------------------------

#: The longest value an owned entry holds: a seed has at most 10 digits
#: (``MAX_SEED`` is ``2**32 - 1``); a longer value goes through ``os.putenv``.
SLOT_CHARS = 24


class _Slot:
    """Two owned ``NAME=value`` buffers of one variable, used in turn.

    :meth:`write` fills the buffer that is not the C environment's entry (the
    other one may be) and hands it to ``putenv``, which stores the pointer
    itself: no copy is made and nothing is kept per value.  The buffers are
    never freed (a slot lives in :data:`_SLOTS` for the life of the process),
    since the environment may point into either of them at any time.
    """

    __slots__ = ("_buffers", "_next", "_offset", "_putenv", "_views")

    def __init__(self, key: bytes, putenv: Callable[[Any], int]) -> None:
        prefix = key + b"="
        size = len(prefix) + SLOT_CHARS + 1
        self._buffers = tuple(ctypes.create_string_buffer(prefix, size) for _ in range(2))
        # Writes through a memoryview are C copies under the GIL (ctypes.memmove would drop it).
        self._views = tuple(memoryview(b).cast("B") for b in self._buffers)
        self._offset = len(prefix)
        self._next = 0
        self._putenv = putenv

    def write(self, raw: bytes) -> bool:
        """Make ``raw`` the variable's value in the C environment; ``False`` (and
        nothing done) if it does not fit or holds a NUL (``os.putenv`` refuses it then)."""
        if len(raw) > SLOT_CHARS or 0 in raw:  # 0: a NUL byte, found by memchr
            return False
        index = self._next
        self._next = index ^ 1
        view, start = self._views[index], self._offset
        end = start + len(raw)
        view[start:end] = raw
        view[end] = 0
        # The buffer itself is the argument: ctypes passes its address with no
        # argtypes to convert through (one ctypes call, a little more than os.putenv).
        if self._putenv(self._buffers[index]):
            raise MemoryError("putenv could not grow the environment")
        return True

    def value_address(self, index: int) -> int:
        """Where buffer ``index``'s value starts (what ``getenv`` returns when it is the entry)."""
        return ctypes.addressof(self._buffers[index]) + self._offset


#: Encoded name -> its owned entry; filled once, never emptied (see :class:`_Slot`).
_SLOTS: dict[bytes, _Slot] = {}


def _libc_environ() -> tuple[Callable[[Any], int], Callable[[bytes], int | None]] | None:
    """The C library's ``putenv`` and ``getenv``, if it shares ``os.putenv``'s
    environment and keeps the pointer ``putenv`` is given, proven on a probe
    variable at import; ``None`` otherwise (then ``os.environ`` is written
    through its public path).

    The functions are called holding the GIL (``ctypes.PyDLL``), as
    ``os.putenv`` runs: no Python thread sees ``os.environ`` and the C
    environment disagree half-way through a write of ours.
    """
    if not ENABLED or os.name != "posix":
        return None
    key = _PROBE.encode()
    try:
        libc = ctypes.PyDLL(None)
        putenv, getenv = libc.putenv, libc.getenv
        putenv.restype = ctypes.c_int  # called with a ctypes buffer: no argtypes needed
        getenv.argtypes, getenv.restype = [ctypes.c_char_p], ctypes.c_void_p
        if getenv(key) is not None:
            return None
        slot = _Slot(key, putenv)
        proven = True
        for index, value in ((0, b"4294967295"), (1, b"7"), (0, b""), (1, b"x" * SLOT_CHARS)):
            proven = proven and slot.write(value)
            address = getenv(key)  # the very buffer, holding the value
            proven = proven and address == slot.value_address(index)
            proven = proven and ctypes.string_at(address) == value
        os.putenv(key, b"from os.putenv")  # Python's setenv: the same environment
        proven = proven and ctypes.string_at(getenv(key)) == b"from os.putenv"
        proven = proven and slot.write(b"12") and getenv(key) == slot.value_address(0)
        os.unsetenv(key)
        proven = proven and getenv(key) is None
        proven = proven and not slot.write(b"x" * (SLOT_CHARS + 1)) and not slot.write(b"1\0")
        proven = proven and getenv(key) is None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            os.unsetenv(key)
    return (putenv, getenv) if proven else None


_PROBE = "DETERMINISTIC_CTX_ENV_PROBE"
_PROBE_VALUE = "probe value é \udcff"  # non-ASCII, and a byte only surrogateescape carries
#: The proven C functions (see :func:`_libc_environ`), or ``None``.
_LIBC = _libc_environ()


def _access(env: MutableMapping[str, str]) -> _Access:
    """The proven path for ``os.environ`` itself, else ``env``'s public API."""
    if ENABLED and type(env) is os._Environ and _proven(env):
        data: dict[Any, Any] = env._data  # type: ignore[attr-defined]
        putenv, unsetenv = os.putenv, os.unsetenv
        slots = _owned_slots(env.encodekey)
        slot_of = slots.get

        def put(key: Any, raw: Any) -> None:
            # The C environment first, then the dict, as os._Environ.__setitem__ does.
            slot = slot_of(key)
            if slot is None or not slot.write(raw):
                putenv(key, raw)
            data[key] = raw

        def delete(key: Any) -> None:
            unsetenv(key)
            data.pop(key, None)

        codecs = env.encodekey, env.encodevalue, env.decodevalue
        return _Access(True, data.get, *codecs, put, delete, bool(slots))
    return _Access(False, env.get, str, str, str, env.__setitem__, env.__delitem__, False)


#: The names written into owned entries: the two whose value is a new seed each time.
OWNED = (HASHSEED, SEED)


def _owned_slots(encodekey: Callable[[str], Any]) -> dict[Any, _Slot]:
    """The owned entries of :data:`OWNED`, by encoded key; empty where the C
    environment's probe failed (or the fast paths are off)."""
    if _LIBC is None:
        return {}
    with _lock:
        for name in OWNED:
            key = encodekey(name)
            if type(key) is not bytes:
                return {}
            if key not in _SLOTS:
                _SLOTS[key] = _Slot(key, _LIBC[0])
        return {key: _SLOTS[key] for key in map(encodekey, OWNED)}


def _proven(env: Any) -> bool:
    """Whether ``env._data`` reads what ``env`` reads, under ``env``'s codecs."""
    data = getattr(env, "_data", None)
    codecs: list[Any] = [
        getattr(env, name, None) for name in ("encodekey", "encodevalue", "decodevalue")
    ]
    if type(data) is not dict or not all(map(callable, codecs)):
        return False
    encodekey, encodevalue, decodevalue = codecs
    try:
        key = encodekey(_PROBE)
        env[_PROBE] = _PROBE_VALUE
        raw = data.get(key)
        proven = raw == encodevalue(_PROBE_VALUE) and decodevalue(raw) == _PROBE_VALUE
        del env[_PROBE]
        proven = proven and data.get(key) is None
        for name in _MANAGED:
            raw = data.get(encodekey(name))
            proven = proven and (None if raw is None else decodevalue(raw)) == env.get(name)
    except Exception:
        return False
    finally:
        env.pop(_PROBE, None)
    return bool(proven)


class EnvironSource(SettingSource):
    """The managed environment variables (:func:`managed_env_vars`) of ``os.environ``.

    Example:
        >>> source = EnvironSource({"PL_GLOBAL_SEED": "7"})
        >>> names, values = source.capture()
        >>> dict(zip(names, values))["PL_GLOBAL_SEED"]
        '7'
    """

    name = "environ"

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._access = access = _access(environ if environ is not None else os.environ)
        #: Whether ``os.environ`` is read and written through its proven C-level dict.
        self.fast = access.fast
        #: Whether ``PYTHONHASHSEED`` and ``DETERMINISTIC_CTX_SEED`` are written into
        #: entries this process owns, so that new seeds do not grow the process.
        self.owned = access.owned
        self.fast_paths = (
            FastPath("os.environ: read and written through its C-level dict", lambda: self.fast),
            FastPath(
                "os.environ: seeds written into entries the process owns (C putenv)",
                lambda: self.owned,
            ),
            FastPath("os.environ: PYTHONHASHSEED's value remembered per seed", lambda: True),
        )
        # (names, their keys): replaced as a whole when a name is registered.
        self._cache: tuple[tuple[str, ...], tuple[Any, ...]] = (_MANAGED, access.keys(_MANAGED))
        self._cublas_key = access.encodekey(CUBLAS)
        self._hash_key = access.encodekey(HASHSEED)
        self._cublas_valid = tuple(map(access.encode, CUBLAS_VALID))
        #: Seed -> ``PYTHONHASHSEED``'s raw value.
        self._hash_values: BoundedCache[int, Any] = BoundedCache(256)

    def capture(self) -> EnvState:
        names, keys = self._cache
        if names is not _MANAGED:  # a name was registered since the last capture
            names = _MANAGED
            keys = self._access.keys(names)
            self._cache = (names, keys)
        return names, tuple(map(self._access.get, keys))

    def apply(self, settings: Settings) -> None:
        if not settings.flags:  # the caller's variables, captured and restored all the same
            return
        access = self._access
        seed = settings.seed
        wanted = self._hash_values.get(seed)
        if wanted is None:
            wanted = access.encode(str(seed))
            self._hash_values.put(seed, wanted)
        if access.get(self._cublas_key) not in self._cublas_valid:
            access.put(self._cublas_key, self._cublas_valid[0])
        if access.get(self._hash_key) != wanted:
            access.put(self._hash_key, wanted)

    def restore(self, state: EnvState) -> None:
        names, saved = state
        access = self._access
        cached, keys = self._cache
        if names is not cached:  # captured before a registration, or loaded from a checkpoint
            keys = access.keys(names)
        now = tuple(map(access.get, keys))
        if now == saved:
            return
        # Write the names whose values differ; one name that fails does not
        # keep the others from being restored.
        rows: Iterable[tuple[Any, Any, Any]]
        if names is _MANAGED and now[2:] == saved[2:]:
            # Only the two a block sets may differ (the common case): no loop
            # over every name.
            rows = ((keys[0], saved[0], now[0]), (keys[1], saved[1], now[1]))
        else:  # only the names that differ, picked in C
            rows = compress(zip(keys, saved, now, strict=True), map(ne, saved, now))
        error: Exception | None = None
        for key, was, is_now in rows:
            if was == is_now:
                continue
            try:
                if was is None:
                    access.delete(key)
                else:
                    access.put(key, was)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def export_state(self, state: EnvState) -> dict[str, Any]:
        """The state as plain data: ``{"set": {name: value}, "unset": [name, ...]}``.

        Every captured name is in exactly one of the two, so a restore knows
        which variables to remove.
        """
        names, saved = state
        decode = self._access.decode
        return {
            "set": {n: decode(v) for n, v in zip(names, saved, strict=True) if v is not None},
            "unset": [n for n, v in zip(names, saved, strict=True) if v is None],
        }

    def import_state(self, data: object, path: str) -> EnvState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        Accepts this version's ``{"set": ..., "unset": ...}`` and the first
        format, ``{name: value}`` of ``CUBLAS_WORKSPACE_CONFIG`` and
        ``PYTHONHASHSEED`` only, an unset one left out (so that file restores
        those two and nothing else).  Every name must be managed here and every
        value must be one the environment can hold: a loaded snapshot restores
        fully or is refused here, never half-way.
        """
        d = _plain.mapping(data, path)
        if "set" in d or "unset" in d:
            d = _plain.fields(d, path, ("set", "unset"))
            values = _plain.mapping(d["set"], f"{path}.set")
            unset = d["unset"]
            if type(unset) is not list:
                raise ValueError(
                    f"{path}.unset: expected a list of names, got a {type(unset).__name__}"
                )
            base = f"{path}.set"
        else:  # format 1
            values = _plain.fields(d, path, (), (CUBLAS, HASHSEED))
            unset = [n for n in (CUBLAS, HASHSEED) if n not in values]
            base = path
        managed = _MANAGED
        captured: dict[str, Any] = {}
        encode = self._access.encode
        for i, name in enumerate(unset):
            self._managed_name(name, f"{path}.unset[{i}]", managed)
            if name in captured:
                raise ValueError(f"{path}.unset[{i}]: {name!r} is listed twice")
            captured[name] = None
        for name, value in values.items():
            self._managed_name(name, f"{base} (a key)", managed)
            raw = encode(_env_text(value, f"{base}.{name}"))
            if name in captured:
                raise ValueError(f"{base}.{name}: {name!r} is also listed as unset")
            captured[name] = raw
        # In capture order; the very tuple of this process when it holds them all,
        # so restoring takes the cached keys.
        names = (
            managed if len(captured) == len(managed) else tuple(n for n in managed if n in captured)
        )
        return names, tuple(captured[n] for n in names)

    @staticmethod
    def _managed_name(value: object, path: str, managed: tuple[str, ...]) -> None:
        name = _env_text(value, path, name=True)
        if name not in managed:
            shown = repr(name) if len(name) <= 60 else f"{name[:57]!r}..."
            raise ValueError(
                f"{path}: {shown} is not an environment variable managed here; "
                f"call register_env_var({shown}) before loading"
            )
