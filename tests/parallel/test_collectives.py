"""Collective determinism: NCCL's variables in blocks and in the report, and real gloo groups.

The promises tested here:

* every NCCL variable that decides how a reduction sums is captured and restored by blocks,
  and never set by them; ``DETERMINISTIC_COLLECTIVES`` holds the recipe's values;
* the report shows the process group, each NCCL variable and what its value means, the
  values NCCL's configuration files give unset ones;
* with a real gloo group: a variable changed after a report saw the group is reported as
  changed late (certain), one set before ``init_process_group`` is not, a new group starts
  a new record; what cannot be known (a change before the first look) is only a note, and
  only for NCCL groups;
* the rules, one by one, from the facts alone: warnings for NCCL groups, notes otherwise.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from deterministic_ctx import DETERMINISTIC_COLLECTIVES, deterministic
from deterministic_ctx.reporting import collectives, report, rules
from deterministic_ctx.reporting.collectives import (
    COLLNET_ALGORITHMS,
    NVLS_ALGORITHMS,
    may_use,
    meaning,
    nccl_env_names,
    observe,
)
from deterministic_ctx.sources import environ as environ_mod
from tests._oracle import ENV_NAMES
from tests.helpers import free_port, needs_gloo, spawn_ranks

#: The NCCL variables that decide the order of a reduction: the leak guard's own list
#: (tests/_oracle.py, written out there, not read from the library), NCCL's part of it.
NCCL_NAMES = tuple(name for name in ENV_NAMES if name.startswith("NCCL_"))
LAUNCH_TIMEOUT = 180.0


def codes(problems: Any) -> dict[str, str]:
    """``{code: level}`` of the NCCL problems."""
    return {p.code: p.level for p in problems if p.code.startswith("nccl")}


def message(problems: Any, code: str) -> str:
    return next(p.message for p in problems if p.code == code)


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """NCCL variables unset, no configuration file, and a report with no memory of earlier
    looks; monkeypatch puts all of it back."""
    for name in (*NCCL_NAMES, "NCCL_CONF_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.nccl.conf
    monkeypatch.setattr(collectives, "_memory", collectives._Memory())
    if any(collectives._config_files(NCCL_NAMES).values()):
        pytest.skip("/etc/nccl.conf sets NCCL variables on this machine")
    return monkeypatch


def init_group(tmp_path: Path, name: str = "store") -> None:
    """A real one-rank gloo group on a file store."""
    dist.init_process_group(
        "gloo",
        init_method=(tmp_path / name).as_uri(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )


@pytest.fixture
def group(clean: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """A gloo group for the test's second half: ``group.start()`` creates it; destroyed after."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed gloo")
    assert not dist.is_initialized()
    try:
        yield clean
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the list, and blocks ---------------------------------------------------------------------


def test_every_nccl_variable_is_managed_with_a_reason():
    reasons = dict(environ_mod.ENV_VARS)
    for name in NCCL_NAMES:
        assert len(reasons[name]) > 20, name
    assert nccl_env_names()[: len(NCCL_NAMES)] == NCCL_NAMES


@pytest.mark.parametrize("name", NCCL_NAMES)
def test_blocks_restore_nccl_variables_and_never_set_them(clean, name):
    clean.setenv(name, "before")
    with deterministic(seed=1):
        assert os.environ[name] == "before"  # a block does not set it
        os.environ[name] = "inside"
    assert os.environ[name] == "before"
    clean.delenv(name)
    with deterministic(seed=1):
        os.environ[name] = "inside"
    assert name not in os.environ


def test_the_recipe_values():
    assert dict(DETERMINISTIC_COLLECTIVES) == {
        "NCCL_ALGO": "Ring",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_COLLNET_ENABLE": "0",
    }
    with pytest.raises(TypeError):
        DETERMINISTIC_COLLECTIVES["NCCL_ALGO"] = "Tree"  # type: ignore[index]
    # Every value rules out NCCL's in-network reductions on its own.
    assert not may_use(DETERMINISTIC_COLLECTIVES["NCCL_ALGO"], NVLS_ALGORITHMS | COLLNET_ALGORITHMS)


