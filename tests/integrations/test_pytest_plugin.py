"""The pytest plugin, driven through ``pytester`` as a user's project would use it.

Most runs are in-process (``runpytest``), so the inner tests run in this interpreter: they
draw only inside blocks, and the leak tests put back what they leak, or this suite's own
conftest guard fails them.  Runs that need a fresh interpreter (xdist, pytest-randomly, import
cost) use ``runpytest_subprocess``.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

# torch imports torch._dynamo (and with it torch._inductor) lazily, on the first call of some
# functions, torch.manual_seed among them.  If that first call happened in an in-process pytester
# run, pytester would drop the new modules afterwards, and the next import would register
# inductor's test operators a second time, which torch refuses.  Import them once, out here.
# torch._inductor.config also gives the inductor flag a value before any leak test starts.
import torch._dynamo
import torch._inductor.config  # noqa: F401

from deterministic_ctx import _torch
from deterministic_ctx.integrations import pytest_plugin as plugin
from tests.helpers import needs, run_python

#: A block's ``fill_uninitialized_memory=False`` needs the flag (torch >= 2.2).
needs_fill = needs(_torch.FILL_UNINITIALIZED_MEMORY)

# Each inner test imports this: ``draw`` takes one value from each global RNG, ``recipe`` is the
# classic seeding recipe the library must reproduce.
RECIPE = """
import random

import numpy as np
import torch


def draw():
    return (random.random(), float(np.random.rand()), torch.rand(2).tolist())


def recipe(seed, n=1):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return [draw() for _ in range(n)]
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(_recipe=RECIPE)
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # pytest-randomly, when installed, would reseed this very process from the inner run.
    return pytester.runpytest("-p", "no:randomly", *args)


def header_seed(result: pytest.RunResult) -> int:
    match = re.search(r"^deterministic-ctx: --deterministic-seed=(\d+)", result.stdout.str(), re.M)
    assert match, result.stdout.str()
    return int(match.group(1))


# -- marker -----------------------------------------------------------------------------------


def test_marked_test_and_its_fixtures_draw_the_classic_recipe(project: pytest.Pytester) -> None:
    project.makepyfile(
        """
        import pytest
        import torch
        from _recipe import draw, recipe

        @pytest.fixture
        def drawn():
            return draw()

        @pytest.mark.deterministic(seed=3)
        def test_marker_seed(drawn, deterministic_seed):
            body = draw()
            assert [drawn, body] == recipe(3, n=2)
            assert deterministic_seed == 3
            assert torch.are_deterministic_algorithms_enabled()

        @pytest.mark.deterministic
        def test_session_seed(drawn, deterministic_seed):
            body = draw()
            assert [drawn, body] == recipe(11, n=2)
            assert deterministic_seed == 11
        """
    )
    run(project, "--deterministic-seed=11").assert_outcomes(passed=2)


def test_block_holds_exactly_the_function_scoped_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        on = torch.are_deterministic_algorithms_enabled

        @pytest.fixture(scope="module")
        def wide():
            return on()

        @pytest.fixture
        def narrow():
            assert on()
            yield on()
            assert on(), "function fixture teardown ran outside the block"

        @pytest.mark.deterministic
        def test_scopes(wide, narrow):
            assert (wide, narrow, on()) == (False, True, True)

        def test_unmarked_runs_outside(deterministic_seed):
            assert not on()
            assert deterministic_seed == 0
        """
    )
    run(pytester).assert_outcomes(passed=2)


def test_marker_on_module_and_class_applies_to_every_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        pytestmark = pytest.mark.deterministic(seed=5)

        def test_module(deterministic_seed):
            assert deterministic_seed == 5
            assert torch.are_deterministic_algorithms_enabled()

        @pytest.mark.deterministic(seed=6, warn_only=True)
        class TestClass:
            def test_class(self, deterministic_seed):
                assert deterministic_seed == 6
                assert torch.is_deterministic_algorithms_warn_only_enabled()

            @pytest.mark.deterministic(seed=7)
            def test_closest_wins(self, deterministic_seed):
                assert deterministic_seed == 7
                assert not torch.is_deterministic_algorithms_warn_only_enabled()
        """
    )
    run(pytester).assert_outcomes(passed=3)


