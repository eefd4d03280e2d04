"""Environment variables: every one that decides seeding or determinism is captured and restored.

The promises tested here:

* each name of ``ENV_VARS`` set, changed or removed inside a block is as before after it, and
  only ``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED`` are changed on entry;
* ``register_env_var`` adds a name (validated, idempotent); a snapshot taken before restores only
  what it captured;
* the fast reader of ``os.environ`` reads exactly what the public API reads, raw bytes included;
* state dicts: this version's format round-trips, the first format (two names, unset left out)
  still loads, and every name and value is checked at load, so a loaded snapshot restores fully
  or is refused with ``InvalidSnapshotError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import deterministic_ctx
from deterministic_ctx import InvalidSnapshotError, Snapshot, deterministic
from deterministic_ctx.base import fast_paths as _memory
from deterministic_ctx.base.settings import Settings
from deterministic_ctx.sources import environ as environ_mod
from deterministic_ctx.sources.environ import EnvironSource
from deterministic_ctx.state import checkpoint
from tests._oracle import ENV_NAMES

#: Every name blocks must manage: the suite guard's own list, written out there
#: independently of the library (the issue's names and the ecosystem's others).
REQUIRED = ENV_NAMES
#: Names only captured and restored, never changed by a block.
PASSIVE = REQUIRED[2:]
SET_ON_ENTRY = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")
# A value only surrogateescape carries (the bytes b"\xff\xfe" are not UTF-8).
UNDECODABLE = os.fsdecode(b"seed\xff\xfe")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Every required name starts unset; monkeypatch puts the session's values back."""
    for name in REQUIRED:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def live_state() -> Iterator[None]:
    """For tests that restore loaded snapshots: the live state is put back after them,
    whatever a loaded snapshot held, since this file tests the environment only."""
    snapshot = Snapshot.capture()
    yield
    snapshot.restore()


def env_of(names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


# --- the list -----------------------------------------------------------------------------------


def test_the_list_holds_every_required_name_with_a_reason():
    names = [name for name, _ in environ_mod.ENV_VARS]
    assert len(names) == len(set(names))
    assert set(REQUIRED) <= set(names)
    assert names[:2] == list(SET_ON_ENTRY)
    for name, reason in environ_mod.ENV_VARS:
        assert isinstance(reason, str) and len(reason) > 10, name


def test_managed_env_vars_is_public_and_read_only():
    managed = deterministic_ctx.managed_env_vars()
    assert isinstance(managed, tuple)
    assert managed[: len(environ_mod.ENV_VARS)] == tuple(n for n, _ in environ_mod.ENV_VARS)
    assert {"managed_env_vars", "register_env_var"} <= set(deterministic_ctx.__all__)
    assert deterministic_ctx.register_env_var is environ_mod.register_env_var


# --- blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED)
@pytest.mark.parametrize("before", [None, "0", UNDECODABLE], ids=["unset", "set", "raw-bytes"])
@pytest.mark.parametrize("inside", [None, "1", "changed é"], ids=["removed", "one", "changed"])
def test_every_name_is_restored_after_a_block(clean_env, name, before, inside):
    if before is not None:
        clean_env.setenv(name, before)
    raw_before = os.environb.get(os.fsencode(name))
    with deterministic(seed=5):
        if inside is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = inside
    assert os.environ.get(name) == before
    assert os.environb.get(os.fsencode(name)) == raw_before  # the very bytes


def test_a_block_changes_only_the_two_names_it_sets(clean_env):
    clean_env.setenv("PL_GLOBAL_SEED", "77")
    clean_env.setenv("CUDA_LAUNCH_BLOCKING", "0")
    before = dict(os.environ)
    with deterministic(seed=9):
        inside = dict(os.environ)
        assert inside["PYTHONHASHSEED"] == "9"
        assert inside["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert {k: v for k, v in inside.items() if k not in SET_ON_ENTRY} == before
    assert dict(os.environ) == before


def test_every_name_at_once_set_and_removed_in_one_block(clean_env):
    for i, name in enumerate(PASSIVE[::2]):
        clean_env.setenv(name, f"v{i}")
    before = dict(os.environ)
    with deterministic(seed=1):
        for name in PASSIVE:
            if name in os.environ:
                del os.environ[name]
            else:
                os.environ[name] = "inside"
    assert dict(os.environ) == before


def test_nested_blocks_and_snapshots_restore_each_level(clean_env):
    with deterministic(seed=1):
        os.environ["PL_GLOBAL_SEED"] = "1"
        snap = Snapshot.capture()
        with deterministic(seed=2):
            os.environ["PL_GLOBAL_SEED"] = "2"
            os.environ["NCCL_ALGO"] = "Tree"
        assert env_of(("PL_GLOBAL_SEED", "NCCL_ALGO")) == {"PL_GLOBAL_SEED": "1", "NCCL_ALGO": None}
        os.environ["PL_GLOBAL_SEED"] = "3"
        snap.restore()
        assert os.environ["PL_GLOBAL_SEED"] == "1"
    assert "PL_GLOBAL_SEED" not in os.environ


# --- register_env_var ---------------------------------------------------------------------------


@pytest.mark.usefixtures("registry")
def test_a_registered_name_is_restored(monkeypatch):
    name = "DCTX_TEST_MY_SEED"
    monkeypatch.delenv(name, raising=False)
    deterministic_ctx.register_env_var(name)
    assert deterministic_ctx.managed_env_vars()[-1] == name
    with deterministic(seed=0):
        assert name not in os.environ  # only captured, never set
        os.environ[name] = "42"
    assert name not in os.environ
    monkeypatch.setenv(name, "7")
    with deterministic(seed=0):
        del os.environ[name]
    assert os.environ[name] == "7"


@pytest.mark.usefixtures("registry")
def test_registering_twice_is_a_no_op():
    deterministic_ctx.register_env_var("DCTX_TEST_TWICE")
    once = deterministic_ctx.managed_env_vars()
    deterministic_ctx.register_env_var("DCTX_TEST_TWICE")
    deterministic_ctx.register_env_var("PL_GLOBAL_SEED")  # a built-in name
    assert deterministic_ctx.managed_env_vars() is once
    assert once.count("DCTX_TEST_TWICE") == 1


@pytest.mark.usefixtures("registry")
@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        (b"BYTES", TypeError, "must be a str"),
        (None, TypeError, "must be a str"),
        (3, TypeError, "must be a str"),
        ("", ValueError, "empty"),
        ("A=B", ValueError, "'='"),
        ("A\0B", ValueError, "NUL"),
        ("\ud800", ValueError, "cannot be encoded"),
    ],
)
def test_register_env_var_validates(name, error, match):
    before = deterministic_ctx.managed_env_vars()
    with pytest.raises(error, match=match):
        deterministic_ctx.register_env_var(name)
    assert deterministic_ctx.managed_env_vars() is before