# --- what values mean ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algo", "nvls", "collnet"),
    [
        (None, True, True),
        ("", True, True),
        ("Ring", False, False),
        ("ring,tree", False, False),
        ("NVLS", True, False),
        ("^NVLS,NVLSTree", False, True),
        ("^nvls", True, True),  # NVLSTree is left
        ("^CollnetDirect,CollnetChain", True, False),
        ("Collnet", False, True),  # the name before 2.14
        ("ring;allreduce:nvls", True, False),  # 2.24+: per collective
        ("ring;allreduce:^tree", True, True),
        ("ring;broadcast:nvls", False, False),  # a broadcast only copies
        ("allreduce:ring;broadcast:ring", True, True),  # ReduceScatter keeps NCCL's default
        ("AllReduce:Ring;ReduceScatter:Ring;Reduce:Ring", False, False),
    ],
)
def test_which_algorithms_nccl_algo_allows(algo, nvls, collnet):
    assert may_use(algo, NVLS_ALGORITHMS) is nvls
    assert may_use(algo, COLLNET_ALGORITHMS) is collnet


@given(st.lists(st.sampled_from(["ring", "tree", "nvls", "nvlstree", "pat"]), max_size=5))
def test_an_exclusion_list_allows_exactly_what_it_does_not_name(names):
    value = "^" + ",".join(names)
    for algorithm in ("ring", "tree", "nvls", "nvlstree", "pat"):
        assert may_use(value, frozenset({algorithm})) is (algorithm not in names or not names)
        assert may_use(",".join(names), frozenset({algorithm})) is (algorithm in names or not names)


def test_every_variable_has_a_meaning_for_unset_and_set():
    for name in NCCL_NAMES:
        unset, chosen = meaning(name, None), meaning(name, "7")
        assert unset and chosen and unset != chosen, name
    assert meaning("NCCL_NVLS_ENABLE", "0") == "NVLink SHARP off"
    assert "default" in meaning("NCCL_NVLS_ENABLE", None)
    assert "in the switch" in meaning("NCCL_NVLS_ENABLE", "1")
    assert meaning("NCCL_COLLNET_ENABLE", "1").startswith("CollNet on")
    assert meaning("NCCL_ALGO", "^NVLS") == "every algorithm but NVLS"
    assert "per collective" in meaning("NCCL_ALGO", "allreduce:ring")
    assert meaning("NCCL_TUNER_PLUGIN", "none") == "NCCL's built-in model"
    assert meaning("NCCL_MY_OWN", None) == "registered with register_env_var"