@needs_fill
def test_marker_flags_and_fill_options(pytester: pytest.Pytester):
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch

        @pytest.mark.deterministic(seed=2, flags=False)
        def test_seeded_without_flags():
            assert not torch.are_deterministic_algorithms_enabled()
            assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
            x = torch.rand(2)
            torch.manual_seed(2)
            assert torch.equal(x, torch.rand(2))

        @pytest.mark.deterministic(seed=2, fill_uninitialized_memory=False)
        def test_without_the_fill():
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.utils.deterministic.fill_uninitialized_memory
        """
    )
    run(pytester).assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ('seed="1"', "seed must be an int in 0 .. 4294967295*got str '1'"),
        ("seed=-1", "seed must be in 0 .. 4294967295*got -1"),
        ('warn_only="yes"', "warn_only must be True or False, got 'yes'"),
        (
            "sede=1",
            "unknown argument(s) sede; accepted: seed, warn_only, flags, fill_uninitialized_memory",
        ),
        ('flags="no"', "flags must be True or False, got 'no'"),
        ("3", "takes keyword arguments only (seed=..., warn_only=...), got positional (3,)"),
    ],
)
def test_bad_marker_arguments_fail_the_test_naming_them(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.deterministic({marker})
        def test_it():
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.deterministic on test_*.py::test_it: {message}*"])


def test_deterministic_all_runs_every_test_as_if_marked(project: pytest.Pytester) -> None:
    project.makepyfile(
        """
        import pytest
        from _recipe import draw, recipe

        def test_unmarked(deterministic_seed):
            assert [draw()] == recipe(9)
            assert deterministic_seed == 9

        @pytest.mark.deterministic(seed=2)
        def test_marker_still_wins():
            assert [draw()] == recipe(2)
        """
    )
    result = run(project, "--deterministic-all", "--deterministic-seed=9")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["deterministic-ctx: --deterministic-seed=9 --deterministic-all *"])


# -- session seed -----------------------------------------------------------------------------


def test_header_shows_the_seed_and_the_default_is_fixed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_it(): pass")
    assert header_seed(run(pytester)) == plugin.DEFAULT_SEED == 0
    result = run(pytester, "--deterministic-seed=123")
    result.stdout.fnmatch_lines(
        ["deterministic-ctx: --deterministic-seed=123 --deterministic-leaks=warn"]
    )


def test_random_draws_a_seed_and_last_replays_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_it(deterministic_seed):
            print(f"SEED={deterministic_seed}")
        """
    )
    first = run(pytester, "-s", "--deterministic-seed=random")
    seed = header_seed(first)
    first.stdout.fnmatch_lines([f"*SEED={seed}*"])
    again = run(pytester, "-s", "--deterministic-seed=last")
    assert header_seed(again) == seed
    again.stdout.fnmatch_lines([f"*SEED={seed}*"])


def test_last_without_history_uses_the_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_it(): pass")
    assert header_seed(run(pytester, "--deterministic-seed=last")) == plugin.DEFAULT_SEED


def test_last_without_cache_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_it(): pass")
    result = run(pytester, "-p", "no:cacheprovider", "--deterministic-seed=last")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--deterministic-seed=last needs pytest's cache*"])


