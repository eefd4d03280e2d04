"""assert_reproducible: exact comparison of repeated runs, and the first difference named."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import random
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deterministic_ctx import Snapshot, deterministic, register_rng, unregister_rng
from deterministic_ctx.verify import NotReproducibleError, assert_reproducible
from deterministic_ctx.verify.compare import first_difference
from tests._oracle import World
from tests.helpers import TENSOR_DTYPES


def alternating(*values):
    """A function returning ``values[0]``, ``values[1]``, ... on successive calls."""
    it = itertools.cycle(values)
    return lambda: next(it)


# --- passing and failing functions ------------------------------------------------------------


def test_reproducible_function_passes_and_returns_first_result():
    def init():
        return {
            "w": torch.randn(4, 3),
            "np": np.random.rand(5),
            "py": [random.random(), random.gauss(0, 1)],
            "ids": torch.randperm(10),
        }

    result = assert_reproducible(init, seed=7, runs=3)
    with deterministic(seed=7):
        expected = init()
    assert torch.equal(result["w"], expected["w"])
    assert np.array_equal(result["np"], expected["np"])
    assert result["py"] == expected["py"]


def test_args_and_kwargs_reach_fn():
    def scaled(x, *, factor):
        return x * factor + torch.rand(())

    out = assert_reproducible(scaled, torch.ones(2), factor=3.0)
    assert out.shape == (2,)


def test_os_urandom_fails_at_the_right_path():
    def salted():
        return {"salt": os.urandom(8), "ok": 1}

    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(salted)
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.path == 'result["salt"]'
    assert err.run == 2 and err.seed == 0
    assert 'result["salt"]' in str(err)


def test_unmanaged_torch_generator_fails_with_path_index_and_max_difference():
    leak = torch.Generator()  # created once and never seeded: not managed by the block

    def forward():
        return {
            "logits": [
                torch.zeros(2),
                torch.zeros(2),
                torch.zeros(2),
                torch.rand(2, 3, generator=leak),
            ]
        }

    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(forward)
    err = info.value
    assert err.path == 'result["logits"][3]'
    assert err.index == (0, 0)
    assert err.max_abs_diff is not None and 0 < err.max_abs_diff < 1
    message = str(err)
    assert 'at result["logits"][3]: values differ at index (0, 0)' in message
    assert "6 of 6 element(s) differ" in message
    assert f"max abs difference {err.max_abs_diff:.6g}" in message


def test_generator_seeded_from_entropy_inside_fn_fails():
    def draw():
        g = torch.Generator()
        g.seed()  # nondeterministic seed
        return torch.rand(3, generator=g)

    with pytest.raises(NotReproducibleError, match=r"at result: values differ"):
        assert_reproducible(draw)


def test_fresh_unseeded_generator_per_call_is_reproducible():
    # A new torch.Generator() starts from torch's fixed default seed: the same every call.
    assert_reproducible(lambda: torch.rand(3, generator=torch.Generator()))


def test_registered_generator_is_managed_by_the_block():
    gen = register_rng(torch.Generator(), key="verify-test")
    try:
        assert_reproducible(lambda: torch.rand(3, generator=gen))
    finally:
        unregister_rng(gen)


def test_difference_only_in_a_later_run_names_that_run():
    fn = alternating(1, 1, 2)
    with pytest.raises(
        NotReproducibleError,
        match=r"run 3 of 3 differs from run 1 at result: 1 \(run 1\) != 2 \(run 3\)",
    ) as info:
        assert_reproducible(fn, runs=3)
    assert info.value.run == 3


def test_caller_state_is_untouched_and_streams_continue():
    outside = Snapshot.capture()
    try:

        def reseed():  # generator-level seeding: torch.manual_seed would queue lazy CUDA seeds
            torch.default_generator.manual_seed(123)
            random.seed(123)
            np.random.seed(123)

        reseed()
        before = World.now()
        expected = (torch.rand(3), random.random(), np.random.rand())
        reseed()
        assert World.now() == before
        assert_reproducible(lambda: (torch.rand(2), random.random(), np.random.rand()), seed=5)
        assert World.now() == before
        after = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]
    finally:
        outside.restore()


# --- exact comparison --------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    mean: torch.Tensor
    count: int
    label: str = dataclasses.field(default="", compare=False)


Pair = namedtuple("Pair", ["left", "right"])


def test_nested_structures_pass_and_fail_with_paths():
    def nested():
        return [
            {
                "stats": Stats(torch.rand(3), 3, label=str(object())),
                "pair": Pair(1, (torch.rand(2), "x")),
            },
            OrderedDict(a=np.random.rand(2)),
        ]

    assert_reproducible(nested)  # label has compare=False and differs every run

    leak = np.random.default_rng()
    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(
            lambda: [
                {
                    "stats": Stats(torch.zeros(1), 1),
                    "pair": Pair(1, (torch.zeros(2), leak.random())),
                }
            ]
        )
    assert info.value.path == 'result[0]["pair"].right[1]'

    leak_t = torch.Generator()
    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(lambda: {"stats": Stats(torch.rand(2, generator=leak_t), 1)})
    assert info.value.path == 'result["stats"].mean'


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1.0, math.nan, 3.0]) + torch.rand(3),
        lambda: np.array([[math.nan, 1.0], [2.0, math.nan]]) * np.random.rand(2, 2),
        lambda: [math.nan, float("inf"), random.random()],
        lambda: torch.tensor([complex(math.nan, 1.0)]),
        lambda: np.float32(math.nan),
    ],
    ids=["torch", "numpy", "python", "complex", "numpy-scalar"],
)
def test_nans_in_the_same_places_compare_equal(make):
    assert_reproducible(make)


def test_nan_in_a_different_place_is_a_difference():
    fn = alternating(torch.tensor([1.0, math.nan]), torch.tensor([math.nan, 1.0]))
    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(fn)
    assert info.value.index == (0,)
    assert info.value.max_abs_diff is None
    assert "2 element(s) are NaN in only one run" in str(info.value)


@pytest.mark.filterwarnings("error")
def test_a_signalling_nan_is_reported_without_a_numpy_warning():
    # Widening a float32 signalling NaN warns in NumPy: under ``-W error`` the
    # warning used to replace the report.
    snan = np.frombuffer(np.uint32(0x7F800001).tobytes(), dtype=np.float32).copy()
    fn = alternating(snan, np.array([1.0], dtype=np.float32))
    with pytest.raises(NotReproducibleError, match="NaN in only one run"):
        assert_reproducible(fn)


def test_signed_zero_is_a_bitwise_difference():
    fn = alternating(np.array([0.0]), np.array([-0.0]))
    with pytest.raises(NotReproducibleError, match="signed zeros"):
        assert_reproducible(fn)
    fn = alternating(0.0, -0.0)
    with pytest.raises(NotReproducibleError, match=r"0.0 \(run 1\) != -0.0 \(run 2\)"):
        assert_reproducible(fn)


@pytest.mark.parametrize(
    ("first", "second", "what"),
    [
        (
            torch.zeros(2),
            torch.zeros(2, dtype=torch.float64),
            "dtype differs: torch.float32 (run 1) vs torch.float64 (run 2)",
        ),
        (torch.zeros(2), torch.zeros(3), "shape differs: (2,) (run 1) vs (3,) (run 2)"),
        (
            torch.zeros(2),
            torch.zeros(2, device="meta"),
            "device differs: cpu (run 1) vs meta (run 2)",
        ),
        (
            np.zeros(2, np.int32),
            np.zeros(2, np.int64),
            "dtype differs: int32 (run 1) vs int64 (run 2)",
        ),
        (torch.zeros(1), np.zeros(1), "type differs: Tensor (run 1) vs ndarray (run 2)"),
        ([1, 2], [1, 2, 3], "length differs: 2 (run 1) vs 3 (run 2)"),
        (
            {"a": 1, "b": 2},
            {"b": 2, "a": 1},
            "keys differ: ['a', 'b'] (run 1) vs ['b', 'a'] (run 2); same keys in a different order",
        ),
        ({"a": 1}, {"c": 1}, "keys differ: ['a'] (run 1) vs ['c'] (run 2)"),
    ],
)
def test_metadata_differences_are_named(first, second, what):
    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(alternating(first, second))
    assert f"at result: {what}" in str(info.value)


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
def test_every_tensor_dtype_compares_bitwise(dtype):
    base = (
        torch.arange(12).reshape(3, 4) % 2
        if dtype == torch.bool
        else torch.arange(12).reshape(3, 4)
    )
    a = base.to(dtype)
    b = a.clone()
    b[2, 1] = ~a[2, 1] if dtype == torch.bool else 0
    assert first_difference(a, a.clone()) is None
    found = first_difference(a, b)
    assert found is not None and found.index == (2, 1) and found.count == 1
    if dtype != torch.bool:
        assert found.max_abs_diff == 9.0


def test_non_contiguous_conjugated_and_sparse_tensors():
    a = torch.arange(12.0).reshape(3, 4).t()
    assert first_difference(a, a.contiguous()) is None
    c = torch.tensor([1 + 2j, 3 - 1j])
    assert first_difference(c.conj(), c.conj().resolve_conj()) is None
    assert first_difference(c.conj(), c) is not None
    s = torch.eye(3).to_sparse()
    assert first_difference(s, torch.eye(3).to_sparse()) is None
    found = first_difference(s, (torch.eye(3) * 2).to_sparse())
    assert found is not None and found.index == (0, 0)


def test_numpy_structured_and_object_arrays():
    rec = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])
    other = rec.copy()
    other["b"][1] = 0.5
    assert first_difference(rec, rec.copy()) is None
    found = first_difference(rec, other)
    assert found is not None and found.index == (1,) and found.max_abs_diff is None
    assert found.note == ""  # no numeric notes for structured data
    objs = np.array([{"x": 1}, [torch.zeros(1)]], dtype=object)
    changed = np.array([{"x": 1}, [torch.ones(1)]], dtype=object)
    assert first_difference(objs, np.array([{"x": 1}, [torch.zeros(1)]], dtype=object)) is None
    assert first_difference(objs, changed).path == "result[1][0]"


def test_returned_module_compares_by_state_dict():
    def build():
        return torch.nn.Linear(3, 2)

    assert isinstance(assert_reproducible(build), torch.nn.Linear)
    leak = torch.Generator()

    def build_leaky():
        layer = torch.nn.Linear(3, 2)
        with torch.no_grad():
            layer.bias.copy_(torch.rand(2, generator=leak))
        return layer

    with pytest.raises(NotReproducibleError) as info:
        assert_reproducible(build_leaky)
    assert info.value.path == 'result.state_dict()["bias"]'


def test_objects_without_eq_get_a_hint():
    class Box:
        pass

    with pytest.raises(
        NotReproducibleError, match="Box defines no __eq__, so == compares identity"
    ):
        assert_reproducible(Box)


def test_objects_whose_eq_raises_are_a_type_error():
    class Weird:
        def __eq__(self, other):
            raise ValueError("ambiguous")

        __hash__ = object.__hash__

    with pytest.raises(TypeError, match=r"cannot compare result\[0\] of type .*Weird: == raised"):
        assert_reproducible(lambda: [Weird()])


def test_cycles_do_not_recurse_forever():
    def cyclic():
        items = [torch.rand(1)]
        items.append(items)
        return items

    out = assert_reproducible(cyclic)
    assert out[1] is out


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int16, np.uint8]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
    ),
    st.data(),
)
def test_property_a_copy_agrees_and_one_changed_element_is_found(array, data):
    assert first_difference(array, array.copy()) is None
    tensor = torch.from_numpy(array.copy())
    assert first_difference(tensor, tensor.clone()) is None
    if array.size == 0:
        return
    flat = data.draw(st.integers(0, array.size - 1))
    changed = array.copy().reshape(-1)
    raw = changed.view(np.uint8).reshape(array.size, array.itemsize)
    raw[flat, 0] ^= 1  # flip one bit of one element
    changed = changed.reshape(array.shape)
    index = np.unravel_index(flat, array.shape)
    for a, b in ((array, changed), (torch.from_numpy(array.copy()), torch.from_numpy(changed))):
        found = first_difference(a, b)
        assert found is not None
        assert found.index == tuple(int(i) for i in index)
        assert found.count == 1


# --- generators, exceptions, arguments, validation ----------------------------------------------


def test_generator_results_are_consumed_inside_the_block():
    def gen():
        for _ in range(3):
            yield torch.rand(1).item()

    out = assert_reproducible(gen)
    with deterministic(seed=0):
        assert out == [torch.rand(1).item() for _ in range(3)]


def test_exception_in_the_first_run_propagates_unchanged():
    def broken():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        assert_reproducible(broken)


def test_exception_in_a_later_run_is_a_reproducibility_failure():
    calls = itertools.count()

    def flaky():
        if next(calls) == 1:
            raise RuntimeError("second time")
        return 1

    with pytest.raises(NotReproducibleError, match="run 2 of 2 raised RuntimeError") as info:
        assert_reproducible(flaky)
    assert isinstance(info.value.__cause__, RuntimeError)


def make_training():
    with deterministic(seed=1):
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        batch = torch.randn(16, 4)
    return model, opt, batch


def train_step(model, opt, batch):
    model.train()
    opt.zero_grad()
    loss = model(batch).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def test_modules_and_optimizers_among_arguments_are_reset_between_runs_and_after():
    model, opt, batch = make_training()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = opt.state_dict()["state"]
    loss = assert_reproducible(train_step, model, opt, batch, runs=3)
    assert loss.shape == ()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats too
    assert not model.training  # train/eval flags put back
    assert opt.state_dict()["state"] == opt_before == {}
    assert all(p.grad is None for p in model.parameters())


def test_closures_need_reset_for_their_objects():
    model, opt, batch = make_training()
    step = functools.partial(train_step, model, opt)
    # The partial is not a module: without reset=, run 2 starts from trained weights.
    with pytest.raises(NotReproducibleError):
        assert_reproducible(lambda: step(batch))
    model, opt, batch = make_training()
    step = functools.partial(train_step, model, opt)
    assert_reproducible(lambda: step(batch), reset=[model, opt])


def test_fn_bound_to_a_module_is_reset():
    model, _, batch = make_training()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    assert_reproducible(model.forward, batch)  # BatchNorm updates running stats in train mode
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_replaced_parameter_is_put_back():
    with deterministic(seed=0):
        model = torch.nn.Linear(2, 2)
    original = model.weight

    def swap():
        model.weight = torch.nn.Parameter(torch.zeros(2, 2))
        return model.weight.sum()

    assert_reproducible(swap, reset=[model])
    assert model.weight is original


def test_lazy_modules_must_be_materialized_before_they_can_be_reset():
    with pytest.raises(ValueError, match=r"LazyLinear.weight is an uninitialized lazy parameter"):
        assert_reproducible(torch.nn.LazyLinear(2), torch.ones(1, 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"runs": 1}, ValueError, "runs must be an int >= 2, got 1"),
        ({"runs": 2.0}, TypeError, "runs must be an int >= 2, got float 2.0"),
        ({"runs": True}, TypeError, "runs must be an int >= 2, got bool True"),
        ({"seed": -1}, ValueError, "seed must be in 0 .. 4294967295"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
        ({"warn_only": 1}, TypeError, "warn_only must be True or False"),
        (
            {"reset": [object()]},
            TypeError,
            "reset must contain modules, optimizers or other objects",
        ),
        ({"reset": torch.nn.Linear(1, 1)}, TypeError, "reset must be an iterable"),
    ],
)
def test_invalid_arguments(kwargs, error, message):
    with pytest.raises(
        error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        assert_reproducible(lambda: 1, **kwargs)


def test_fn_must_be_a_synchronous_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int 3"):
        assert_reproducible(3)

    async def coro():
        return 1

    with pytest.raises(TypeError, match="fn must be synchronous"):
        assert_reproducible(coro)


def test_warn_only_reaches_the_block():
    seen = assert_reproducible(torch.is_deterministic_algorithms_warn_only_enabled, warn_only=True)
    assert seen is True