def test_configuration_files_fill_only_unset_variables(clean, tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_bytes(
        b"# a comment\nNCCL_ALGO=Tree\nNCCL_DEBUG=WARN\nNCCL_PROTO=LL\r\n"
        b"NCCL_NVLS_ENABLE=1\nNCCL_ALGO=Ring\nnot a setting\nNCCL_COLLNET_ENABLE==1\n"
    )
    clean.setenv("NCCL_CONF_FILE", str(conf))
    clean.setenv("NCCL_PROTO", "Simple")  # the environment wins over the file
    facts = report().collectives
    assert facts["config_files"][str(conf)] == {
        "NCCL_ALGO": "Tree",  # NCCL: the first line that sets a name wins
        "NCCL_PROTO": "LL",
        "NCCL_NVLS_ENABLE": "1",
        "NCCL_COLLNET_ENABLE": "=1",  # everything after the first "=", as NCCL reads it
    }
    assert facts["env"]["NCCL_ALGO"] is None
    assert facts["effective"]["NCCL_ALGO"] == "Tree"
    assert facts["effective"]["NCCL_PROTO"] == "Simple"
    assert facts["meaning"]["NCCL_ALGO"] == f"only Tree ({conf})"
    assert facts["meaning"]["NCCL_PROTO"] == "only Simple"


def test_the_report_shows_the_section(clean):
    clean.setenv("NCCL_ALGO", "Ring")
    r = report()
    data = r.to_dict()["collectives"]
    assert data["process_group"] == {"initialized": False, "available": dist.is_available()}
    assert data["env"]["NCCL_ALGO"] == "Ring" and data["meaning"]["NCCL_ALGO"] == "only Ring"
    assert data["nccl_available"] is (dist.is_available() and dist.is_nccl_available())
    assert data["env_before_use"] is None and data["env_first_seen_in_use"] is None
    text = str(r)
    # Columns are as wide as the longest name shown (all of them where NCCL is built in).
    assert re.search(r"\nCollectives\n  process group +not initialized\n", text)
    assert re.search(r"\n  NCCL_ALGO +Ring: only Ring\n", text)


# --- real gloo groups, in this process ---------------------------------------------------------


def test_set_before_init_and_seen_before_init_is_no_problem(group, tmp_path):
    group.setenv("NCCL_ALGO", "Ring")
    report()  # a look before the group
    init_group(tmp_path)
    r = report()
    facts = r.collectives
    assert facts["process_group"]["initialized"] is True
    assert facts["process_group"]["backend"] == "gloo"
    assert facts["process_group"]["uses_nccl"] is False
    assert facts["process_group"]["nccl_communicators"] is None
    assert (facts["process_group"]["rank"], facts["process_group"]["world_size"]) == (0, 1)
    assert facts["env_before_use"]["source"].startswith("a look before NCCL read them")
    assert facts["env_before_use"]["env"]["NCCL_ALGO"] == "Ring"
    assert facts["env_first_seen_in_use"]["NCCL_ALGO"] == "Ring"
    assert codes(r.problems) == {}
    assert "gloo (cpu:gloo,cuda:gloo), rank 0 of 1" in str(r)


def test_observe_stands_for_a_report_before_init(group, tmp_path):
    group.setenv("NCCL_ALGO", "Ring")
    observe()
    init_group(tmp_path)
    facts = report().collectives
    assert facts["env_before_use"]["env"]["NCCL_ALGO"] == "Ring"
    assert facts["env_before_use"]["source"].endswith("(report() or observe())")


def test_set_after_init_is_reported_as_late(group, tmp_path):
    init_group(tmp_path)
    first = report()  # the first look at the group
    assert codes(first.problems) == {}
    group.setenv("NCCL_ALGO", "Tree")
    group.setenv("NCCL_NVLS_ENABLE", "0")
    late = report()
    assert late.collectives["env_first_seen_in_use"]["NCCL_ALGO"] is None
    # gloo does not use NCCL: a note; an NCCL group gets a warning (see the rules below).
    assert codes(late.problems) == {"nccl-env-late": "note"}
    text = message(late.problems, "nccl-env-late")
    assert "NCCL_ALGO (unset then, 'Tree' now)" in text
    assert "NCCL_NVLS_ENABLE (unset then, '0' now)" in text
    assert "backend 'gloo' does not use NCCL" in text
    # Undone: nothing to say any more (a change undone between two looks goes unseen).
    group.delenv("NCCL_ALGO")
    group.delenv("NCCL_NVLS_ENABLE")
    assert codes(report().problems) == {}


def test_a_new_group_starts_a_new_record(group, tmp_path):
    report()
    init_group(tmp_path, "first")
    report()
    dist.destroy_process_group()
    group.setenv("NCCL_ALGO", "Ring")  # between two groups: before the second one
    init_group(tmp_path, "second")
    r = report()
    assert r.collectives["env_first_seen_in_use"]["NCCL_ALGO"] == "Ring"
    assert "nccl-env-late" not in codes(r.problems)
    # Before the second group, the latest look was made before the first one.
    assert r.collectives["env_before_use"]["env"]["NCCL_ALGO"] is None


def test_set_in_process_before_the_first_look_cannot_be_placed(group, tmp_path):
    # No report before init: the report knows only the environment at process start.
    group.setenv("NCCL_ALGO", "Ring")
    init_group(tmp_path)
    r = report()
    before = r.collectives["env_before_use"]
    if before is None:  # not Linux: nothing to compare with, nothing is claimed
        assert r.process["env_at_start"] is None
        return
    assert before["source"] == "the environment the process started with"
    assert before["env"]["NCCL_ALGO"] is None
    assert r.collectives["env_first_seen_in_use"]["NCCL_ALGO"] == "Ring"
    # Changed at a time the report cannot place, and gloo does not use NCCL: no problem.
    assert codes(r.problems) == {}
    nccl = {**r.collectives, "process_group": {**r.collectives["process_group"], "uses_nccl": True}}
    assert codes(problems(nccl)) == {"nccl-env-changed": "note"}


# --- the rules, from the facts alone ---------------------------------------------------------


def facts(
    *,
    env: dict[str, str | None] | None = None,
    seen: dict[str, str | None] | None = None,
    before: dict[str, str | None] | None = None,
    backend: str | None = "nccl",
    communicators: bool | None = True,
    available: bool = True,
    files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Collectives facts: NCCL variables ``env`` now (the others unset), ``seen`` when the group
    was first seen, ``before`` at the last look before it; ``backend`` ``None``: no group."""
    names = dict.fromkeys(NCCL_NAMES)
    now = {**names, **(env or {})}
    group: dict[str, Any] = {"initialized": False, "available": True}
    if backend is not None:
        nccl = "nccl" in backend
        group = {
            "initialized": True,
            "available": True,
            "backend": backend,
            "backend_config": backend,
            "rank": 0,
            "world_size": 2,
            "uses_nccl": nccl,
            "nccl_communicators": communicators if nccl else None,
        }
    return {
        "process_group": group,
        "nccl_available": available,
        "env": now,
        "effective": {n: now[n] if now[n] is not None else (files or {}).get(n) for n in now},
        "env_before_use": None
        if before is None or backend is None
        else {"source": "a look", "env": {**names, **before}},
        "env_first_seen_in_use": None if seen is None or backend is None else {**names, **seen},
    }


def problems(collectives_facts: dict[str, Any]) -> tuple[Any, ...]:
    return rules.problems(
        flags={
            "deterministic_algorithms": True,
            "deterministic_warn_only": False,
            "fill_uninitialized_memory": True,
            "cudnn_benchmark": False,
            "cudnn_deterministic": True,
            "float32_matmul_precision": "highest",
            "inductor_deterministic": None,
        },
        env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"},
        startup_env=None,
        cuda={"built": False, "initialized": False, "bad_fork": False},
        start_method="fork",
        rngs=(),
        collectives=collectives_facts,
    )


SAFE = dict(DETERMINISTIC_COLLECTIVES)


def test_a_recipe_setup_has_no_problems():
    assert codes(problems(facts(env=SAFE, seen=SAFE, before=SAFE))) == {}
    assert codes(problems(facts(env=SAFE, seen=SAFE, backend=None))) == {}
    assert codes(problems({})) == {}  # a report without the section: no claim


def test_late_changes_are_warnings_for_nccl_groups():
    late = problems(facts(env={**SAFE, "NCCL_ALGO": "Tree"}, seen=SAFE))
    assert codes(late) == {"nccl-env-late": "warning"}
    text = message(late, "nccl-env-late")
    assert text.startswith("NCCL_ALGO ('Ring' then, 'Tree' now): changed after the process")
    assert "NCCL_ALGO will reach communicators created from now on" in text
    # Read once per process: the change has no effect at all.
    cached = problems(facts(env={**SAFE, "NCCL_BUFFSIZE": "1024"}, seen=SAFE))
    assert "once per process" in message(cached, "nccl-env-late")
    # Unknown whether the communicators exist: still a warning.
    unknown = problems(facts(env={**SAFE, "NCCL_ALGO": "Tree"}, seen=SAFE, communicators=None))
    assert codes(unknown) == {"nccl-env-late": "warning"}


def test_looks_before_the_first_collective_count_as_looks_before_use(clean):
    """An NCCL group's communicators are created at its first collective (unless
    ``init_process_group`` had a ``device_id``): until then NCCL has read nothing."""

    class Group:  # stands for a process group: only its identity counts
        pass

    group, other = Group(), Group()
    remember = collectives._remember
    assert remember(None, False, {"NCCL_ALGO": None}) == ({"NCCL_ALGO": None}, None)
    # Started, communicators not created: a look before use.
    assert remember(group, False, {"NCCL_ALGO": "Ring"}) == ({"NCCL_ALGO": "Ring"}, None)
    # The first look in use keeps the values it saw; later looks change nothing.
    assert remember(group, True, {"NCCL_ALGO": "Ring"})[1] == {"NCCL_ALGO": "Ring"}
    before, in_use = remember(group, True, {"NCCL_ALGO": "Tree"})
    assert (before, in_use) == ({"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Ring"})
    # Another group: its own record, the latest look before use kept.
    assert remember(other, True, {"NCCL_ALGO": "Tree"}) == (
        {"NCCL_ALGO": "Ring"},
        {"NCCL_ALGO": "Tree"},
    )
    # A group with communicators not created yet gives no facts to judge: no problem.
    assert codes(problems(facts(env={**SAFE, "NCCL_ALGO": "Tree"}, communicators=False))) == {}


def test_late_changes_to_a_gloo_group_are_notes():
    gloo = problems(facts(env={"NCCL_ALGO": "Tree"}, seen={}, backend="gloo"))
    assert codes(gloo) == {"nccl-env-late": "note"}
    mixed = problems(facts(env={"NCCL_ALGO": "Tree"}, seen={}, backend="cpu:gloo,cuda:nccl"))
    assert codes(mixed)["nccl-env-late"] == "warning"


def test_changes_that_cannot_be_placed_are_notes_for_nccl_groups_only():
    unplaced = problems(facts(env=SAFE, seen=SAFE, before={}))
    assert codes(unplaced) == {"nccl-env-changed": "note"}
    text = message(unplaced, "nccl-env-changed")
    assert "NCCL_ALGO (unset then, 'Ring' when a report first saw the group using NCCL)" in text
    assert "since a look" in text
    assert codes(problems(facts(env=SAFE, seen=SAFE, before={}, backend="gloo"))) == {}


def test_nvls_rules():
    # NCCL's default on an NCCL group: a note; no group, or no NCCL at all: nothing.
    assert codes(problems(facts(env={}, seen={}))) == {"nccl-nvls": "note"}
    assert codes(problems(facts(env={}, backend=None))) == {}
    assert codes(problems(facts(env={}, seen={}, backend="gloo"))) == {}
    # Asked for where NCCL exists: a warning, with or without a group.
    for env in ({"NCCL_NVLS_ENABLE": "1"}, {"NCCL_ALGO": "NVLS,Ring"}):
        assert codes(problems(facts(env=env, backend=None))) == {"nccl-nvls": "warning"}
        assert codes(problems(facts(env=env, backend=None, available=False))) == {}
    # Ruled out either way.
    for env in ({"NCCL_NVLS_ENABLE": "0"}, {"NCCL_NVLS_ENABLE": "1", "NCCL_ALGO": "Ring"}):
        assert codes(problems(facts(env=env, seen=env))) == {}
    # A configuration file counts where the environment leaves it unset.
    from_file = facts(env={}, backend=None, files={"NCCL_NVLS_ENABLE": "1"})
    assert codes(problems(from_file)) == {"nccl-nvls": "warning"}


def test_collnet_rules():
    on = {"NCCL_COLLNET_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    assert codes(problems(facts(env=on, backend=None))) == {"nccl-collnet": "warning"}
    assert codes(problems(facts(env={**on, "NCCL_ALGO": "Ring"}, backend=None))) == {}
    assert codes(problems(facts(env=on, backend=None, available=False))) == {}
    file_on = facts(env={"NCCL_NVLS_ENABLE": "0"}, backend=None, files={"NCCL_COLLNET_ENABLE": "1"})
    assert codes(problems(file_on)) == {"nccl-collnet": "warning"}


# --- two real ranks --------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One rank: a variable set before init (seen by a report then), one set after init."""
    from deterministic_ctx.reporting import report as rank_report

    os.environ["NCCL_ALGO"] = "Ring"
    rank_report()  # a look before the group
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        at_start = rank_report()
        total = torch.ones(1) * (rank + 1)
        dist.all_reduce(total)
        os.environ["NCCL_PROTO"] = "Simple"  # after the group started
        late = rank_report()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {
        "start": codes(at_start.problems),
        "late": codes(late.problems),
        "late_message": message(late.problems, "nccl-env-late"),
        "group": late.collectives["process_group"],
        "sum": total.item(),
    }
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


@needs_gloo
@pytest.mark.slow
def test_two_ranks_tell_values_set_before_from_values_set_after(tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    args = (2, free_port(), str(out))
    results = spawn_ranks(_rank_main, args, 2, out, timeout=LAUNCH_TIMEOUT, what="the ranks")
    for rank, result in enumerate(results):
        assert result["start"] == {}
        assert result["late"] == {"nccl-env-late": "note"}
        assert result["late_message"].startswith("NCCL_PROTO (unset then, 'Simple' now)")
        assert "NCCL_ALGO" not in result["late_message"]
        assert result["group"]["rank"] == rank and result["group"]["world_size"] == 2
        assert result["sum"] == 3.0


# --- a real NCCL group ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA device and NCCL",
)
def test_a_real_nccl_group(group, tmp_path):
    group.setenv("NCCL_ALGO", "Ring")
    report()  # before the group
    dist.init_process_group("nccl", init_method=(tmp_path / "nccl").as_uri(), rank=0, world_size=1)
    started = report()
    pg = started.collectives["process_group"]
    assert (pg["backend"], pg["uses_nccl"], pg["nccl_communicators"]) == ("nccl", True, False)
    assert started.collectives["nccl_version"]
    # After init_process_group, before the first collective: NCCL has read nothing yet.
    group.setenv("NCCL_PROTO", "Simple")
    assert codes(report().problems) == {}
    torch.cuda.set_device(0)
    total = torch.ones(4, device="cuda")
    dist.all_reduce(total)
    torch.cuda.synchronize()
    in_use = report()
    assert in_use.collectives["process_group"]["nccl_communicators"] is True
    assert in_use.collectives["env_first_seen_in_use"]["NCCL_PROTO"] == "Simple"
    assert codes(in_use.problems) == {}
    group.setenv("NCCL_ALGO", "Tree")
    late = report()
    assert codes(late.problems) == {"nccl-env-late": "warning"}
    assert "NCCL_ALGO ('Ring' then, 'Tree' now)" in message(late.problems, "nccl-env-late")
