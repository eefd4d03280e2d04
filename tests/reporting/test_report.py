"""report(): the determinism setup of the process, and warnings for known problems."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from deterministic_ctx import (
    Snapshot,
    deterministic,
    managed_env_vars,
    register_env_var,
    register_rng,
    seed_everything,
    unregister_rng,
)
from deterministic_ctx.reporting import DeterminismReport, Problem, RngStatus, report, rules
from deterministic_ctx.reporting.facts import startup_env
from deterministic_ctx.sources import environ as environ_mod
from tests.helpers import cuda_initialized_after, run_python


def codes(r: DeterminismReport | tuple[Problem, ...]) -> set[str]:
    problems = r.problems if isinstance(r, DeterminismReport) else r
    return {p.code for p in problems}


def rng(r: DeterminismReport, name: str) -> RngStatus:
    return next(s for s in r.rngs if s.name == name)


def test_structure_json_and_text():
    r = report()
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {
        "versions",
        "in_block",
        "flags",
        "env",
        "rngs",
        "cuda",
        "process",
        "problems",
        "torch_compile",
        "collectives",
        "fast_paths",
        "exempted_ops",
    }
    assert data["versions"]["torch"] == torch.__version__
    assert data["flags"]["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert data["flags"]["cudnn_benchmark"] == torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" in data["env"] and "PYTHONHASHSEED" in data["env"]
    assert set(managed_env_vars()) <= set(data["env"])  # every variable blocks restore
    assert {"random", "numpy", "torch.cpu"} <= {s["name"] for s in data["rngs"]}
    assert data["cuda"]["initialized"] == torch.cuda.is_initialized()
    assert data["collectives"]["process_group"]["initialized"] is False
    assert set(data["collectives"]["env"]) == {
        n for n in managed_env_vars() if n.startswith("NCCL_")
    }
    text = str(r)
    for title in (
        "Determinism report",
        "Flags",
        "Environment",
        "RNGs",
        "torch.compile",
        "CUDA",
        "Collectives",
        "Process",
        "Problems",
    ):
        assert title in text
    for p in r.problems:
        assert f"{p.level} [{p.code}] {p.message}" in text
    assert r.warnings == tuple(p for p in r.problems if p.level == "warning")


def test_outside_a_block_nondeterministic_algorithms_are_a_warning():
    if torch.are_deterministic_algorithms_enabled():
        pytest.skip("deterministic algorithms are on for the whole session")
    r = report()
    assert not r.in_block
    assert "nondeterministic-algorithms" in codes(r.warnings)


def test_inside_a_block_shows_the_block():
    with deterministic(seed=11):
        r = report()
    assert r.in_block
    assert r.flags["deterministic_algorithms"] and r.flags["cudnn_deterministic"]
    assert not r.flags["cudnn_benchmark"]
    assert r.env["PYTHONHASHSEED"] == "11"
    assert rng(r, "torch.cpu") == RngStatus("torch.cpu", True, 11, rng(r, "torch.cpu").detail)
    assert rng(r, "random").seeded and rng(r, "numpy").seeded
    assert not {"nondeterministic-algorithms", "cudnn-benchmark", "pythonhashseed-spawn"} & codes(r)


def test_cudnn_benchmark_is_a_warning():
    with deterministic(seed=0):
        torch.backends.cudnn.benchmark = True  # restored by the block
        r = report()
    assert "cudnn-benchmark" in codes(r.warnings)
    assert r.flags["cudnn_benchmark"] is True


def test_warn_only_is_a_note():
    with deterministic(seed=0, warn_only=True):
        r = report()
    assert [p.level for p in r.problems if p.code == "warn-only"] == ["note"]


def test_seeded_rngs_are_recognized_after_seed_everything():
    snap = Snapshot.capture()
    try:
        seed_everything(5)
        r = report()
    finally:
        snap.restore()
    assert not r.in_block
    assert rng(r, "torch.cpu").seeded and rng(r, "torch.cpu").seed == 5
    assert rng(r, "random") == RngStatus("random", True, 5, rng(r, "random").detail)
    assert rng(r, "numpy").seeded and rng(r, "numpy").seed == 5
    assert "unseeded" not in codes(r)


def test_after_draws_python_and_numpy_seeding_is_unknown():
    snap = Snapshot.capture()
    try:
        seed_everything(5)
        import random

        import numpy as np

        random.random()
        np.random.rand()
        r = report()
    finally:
        snap.restore()
    assert rng(r, "random").seeded is None and rng(r, "numpy").seeded is None
    assert rng(r, "torch.cpu").seed == 5


def test_registered_rngs_are_listed():
    gen = register_rng(torch.Generator(), key="report-test")
    try:
        r = report()
    finally:
        unregister_rng(gen)
    status = rng(r, "user:report-test")
    assert "Generator" in status.detail


def test_report_never_initializes_cuda_nor_queries_devices():
    # In a fresh interpreter (see cuda_initialized_after): in this one an earlier test may
    # have initialized CUDA, and the report then rightly asks the devices.
    assert not cuda_initialized_after("""
        import torch
        from deterministic_ctx import report

        def forbidden(*args, **kwargs):
            raise AssertionError("report() queried a CUDA device")

        for name in (
            "device_count",
            "current_device",
            "get_device_name",
            "get_device_capability",
            "initial_seed",
            "get_rng_state",
            "is_available",
            "init",
        ):
            setattr(torch.cuda, name, forbidden)
        torch.backends.cudnn.version = forbidden
        r = report()
        assert r.cuda["initialized"] is False and "devices" not in r.cuda, r.cuda
    """)


def test_reading_the_start_method_does_not_fix_it():
    context = multiprocessing.get_start_method(allow_none=True)
    r = report()
    assert multiprocessing.get_start_method(allow_none=True) == context
    assert r.process["start_method"] in multiprocessing.get_all_start_methods()
    assert r.process["start_method_explicit"] is (context is not None)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux only")
def test_environment_at_start_is_read_from_proc():
    startup = startup_env()
    assert startup is not None and set(startup) == set(managed_env_vars())
    # Changing os.environ now does not change what the process started with.
    with deterministic(seed=3):
        assert startup_env() == startup


def test_env_section_covers_the_managed_list_and_registered_names(monkeypatch):
    # Registrations are process-wide: put the registry back after the test.
    monkeypatch.setattr(environ_mod, "_MANAGED", environ_mod._MANAGED)
    monkeypatch.setenv("DCTX_TEST_REPORTED", "on")
    monkeypatch.setenv("PL_GLOBAL_SEED", "123")
    register_env_var("DCTX_TEST_REPORTED")
    r = report()
    assert tuple(r.env)[: len(managed_env_vars())] == managed_env_vars()
    assert r.env["DCTX_TEST_REPORTED"] == "on" and r.env["PL_GLOBAL_SEED"] == "123"
    assert "CUDA_VISIBLE_DEVICES" in r.env  # shown, though blocks do not manage it
    assert "PL_GLOBAL_SEED" in str(r)
    if r.process["env_at_start"] is not None:  # Linux: read from /proc/self/environ
        assert set(r.process["env_at_start"]) == set(managed_env_vars())


@pytest.mark.slow
def test_importing_and_calling_report_stays_cheap():
    code = (
        "import sys; import deterministic_ctx.reporting as r; "
        "print('torch._inductor' in sys.modules); r.report(); "
        "print('torch._inductor' in sys.modules); import torch; print(torch.cuda.is_initialized())"
    )
    out = run_python([], code=code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


# --- the rules, one by one (a pure function of the facts) -----------------------------------------

FLAGS = {
    "deterministic_algorithms": True,
    "deterministic_warn_only": False,
    "fill_uninitialized_memory": True,
    "cudnn_benchmark": False,
    "cudnn_deterministic": True,
    "float32_matmul_precision": "highest",
    "fp32_precision": {"cuda.matmul": "ieee"},
    "inductor_deterministic": None,
}
GPU = {"built": True, "initialized": False, "bad_fork": False}
CPU = {"built": False, "initialized": False, "bad_fork": False}
GOOD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"}


def problems(
    flags=None, env=None, startup=None, cuda=None, method="fork", rngs=(), torch_compile=None
):
    return codes(
        rules.problems(
            flags={**FLAGS, **(flags or {})},
            env={**GOOD_ENV, **(env or {})},
            startup_env=startup,
            cuda=cuda or GPU,
            start_method=method,
            rngs=rngs,
            torch_compile=torch_compile,
        )
    )


def test_reports_built_before_the_collectives_section_still_build_and_print():
    r = report()
    fields = [getattr(r, f) for f in ("versions", "in_block", "flags", "env", "rngs", "cuda")]
    old = DeterminismReport(*fields, r.process, r.problems, r.torch_compile)
    assert old.collectives == {}
    assert "Collectives" not in str(old) and "Problems" in str(old)


def test_a_good_setup_has_no_problems():
    assert problems() == set()
    assert problems(startup=GOOD_ENV, cuda={**GPU, "initialized": True}) == set()


def test_cublas_workspace_missing_or_invalid_on_cuda_builds_only():
    assert "cublas-workspace" in problems(env={"CUBLAS_WORKSPACE_CONFIG": None})
    assert "cublas-workspace" in problems(env={"CUBLAS_WORKSPACE_CONFIG": ":1:1"})
    assert "cublas-workspace" not in problems(env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert problems(env={"CUBLAS_WORKSPACE_CONFIG": None}, cuda=CPU) == set()


def test_cublas_workspace_set_after_cuda_started():
    late = problems(startup={"CUBLAS_WORKSPACE_CONFIG": None}, cuda={**GPU, "initialized": True})
    assert "cublas-workspace-late" in late
    # Not initialized yet: setting it now is still in time.
    assert "cublas-workspace-late" not in problems(startup={"CUBLAS_WORKSPACE_CONFIG": None})
    # Unknown start environment (not Linux): no claim either way.
    assert "cublas-workspace-late" not in problems(startup=None, cuda={**GPU, "initialized": True})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pythonhashseed_unset_with_spawned_workers(method):
    assert "pythonhashseed-spawn" in problems(env={"PYTHONHASHSEED": None}, method=method)
    assert "pythonhashseed-spawn" in problems(env={"PYTHONHASHSEED": "random"}, method=method)
    assert "pythonhashseed-spawn" not in problems(env={"PYTHONHASHSEED": "3"}, method=method)
    assert "pythonhashseed-spawn" not in problems(env={"PYTHONHASHSEED": None}, method="fork")


def test_flag_rules():
    assert {"nondeterministic-algorithms", "cudnn-nondeterministic"} <= problems(
        flags={"deterministic_algorithms": False, "cudnn_deterministic": False}
    )
    assert "cudnn-nondeterministic" not in problems(flags={"cudnn_deterministic": False})
    assert "cudnn-benchmark" in problems(flags={"cudnn_benchmark": True})
    assert "warn-only" in problems(flags={"deterministic_warn_only": True})
    assert "uninitialized-memory" in problems(flags={"fill_uninitialized_memory": False})
    assert "tf32" in problems(flags={"float32_matmul_precision": "high"})
    assert "tf32" in problems(flags={"fp32_precision": {"cuda.matmul": "tf32"}})
    assert "tf32" not in problems(flags={"float32_matmul_precision": "high"}, cuda=CPU)
    assert "inductor" in problems(flags={"inductor_deterministic": False})
    assert "cuda-bad-fork" in problems(cuda={**GPU, "bad_fork": True})
    assert "unseeded" in problems(rngs=(RngStatus("torch.cpu", False, 2**60, ""),))


#: compiled_settings() with every config module imported and nothing set.
COMPILED = {
    "torch._inductor.config.fallback_random": False,
    "torch._inductor.config.align_random_eager": False,
    "torch._inductor.config.batch_invariant": False,
    "torch._functorch.config.functionalize_rng_ops": False,
    "torch._functorch.config.graphsafe_rng_functionalization": True,
    "torch._dynamo.config.use_numpy_random_stream": False,
}


def test_compiled_rng_rules():
    assert {"compiled-rng", "compiled-numpy-rng"} <= problems(torch_compile=COMPILED)
    # torch.compile not used (its config modules not imported): nothing to say.
    assert problems(torch_compile={}) == problems() == set()
    # Only AOTAutograd's config imported (torch.func alone, say): no inductor, no dynamo.
    functorch_only = {k: v for k, v in COMPILED.items() if k.startswith("torch._functorch.")}
    assert problems(torch_compile=functorch_only) == set()
    fallback = {**COMPILED, "torch._inductor.config.fallback_random": True}
    assert "compiled-rng" not in problems(torch_compile=fallback)
    stream = {**COMPILED, "torch._dynamo.config.use_numpy_random_stream": True}
    assert problems(torch_compile=stream) == {"compiled-rng"}
    # Neither functionalize_rng_ops nor align_random_eager makes compiled numbers eager's.
    for name in (
        "torch._functorch.config.functionalize_rng_ops",
        "torch._inductor.config.align_random_eager",
    ):
        assert "compiled-rng" in problems(torch_compile={**COMPILED, name: True})


def test_report_is_the_function_on_the_package_even_after_its_module_is_imported():
    # The module is ``deterministic_ctx.reporting``: a subpackage named ``report``
    # would become the package's ``report`` attribute on import and shadow the
    # function (``dc.report()`` raised "'module' object is not callable").
    import deterministic_ctx as dc
    import deterministic_ctx.reporting

    assert callable(dc.report)
    assert not hasattr(dc, "determinism_report")  # one name for one function
    assert isinstance(dc.report(), dc.DeterminismReport)