@pytest.mark.usefixtures("live_state")
@pytest.mark.usefixtures("registry")
def test_a_snapshot_from_before_a_registration_restores_only_what_it_captured(monkeypatch):
    name = "DCTX_TEST_LATE"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    early = Snapshot.capture()
    early_state = early.state_dict()
    deterministic_ctx.register_env_var(name)
    monkeypatch.setenv(name, "set after the snapshot")
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    early.restore()
    assert os.environ[name] == "set after the snapshot"  # never captured: untouched
    assert "PL_GLOBAL_SEED" not in os.environ
    # The same through a state dict taken before the registration.
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    Snapshot.from_state_dict(early_state).restore()
    assert os.environ[name] == "set after the snapshot"
    assert "PL_GLOBAL_SEED" not in os.environ
    # A snapshot taken now captures it.
    late = Snapshot.capture()
    os.environ[name] = "changed"
    late.restore()
    assert os.environ[name] == "set after the snapshot"


# --- the fast reader ----------------------------------------------------------------------------


def test_fast_reader_is_proven_for_os_environ_and_reads_raw_values(clean_env):
    access = environ_mod._access(os.environ)
    assert access.fast is _memory.ENABLED  # proven on this platform, unless switched off
    if access.fast:
        assert access.get.__self__ is os.environ._data
    key = access.encodekey("PL_GLOBAL_SEED")
    for value in ("", ":16:8", "ünïcode", UNDECODABLE):
        clean_env.setenv("PL_GLOBAL_SEED", value)
        assert access.decode(access.get(key)) == os.environ["PL_GLOBAL_SEED"] == value
        assert access.get(key) == access.encode(value)
    clean_env.delenv("PL_GLOBAL_SEED")
    assert access.get(key) is None
    assert not environ_mod._access({}).fast  # any other mapping: its own get


