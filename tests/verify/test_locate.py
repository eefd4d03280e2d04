"""locate_divergence: the first module call where two runs differ, and fingerprints."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as nn_module

from deterministic_ctx import deterministic, register_rng, unregister_rng
from deterministic_ctx.verify.locate import locate_divergence
from deterministic_ctx.verify.record import record
from deterministic_ctx.verify.rerun import SavedState
from deterministic_ctx.verify.timeline import _Comparison, compare_runs
from tests.helpers import ROOT, run_python


class Noise(nn.Module):
    """Adds noise from its own generator: a stream no block manages (the planted bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * torch.randn(x.shape, generator=self.generator, device=x.device)


SHARED = torch.Generator()


class SharedNoise(nn.Module):
    """Noise from a module-level generator, which outlives every model built."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * torch.randn(x.shape, generator=SHARED)


class NoisyGrad(torch.autograd.Function):
    """Identity forward; backward adds noise from an unmanaged generator."""

    generator = torch.Generator()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 1e-3 * torch.randn(grad.shape, generator=NoisyGrad.generator)


class BackwardNoise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NoisyGrad.apply(x)


class Flip(nn.Module):
    """Negates its input on every other call: state that no reset reaches (the planted bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x if self.calls % 2 else -x


class Block(nn.Module):
    def __init__(self, width: int, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)  # in-place: gradient hooks must cope
        self.extra = extra if extra is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.act(self.linear(x)))


class Net(nn.Module):
    def __init__(
        self, depth: int = 6, planted: int | None = None, extra: type[nn.Module] = Noise
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(16, extra() if i == planted else None) for i in range(depth)
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(**kwargs) -> tuple[Net, torch.Tensor]:
    with deterministic(seed=1):
        return Net(**kwargs), torch.randn(8, 16)


# Per call of Block: linear, act, extra, then the block itself, in the order calls start.
def call_index(block: int, part: int) -> int:
    return block * 4 + 1 + part


# --- the planted module -----------------------------------------------------------------------


@pytest.mark.parametrize("planted", [0, 3, 5])
def test_names_the_planted_module_and_not_an_earlier_one(planted):
    model, x = build(planted=planted)
    report = locate_divergence(model, x)
    d = report.divergence
    assert not report.agree and d is not None
    assert (d.phase, d.kind, d.module, d.module_type, d.root) == (
        "forward",
        "values",
        f"blocks.{planted}.extra",
        "Noise",
        "Net",
    )
    assert d.call_index == call_index(planted, 3)
    assert d.what == "output" and d.shapes == ((8, 16),) and d.run == 2
    assert d.index == (0, 0) and d.max_abs_diff is not None and 0 < d.max_abs_diff < 0.1
    # Every earlier module call agreed: linear, act and extra of each earlier block, plus the
    # block itself, then this block's linear and act.
    assert report.compared == 4 * planted + 2
    text = str(report)
    assert f"module call #{d.call_index}, blocks.{planted}.extra (Noise), forward output" in text
    assert "max abs difference" in text


def test_a_sign_flip_of_every_element_is_found_where_it_happens():
    # In float64 every sign bit is a word's top bit: two 64-bit sums of the words (plain and
    # weighted by position) miss this flip, and would blame the next module instead.
    model, x = build(planted=2, extra=Flip)
    model, x = model.double(), x.double()
    d = locate_divergence(model, x).divergence
    assert d is not None and (d.module, d.module_type, d.kind) == (
        "blocks.2.extra",
        "Flip",
        "values",
    )
    assert d.max_abs_diff is not None and d.max_abs_diff > 0


def test_inference_mode_is_fine():
    # Inference tensors have no version counter: reading it raised inside the hooks.
    model, x = build(planted=4)

    def infer():
        with torch.inference_mode():
            return model(x)

    d = locate_divergence(infer).divergence
    assert d is not None and d.module == "blocks.4.extra"
    model, x = build()
    assert locate_divergence(infer).agree


def test_deterministic_model_agrees_forward_and_backward():
    model, x = build()

    def step():
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    report = locate_divergence(step, reset=[model], backward=True)
    assert report.agree and report.divergence is None
    assert report.calls == 1 + 6 * 4 + 1
    assert str(report).startswith("Runs agree (seed=0, 2 runs): 26 module calls per run")
    assert all(p.grad is None for p in model.parameters())  # reset put the gradients back
    assert locate_divergence(model, x, runs=3).agree


def test_registering_the_generator_fixes_the_divergence():
    model, x = build(planted=2)
    gen = register_rng(model.blocks[2].extra.generator, key="locate-test")
    try:
        assert locate_divergence(model, x).agree
    finally:
        unregister_rng(gen)


def test_backward_nondeterminism_is_found_with_backward_hooks():
    model, x = build(planted=3, extra=BackwardNoise)

    def step():
        model.zero_grad()
        model(x).sum().backward()

    # Forward only: every output agrees; the gradients after fn returned differ.
    report = locate_divergence(step, reset=[model])
    d = report.divergence
    assert d is not None and d.phase == "final"
    # Gradients are compared last layer first: the first that differs is nearest the cause.
    assert d.what == "gradient of parameter 'bias' after fn returned"
    assert d.module == "blocks.3.linear"

    # With backward hooks: the gradient flowing into the planted module's input.
    report = locate_divergence(step, reset=[model], backward=True)
    d = report.divergence
    assert d is not None and (d.phase, d.module, d.module_type) == (
        "backward",
        "blocks.3.extra",
        "BackwardNoise",
    )
    assert d.what == "gradient w.r.t. input[0]"
    assert d.call_index == call_index(3, 3)
    assert d.max_abs_diff is not None


def test_training_step_with_optimizer_passed_as_arguments():
    model, x = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def train_step(model, opt, x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.item()

    assert locate_divergence(train_step, model, opt, x, backward=True).agree
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}


def test_optimizer_side_nondeterminism_shows_in_the_final_parameters():
    model, x = build()
    leak = torch.Generator()

    def train_step():
        model(x).sum().backward()
        with torch.no_grad():
            model.head.bias.add_(torch.rand(2, generator=leak))  # outside any module call
        model.zero_grad(set_to_none=True)

    report = locate_divergence(train_step, reset=[model])
    d = report.divergence
    assert d is not None and (d.phase, d.module, d.what) == (
        "final",
        "head",
        "parameter 'bias' after fn returned",
    )
    assert d.index == (0,) and d.max_abs_diff is not None


def test_difference_in_the_return_value_outside_modules():
    model, x = build()
    leak = torch.Generator()
    report = locate_divergence(lambda: {"out": model(x), "noise": torch.rand(1, generator=leak)})
    d = report.divergence
    assert d is not None and (d.phase, d.what, d.module) == ("result", 'result["noise"]', None)
    assert d.index == (0,)
    assert 'the return value at result["noise"]' in str(report)


def test_control_flow_divergence_is_a_call_difference():
    model, x = build()
    leak = torch.Generator().manual_seed(3)

    def branchy():
        h = model.blocks[0](x)
        if torch.rand(1, generator=leak).item() < 0.5:
            h = model.blocks[1](h)
        return model.head(h)

    report = None
    for _ in range(20):  # until the two runs take different branches
        report = locate_divergence(branchy, reset=[model])
        if not report.agree:
            break
    d = report.divergence
    assert d is not None and (d.phase, d.kind, d.what) == ("forward", "call", "call")
    assert d.call_index == 4  # the first call after blocks.0 and its three children
    assert {d.module, "head", "blocks.1"} == {"head", "blocks.1"}
    assert "blocks.1 (Block)" in d.detail and "head (Linear)" in d.detail


def test_model_built_inside_fn_is_named_from_its_root():
    x = torch.ones(2, 16)

    def fresh():
        return Net(depth=5, planted=4, extra=SharedNoise)(x)  # weights from the block's seed

    d = locate_divergence(fresh).divergence
    assert d is not None and (d.root, d.module, d.module_type) == (
        "Net",
        "blocks.4.extra",
        "SharedNoise",
    )
    assert d.call_index == call_index(4, 3)
    # A fresh torch.Generator() starts from torch's fixed default seed: this one agrees.
    assert locate_divergence(lambda: Net(depth=5, planted=4)(x)).agree


def test_multi_output_module_names_the_output():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator()

        def forward(self, x):
            return x * 2, {"noisy": x + torch.rand(x.shape, generator=self.gen)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(3, 3)
            self.split = Split()

        def forward(self, x):
            return self.split(self.pre(x))

    with deterministic(seed=0):
        model = Model()
    report = locate_divergence(model, torch.ones(1, 3))
    d = report.divergence
    assert d is not None and (d.module, d.what) == ("split", 'output[1]["noisy"]')
    assert d.shapes == ((1, 3), (1, 3))


def test_calls_from_other_threads_are_ignored():
    model, x = build(depth=5)
    with deterministic(seed=0):
        other = nn.Linear(16, 16)

    def fn():
        worker = threading.Thread(target=lambda: other(x))
        worker.start()
        worker.join()
        return model(x)

    report = locate_divergence(fn)
    assert report.agree and report.calls == 1 + 5 * 4 + 1


def test_hooks_are_removed_even_when_fn_raises():
    model, x = build(depth=5)
    before = (dict(nn_module._global_forward_hooks), dict(nn_module._global_forward_pre_hooks))

    def broken():
        model(x)
        raise RuntimeError("in the step")

    with pytest.raises(RuntimeError, match="in the step"):
        locate_divergence(broken, backward=True)
    assert (
        dict(nn_module._global_forward_hooks),
        dict(nn_module._global_forward_pre_hooks),
    ) == before
    locate_divergence(model, x, backward=True)
    assert (
        dict(nn_module._global_forward_hooks),
        dict(nn_module._global_forward_pre_hooks),
    ) == before
    assert all(not p._backward_hooks for p in model.parameters())


def test_report_to_dict_is_json():
    model, x = build(planted=1)
    data = locate_divergence(model, x).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["agree"] is False
    assert data["divergence"]["location"] == "blocks.1.extra (Noise)"
    assert data["divergence"]["shapes"] == [[8, 16]]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"backward": 1}, TypeError, "backward must be True or False, got 1"),
        ({"runs": 1}, ValueError, "runs must be an int >= 2, got 1"),
        ({"seed": 2**40}, ValueError, "seed must be in 0 .. 4294967295"),
        ({"reset": ["model"]}, TypeError, "reset must contain modules"),
    ],
)
def test_invalid_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        locate_divergence(lambda: None, **kwargs)


