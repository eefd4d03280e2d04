"""pytest-randomly's per-test reseed reaches torch and the registered RNGs.

The seeder is tested alone in this process, then with the real plugins in child runs
(``runpytest_subprocess``: pytest-randomly reseeds the process it runs in, and this suite's
own options turn it off with ``-p no:randomly``).
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import torch

from deterministic_ctx import Snapshot, deterministic, register_rng, unregister_rng
from deterministic_ctx.integrations.randomly import reseed
from tests.helpers import cuda_initialized_after, run_python

needs_randomly = pytest.mark.skipif(
    importlib.util.find_spec("pytest_randomly") is None, reason="needs pytest-randomly"
)


@pytest.fixture
def restore() -> Iterator[None]:
    """``reseed`` never restores (like pytest-randomly): put everything back after the test."""
    snapshot = Snapshot.capture()
    yield
    snapshot.restore()


@pytest.fixture
def augment() -> Iterator[random.Random]:
    rng = register_rng(random.Random(), key="test-randomly")
    yield rng
    unregister_rng(rng)


# -- the seeder alone -------------------------------------------------------------------------


def test_the_entry_point_is_the_seeder() -> None:
    found = [
        e
        for e in entry_points(group="pytest_randomly.random_seeder")
        if e.value.startswith("deterministic_ctx")
    ]
    assert [e.value for e in found] == ["deterministic_ctx.integrations.randomly:reseed"]
    assert found[0].load() is reseed


@pytest.mark.usefixtures("restore")
def test_reseed_draws_what_a_block_with_the_seed_draws(augment: random.Random) -> None:
    reseed(1234)
    drawn = (torch.rand(3), augment.random())
    with deterministic(seed=1234):
        expected = (torch.rand(3), augment.random())
    assert torch.equal(drawn[0], expected[0])
    assert drawn[1] == expected[1]
    # The CPU generator gets torch.manual_seed's state, initial_seed included.
    assert torch.equal(torch.rand(3, generator=torch.Generator().manual_seed(1234)), expected[0])
    assert torch.initial_seed() == 1234


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize(
    ("seed", "same_as"), [(2**32 + 5, 5), (-1, 2**32 - 1), (10**30 + 7, (10**30 + 7) % 2**32)]
)
def test_seeds_are_taken_modulo_2_to_the_32_as_for_numpy(seed: int, same_as: int) -> None:
    reseed(seed)
    drawn = torch.rand(2)
    reseed(same_as)
    assert torch.equal(drawn, torch.rand(2))


def test_reseed_initializes_no_device_and_formats_no_stack() -> None:
    # In a fresh interpreter (see cuda_initialized_after): on a GPU machine an earlier test
    # of this worker may have initialized CUDA.
    assert not cuda_initialized_after("""
        import torch
        from deterministic_ctx.integrations.randomly import reseed

        queued = list(torch.cuda._lazy_seed_tracker.call_order)
        reseed(3)
        if not torch.cuda._is_compiled():
            # torch.manual_seed would queue a lazy CUDA seed with a formatted stack even here.
            assert torch.cuda._lazy_seed_tracker.call_order == queued, "a lazy seed was queued"
    """)


def test_without_torch_reseed_imports_nothing() -> None:
    proc = run_python(
        [],
        code=(
            "import sys\n"
            "from deterministic_ctx.integrations.randomly import reseed\n"
            "reseed(3)\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'\n"
        ),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- with pytest-randomly ---------------------------------------------------------------------

# Each test writes what it drew to <test name>.json; the unmarked one also checks, against a
# block, that torch and the registered RNGs got pytest-randomly's per-test seed.
SEEDED = """
import json
import random
import zlib

import pytest
import torch

from deterministic_ctx import deterministic, register_rng

AUGMENT = register_rng(random.Random(), key="augment")
NOISE = register_rng(torch.Generator(), key="noise")


def draw():
    return [torch.rand(3).tolist(), AUGMENT.random(), torch.rand(2, generator=NOISE).tolist()]


def record(name, numbers):
    with open(f"{name}.json", "w") as f:
        json.dump(numbers, f)


def test_unmarked(request):
    assert not torch.cuda.is_initialized()
    numbers = draw()
    record("unmarked", numbers)
    # pytest-randomly's seed for the call phase, which it gives random.seed as is.
    seed = request.config.getoption("randomly_seed") + zlib.crc32(request.node.nodeid.encode())
    assert random.getstate() == random.Random(seed).getstate(), "pytest-randomly's seed changed"
    with deterministic(seed=seed % 2**32):
        assert draw() == numbers


@pytest.fixture
def drawn():
    return draw()


@pytest.mark.deterministic(seed=3)
def test_marked(drawn):
    numbers = [drawn, draw()]
    record("marked", numbers)
    with deterministic(seed=3):
        assert [draw(), draw()] == numbers
"""


#: pytest-randomly on; Hypothesis' plugin, which costs a child a second at start-up, off.
RANDOMLY = ("-p", "randomly", "-p", "no:hypothesispytest", "-p", "no:cacheprovider")


def _run(pytester: pytest.Pytester, seed: int) -> dict[str, object]:
    result = pytester.runpytest_subprocess(*RANDOMLY, f"--randomly-seed={seed}")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"Using --randomly-seed={seed}"])
    found = {}
    for name in ("unmarked", "marked"):
        path = pytester.path / f"{name}.json"
        found[name] = json.loads(path.read_text())
        path.unlink()
    return found


@pytest.mark.slow
@needs_randomly
def test_randomly_seed_decides_torch_and_registered_rngs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_seeded=SEEDED)
    first, again, other = _run(pytester, 1234), _run(pytester, 1234), _run(pytester, 99)
    assert again == first
    # Every stream of the unmarked test moves with the seed: torch, a registered random.Random
    # and a registered torch.Generator.
    assert all(a != b for a, b in zip(first["unmarked"], other["unmarked"], strict=True))
    # The marked test keeps its block's numbers, whatever pytest-randomly's seed.
    assert other["marked"] == first["marked"]


@pytest.mark.slow
@needs_randomly
def test_a_run_without_torch_never_loads_it(pytester: pytest.Pytester) -> None:
    # pytest-randomly loads and calls its seeders at session start, in every project.
    pytester.makepyfile(
        """
        import sys

        def test_it():
            assert "torch" not in sys.modules
        """
    )
    pytester.runpytest_subprocess(*RANDOMLY, "--randomly-seed=1").assert_outcomes(passed=1)