def test_capture_does_not_read_the_whole_environment():
    # A capture reads one entry per managed name, never the environment's other variables.
    source = EnvironSource()
    reads: list[object] = []
    data = os.environ._data

    class Counting(dict):
        def get(self, key, default=None):
            reads.append(key)
            return dict.get(self, key, default)

    source._access = source._access._replace(get=Counting(data).get)
    names, values = source.capture()
    assert len(reads) == len(names) == len(values) == len(deterministic_ctx.managed_env_vars())


# --- the source with any mapping ----------------------------------------------------------------


def test_source_on_a_plain_mapping():
    env = {"PL_GLOBAL_SEED": "1", "OTHER": "x"}
    source = EnvironSource(env)
    state = source.capture()
    source.apply(Settings(4, False))
    env["PL_GLOBAL_SEED"] = "2"
    env["NCCL_PROTO"] = "LL"
    env["OTHER"] = "y"  # not managed: the block leaves it
    source.restore(state)
    assert env == {"PL_GLOBAL_SEED": "1", "OTHER": "y"}


def test_restore_puts_back_every_other_name_when_one_write_fails():
    class Refusing(dict):
        def __setitem__(self, key, value):
            if key == "NCCL_ALGO":
                raise OSError("refused")
            dict.__setitem__(self, key, value)

    env = Refusing()
    dict.update(env, {"NCCL_ALGO": "Ring", "PL_GLOBAL_SEED": "1"})
    source = EnvironSource(env)
    state = source.capture()
    dict.update(env, {"NCCL_ALGO": "Tree", "PL_GLOBAL_SEED": "2", "NCCL_PROTO": "LL"})
    with pytest.raises(OSError, match="refused"):
        source.restore(state)
    assert env == {"NCCL_ALGO": "Tree", "PL_GLOBAL_SEED": "1"}


# --- state dicts ---------------------------------------------------------------------------------


def test_state_dict_names_every_captured_variable(clean_env):
    clean_env.setenv("PL_GLOBAL_SEED", "3")
    clean_env.setenv("NCCL_ALGO", UNDECODABLE)
    entry = Snapshot.capture().state_dict()["sources"]["environ"]
    assert set(entry) == {"set", "unset"}
    assert entry["set"]["PL_GLOBAL_SEED"] == "3"
    assert entry["set"]["NCCL_ALGO"] == UNDECODABLE
    assert set(entry["set"]) | set(entry["unset"]) == set(deterministic_ctx.managed_env_vars())
    assert not set(entry["set"]) & set(entry["unset"])


@pytest.mark.usefixtures("live_state")
def test_state_dict_and_file_round_trip_restore_every_name(clean_env, tmp_path):
    clean_env.setenv("PL_GLOBAL_SEED", "3")
    clean_env.setenv("NCCL_ALGO", UNDECODABLE)
    before = dict(os.environ)
    snap = Snapshot.capture()
    snap.save(tmp_path / "env.snap")
    state = snap.state_dict()
    for load in (
        lambda: Snapshot.from_state_dict(state),
        lambda: Snapshot.load(tmp_path / "env.snap"),
    ):
        os.environ["PL_GLOBAL_SEED"] = "changed"
        os.environ["PL_SEED_WORKERS"] = "1"
        del os.environ["NCCL_ALGO"]
        load().restore()
        assert dict(os.environ) == before


def _with_environ(entry: object) -> dict:
    state = Snapshot.capture().state_dict()
    state["sources"]["environ"] = entry
    return state


@pytest.mark.usefixtures("live_state")
@pytest.mark.parametrize(
    "entry",
    [{}, {"PYTHONHASHSEED": "4"}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "PYTHONHASHSEED": "random"}],
    ids=["both-unset", "one-set", "both-set"],
)
def test_the_first_format_still_loads_and_restores_only_its_two_names(clean_env, tmp_path, entry):
    clean_env.setenv("PL_GLOBAL_SEED", "kept")
    state = _with_environ(entry)
    for load in (
        lambda: Snapshot.from_state_dict(state),
        lambda: _load_file(state, tmp_path),
    ):
        clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":1:1")
        clean_env.setenv("PYTHONHASHSEED", "99")
        load().restore()
        assert env_of(SET_ON_ENTRY) == {n: entry.get(n) for n in SET_ON_ENTRY}
        assert os.environ["PL_GLOBAL_SEED"] == "kept"  # not in that format: left alone