# --- runs that recorded the same: compared in one step ------------------------------------------


class Toy(nn.Module):
    """Module calls as a plan says: which child, on how many rows of which value."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.same = nn.Identity()  # its output is the input: -0.0 and 0.0 stay apart
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))

    def forward(self, plan):
        outputs = []
        for child, rows, fill in plan["calls"]:
            if child == 4:  # a module without data: events whose fingerprints are None
                outputs.append(Meta()(rows))
                continue
            x = torch.full((rows, 3), fill)
            outputs.append(self.same(x) if child == 3 else self.linears[child](x))
        total = sum(o.sum() for o in outputs if not o.is_meta)
        if plan["backward"] and torch.is_tensor(total) and total.requires_grad:
            total.backward()
        with torch.no_grad():
            self.linears[0].bias.add_(plan["nudge"])  # after every call: the final state
            self.count += plan["count"]
        return {"total": torch.as_tensor(total).detach(), "calls": len(plan["calls"])}


class Meta(nn.Module):
    def forward(self, rows):
        return torch.empty(rows, 3, device="meta")


def recorded(model, plan, backward):
    def fn():  # the return value has more than the model's output
        return model(plan), torch.tensor([plan["result"]])

    saved = SavedState([model])
    try:
        return record(deterministic(0), fn, (), {}, [model], backward=backward)
    finally:
        saved.load()


def walked(a, b):
    """compare_runs without its one-step comparison of whole recordings: the walk."""
    comparison = _Comparison(a, b, ("run 1", "run 2"))
    return comparison.first(), comparison.agreed


CALLS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(1, 3), st.sampled_from([0.5, 0.5, 0.25, 0.0, -0.0])),
    max_size=5,
)
PLANS = st.fixed_dictionaries(
    {
        "calls": CALLS,
        "result": st.sampled_from([0.0, 0.0, 1.0]),
        "backward": st.booleans(),
        "nudge": st.sampled_from([0.0, 0.0, 0.5]),
        "count": st.sampled_from([0, 0, 1]),
    }
)


@st.composite
def plan_pairs(draw):
    """A plan, and the same plan with a few changes, or none: another shift, shape, child or
    result, a call more or less, another nudge of a parameter or count in a buffer."""
    plan = draw(PLANS)
    other = {**plan, "calls": list(plan["calls"])}
    for _ in range(draw(st.integers(0, 2))):
        change = draw(st.sampled_from(["call", "insert", "delete", "result", "nudge", "count"]))
        calls = other["calls"]
        if change == "call" and calls:
            calls[draw(st.integers(0, len(calls) - 1))] = draw(CALLS.filter(bool))[0]
        elif change == "insert":
            calls.insert(draw(st.integers(0, len(calls))), draw(CALLS.filter(bool))[0])
        elif change == "delete" and calls:
            del calls[draw(st.integers(0, len(calls) - 1))]
        elif change in ("result", "nudge", "count"):
            other[change] = draw(PLANS)[change]
    return plan, other


@settings(max_examples=150, deadline=None)
@given(pair=plan_pairs(), backward=st.booleans())
def test_the_one_step_comparison_finds_what_the_walk_finds(pair, backward):
    with deterministic(seed=1):
        model = Toy()
    first, other = (recorded(model, plan, backward) for plan in pair)
    expected = walked(first, other)
    assert compare_runs(first, other, 2) == expected
    agreed = first.agreement(other)
    if agreed is not None:  # exactly the same recording: no difference but the return value
        assert agreed == len(first.events)
        assert expected[0] is None or expected[0].kind == "result"
        assert expected[0] is not None or expected[1] == agreed
    if repr(pair[0]) == repr(pair[1]):  # not ==: 0.0 == -0.0, and the recordings differ
        assert agreed is not None and expected == (None, agreed)


def test_recordings_that_differ_in_anything_are_walked_event_by_event():
    with deterministic(seed=1):
        model = Toy()
    plan = {"calls": [(0, 2, 0.5), (3, 1, 0.0)], "result": 0.0, "backward": True}
    plan |= {"nudge": 0.0, "count": 0}
    base = recorded(model, plan, True)
    # 3 module calls, 2 parameter gradients; then 2 gradients, 6 parameters and a buffer.
    assert base.agreement(recorded(model, plan, True)) == 3 + 2 + 2 + 6 + 1
    variants = {
        "a value": {"calls": [(0, 2, 0.25), (3, 1, 0.0)]},
        "-0.0 for 0.0": {"calls": [(0, 2, 0.5), (3, 1, -0.0)]},
        "a shape": {"calls": [(0, 3, 0.5), (3, 1, 0.0)]},
        "another module": {"calls": [(2, 2, 0.5), (3, 1, 0.0)]},
        "a call more": {"calls": [(0, 2, 0.5), (3, 1, 0.0), (1, 1, 0.0)]},
        "a final parameter": {"nudge": 0.5},
        "a buffer": {"count": 1},
    }
    for what, change in variants.items():
        other = recorded(model, plan | change, True)
        assert base.agreement(other) is None, what
        finding, _ = compare_runs(base, other, 2)
        assert finding is not None, what
    # Only the return value differs: the same recording, and the return values compared.
    other = recorded(model, plan | {"result": 1.0}, True)
    assert base.agreement(other) is not None
    finding, agreed = compare_runs(base, other, 2)
    assert finding is not None and finding.kind == "result"
    assert (finding, agreed) == walked(base, other)


# --- on a GPU (fingerprints themselves: tests/verify/test_fingerprint.py) -----------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.backends.cuda.is_built() or not torch.cuda.is_available(), reason="needs CUDA"
)
def test_locate_on_cuda_names_the_planted_module():
    model, x = build(planted=3)
    with deterministic(seed=0):
        model, x = model.cuda(), x.cuda()
        for block in model.blocks:  # keep the planted generator on the model's device
            if isinstance(block.extra, Noise):
                block.extra.generator = torch.Generator(device="cuda")
    report = locate_divergence(model, x, backward=True)
    assert report.divergence is not None and report.divergence.module == "blocks.3.extra"


# --- the example ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_finds_the_planted_module():
    proc = run_python([str(ROOT / "examples" / "find_divergence.py")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "not reproducible" in out
    assert "blocks.3.act (NoisyGELU)" in out
    assert "Runs agree" in out
    assert np.char.count(out, "Runs diverge").item() == 1


class _Tied(nn.Module):
    """Tied weights, a buffer of another dtype, a parameter without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight  # one tensor under two names
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("one_by_one", [False, True])
def test_a_saved_state_loads_every_tensor_back_in_place(monkeypatch, one_by_one):
    # All same-shaped tensors are copied back at once (torch._foreach_copy_) or, where torch
    # lacks it or refuses the mix, one by one: the same state either way, the same objects.
    import deterministic_ctx.verify.rerun as rerun

    if one_by_one:
        monkeypatch.setattr(rerun, "_foreach_copy", None)
    with deterministic(0):  # its initialization draws from torch's generator
        model = _Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    objects = dict(model.state_dict(keep_vars=True))
    saved = SavedState([model])
    for _ in range(2):  # loaded more than once
        with torch.no_grad():
            model.a.weight.add_(1.0)
            model.a.bias.mul_(-2.0)
            model.steps += 3
        model.b.bias = nn.Parameter(torch.ones(3))  # a run that replaced a tensor object
        saved.load()
        after = model.state_dict(keep_vars=True)
        assert all(after[name] is objects[name] for name in objects)
        assert all(torch.equal(after[name], before[name]) for name in before)
        assert model.b.weight is model.a.weight
