"""assert_batch_invariant: each row of fn(batch) against fn on that row alone, bit for bit.

A note on ``nn.Linear`` on the CPU, measured with torch 2.13 (MKL, AVX2, random
float32 weights and inputs, 48 shapes per row of this table, batch 2 to 33):

    in_features     1     2     3     4    16   512   3-D (B, T, 16 or 64)
    rows differ  0/48  9/48  9/48 24/48 45/48 48/48   8/16

One row alone takes MKL's matrix-vector kernel, which sums the products (and
fuses multiply-adds) in another order than the matrix-matrix kernel of bigger
batches, and the matrix-matrix kernel's blocking changes with the number of
rows too.  Only a single product per output (in_features=1) always agreed.
Which shapes agree depends on the data, the CPU and the BLAS, so the tests
that must pass use values whose products and partial sums are all exact in
float32 (multiples of 1/32 below 17 in magnitude, far fewer than 2**24 steps):
every summation order, on every kernel, gives the same bits.  Random weights
are checked against a row-by-row oracle instead, which holds whatever the
kernels do.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx import deterministic
from deterministic_ctx.verify import (
    BatchInvarianceError,
    NotReproducibleError,
    assert_batch_invariant,
)


def built(make, *args):
    """``make(*args)`` in a block: initializing a module draws from torch's global RNG."""
    with deterministic(0):
        return make(*args)


def exact_linear(in_features=16, out_features=8, device="cpu"):
    """A Linear whose weights and bias are multiples of 1/4 in [-1, 1]."""
    gen = torch.Generator().manual_seed(1)
    lin = built(torch.nn.Linear, in_features, out_features)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-4, 5, lin.weight.shape, generator=gen) / 4)
        lin.bias.copy_(torch.randint(-4, 5, lin.bias.shape, generator=gen) / 4)
    return lin.to(device)


def exact_batch(*shape, device="cpu"):
    """Inputs that are multiples of 1/8 in [-1, 1]: products with exact_linear's weights
    are multiples of 1/32, and sums of 16 of them stay exact in float32."""
    gen = torch.Generator().manual_seed(2)
    return (torch.randint(-8, 9, shape, generator=gen) / 8).to(device)


def random_batch(*shape, seed=3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def differing_rows(fn, batch):
    """The oracle: rows of fn(batch) that differ from fn on a copy of batch[i:i+1]."""
    with torch.no_grad():
        full = fn(batch)
        return [
            i
            for i in range(batch.shape[0])
            if not torch.equal(full[i : i + 1], fn(batch[i : i + 1].clone()))
        ]


def batch_centered(b):
    """Subtracts the batch mean: every row depends on the others."""
    return {"logits": b - b.mean(dim=0, keepdim=True), "n": 1}


# --- passing --------------------------------------------------------------------------------------


def test_linear_with_exact_values_passes_and_returns_the_batched_result():
    lin, x = exact_linear(), exact_batch(6, 16)
    assert differing_rows(lin, x) == []  # the oracle agrees: exact sums, any kernel
    out = assert_batch_invariant(lin, x)
    assert torch.equal(out, lin(x))


def test_three_dimensional_batch_of_a_linear_passes():
    lin, x = exact_linear(), exact_batch(4, 5, 16)
    assert torch.equal(assert_batch_invariant(lin, x), lin(x))


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(2, 3, 8), (5, 4, 8), (8, 16, 2), (4, 64, 8), (33, 512, 64)],
)
def test_linear_with_random_weights_agrees_with_the_row_by_row_oracle(
    rows, in_features, out_features
):
    # Whatever this CPU's kernels do, the check must say what the oracle says.
    gen = torch.Generator().manual_seed(rows)
    lin = built(torch.nn.Linear, in_features, out_features)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = random_batch(rows, in_features)
    expected = differing_rows(lin, x)
    if not expected:
        assert_batch_invariant(lin, x)
        return
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(lin, x)
    err = info.value
    assert err.row == expected[0]
    assert err.path == "result"
    assert err.index[0] == expected[0]
    assert "Only the last bits differ" in str(err)
    assert "matrix-vector kernel, so even nn.Linear differs" in str(err)


