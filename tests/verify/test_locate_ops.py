"""locate_divergence(ops=True): the first aten op that differs, with the user's file:line;
and the op recorder it uses (deterministic_ctx.verify.ops)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from deterministic_ctx import MisuseError, deterministic
from deterministic_ctx.verify.locate import locate_divergence
from deterministic_ctx.verify.ops import OpCall, OpRecorder, TensorPrint, first_op_difference
from tests.helpers import run_python
from tests.verify.test_locate import Flip, Noise, build, call_index

SOURCE = Path(__file__).read_text().splitlines()

#: "Scatter." where Python names a code object's class (co_qualname, 3.11+); 3.10
#: names the function only, and the library cannot know better.
_QUALIFIED = "Scatter." if sys.version_info >= (3, 11) else ""


def line(marker: str) -> str:
    """``file:line`` of the line of this file that ends with the comment ``# <marker>``."""
    [number] = [n for n, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# {marker}")]
    return f"{__file__}:{number}"


def urandom_permutation(n: int) -> np.ndarray:
    """A permutation of range(n) that differs from run to run: no block can seed it."""
    return np.random.default_rng(int.from_bytes(os.urandom(8), "little")).permutation(n)


def urandom_scale() -> float:
    """A factor in [1, 1.5) from os.urandom: a different float32 in every run."""
    return 1 + int.from_bytes(os.urandom(4), "little") / 2**33


class Scatter(nn.Module):
    """``index_add_`` whose index order or scale comes from os.urandom (the planted bug)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("index", torch.arange(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        if self.how == "from_numpy":
            index = torch.from_numpy(urandom_permutation(len(x)))  # scatter: from_numpy
            return out.index_add_(0, index, x)
        if self.how == "numpy_write":
            self.index.numpy()[:] = urandom_permutation(len(x))  # no op sees a NumPy write
            return out.index_add_(0, self.index, x)  # scatter: numpy_write
        return out.index_add_(0, self.index, x, alpha=urandom_scale())  # scatter: alpha


class ReorderedSum(nn.Module):
    """Running sums of the rows, added up in an order chosen by os.urandom."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.unbind(0)
        order = urandom_permutation(len(rows))
        total = rows[order[0]]
        partial = [total]
        for i in order[1:]:
            total = total + rows[i]  # reduction: add
            partial.append(total)
        return torch.stack(partial)


class ScaledGrad(torch.autograd.Function):
    """Identity forward; backward index_adds the gradient with a scale from os.urandom."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        index = torch.arange(len(grad), device=grad.device)
        scale = urandom_scale()
        return torch.zeros_like(grad).index_add_(0, index, grad, alpha=scale)  # grad: alpha


class BackwardScatter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledGrad.apply(x)


@pytest.fixture
def recorders(monkeypatch):
    """Every OpRecorder that exits during the test, in order."""
    exited: list[OpRecorder] = []
    original = OpRecorder.__exit__

    def spy(self, *exc):
        original(self, *exc)
        if self not in exited:
            exited.append(self)

    monkeypatch.setattr(OpRecorder, "__exit__", spy)
    return exited


def assert_no_mode_left() -> None:
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.is_anomaly_enabled()


# --- the planted op is named with its file:line --------------------------------------------------


@pytest.mark.parametrize(
    ("how", "op", "marker", "says"),
    [
        # The index is the first tensor that differs: the op that brings it into torch is named.
        (
            "from_numpy",
            "aten.lift_fresh.default",
            "scatter: from_numpy",
            "made from Python or NumPy",
        ),
        # Every tensor index_add_ reads agrees, its result does not: the op made the difference.
        ("alpha", "aten.index_add_.default", "scatter: alpha", "the op made the difference"),
    ],
)
def test_an_op_fed_by_os_urandom_is_named_with_its_line(how, op, marker, says):
    model, x = build(planted=2, extra=functools.partial(Scatter, how))
    report = locate_divergence(model, x, ops=True)
    d = report.divergence
    assert d is not None and (d.module, d.module_type) == ("blocks.2.extra", "Scatter")
    assert (d.op, d.op_location) == (op, line(marker))
    assert d.op_detail is not None and says in d.op_detail
    assert f"during module call #{call_index(2, 3)}" in d.op_detail
    assert f"(in {_QUALIFIED}forward)" in d.op_detail
    assert_no_mode_left()


def test_a_tensor_changed_behind_torchs_back_names_no_op(recorders):
    # index_add_ reads the buffer changed through NumPy: it only read it, so it is not
    # named; the op calls before the module call agree, so no op made it.
    model, x = build(planted=2, extra=functools.partial(Scatter, "numpy_write"))
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and (d.module, d.op, d.op_location) == ("blocks.2.extra", None, None)
    index = call_index(2, 3)
    assert d.op_detail is not None and d.op_detail.startswith(
        f"none: module call #{index} read a differing tensor that no op during the call made "
        f"(input 'index', read by aten.index_add_.default at {line('scatter: numpy_write')}"
    )
    assert "agree on every one" in d.op_detail and "changed outside torch ops" in d.op_detail
    # Two re-runs of the call, then two from the start of fn until the call starts.
    assert len(recorders) == 4
    assert [c.op for c in recorders[0].calls][-1] == "aten.index_add_.default"
    assert len(recorders[2].calls) > 10 and "aten.index_add_.default" not in {
        c.op for c in recorders[2].calls
    }
    assert_no_mode_left()


def test_an_input_made_between_module_calls_names_the_op_that_made_it():
    # An unseeded randn between two module calls: the next call's first op reads a differing
    # input; the op that made it ran before the call, and is named.
    model, x = build()
    leak = torch.Generator()

    def fn():
        h = model.blocks[0](x)
        noise = torch.randn(h.shape, generator=leak)  # between calls: randn
        h = h + 1e-3 * noise
        return model.blocks[1](h)

    report = locate_divergence(fn, reset=[model], ops=True)
    d = report.divergence
    assert d is not None and d.phase == "forward" and d.module == "blocks.1.linear"
    assert (d.op, d.op_location) == ("aten.randn.generator", line("between calls: randn"))
    assert d.op_detail is not None
    assert f"before module call #{d.call_index}" in d.op_detail
    assert "read a differing tensor that no op during the call made" in d.op_detail
    assert "the op made the difference" in d.op_detail


def test_a_differing_outside_input_names_no_op_in_any_window():
    # The whole-run window: a tensor fn reads, changed through NumPy by the run before and
    # made by no op; .numpy() reads it first, through aten.detach.  Each run writes other
    # values, from a counter that no block resets: a random permutation of 4 items came out
    # the same in both runs once in 24.
    held = torch.zeros(4)
    runs = itertools.count()

    def fn():
        view = held.numpy()  # outside: detach
        view[:] = np.arange(4) + 10 * next(runs)
        return held * 2

    d = locate_divergence(fn, ops=True).divergence
    assert d is not None and d.phase == "result"
    assert (d.op, d.op_location) == (None, None)
    assert d.op_detail is not None
    assert d.op_detail.startswith(f"none: aten.detach.default at {line('outside: detach')}")
    assert "no recorded op made it" in d.op_detail


def test_a_reordered_reduction_is_named_by_the_first_op_that_differs():
    model, x = build(planted=1, extra=ReorderedSum)
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and d.module == "blocks.1.extra"
    # unbind agrees (same rows); the first sum of two rows taken in another order differs.
    assert (d.op, d.op_location) == ("aten.add.Tensor", line("reduction: add"))
    assert d.op_detail is not None and "the op made the difference" in d.op_detail


def test_only_the_differing_module_call_is_recorded(recorders):
    model, x = build(planted=3)  # Noise: x + 1e-3 * randn(generator=its own)
    report = locate_divergence(model, x, ops=True)
    d = report.divergence
    assert d is not None and d.op == "aten.randn.generator"
    assert d.op_location is not None and d.op_location.endswith(
        f"test_locate.py:{Noise.forward.__code__.co_firstlineno + 1}"
    )
    # Two re-runs, each recording only the three ops of Noise.forward: not the 5 x 4 other
    # module calls, nor a gradient, parameter or fingerprint of the hooks.
    assert len(recorders) == 2
    for rec in recorders:
        assert [c.op for c in rec.calls] == [
            "aten.randn.generator",
            "aten.mul.Tensor",
            "aten.add.Tensor",
        ]
    # The module-level report is the one ops=False gives, with the op added.
    # The module-level report is the one ops=False gives (but for the noise's values).
    plain = locate_divergence(model, x).to_dict()
    data = report.to_dict()
    assert (data.pop("ops"), plain.pop("ops")) == (True, False)
    for key in ("op", "op_location", "op_detail"):
        assert plain["divergence"].pop(key) is None
        assert data["divergence"].pop(key) is not None
    for key in ("detail", "index", "max_abs_diff"):
        data["divergence"].pop(key)
        plain["divergence"].pop(key)
    assert data == plain


def test_a_reproducible_model_records_no_ops(recorders, monkeypatch):
    entered = []
    original = OpRecorder.__enter__
    monkeypatch.setattr(
        OpRecorder, "__enter__", lambda self: entered.append(self) or original(self)
    )
    model, x = build()

    def step():
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    report = locate_divergence(step, reset=[model], backward=True, ops=True)
    assert report.agree and report.ops
    assert entered == [] and recorders == []
    assert str(report) == str(locate_divergence(step, reset=[model], backward=True))


def test_ops_false_is_unchanged(recorders):
    model, x = build(planted=3)
    report = locate_divergence(model, x)
    d = report.divergence
    assert d is not None and (d.op, d.op_location, d.op_detail) == (None, None, None)
    assert not report.ops and recorders == []
    assert "first differing op" not in str(report)


# --- backward ------------------------------------------------------------------------------------


def backward_step():
    model, x = build(planted=3, extra=BackwardScatter)

    def step():
        model.zero_grad()
        model(x).sum().backward()

    return model, step


def test_a_custom_backward_is_named_with_its_line(recorders):
    model, step = backward_step()
    report = locate_divergence(step, reset=[model], backward=True, ops=True)
    d = report.divergence
    assert d is not None and (d.phase, d.module, d.what) == (
        "backward",
        "blocks.3.extra",
        "gradient w.r.t. input[0]",
    )
    assert (d.op, d.op_location) == ("aten.index_add_.default", line("grad: alpha"))
    assert d.op_detail is not None
    assert "in the backward of ScaledGradBackward" in d.op_detail
    assert "in the backward pass up to that gradient" in d.op_detail
    # Only backward ops, and none after the differing gradient: the later blocks' backward
    # ran first, blocks 0-2 after it.
    for rec in recorders:
        assert rec.calls and all(c.node is not None for c in rec.calls)
        assert rec.calls[-1].op == "aten.index_add_.default"
    assert_no_mode_left()


def test_a_gradient_found_after_fn_returned_records_the_whole_run():
    model, step = backward_step()
    d = locate_divergence(step, reset=[model], ops=True).divergence
    assert d is not None and d.phase == "final"
    assert (d.op, d.op_location) == ("aten.index_add_.default", line("grad: alpha"))
    assert d.op_detail is not None and "in the whole run" in d.op_detail


def test_built_in_backward_ops_are_placed_at_their_forward_line():
    x = torch.ones(4, requires_grad=True)
    index = torch.tensor([0, 2, 2])
    with OpRecorder(phase="backward", node_locations=True) as rec:
        y = x[index]  # forward: index
        y.sum().backward()
    placed = {(c.location, c.function) for c in rec.calls if c.node == "IndexBackward0"}
    assert placed == {
        (
            line("forward: index"),
            test_built_in_backward_ops_are_placed_at_their_forward_line.__qualname__,
        )
    }
    # Without node locations: the line that started the backward pass.
    with OpRecorder(phase="backward") as rec:
        y = x[index]
        y.sum().backward()  # backward: started here
    placed = {c.location for c in rec.calls if c.node == "IndexBackward0"}
    assert placed == {line("backward: started here")}
    x.grad = None


def test_ops_of_autograd_grad_are_placed_at_their_forward_line():
    # torch 2.1 has no _engine_run_backward: torch.autograd.grad calls the engine itself.
    x = torch.ones(4, requires_grad=True)
    index = torch.tensor([0, 2, 2])
    with OpRecorder(phase="backward", node_locations=True) as rec:
        y = x[index]  # forward of grad: index
        (grad,) = torch.autograd.grad(y.sum(), x)
    placed = {c.location for c in rec.calls if c.node == "IndexBackward0"}
    assert placed == {line("forward of grad: index")}
    assert grad.tolist() == [1.0, 0.0, 2.0, 0.0]


# --- other kinds of divergence ------------------------------------------------------------------


def test_control_flow_names_the_op_that_decided_it():
    model, x = build()
    leak = torch.Generator().manual_seed(3)

    def branchy():
        h = model.blocks[0](x)
        if torch.rand(1, generator=leak).item() < 0.5:  # control flow: rand
            h = model.blocks[1](h)
        return model.head(h)

    report = None
    for _ in range(20):  # until the two runs take different branches
        report = locate_divergence(branchy, reset=[model], ops=True)
        if not report.agree and report.divergence.kind == "call":
            break
    d = report.divergence
    assert d is not None and d.kind == "call"
    # The generator is never reset, so the re-runs' draws differ whatever branch they take.
    assert (d.op, d.op_location) == ("aten.rand.generator", line("control flow: rand"))
    assert d.op_detail is not None and "before module call #4" in d.op_detail


def test_a_different_return_value_records_the_whole_run():
    model, x = build()
    leak = torch.Generator()
    report = locate_divergence(
        lambda: {"out": model(x), "noise": torch.rand(1, generator=leak)},  # result: rand
        ops=True,
    )
    d = report.divergence
    assert d is not None and d.phase == "result"
    assert (d.op, d.op_location) == ("aten.rand.generator", line("result: rand"))
    assert d.op_detail is not None and "in the whole run" in d.op_detail


def test_an_op_called_in_one_run_only_is_named():
    model, x = build(planted=2, extra=Flip)  # x in one run, -x in the next
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and d.op == "aten.neg.default"
    assert d.op_location is not None and d.op_location.endswith(
        f"test_locate.py:{Flip.forward.__code__.co_firstlineno + 2}"
    )
    assert d.op_detail is not None and "run 3 made no more op calls" in d.op_detail


class Pick(nn.Module):
    """Returns one of two tensors it holds: differs from call to call without any op."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.calls = 0
        self.a, self.b = torch.zeros(8, 16), torch.ones(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b if self.calls % self.every == 0 else self.a


def test_no_op_to_name_is_explained():
    # Runs 1 and 2 differ, so do the re-runs 3 and 4, but no op ran in the module call.
    model, x = build(planted=1, extra=functools.partial(Pick, 2))
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and d.op is None and d.op_location is None
    assert d.op_detail is not None and d.op_detail.startswith("none: no aten op ran")
    assert "first differing op: none: no aten op ran during module call #" in str(
        locate_divergence(model, x, ops=True)
    )


class Once(nn.Module):
    """Differs in its second call only: the re-runs agree again."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (2 if self.calls == 2 else 1)


def test_an_intermittent_difference_is_explained():
    model, x = build(planted=1, extra=Once)
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and d.op is None
    assert d.op_detail is not None and "agree on every one" in d.op_detail


def test_report_shows_the_op():
    model, x = build(planted=2, extra=functools.partial(Scatter, "alpha"))
    report = locate_divergence(model, x, ops=True)
    text = str(report)
    assert f"first differing op: aten.index_add_.default at {line('scatter: alpha')}" in text
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["ops"] is True
    assert data["divergence"]["op"] == "aten.index_add_.default"
    assert data["divergence"]["op_location"] == line("scatter: alpha")
    assert data["divergence"]["location"] == "blocks.2.extra (Scatter)"  # the module, as before


# Anomaly mode, on in re-runs that record a backward pass, warns with the forward stack.
@pytest.mark.filterwarnings("ignore:Error detected in FailsBackward")
def test_a_recording_that_fails_keeps_the_module_report_and_leaves_no_mode_behind():
    class Fails(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            Fails.calls += 1
            if Fails.calls == 3:  # the first re-run, recording the backward pass
                raise RuntimeError("in backward")
            return grad * Fails.calls

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return Fails.apply(self.linear(x))

    with deterministic(seed=0):
        model = Model()

    def step():
        model.zero_grad()
        model(torch.ones(1, 2)).sum().backward()

    report = locate_divergence(step, reset=[model], backward=True, ops=True)
    d = report.divergence
    assert d is not None and d.phase == "backward"
    assert d.op is None and d.max_abs_diff is not None  # measured by two plain re-runs
    assert d.op_detail is not None and "raised RuntimeError: in backward" in d.op_detail
    assert_no_mode_left()
    # An error in every run is the caller's: it propagates.
    with pytest.raises(RuntimeError, match="always"):
        locate_divergence(lambda: (_ for _ in ()).throw(RuntimeError("always")), ops=True)


def test_invalid_ops_argument():
    with pytest.raises(TypeError, match="ops must be True or False, got 1"):
        locate_divergence(lambda: None, ops=1)


# --- on a GPU: backward ops run on autograd's device thread --------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.backends.cuda.is_built() or not torch.cuda.is_available(), reason="needs CUDA"
)
def test_locate_ops_on_cuda_names_the_op_forward_and_backward():
    model, x = build(planted=3)
    with deterministic(seed=0):
        model, x = model.cuda(), x.cuda()
        model.blocks[3].extra.generator = torch.Generator(device="cuda")
    d = locate_divergence(model, x, ops=True).divergence
    assert d is not None and d.op == "aten.randn.generator"
    assert d.op_location is not None and d.op_location.endswith(
        f"test_locate.py:{Noise.forward.__code__.co_firstlineno + 1}"
    )
    model, _ = backward_step()
    model.cuda()

    def cuda_step():
        model.zero_grad()
        model(torch.ones(8, 16, device="cuda")).sum().backward()

    d = locate_divergence(cuda_step, reset=[model], backward=True, ops=True).divergence
    assert d is not None and d.phase == "backward"
    assert (d.op, d.op_location) == ("aten.index_add_.default", line("grad: alpha"))
    assert_no_mode_left()


# --- the op recorder on its own -----------------------------------------------------------------


def test_recorder_pause_stop_and_errors():
    rec = OpRecorder()
    with pytest.raises(MisuseError, match="available once the recorder has exited"):
        rec.calls  # noqa: B018
    with rec:
        a = torch.ones(2)
        with rec.pause():
            a = a + 1
        b = a * 2  # recorder: mul
        rec.stop()
        assert torch._C._len_torch_dispatch_stack() == 0  # stopped: the mode is off already
        _ = b - 1
    assert [c.op for c in rec.calls] == ["aten.ones.default", "aten.mul.Tensor"]
    # a + 1 was paused: its result is an input from outside the recording.
    assert [p.path for p in rec.calls[1].inputs] == ["input 'self'"]
    assert (rec.calls[1].location, rec.calls[1].function) == (
        line("recorder: mul"),
        "test_recorder_pause_stop_and_errors",
    )
    with pytest.raises(MisuseError, match="records once"):
        rec.__enter__()
    with pytest.raises(ValueError, match="phase must be one of 'any', 'forward', 'backward'"):
        OpRecorder(phase="both")
    with pytest.raises(TypeError, match="inputs must be True or False, got 1"):
        OpRecorder(inputs=1)


def test_recorder_sees_numbers_and_changes_in_place():
    with OpRecorder() as rec:
        x = torch.zeros(3)
        x.add_(1)
        torch._foreach_add_([x], 1.0)  # returns nothing: the changed list is recorded
        value = x.sum().item()
    ops = [c.op for c in rec.calls]
    assert ops == [
        "aten.zeros.default",
        "aten.add_.Tensor",
        "aten._foreach_add_.Scalar",
        "aten.sum.default",
        "aten._local_scalar_dense.default",
    ]
    assert [p.path for p in rec.calls[2].outputs] == ["self[0] (changed in place)"]
    assert rec.calls[4].outputs == (TensorPrint("output", (), "float", repr(value).encode()),)


def call(op: str, out: bytes, *, inputs: tuple[TensorPrint, ...] = (), index: int = 0) -> OpCall:
    return OpCall(
        index, op, "m.py:1", "f", None, (TensorPrint("output", (2,), "float32", out),), inputs
    )


def test_first_op_difference_kinds():
    same = [call("aten.ones.default", b"a")]
    assert first_op_difference(same, same) is None
    cases = [
        ([call("aten.mul.Tensor", b"a")], [call("aten.add.Tensor", b"a")], "op", ""),
        ([call("aten.mul.Tensor", b"a")], [call("aten.mul.Tensor", b"b")], "values", "output"),
        (same + same, same, "missing", ""),
        (same, same + same, "extra", ""),
    ]
    outside = TensorPrint("input 'self'", (2,), "float32", b"x")
    moved = TensorPrint("input 'self'", (3,), "float32", b"x")
    cases += [
        (
            [call("aten.neg.default", b"a", inputs=(outside,))],
            [
                call(
                    "aten.neg.default",
                    b"b",
                    inputs=(TensorPrint("input 'self'", (2,), "float32", b"y"),),
                )
            ],
            "input",
            "input 'self'",
        ),
        (
            [call("aten.neg.default", b"a", inputs=(outside,))],
            [call("aten.neg.default", b"a", inputs=(moved,))],
            "shape",
            "input 'self'",
        ),
    ]
    for a, b, kind, what in cases:
        found = first_op_difference(a, b, left="run 3", right="run 4")
        assert found is not None and (found.kind, found.what) == (kind, what), found
        assert "run 3" in found.detail or kind == "extra"


def test_recording_ops_does_not_import_dynamo():
    # A fresh process: recording imports no torch._dynamo (about 2 s); once something else
    # imported it, the mode goes through torch._dynamo.disable and records as before.
    code = """
import sys, torch
from deterministic_ctx.verify.ops import OpRecorder
modes = []
def record():
    with OpRecorder() as rec:
        (torch.ones(2, requires_grad=True) * 2).sum().backward()
    modes.append(rec._mode)
    return [(c.op, c.location) for c in rec.calls]
plain = record()
print("torch._dynamo" in sys.modules)
import torch._dynamo
print(record() == plain, ["_unseen_by_dynamo" in vars(m) for m in modes], plain[:2])
"""
    done = run_python([], code=code, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False",
        "True [False, True] [('aten.ones.default', '<string>:7'), ('aten.mul.Tensor', '<string>:7')]",
    ]