@pytest.mark.parametrize(
    "option",
    [
        "--deterministic-seed=abc",
        "--deterministic-seed=-5",
        f"--deterministic-seed={2**32}",
        "--deterministic-seed=",
        "--deterministic-leaks=maybe",
    ],
)
def test_bad_option_values_are_usage_errors_naming_the_option(
    pytester: pytest.Pytester, option: str
) -> None:
    pytester.makepyfile("def test_it(): pass")
    result = run(pytester, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    name = option.split("=")[0]
    result.stderr.fnmatch_lines([f"*error: argument {name}: *"])


def test_failed_marked_test_report_names_its_seed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.deterministic(seed=7)
        def test_marker_seed():
            assert False

        @pytest.mark.deterministic
        def test_session_seed():
            assert False

        def test_unmarked():
            assert False
        """
    )
    result = run(pytester, "--deterministic-seed=42")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert (
        "ran in a deterministic block: seed=7 (from @pytest.mark.deterministic(seed=7)), "
        "warn_only=False" in out
    )
    assert (
        "ran in a deterministic block: seed=42 (from the session; replay with "
        "--deterministic-seed=42), warn_only=False" in out
    )
    assert out.count("ran in a deterministic block") == 2


# -- leak guard -------------------------------------------------------------------------------

LEAKY = """
import os

import numpy as np
import pytest
import torch


def test_leaves_deterministic_algorithms_on():
    torch.use_deterministic_algorithms(True)


def test_leaves_cublas_config_set():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"


def test_puts_flags_back():
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark


@pytest.mark.deterministic
def test_draws_only_inside_a_block():
    np.random.rand()
    torch.rand(3)


@pytest.mark.deterministic
def test_marked_test_changes_are_undone_by_its_block():
    torch.use_deterministic_algorithms(False)
    os.environ["PYTHONHASHSEED"] = "12345"
"""

LEAKS = [
    "*test_leaves_deterministic_algorithms_on changed torch.deterministic_algorithms "
    "(False -> True)*and did not put it back*",
    "*test_leaves_cublas_config_set changed $CUBLAS_WORKSPACE_CONFIG (None -> ':16:8') "
    "and did not put it back*",
]


@pytest.mark.usefixtures("restore_world")
@pytest.mark.parametrize("mode", ["default", "warn", "error", "off"])
def test_leak_guard(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    pytester.makepyfile(LEAKY)
    args = [] if mode == "default" else [f"--deterministic-leaks={mode}"]
    result = run(pytester, *args)
    out = result.stdout.str()
    if mode == "error":
        result.assert_outcomes(passed=5, errors=2)
        result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_deterministic_*"])
        result.stdout.fnmatch_lines(LEAKS)
        assert "DeterministicLeakWarning" not in out
    elif mode == "off":
        result.assert_outcomes(passed=5)
        assert "deterministic-ctx: test_" not in out
    else:
        result.assert_outcomes(passed=5, warnings=2)
        result.stdout.fnmatch_lines(
            [f"*DeterministicLeakWarning: deterministic-ctx: {p}" for p in LEAKS]
        )
    # Only the two leaking tests are named: draws and restored changes are not leaks.
    for clean in ("test_puts_flags_back", "test_draws_only_inside", "test_marked_test_changes"):
        assert f"{clean}_" not in out.replace(f"::{clean}", "")


@pytest.mark.parametrize(
    "category",
    [
        "deterministic_ctx.integrations.pytest_plugin.DeterministicLeakWarning",
        "deterministic_ctx.DeterministicCtxWarning",
    ],
)
def test_leak_warning_can_be_filtered_by_category(
    pytester: pytest.Pytester, restore_world: None, category: str
) -> None:
    pytester.makepyfile(LEAKY)
    result = run(pytester, "-W", f"error::{category}")
    result.assert_outcomes(passed=5, errors=2)


LEAKY_ENV = """
import os

import pytest

from deterministic_ctx import register_env_var

register_env_var("DCTX_TEST_GUARDED")


def test_leaves_lightning_seed():
    os.environ["PL_GLOBAL_SEED"] = "123"


def test_removes_flash_attention_determinism():
    del os.environ["FLASH_ATTENTION_DETERMINISTIC"]


def test_leaves_registered_name():
    os.environ["DCTX_TEST_GUARDED"] = "1"


@pytest.mark.deterministic
def test_marked_test_is_restored_by_its_block():
    os.environ["PL_SEED_WORKERS"] = "1"
    os.environ["DCTX_TEST_GUARDED"] = "2"
"""


@pytest.mark.usefixtures("registry")  # the inner run registers a name in this very process
def test_leak_guard_covers_every_managed_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "DCTX_TEST_GUARDED"):
        monkeypatch.setenv(name, "outer")  # recorded, so the undo removes what the tests leave
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    pytester.makepyfile(LEAKY_ENV)
    result = run(pytester, "--deterministic-leaks=error")
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*test_leaves_lightning_seed changed $PL_GLOBAL_SEED (None -> '123')*",
            "*test_removes_flash_attention_determinism changed $FLASH_ATTENTION_DETERMINISTIC "
            "('1' -> None)*",
            "*test_leaves_registered_name changed $DCTX_TEST_GUARDED (None -> '1')*",
        ]
    )
    assert "test_marked_test_is_restored_by_its_block changed" not in result.stdout.str()


# -- other kinds of tests ---------------------------------------------------------------------


def test_unittest_testcases(project: pytest.Pytester) -> None:
    project.makepyfile(
        """
        import unittest

        import pytest
        from _recipe import draw, recipe

        from deterministic_ctx import reproducible


        @pytest.mark.deterministic(seed=4)
        class Marked(unittest.TestCase):
            def setUp(self):
                self.drawn = draw()

            def test_setup_and_body_share_the_block(self):
                body = draw()
                self.assertEqual([self.drawn, body], recipe(4, n=2))


        @reproducible(seed=8)
        class Decorated(unittest.TestCase):
            def test_reproducible_class(self):
                self.assertEqual([draw()], recipe(8))


        class Plain(unittest.TestCase):
            def test_all(self):
                self.assertEqual([draw()], recipe(1))
        """
    )
    run(project, "--deterministic-all", "--deterministic-seed=1").assert_outcomes(passed=3)


def test_hypothesis_given_stacks_with_the_marker_and_reproducible(
    project: pytest.Pytester,
) -> None:
    project.makepyfile(
        """
        import pytest
        import torch
        from hypothesis import given, settings, strategies as st
        from _recipe import recipe

        from deterministic_ctx import reproducible


        @pytest.mark.deterministic(seed=1)
        @settings(max_examples=10, database=None)
        @given(st.integers())
        def test_marker_outside_given(x):
            assert torch.are_deterministic_algorithms_enabled()
            torch.rand(2)


        @settings(max_examples=10, database=None)
        @given(st.integers())
        @reproducible(seed=5)
        def test_each_example_is_a_block(x):
            first = torch.rand(2).tolist()
            assert first == recipe(5)[0][2]


        @reproducible(seed=5)
        @settings(max_examples=10, database=None)
        @given(st.integers())
        def test_reproducible_outside_given(x):
            assert torch.are_deterministic_algorithms_enabled()
        """
    )
    run(project).assert_outcomes(passed=3)


# -- plugin loading ---------------------------------------------------------------------------


def test_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_it(deterministic_seed): pass")
    result = run(pytester, "-p", "no:deterministic_ctx")
    assert "deterministic-ctx:" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*fixture 'deterministic_seed' not found*"])


def test_importing_the_plugin_imports_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, deterministic_ctx.integrations.pytest_plugin\n"
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    out = run_python([], code=code, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_run_without_torch_never_loads_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import sys

        def test_it(deterministic_seed):
            assert "torch" not in sys.modules
        """
    )
    pytester.runpytest_subprocess("-p", "no:randomly").assert_outcomes(passed=1)