def test_elementwise_function_passes_for_every_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool):
        x = torch.arange(12).reshape(4, 3).to(dtype)
        assert torch.equal(assert_batch_invariant(lambda b: b * 1, x), x)


def test_batchnorm_in_eval_mode_passes():
    bn = torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.running_mean.copy_(random_batch(4))
        bn.running_var.copy_(random_batch(4).abs() + 0.5)
    bn.eval()
    assert_batch_invariant(bn, random_batch(5, 4, 3))


def test_batch_of_one_row_passes():
    lin, x = exact_linear(), exact_batch(1, 16)
    assert torch.equal(assert_batch_invariant(lin, x), lin(x))


# --- failing --------------------------------------------------------------------------------------


def test_function_normalizing_over_the_batch_fails_naming_row_and_leaf():
    x = random_batch(4, 3)
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(batch_centered, x, seed=5)
    err = info.value
    assert isinstance(err, NotReproducibleError)
    assert isinstance(err, AssertionError)
    assert (err.row, err.path, err.index, err.seed, err.run) == (
        0,
        'result["logits"]',
        (0, 0),
        5,
        None,
    )
    expected = (x - x.mean(0))[0].abs().max().item()  # alone, the row minus itself is 0
    assert err.max_abs_diff == pytest.approx(expected, rel=1e-6)
    message = str(err)
    assert message.startswith(
        "batch_centered is not batch-invariant with seed=5: row 0 of batch_centered(batch) "
        '(dim=0, out_dim=0) differs from batch_centered(batch[0:1]) at result["logits"]: '
        "values differ at index (0, 0)"
    )
    assert "(in the batch)" in message
    assert "(alone)" in message
    assert "3 of 3 element(s) differ" in message
    assert "more than rounding" in message
    assert "reduction over the batch" in message


def test_first_differing_row_is_named_when_earlier_rows_agree():
    def minus_first(b):  # row 0 alone and in the batch are both 0; the others differ
        return b - b[:1]

    x = random_batch(4, 2)
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(minus_first, x)
    assert (info.value.row, info.value.index) == (1, (1, 0))
    assert "minus_first is not batch-invariant with seed=0: row 1 of " in str(info.value)
    assert "minus_first(batch[1:2]) at result:" in str(info.value)