def _load_file(state: dict, directory) -> Snapshot:
    path = directory / "crafted.snap"
    checkpoint.write(path, checkpoint.encode(state))
    return Snapshot.load(path)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # The case: every other check passed, then restore() raised.
        ({"PYTHONHASHSEED": "\ud800"}, r"sources\.environ\.PYTHONHASHSEED: .*cannot be encoded"),
        ({"set": {"PYTHONHASHSEED": "\ud800"}, "unset": []}, "cannot be encoded"),
        ({"set": {"PL_GLOBAL_SEED": "a\0b"}, "unset": []}, r"environ\.set\.PL_GLOBAL_SEED: .*NUL"),
        ({"set": {"PL_GLOBAL_SEED": 3}, "unset": []}, "expected a string"),
        ({"set": {"PL_GLOBAL_SEED": "x" * (2 << 20)}, "unset": []}, "at most"),
        ({"set": {"LD_PRELOAD": "x.so"}, "unset": []}, r"'LD_PRELOAD' is not .*register_env_var"),
        ({"set": {}, "unset": ["PATH"]}, "'PATH' is not an environment variable managed here"),
        ({"set": {}, "unset": ["A=B"]}, r"unset\[0\]: .*'='"),
        ({"set": {}, "unset": [""]}, "empty"),
        ({"set": {}, "unset": [7]}, r"unset\[0\]: expected a string"),
        ({"set": {}, "unset": ["NCCL_ALGO", "NCCL_ALGO"]}, "listed twice"),
        ({"set": {"NCCL_ALGO": "Ring"}, "unset": ["NCCL_ALGO"]}, "also listed as unset"),
        ({"set": [], "unset": []}, r"environ\.set: expected a dict"),
        ({"set": {}, "unset": "NCCL_ALGO"}, r"environ\.unset: expected a list"),
        ({"set": {}}, "missing field"),
        ({"set": {}, "unset": [], "more": 1}, "unexpected field"),
        ({"PYTHONHASHSEED": "1", "PL_GLOBAL_SEED": "2"}, "unexpected field"),
        ({"PYTHONHASHSEED": None}, "expected a string"),
        ([], r"sources\.environ: expected a dict"),
    ],
)
def test_bad_entries_are_refused_at_load(tmp_path, entry, message):
    state = _with_environ(entry)
    with pytest.raises(InvalidSnapshotError, match=message):
        Snapshot.from_state_dict(state)
    if len(str(entry)) < 1000:
        with pytest.raises(InvalidSnapshotError, match=message):
            _load_file(state, tmp_path)


@pytest.mark.usefixtures("live_state")
@pytest.mark.usefixtures("registry")
def test_a_registered_name_loads_only_where_it_is_registered(monkeypatch):
    name = "DCTX_TEST_SAVED"
    monkeypatch.setenv(name, "saved")
    deterministic_ctx.register_env_var(name)
    state = Snapshot.capture().state_dict()
    assert state["sources"]["environ"]["set"][name] == "saved"
    os.environ[name] = "changed"
    Snapshot.from_state_dict(state).restore()
    assert os.environ[name] == "saved"
    monkeypatch.setattr(environ_mod, "_MANAGED", tuple(n for n, _ in environ_mod.ENV_VARS))
    with pytest.raises(InvalidSnapshotError, match=f"register_env_var\\('{name}'\\)"):
        Snapshot.from_state_dict(state)


#: The NCCL names added after the first release of the list (reasons in ``ENV_VARS``).
LATER_NCCL = (
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_BUFFSIZE",
    "NCCL_TOPO_FILE",
    "NCCL_TUNER_PLUGIN",
)


@pytest.mark.usefixtures("live_state")
def test_a_state_saved_before_the_later_nccl_names_loads_and_leaves_them_alone(clean_env):
    clean_env.setenv("NCCL_ALGO", "Ring")
    state = Snapshot.capture().state_dict()
    entry = state["sources"]["environ"]
    assert set(LATER_NCCL) <= set(entry["unset"])
    # What the version before them wrote: the same format, without those names.
    entry["unset"] = [n for n in entry["unset"] if n not in LATER_NCCL]
    for name in LATER_NCCL:
        clean_env.setenv(name, "kept")
    clean_env.setenv("NCCL_ALGO", "Tree")
    Snapshot.from_state_dict(state).restore()
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert env_of(LATER_NCCL) == dict.fromkeys(LATER_NCCL, "kept")
    # A snapshot of this version restores them too.
    snap = Snapshot.capture()
    for name in LATER_NCCL:
        os.environ[name] = "changed"
    snap.restore()
    assert env_of(LATER_NCCL) == dict.fromkeys(LATER_NCCL, "kept")