def test_constants_agree_with_the_library() -> None:
    from deterministic_ctx.core.decorate import DEFAULT_SEED

    assert plugin.DEFAULT_SEED == DEFAULT_SEED


# -- pytest-xdist and pytest-randomly ---------------------------------------------------------

NUMBERS = """
import json
import os

import pytest
from _recipe import draw


@pytest.mark.parametrize("k", range(6))
@pytest.mark.deterministic
def test_numbers(k, deterministic_seed):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "serial")
    with open(f"out-{k}.json", "w") as f:
        json.dump({"seed": deterministic_seed, "worker": worker, "numbers": draw()}, f)
"""


def _collect(pytester: pytest.Pytester) -> list[dict[str, object]]:
    found = []
    for k in range(6):
        path = pytester.path / f"out-{k}.json"
        found.append(json.loads(path.read_text()))
        path.unlink()
    return found


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist")
def test_xdist_workers_share_the_session_seed(project: pytest.Pytester) -> None:
    project.makepyfile(NUMBERS)
    parallel = project.runpytest_subprocess(
        "-p", "no:randomly", "-n", "2", "--deterministic-seed=random"
    )
    parallel.assert_outcomes(passed=6)
    seed = header_seed(parallel)
    on_workers = _collect(project)
    assert {r["worker"] for r in on_workers} == {"gw0", "gw1"}
    assert {r["seed"] for r in on_workers} == {seed}

    serial = project.runpytest_subprocess("-p", "no:randomly", f"--deterministic-seed={seed}")
    serial.assert_outcomes(passed=6)
    in_serial = _collect(project)
    assert [r["numbers"] for r in on_workers] == [r["numbers"] for r in in_serial]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("pytest_randomly") is None, reason="needs pytest-randomly"
)
def test_marked_tests_keep_their_numbers_under_pytest_randomly(project: pytest.Pytester) -> None:
    project.makepyfile(
        """
        import random

        import pytest
        from _recipe import draw, recipe

        @pytest.fixture
        def drawn():
            return draw()

        @pytest.mark.deterministic(seed=3)
        def test_marked(drawn):
            assert [drawn, draw()] == recipe(3, n=2)

        def test_unmarked():
            print(f"UNMARKED={random.random()}")
        """
    )
    args = ("-p", "randomly", "--randomly-seed=1234", "-s")
    result = project.runpytest_subprocess(*args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["Using --randomly-seed=1234", "deterministic-ctx: *"])
    # Unmarked tests get pytest-randomly's numbers, as they would without this plugin.
    alone = project.runpytest_subprocess(*args, "-p", "no:deterministic_ctx", "-k", "unmarked")
    alone.assert_outcomes(passed=1)
    found = [re.findall(r"UNMARKED=(\S+)", r.stdout.str()) for r in (result, alone)]
    assert len(found[0]) == 1
    assert found[0] == found[1]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("pytest_randomly") is None, reason="needs pytest-randomly"
)
def test_reproducible_on_a_test_covers_its_body_and_the_marker_its_fixtures_too(
    project: pytest.Pytester,
) -> None:
    # What docs/how-to/pytest.md says: a decorated test's fixtures draw outside its block
    # (pytest sets them up before it calls the test), a marked test's inside.
    project.makepyfile(
        """
        import json

        import pytest
        from _recipe import draw, recipe
        from deterministic_ctx import reproducible

        @pytest.fixture
        def drawn():
            return draw()

        @reproducible(seed=3)
        def test_decorated(drawn):
            body = draw()
            print("FIXTURE=" + json.dumps(drawn))
            assert body == recipe(3)[0]  # the body draws the block's numbers

        @pytest.mark.deterministic(seed=3)
        def test_marked(drawn):
            assert [drawn, draw()] == recipe(3, n=2)  # the fixture draws them too
        """
    )
    fixture = []
    for seed in (1, 2):
        result = project.runpytest_subprocess("-p", "randomly", f"--randomly-seed={seed}", "-s")
        result.assert_outcomes(passed=2)
        (found,) = re.findall(r"FIXTURE=(.+)", result.stdout.str())
        fixture.append(json.loads(found))
    # Under @reproducible the fixture drew pytest-randomly's numbers: they follow its seed.
    assert fixture[0] != fixture[1]