def test_batchnorm_in_training_mode_fails_with_a_hint_and_is_reset():
    model = built(lambda: torch.nn.Sequential(torch.nn.Conv1d(2, 4, 1), torch.nn.BatchNorm1d(4)))
    bn = model[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(model, random_batch(5, 2, 3))
    assert info.value.row == 0
    assert info.value.path == "result"
    assert "BatchNorm1d (submodule '1') is in training mode" in str(info.value)
    assert "Call .eval()" in str(info.value)
    # Every call updated the running statistics; the check put them back.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert bn.training and model.training


def test_an_error_of_a_lone_call_is_the_cause():
    model = built(lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(model, random_batch(5, 3))
    err = info.value
    assert isinstance(err.__cause__, ValueError)
    assert "Expected more than 1 value per channel" in str(err.__cause__)
    assert err.row == 0
    assert err.path is None
    assert "Sequential(batch[0:1]) raised ValueError" in str(err)
    assert "BatchNorm1d (submodule '1') is in training mode" in str(err)


def test_an_error_of_the_batched_call_propagates_as_is():
    def broken(b):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        assert_batch_invariant(broken, torch.ones(2, 1))


def test_random_ops_draw_for_the_batch_shape():
    # Every call starts from the same seed: a scalar draw is the same for every row ...
    x = torch.zeros(4, 3)
    out = assert_batch_invariant(lambda b: b + torch.rand(()), x, seed=2)
    with deterministic(2):
        assert torch.equal(out, x + torch.rand(()))
    # ... but a draw of the batch's shape gives other rows other numbers.
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(lambda b: b + torch.rand(b.shape), x)
    assert info.value.row in (0, 1)  # on CPU the first row's draws agree (serial draws)
    assert "random ops" in str(info.value)


def test_training_mode_dropout_is_named():
    model = built(lambda: torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Dropout(0.5)))
    with torch.no_grad():
        model[0].load_state_dict(exact_linear().state_dict())
    with pytest.raises(BatchInvarianceError, match=r"Dropout \(submodule '1'\) is in training"):
        assert_batch_invariant(model, exact_batch(6, 16))
    model.eval()
    assert_batch_invariant(model, exact_batch(6, 16))


def test_a_shape_that_changes_for_one_row_is_named():
    def squeezing(b):
        return (b * 2).squeeze(0)  # drops the batch dimension for a single row

    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(squeezing, torch.ones(3, 2))
    err = info.value
    assert (err.row, err.path, err.index, err.max_abs_diff) == (0, "result", None, None)
    assert "shape differs: (1, 2) (in the batch) vs (2,) (alone)" in str(err)
    assert "squeeze()" in str(err)
    assert "reduction" not in str(err)


def test_non_tensor_leaves_of_the_result_must_be_equal():
    def counting(b):
        return {"y": b * 2, "rows": b.shape[0]}

    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(counting, torch.ones(3, 2))
    assert info.value.path == 'result["rows"]'
    assert "leave out what depends on the batch (its size, for one)" in str(info.value)
    assert "3 (in the batch) != 1 (alone)" in str(info.value)
    assert_batch_invariant(lambda b: {"y": b * 2, "tag": "ok", "none": None}, torch.ones(3, 2))


# --- structures in and out ---------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: list[torch.Tensor]
    name: str = "out"
    cache: torch.Tensor | None = dataclasses.field(default=None, compare=False)


Pair = namedtuple("Pair", ["first", "second"])


def test_structures_in_and_out_with_extra_arguments():
    seen = []

    def model(batch, scale, *, shift):
        seen.append(tuple(batch["x"].shape))
        assert batch["tag"] == "keep"  # non-tensor members reach fn as they are
        assert isinstance(batch["pair"], Pair)
        x = batch["x"] * scale + shift
        return Output(
            logits=x.sum(dim=-1, keepdim=True) * batch["mask"][:, None],
            hidden=[x, batch["pair"].second.float()],
            cache=torch.zeros(7),  # not compared: compare=False, so not sliced
        )

    batch = {
        "x": exact_batch(4, 3),
        "mask": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "tag": "keep",
        "pair": Pair(torch.ones(4, 2), torch.arange(4)),
    }
    out = assert_batch_invariant(model, batch, 2.0, shift=0.5)
    assert seen == [(4, 3), (1, 3), (1, 3), (1, 3), (1, 3)]
    assert isinstance(out, Output)
    assert out.hidden[1].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_failure_inside_a_structure_names_the_leaf_path():
    def model(pair):
        first, second = pair
        return OrderedDict(a=Pair(first * 2, [second, second - second.mean(0)]))

    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(model, (torch.ones(3, 2), random_batch(3, 2)))
    assert info.value.path == 'result["a"].second[1]'
    assert info.value.index == (0, 0)


def test_structures_keep_their_types_through_slicing():
    seen = []

    def model(batch):
        seen.append(type(batch["d"]))
        return [batch["d"]["v"] + 1, (batch["t"],)]

    batch = OrderedDict(d=defaultdict(list, v=torch.ones(2, 1)), t=torch.zeros(2))
    out = assert_batch_invariant(model, batch)
    assert isinstance(out, list)
    assert all(kind is type(batch["d"]) for kind in seen)


def test_frozen_dataclass_results_are_rebuilt():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        y: torch.Tensor
        n: int = dataclasses.field(default=0, init=False)

    assert_batch_invariant(lambda b: Frozen(b * 3), torch.ones(3, 2))


def test_batch_is_one_argument_and_a_lambda_unpacks_it():
    lin = exact_linear(3, 2)

    def masked(x, mask):
        return lin(x) * mask[:, None]

    assert_batch_invariant(lambda b: masked(*b), (exact_batch(5, 3), torch.ones(5)))


# --- dim, out_dim, rows -------------------------------------------------------------------------


def test_dim_one():
    lin = exact_linear(16, 8)
    x = exact_batch(16, 5)  # features first, 5 rows along dim 1
    out = assert_batch_invariant(lambda b: lin(b.T).T, x, dim=1)
    assert out.shape == (8, 5)

    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(
            lambda b: b - b.mean(dim=1, keepdim=True), random_batch(3, 4), dim=1, rows=[2]
        )
    err = info.value
    assert (err.row, err.index, err.dim, err.out_dim) == (2, (0, 2), 1, 1)
    assert "(dim=1, out_dim=1) differs from " in str(err)
    assert "<lambda>(batch.narrow(1, 2, 1)) at result:" in str(err)


def test_negative_dim_and_another_out_dim():
    x = exact_batch(4, 3)
    out = assert_batch_invariant(lambda b: b.T * 2, x, dim=-2, out_dim=-1)
    assert out.shape == (3, 4)
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(lambda b: (b - b.mean(0)).T, random_batch(4, 3), out_dim=1, rows=[3])
    assert (info.value.row, info.value.index, info.value.out_dim) == (3, (0, 3), 1)


def test_rows_bounds_the_calls():
    calls = []

    def record(b):
        calls.append(b.shape[0])
        return b * 2

    x = torch.arange(10.0).reshape(10, 1)
    assert_batch_invariant(record, x)
    assert calls == [10] + [1] * 10
    calls.clear()
    assert_batch_invariant(record, x, rows=[9, -1, 0, np.int64(3)])  # -1 is 9: once
    assert calls == [10, 1, 1, 1]

    def minus_first(b):
        return b - b[:1]

    assert_batch_invariant(minus_first, x, rows=range(1))  # only row 0 agrees
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(minus_first, x, rows=[5, 2])
    assert info.value.row == 5  # the first in the order checked


# --- bad arguments ------------------------------------------------------------------------------


def never_called(b):
    raise AssertionError("fn must not run when the arguments are bad")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"dim": 2},
            ValueError,
            r"dim=2 is out of range for batch of shape \(3, 4\) \(accepted: -2 to 1\)",
        ),
        ({"dim": -3}, ValueError, r"dim=-3 is out of range for batch of shape \(3, 4\)"),
        ({"dim": 1.0}, TypeError, "dim must be an int, got float 1.0"),
        ({"dim": True}, TypeError, "dim must be an int, got bool True"),
        ({"out_dim": "0"}, TypeError, "out_dim must be an int, got str '0'"),
        ({"rows": 3}, TypeError, r"rows must be None \(every row\) or an iterable of ints"),
        ({"rows": "01"}, TypeError, "rows must be None"),
        ({"rows": torch.tensor([0])}, TypeError, "rows must be None"),
        ({"rows": [0, 1.5]}, TypeError, "rows must contain ints, got float 1.5"),
        ({"rows": [True]}, TypeError, "rows must contain ints, got bool True"),
        (
            {"rows": [3]},
            ValueError,
            r"rows has 3, out of range for a batch of 3 row\(s\) \(accepted: -3 to 2\)",
        ),
        ({"rows": [-4]}, ValueError, "rows has -4, out of range"),
        ({"rows": []}, ValueError, "rows must name at least one row"),
        ({"seed": -1}, ValueError, "seed"),
        ({"reset": [3]}, TypeError, "reset must contain modules"),
    ],
)
def test_bad_options_are_named_before_fn_runs(kwargs, error, message):
    with pytest.raises(error, match=message):
        assert_batch_invariant(never_called, torch.ones(3, 4), **kwargs)


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        (
            torch.ones(0, 4),
            ValueError,
            r"batch has no rows: batch has size 0 along dim=0 \(shape \(0, 4\)\)",
        ),
        (
            {"x": torch.ones(3, 4), "mask": torch.ones(2)},
            ValueError,
            r'every tensor in batch must have the same size along dim=0: batch\["x"\] has 3 rows '
            r'\(shape \(3, 4\)\), batch\["mask"\] has 2 \(shape \(2,\)\)',
        ),
        (
            (torch.ones(3, 4), torch.tensor(1.0)),
            ValueError,
            r"dim=0 is out of range for batch\[1\] of shape \(\) \(accepted: none: a 0-dim tensor",
        ),
        (
            [1.0, 2.0],
            TypeError,
            r"batch must be a tensor or a tuple, list, dict, named tuple or dataclass of tensors batched along dim, got list \[1.0, 2.0\], which holds no tensor",
        ),
        (
            np.ones((3, 2)),
            TypeError,
            r"got ndarray of shape \(3, 2\), which holds no tensor; convert arrays with torch.from_numpy",
        ),
        (None, TypeError, "got NoneType None, which holds no tensor"),
        (torch.nn.Identity(), TypeError, "got Identity"),
    ],
)
def test_bad_batches_are_named_before_fn_runs(batch, error, message):
    with pytest.raises(error, match=message):
        assert_batch_invariant(never_called, batch)


def test_bad_fn():
    with pytest.raises(TypeError, match="fn must be callable"):
        assert_batch_invariant(3, torch.ones(2))

    async def coro(b):
        return b

    with pytest.raises(TypeError, match="fn must be synchronous"):
        assert_batch_invariant(coro, torch.ones(2))


def test_results_that_are_not_batched_are_named():
    x = torch.ones(3, 4)
    with pytest.raises(
        ValueError, match=r'is not batched along out_dim=0: result\["loss"\] has shape \(\)'
    ) as info:
        assert_batch_invariant(lambda b: {"y": b, "loss": b.mean()}, x)
    assert "a mean loss" in str(info.value)
    with pytest.raises(ValueError, match=r"result has shape \(4, 3\), not the batch's 3 rows"):
        assert_batch_invariant(lambda b: b.T, x)
    with pytest.raises(ValueError, match=r"not batched along out_dim=2: result has shape \(3, 4\)"):
        assert_batch_invariant(lambda b: b, x, out_dim=2)
    with pytest.raises(ValueError, match=r"returned list \[4.0, 4.0, 4.0\], which holds no tensor"):
        assert_batch_invariant(lambda b: [float(v) for v in b.sum(1)], x)


def test_options_of_fn_with_the_same_names_go_through_partial():
    def shifted(b, *, seed):
        return b + seed

    out = assert_batch_invariant(functools.partial(shifted, seed=1), torch.zeros(2, 1))
    assert out.tolist() == [[1.0], [1.0]]


# --- state: the caller's RNGs, modules, the batch ------------------------------------------------


def test_callers_random_streams_are_untouched():
    def noisy(b):
        return b + torch.rand(()) + random.random() + float(np.random.rand())

    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    assert_batch_invariant(noisy, torch.zeros(3, 1))
    with pytest.raises(BatchInvarianceError):
        assert_batch_invariant(batch_centered, random_batch(3, 2))
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert np.array_equal(after[1], np_state[1])
    assert after[2:] == np_state[2:]
    # (The conftest guard checks every other RNG, flag and variable after each test.)


class Counter(torch.nn.Module):
    """Adds its call count to the input: calls differ unless the module is reset."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x + self.calls


def test_modules_are_reset_before_every_call_and_after():
    counter = Counter()
    assert_batch_invariant(counter, torch.zeros(3, 2))
    assert counter.calls.item() == 0

    def closure(b):  # the module is not an argument: reset= names it
        return counter(b)

    with pytest.raises(BatchInvarianceError):
        assert_batch_invariant(closure, torch.zeros(3, 2))
    counter.calls.zero_()
    assert_batch_invariant(closure, torch.zeros(3, 2), reset=[counter])
    assert counter.calls.item() == 0

    def with_module(b, module):
        return module(b)

    assert_batch_invariant(with_module, torch.zeros(3, 2), counter)
    assert counter.calls.item() == 0


def test_rows_are_copied_before_fn_changes_the_batch_in_place():
    x = torch.arange(6.0).reshape(3, 2)
    rows = []

    def doubling(b):
        rows.append(b)
        return b.mul_(2)

    out = assert_batch_invariant(doubling, x)
    assert out is x  # the batched call got the caller's batch, and changed it
    assert x.tolist() == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
    assert all(r.data_ptr() != x.data_ptr() for r in rows[1:])  # each row its own copy


def test_channels_last_rows_keep_the_layout():
    layouts = []

    def conv(b):
        layouts.append(b.is_contiguous(memory_format=torch.channels_last))
        return b * 2

    x = torch.ones(3, 4, 2, 2).to(memory_format=torch.channels_last)
    assert_batch_invariant(conv, x)
    assert layouts == [True] * 4


def test_grad_mode_is_the_callers():
    lin = exact_linear()
    x = exact_batch(3, 16)
    assert assert_batch_invariant(lin, x).requires_grad
    with torch.no_grad():
        assert not assert_batch_invariant(lin, x).requires_grad
    assert lin.weight.grad is None


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_linear_agrees_with_the_row_by_row_oracle():
    lin = built(torch.nn.Linear, 512, 256).cuda()
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).cuda()
    expected = differing_rows(lin, x)
    if not expected:
        assert_batch_invariant(lin, x)
    else:
        with pytest.raises(BatchInvarianceError) as info:
            assert_batch_invariant(lin, x)
        assert info.value.row == expected[0]
    exact = exact_linear(device="cuda")
    assert_batch_invariant(exact, exact_batch(64, 16, device="cuda"))


# --- the law: the check fails exactly when a row differs, and names the first -------------------


def oracle_rows(fn, batch, dim):
    """Rows ``i`` (along ``dim``) where fn(batch) differs from fn on that row alone."""
    full = fn(batch)
    return [
        i
        for i in range(batch.shape[dim])
        if not torch.equal(full.narrow(dim, i, 1), fn(batch.narrow(dim, i, 1).clone()))
    ]


FUNCTIONS = {
    "elementwise": lambda dim: lambda b: torch.sin(b) * 3 + 1,
    "centered": lambda dim: lambda b: b - b.mean(dim=dim, keepdim=True),
    "cumulative": lambda dim: lambda b: b.cumsum(dim),  # row i depends on rows before it
    "flipped": lambda dim: lambda b: b.flip(dim),
}


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    kind=st.sampled_from(sorted(FUNCTIONS)),
)
def test_check_fails_exactly_when_the_oracle_finds_a_row(shape, data, kind):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    fn = FUNCTIONS[kind](dim)
    batch = exact_batch(*shape)
    expected = oracle_rows(fn, batch, dim)
    if not expected:
        assert torch.equal(assert_batch_invariant(fn, batch, dim=dim), fn(batch))
        return
    with pytest.raises(BatchInvarianceError) as info:
        assert_batch_invariant(fn, batch, dim=dim)
    err = info.value
    assert err.row == expected[0]
    assert err.path == "result"
    assert err.index[dim] == expected[0]
    assert err.dim == err.out_dim == dim


def test_a_reused_output_buffer_cannot_hide_a_batch_dependence():
    # fn writes into one buffer for every call: the lone calls would overwrite
    # the batched rows before the comparison without the copy.
    buffer = torch.empty(0)

    def normalize(x: torch.Tensor) -> torch.Tensor:
        nonlocal buffer
        out = x - x.mean(dim=0)
        if buffer.shape != out.shape:
            buffer = torch.empty_like(out)
        buffer[: len(out)] = out
        return buffer[: len(out)]

    batch = torch.arange(12.0).reshape(4, 3)
    for rows in (None, [0]):
        with pytest.raises(BatchInvarianceError) as raised:
            assert_batch_invariant(normalize, batch, rows=rows)
        assert raised.value.row == 0
