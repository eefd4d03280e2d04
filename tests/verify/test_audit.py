"""audit_nondeterminism: ops nondeterministic on CUDA, found on a CPU, and the table behind it."""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import inspect
import json
import sys
import textwrap
import warnings
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from deterministic_ctx import UncheckedTorchWarning, deterministic, isolated
from deterministic_ctx._torch import release_of
from deterministic_ctx.audit import AuditFinding, AuditReport, audit_nondeterminism
from deterministic_ctx.audit import run as audit_run
from deterministic_ctx.audit import table as audit_table
from deterministic_ctx.audit.model import CHECKED_TORCH, CHECKS, OpCall, nearest_checked
from deterministic_ctx.audit.table import entries_for, table, uninitialized_entry
from deterministic_ctx.verify import ops as verify_ops
from tests._oracle import World
from tests.helpers import ROOT, run_python
from tests.verify.audit_examples import EXAMPLES

#: Every case of the table, from its data file.
TABLE = table()

#: Where torch changed a behaviour, the tests expect the running release's.
_BEFORE_2_13 = release_of(torch.__version__) < (2, 13)

#: The running torch is of a release the table was checked against: the tests hold the
#: audit to the table exactly.  On another release they accept, besides, the older
#: behaviours below, each found by probing the running torch, not by its version.
_CHECKED = "{}.{}".format(*release_of(torch.__version__)) in CHECKED_TORCH

#: ``F.pad`` is torch's C function (torch 2.1), without the Python route that runs
#: ``mode="replicate"`` as an index decomposition in deterministic mode: through it,
#: replication padding's backward is the native kernel, which raises on CUDA, as when
#: ``replication_pad*d`` is called directly ("replication_pad", not "replication_pad-F.pad").
_PAD_IN_C = not _CHECKED and not inspect.isfunction(F.pad)
_PAD_REPLICATE = (
    ("replication_pad", "raise") if _PAD_IN_C else ("replication_pad-F.pad", "deterministic")
)

#: ``_embedding_bag_backward`` is a composite (torch 2.1): backward runs, and the audit sees,
#: the ``_embedding_bag_dense_backward`` it calls on the CPU (an op of the same table entry).
_BAG_BACKWARD = (
    "aten._embedding_bag_dense_backward.default"
    if not _CHECKED
    and torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_embedding_bag_backward", "CompositeImplicitAutograd"
    )
    else "aten._embedding_bag_backward.default"
)

_SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_audit.py:N`` for the line of this file that ends with ``# <- marker``."""
    (number,) = [n for n, line in enumerate(_SOURCE, 1) if line.endswith(f"# <- {marker}")]
    return f"test_audit.py:{number}"


@pytest.fixture(autouse=True)
def _tests_draw_in_their_own_world():
    """The tests build models and inputs with the global RNGs: in a block of their own.

    The audit's own isolation is checked without it, by comparing the world before and
    after each audit call (test_nothing_global_changes_*).
    """
    with isolated():
        yield


def notes(report: AuditReport) -> tuple[str, ...]:
    """``report.notes`` less the note on a torch release the table was not checked against.

    That note is expected exactly when the report's torch is not of a checked release (the
    suite may run on another): then it must be there, once and first, and is dropped; on a
    checked release no note may speak of the version.  Every other note is returned.
    """
    version = report.torch_version
    about_version = f"torch {version} is running; the table was checked against torch "
    if "{}.{}".format(*release_of(version)) in CHECKED_TORCH:
        assert not any(n.startswith("torch ") for n in report.notes), report.notes
        return report.notes
    assert report.notes and report.notes[0].startswith(about_version), report.notes
    rest = report.notes[1:]
    assert not any(n.startswith(about_version) for n in rest), report.notes
    return rest


def keys(report: AuditReport) -> list[str]:
    return [f.entry for f in report.findings]


def by_entry(report: AuditReport, key: str) -> AuditFinding:
    (found,) = [f for f in report.findings if f.entry == key]
    return found


# --- the small model ----------------------------------------------------------------


class Small(nn.Module):
    """EmbeddingBag (max), index_add_ and a bilinear F.interpolate, all on the gradient path."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="max")
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.head = nn.Linear(4, 1)

    def forward(self, words: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        bags = self.bag(words)  # <- bag
        rows = torch.zeros(3, 4).index_add_(0, torch.tensor([0, 0, 2]), bags)  # <- index_add
        big = F.interpolate(image, scale_factor=2, mode="bilinear")  # <- interpolate
        return self.head(rows).sum() + self.up(big).mean()  # <- upsample


def small_step(model: Small) -> torch.Tensor:
    words = torch.randint(0, 10, (3, 4))
    image = torch.randn(1, 2, 4, 4, requires_grad=True)
    loss = model(words, image)
    loss.backward()
    return loss


def test_small_model_lists_embedding_bag_index_add_and_interpolate():
    model = Small()
    report = audit_nondeterminism(small_step, model)

    # Forward ops in call order, then backward ops in the order backward runs them.
    assert keys(report) == [
        "index_add",
        "upsample-F.interpolate",
        "upsample-F.interpolate",
        "embedding_bag-max",
    ]
    bag = by_entry(report, "embedding_bag-max")
    assert (bag.op, bag.phase, bag.behaviour) == (
        _BAG_BACKWARD,
        "backward",
        "raise",
    )
    assert (bag.module, bag.module_type) == ("bag", "EmbeddingBag")
    assert bag.location.endswith(line_of("bag"))  # the forward call, not loss.backward()

    index_add = by_entry(report, "index_add")
    assert (index_add.op, index_add.phase, index_add.behaviour) == (
        "aten.index_add_.default",
        "forward",
        "deterministic",
    )
    assert (index_add.module, index_add.module_type) == ("", "Small")
    assert index_add.location.endswith(line_of("index_add"))

    upsample, interpolate = [f for f in report.findings if f.entry == "upsample-F.interpolate"]
    assert interpolate.op == "aten.upsample_bilinear2d_backward.default"
    assert (interpolate.phase, interpolate.behaviour) == ("backward", "deterministic")
    assert interpolate.location.endswith(line_of("interpolate"))
    assert (interpolate.module, upsample.module, upsample.module_type) == ("", "up", "Upsample")
    assert upsample.location.endswith(line_of("upsample"))

    assert report.backward and report.raising == (bag,)
    assert report and not report.clean and len(report) == 4


def test_embedding_bag_sum_and_mean_backward_are_not_listed():
    # CUDA sorts the indices for mode="sum" and "mean" (the same kernel as embedding's
    # backward); only mode="max" accumulates with atomics.
    for mode in ("sum", "mean"):
        bag = nn.EmbeddingBag(10, 4, mode=mode)
        report = audit_nondeterminism(bag, torch.randint(0, 10, (3, 4)))
        assert report.clean, (mode, str(report))
        assert report.backward  # the audit ran the backward pass itself


def test_plain_mlp_with_backward_is_clean():
    def train_step() -> torch.Tensor:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
        loss = F.cross_entropy(model(torch.randn(5, 8)), torch.tensor([0, 1, 2, 1, 0]))
        loss.backward()
        return loss

    report = audit_nondeterminism(train_step)
    assert report.clean and not report and report.findings == ()
    assert report.backward and report.calls > 20
    assert str(report).startswith("No op call is nondeterministic on CUDA")


# --- argument-dependent cases -----------------------------------------------------------------


def _index_put(accumulate: bool) -> torch.Tensor:
    index = torch.tensor([0, 0, 1])
    return torch.zeros(4).index_put_((index,), torch.tensor([1.0, 2.0, 3.0]), accumulate)


def test_index_put_depends_on_accumulate():
    listed = audit_nondeterminism(_index_put, False)
    assert keys(listed) == ["index_put"]
    assert (listed.findings[0].op, listed.findings[0].behaviour) == (
        "aten.index_put_.default",
        "deterministic",
    )
    assert listed.findings[0].condition.startswith("accumulate=False")
    # accumulate=True is sorted on CUDA anyway (deterministic without the flag).
    assert audit_nondeterminism(_index_put, True).clean


def test_index_put_without_a_race_is_not_listed():
    def writes() -> torch.Tensor:
        x = torch.zeros(4)
        x[torch.tensor([0, 0])] = 1.0  # one value: any order gives the same result
        x[x > 0] = torch.tensor([5.0])  # a boolean mask: positions never repeat
        x[torch.tensor([True, False, True, False])] = torch.tensor([1.0, 2.0])
        return x

    assert audit_nondeterminism(writes).clean


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda: torch.zeros(4).put_(torch.tensor([0, 0]), torch.ones(2)), ("put", "raise")),
        (
            lambda: torch.zeros(4).put_(torch.tensor([0, 0]), torch.ones(2), accumulate=True),
            ("put-accumulate", "raise"),
        ),
        (
            lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "sum"),
            ("scatter_reduce-sum", "deterministic"),
        ),
        (
            lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "prod"),
            ("scatter_reduce-prod", "raise"),
        ),
        (
            lambda: torch.bincount(torch.tensor([0, 1, 1]), weights=torch.ones(3)),
            ("bincount-weights", "raise"),
        ),
        (lambda: torch.bincount(torch.tensor([0, 1, 1])), None),
        (lambda: torch.rand(8).histc(bins=4), ("histc", "raise")),
        (lambda: torch.rand(8, dtype=torch.float64).histc(bins=4), ("histc", "raise")),
        (lambda: torch.rand(8).median(0), ("median-indices", "raise")),
        (lambda: torch.rand(8).median(), None),
        # One device-wide scan only along a dimension that holds every element.
        (lambda: torch.rand(8).cumsum(0), ("cumsum", "deterministic")),
        (lambda: torch.rand(1, 8).cumsum(1), ("cumsum", "deterministic")),
        (lambda: torch.rand(4, 8).cumsum(1), None),
        (lambda: torch.rand(4, 8).cumsum(0), None),
        (lambda: torch.arange(8).cumsum(0), None),
        (lambda: torch.arange(8).cumsum(0, dtype=torch.float32), ("cumsum", "deterministic")),
        (lambda: torch.rand(8).kthvalue(2), None),
        (
            lambda: torch.zeros(3).scatter_add_(0, torch.tensor([0, 0]), torch.ones(2)),
            ("scatter_add", "deterministic"),
        ),
        (
            lambda: torch.zeros(3, dtype=torch.long).scatter_add_(
                0, torch.tensor([0, 0]), torch.ones(2, dtype=torch.long)
            ),
            None,
        ),
        (
            lambda: torch.zeros(3, dtype=torch.long).index_add_(
                0, torch.tensor([0, 0]), torch.ones(2, dtype=torch.long)
            ),
            None,
        ),
        (
            lambda: F.nll_loss(torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))),
            ("nll_loss2d", "raise"),
        ),
        (
            lambda: F.nll_loss(
                torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)), reduction="none"
            ),
            None,
        ),
        (lambda: F.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 0])), None),
        (
            lambda: torch.bmm(torch.eye(3).expand(2, 3, 3).to_sparse(), torch.rand(2, 3, 3)),
            ("bmm-sparse", "deterministic"),
        ),
        (lambda: torch.bmm(torch.rand(2, 3, 3), torch.rand(2, 3, 3)), None),
        # From the CUDA kernels, beyond torch's docstring: scatter_reduce amax/amin neither
        # alerts nor is exact for signed zeros; every index_reduce alerts; scatter_(reduce=)
        # add is rerouted, multiply alerts.
        (
            lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "amax"),
            ("scatter_reduce-amax", "none"),
        ),
        (
            lambda: torch.zeros(3, dtype=torch.long).scatter_reduce(
                0, torch.tensor([0, 0]), torch.ones(2, dtype=torch.long), "amin"
            ),
            None,
        ),
        (
            lambda: torch.zeros(3, 2).index_reduce_(
                0, torch.tensor([0, 0]), torch.ones(2, 2), "amax"
            ),
            ("index_reduce", "raise"),
        ),
        (
            lambda: torch.zeros(3, 2).index_reduce(
                0, torch.tensor([0, 0]), torch.ones(2, 2), "mean", include_self=False
            ),
            ("index_reduce", "raise"),
        ),
        (
            lambda: torch.zeros(3).scatter_(0, torch.tensor([0, 0]), torch.ones(2), reduce="add"),
            ("scatter-add", "deterministic"),
        ),
        (
            lambda: torch.ones(3).scatter(
                0, torch.tensor([0, 0]), torch.ones(2), reduce="multiply"
            ),
            ("scatter-multiply", "raise"),
        ),
        (
            lambda: torch.ones(3, dtype=torch.long).scatter_(
                0, torch.tensor([0, 0]), torch.ones(2, dtype=torch.long), reduce="multiply"
            ),
            None,
        ),
        # A scalar value: every update is the same, so their order cannot matter.
        (
            lambda: torch.ones(3).scatter_(0, torch.tensor([0, 0]), 2.0, reduce="multiply"),
            None,
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
def test_forward_cases(fn, expected):
    report = audit_nondeterminism(fn)
    assert [(f.entry, f.behaviour) for f in report.findings] == ([expected] if expected else [])


def _grad_through(forward, *shape):
    def fn():
        x = torch.randn(*shape, requires_grad=True)
        return forward(x)

    return fn


@pytest.mark.parametrize(
    ("forward", "shape", "expected"),
    [
        (
            lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
            (1, 1, 4, 4),
            ("upsample-F.interpolate", "deterministic"),
        ),
        (
            lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"),
            (1, 1, 2, 2, 2),
            ("upsample-F.interpolate", "deterministic"),
        ),
        (
            lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"),
            (1, 1, 4, 4),
            ("upsample", "raise"),
        ),
        (
            lambda x: F.interpolate(x, scale_factor=2, mode="linear"),
            (1, 1, 4),
            ("upsample", "raise"),
        ),
        (
            lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", antialias=True),
            (1, 1, 4, 4),
            ("upsample", "raise"),
        ),
        (
            lambda x: torch._C._nn.upsample_bilinear2d(x, (8, 8), False, None),
            (1, 1, 4, 4),
            ("upsample", "raise"),
        ),
        (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (1, 1, 4, 4), None),
        (
            lambda x: F.interpolate(x, scale_factor=0.5, mode="area"),
            (1, 1, 4, 4),
            ("adaptive_avg_pool2d", "raise"),
        ),
        (
            lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
            (1, 1, 4, 4),
            ("reflection_pad2d", "deterministic"),
        ),
        (lambda x: nn.ReflectionPad1d(1)(x), (1, 1, 4), ("reflection_pad", "raise")),
        (
            lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"),
            (1, 1, 4, 4, 4),
            ("reflection_pad", "raise"),
        ),
        (
            lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"),
            (1, 1, 4, 4),
            _PAD_REPLICATE,
        ),
        (lambda x: nn.ReplicationPad1d(2)(x), (1, 1, 4), _PAD_REPLICATE),
        (
            lambda x: torch._C._nn.replication_pad2d(x, (1, 1, 1, 1)),
            (1, 1, 4, 4),
            ("replication_pad", "raise"),
        ),
        (lambda x: F.pad(x, (1, 1, 1, 1)), (1, 1, 4, 4), None),
        (lambda x: nn.AdaptiveAvgPool2d(1)(x), (1, 1, 4, 4), None),  # a mean: deterministic
        (lambda x: nn.AdaptiveAvgPool2d(2)(x), (1, 1, 5, 5), ("adaptive_avg_pool2d", "raise")),
        (lambda x: nn.AdaptiveMaxPool2d(2)(x), (1, 1, 5, 5), ("adaptive_max_pool2d", "raise")),
        (lambda x: nn.AdaptiveMaxPool3d(2)(x), (1, 1, 5, 5, 5), ("adaptive_max_pool3d", "none")),
        (lambda x: nn.AvgPool3d(2)(x), (1, 1, 4, 4, 4), ("avg_pool3d", "raise")),
        (lambda x: nn.AvgPool2d(2)(x), (1, 1, 4, 4), None),
        # torch 2.13's docstring lists MaxPool3d as deterministic; only return_indices=True is.
        (lambda x: nn.MaxPool3d(2)(x), (1, 1, 4, 4, 4), ("max_pool3d", "raise")),
        (
            lambda x: nn.MaxPool3d(2, return_indices=True)(x)[0],
            (1, 1, 4, 4, 4),
            ("max_pool3d-F.max_pool3d", "raise" if _BEFORE_2_13 else "deterministic"),
        ),
        (
            lambda x: torch.ops.aten.max_pool3d_with_indices(x, [2, 2, 2])[0],
            (1, 1, 4, 4, 4),
            ("max_pool3d", "raise"),
        ),
        (lambda x: nn.MaxPool2d(2)(x), (1, 1, 4, 4), None),
        (
            lambda x: F.grid_sample(x, torch.zeros(1, 2, 2, 2), align_corners=False),
            (1, 1, 4, 4),
            ("grid_sample", "raise"),
        ),
        (lambda x: x.gather(0, torch.tensor([0, 0])), (4,), ("scatter_add", "deterministic")),
        (lambda x: x.index_select(0, torch.tensor([0, 0])), (4,), ("index_add", "deterministic")),
        (lambda x: x.take(torch.tensor([0, 0])), (4,), ("put-accumulate", "raise")),
        (lambda x: x[torch.tensor([0, 0])], (4,), None),  # index_put(accumulate=True): sorted
        (lambda x: x.cumsum(0), (4,), ("cumsum", "deterministic")),
        (lambda x: nn.Embedding(5, 2)(torch.tensor([1, 1, 2])) * x, (2,), None),
    ],
)
def test_backward_cases(forward, shape, expected):
    report = audit_nondeterminism(_grad_through(forward, *shape))
    found = {(f.entry, f.behaviour) for f in report.findings}
    assert found == ({expected} if expected else set()), str(report)
    if expected is not None and expected[0] != "cumsum":
        assert {f.phase for f in report.findings} == {"backward"}


def test_attention_fused_and_math_kernels_are_each_listed_once():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    fused = audit_nondeterminism(lambda: F.scaled_dot_product_attention(q, q, q))
    math = audit_nondeterminism(lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    assert [(f.entry, f.phase, f.behaviour) for f in fused.findings] == [
        ("scaled_dot_product_attention", "backward", "deterministic")
    ]
    assert [(f.entry, f.op) for f in math.findings] == [
        ("scaled_dot_product_attention-math", "torch.nn.functional.scaled_dot_product_attention")
    ]
    # Without gradients there is no backward: nothing to list.
    with torch.no_grad():
        assert audit_nondeterminism(
            lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        ).clean
    warn_only = audit_nondeterminism(
        lambda: F.scaled_dot_product_attention(q, q, q), warn_only=True
    )
    assert [f.behaviour for f in warn_only.findings] == ["warn"]


def test_transformer_attention_is_listed_per_layer():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    report = audit_nondeterminism(encoder, torch.randn(2, 5, 16))
    assert [(f.entry, f.module, f.module_type) for f in report.findings] == [
        ("multi_head_attention-math", "layers.0.self_attn", "MultiheadAttention"),
        ("multi_head_attention-math", "layers.1.self_attn", "MultiheadAttention"),
    ]
    # need_weights=True computes attention with plain matmuls: deterministic.
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    assert audit_nondeterminism(lambda: attention(x, x, x)[0]).clean


def test_convolutions_switch_to_deterministic_kernels():
    report = audit_nondeterminism(nn.Conv2d(1, 2, 3), torch.randn(1, 1, 6, 6))
    assert [(f.op, f.phase, f.behaviour, f.module) for f in report.findings] == [
        ("aten.convolution.default", "forward", "deterministic", ""),
        ("aten.convolution_backward.default", "backward", "deterministic", ""),
    ]


def test_warn_only_turns_raise_into_warn():
    strict = audit_nondeterminism(lambda: torch.rand(8).histc(bins=4))
    lenient = audit_nondeterminism(lambda: torch.rand(8).histc(bins=4), warn_only=True)
    assert [f.behaviour for f in strict.findings] == ["raise"]
    assert [f.behaviour for f in lenient.findings] == ["warn"]
    assert lenient.raising == () and lenient.warn_only
    assert "warn_only=True" in str(lenient)
    index_add = audit_nondeterminism(_index_put, False, warn_only=True)
    assert [f.behaviour for f in index_add.findings] == ["deterministic"]


# --- where: modules, lines, phases, counts --------------------------------------------------------


def test_model_built_inside_fn_and_repeated_calls_are_counted():
    def fn() -> torch.Tensor:
        net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReflectionPad1d(1)))
        out = torch.zeros(3)
        for _ in range(3):
            out.index_add_(0, torch.tensor([0, 0]), torch.ones(2))  # <- loop
        return net(torch.randn(1, 1, 2, requires_grad=True)).sum() + out.sum()  # <- net

    report = audit_nondeterminism(fn)
    assert [(f.entry, f.count) for f in report.findings] == [
        ("index_add", 3),
        ("reflection_pad", 1),
    ]
    loop, pad = report.findings
    assert loop.location.endswith(line_of("loop")) and loop.module is None
    assert (pad.module, pad.module_type) == ("1.0", "ReflectionPad1d")
    assert pad.location.endswith(line_of("net"))
    assert pad.where.startswith("1.0 (ReflectionPad1d) at ")


class Scatter(torch.autograd.Function):
    """A custom op whose backward (seen by no forward op call) uses index_add_."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad).index_add_(0, torch.tensor([0, 0]), grad[:2])  # <- custom


def test_custom_function_backward_is_located_in_its_backward():
    x = torch.randn(4, requires_grad=True)
    report = audit_nondeterminism(lambda: Scatter.apply(x).sum())
    (found,) = report.findings
    assert (found.entry, found.phase, found.module) == ("index_add", "backward", None)
    assert found.location.endswith(line_of("custom"))
    assert x.grad is None  # the audit's backward pass leaves .grad alone


def test_backward_false_leaves_backward_ops_out():
    model = Small()
    report = audit_nondeterminism(small_step, model, backward=False)
    assert keys(report) == ["index_add"]
    assert not report.backward and "forward only" in str(report)

    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    assert audit_nondeterminism(
        lambda: F.interpolate(x, scale_factor=2, mode="bicubic"), backward=False
    ).clean


def test_backward_run_by_the_audit_or_not_at_all():
    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    ran = audit_nondeterminism(lambda: {"out": [F.pad(x, (1, 1, 1, 1), mode="reflect"), 3]})
    assert keys(ran) == ["reflection_pad2d"] and ran.backward and notes(ran) == ()
    assert x.grad is None

    nothing = audit_nondeterminism(lambda: F.pad(x.detach(), (1, 1, 1, 1), mode="reflect"))
    assert nothing.clean and not nothing.backward
    assert notes(nothing) == (
        "fn ran no backward pass and returned no floating-point tensor with a gradient "
        "function: no backward op was audited",
    )


# --- uninitialized memory ----------------------------------------------------------------------


def test_uninitialized_memory_read_before_written():
    def reads() -> torch.Tensor:
        scratch = torch.empty(4)  # <- empty
        return scratch * 2  # <- read

    report = audit_nondeterminism(reads)
    (found,) = report.findings
    assert (found.entry, found.op, found.behaviour) == (
        "uninitialized",
        "aten.empty.memory_format",
        "deterministic",
    )
    assert found.location.endswith(line_of("empty"))
    assert "Read by aten.mul.Tensor at " in found.note
    assert found.note.endswith(line_of("read") + ".")

    grown = audit_nondeterminism(lambda: torch.ones(2).resize_(6).sum())
    assert [(f.entry, f.op) for f in grown.findings] == [("uninitialized", "aten.resize_.default")]


def test_uninitialized_memory_written_first_is_not_listed():
    def writes() -> torch.Tensor:
        a = torch.empty(4).uniform_()
        b = torch.empty(4)
        b.copy_(a)
        c = torch.empty_like(a)
        torch.add(a, b, out=c)
        d = torch.empty(3)
        d[torch.tensor([0, 1, 2])] = 1.0  # index_put_ writes
        layer = nn.Linear(4, 4)  # torch.empty, then an initializer
        return layer(a + b + c).sum() + d.sum() + torch.empty(0).sum()

    report = audit_nondeterminism(writes)
    assert report.clean, str(report)


def test_in_place_views_of_uninitialized_memory_are_not_reads():
    def transposes() -> torch.Tensor:
        h = torch.empty(2, 3)
        h.t_()  # metadata only: the tag inplace_view says so, is_view does not
        h.t_()
        h.unsqueeze_(0).squeeze_(0).transpose_(0, 1).as_strided_((2, 3), (3, 1))
        return h.copy_(torch.ones(2, 3)).sum()

    assert audit_nondeterminism(transposes).clean

    def reads_after_views() -> torch.Tensor:
        h = torch.empty(2, 3)  # <- empty then t_
        return h.t_().sum()

    (found,) = audit_nondeterminism(reads_after_views).findings
    assert found.location.endswith(line_of("empty then t_"))
    assert "Read by aten.sum.default" in found.note


def test_torch_internal_scratch_memory_is_not_listed():
    # ctc_loss builds a tensor of lengths with torch.empty and fills it in C++.
    log_probs = torch.randn(10, 2, 5).log_softmax(2).detach().requires_grad_()
    report = audit_nondeterminism(
        lambda: F.ctc_loss(log_probs, torch.randint(1, 5, (2, 3)), [10, 10], [3, 3])
    )
    assert keys(report) == ["ctc_loss"]


# --- the report ----------------------------------------------------------------------------------


def test_report_str_and_to_dict():
    model = Small()
    report = audit_nondeterminism(small_step, model)
    text = str(report)
    assert text.startswith("4 place(s) nondeterministic on CUDA")
    assert "under use_deterministic_algorithms(True) 1 would raise" in text
    assert "1. aten.index_add_.default (forward, 1 call) in (root) (Small) at " in text
    assert (
        "under use_deterministic_algorithms(True) it raises (no deterministic CUDA kernel)" in text
    )
    assert "(See 2.)" in text  # the second bilinear upsampling points back at the first's note
    data = json.loads(json.dumps(report.to_dict()))
    assert data["clean"] is False and data["backward"] is True
    assert [f["entry"] for f in data["findings"]] == keys(report)
    assert data["findings"][3]["where"].startswith("bag (EmbeddingBag) at ")
    assert data["checked_against"] == nearest_checked(torch.__version__).release
    assert data["checked_against"] in CHECKED_TORCH  # the suite runs on checked releases


def _torch_release(monkeypatch, version: str) -> None:
    """Make the audit see another torch release (its warning about it is expected)."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    monkeypatch.setattr(audit_run, "_version_warned", True)


def test_cublas_note_before_torch_2_10(monkeypatch):
    # torch 2.10 dropped deterministic mode's CUBLAS_WORKSPACE_CONFIG check (pytorch#161749).
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    _torch_release(monkeypatch, "2.10.0")
    assert notes(audit_nondeterminism(nn.Linear(2, 2), torch.ones(1, 2))) == ()

    _torch_release(monkeypatch, "2.9.1")
    report = audit_nondeterminism(nn.Linear(2, 2), torch.ones(1, 2))
    assert report.clean
    (note,) = [n for n in report.notes if "cuBLAS" in n]
    assert "CUBLAS_WORKSPACE_CONFIG is :4096:8 or :16:8" in note and note.endswith("unset")
    assert "Note: fn runs cuBLAS matmuls" in str(report)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    report = audit_nondeterminism(nn.Linear(2, 2), torch.ones(1, 2))
    assert not any("cuBLAS" in n for n in report.notes)


def test_recurrent_layers_get_a_note(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    lstm, gru = nn.LSTM(4, 8), nn.GRU(8, 8)
    report = audit_nondeterminism(lambda x: gru(lstm(x)[0])[0], torch.randn(5, 2, 4))
    (note,) = [n for n in report.notes if "recurrent" in n]
    assert note.startswith("fn runs GRU, LSTM: on CUDA, recurrent layers run cuDNN's RNN ops")
    assert note.endswith("here it is unset")
    assert not any(
        "recurrent" in n for n in audit_nondeterminism(nn.Linear(2, 2), torch.ones(1, 2)).notes
    )


def test_user_module_with_a_standard_library_name_is_user_code(tmp_path, monkeypatch):
    # "test" is in sys.stdlib_module_names; a project's own test.py is still user code.
    (tmp_path / "test.py").write_text(
        "import torch\n\ndef step(index):\n"
        "    return torch.zeros(3).index_add_(0, index, torch.ones(2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = sys.modules.pop("test", None)
    try:
        user = importlib.import_module("test")
        report = audit_nondeterminism(user.step, torch.tensor([0, 0]))
    finally:
        sys.modules.pop("test", None)
        if saved is not None:
            sys.modules["test"] = saved
    (found,) = report.findings
    assert found.location == f"{tmp_path / 'test.py'}:4"


def test_the_audit_does_not_import_dynamo():
    # torch's dispatch modes import torch._dynamo (~2 s) at their first op call unless
    # _should_skip_dynamo() is False; the audit turns dynamo off itself once it is loaded.
    code = (
        "import sys, torch\n"
        "from deterministic_ctx.audit import audit_nondeterminism\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "r = audit_nondeterminism(torch.nn.Upsample(scale_factor=2, mode='bicubic'),\n"
        "                         torch.randn(1, 1, 4, 4, requires_grad=True))\n"
        "assert [f.entry for f in r.findings] == ['upsample'], r\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = run_python([], code=code, check=True)
    assert proc.stdout.strip() == "False"


def test_the_audit_runs_with_dynamo_loaded():
    # In a fresh interpreter: importing torch._dynamo changes process state.
    code = (
        "import torch, torch._dynamo\n"
        "from deterministic_ctx.audit import audit_nondeterminism\n"
        "up = torch.nn.Upsample(scale_factor=2, mode='bicubic')\n"
        "def f(x):\n"
        "    return up(x) * 2\n"
        "r = audit_nondeterminism(f, torch.randn(1, 1, 4, 4, requires_grad=True))\n"
        "print([(f.entry, f.module_type, f.location) for f in r.findings])\n"
    )
    proc = run_python([], code=code, check=True)
    assert proc.stdout.strip() == "[('upsample', 'Upsample', '<string>:5')]"


def test_other_torch_release_warns_once(monkeypatch):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.12.1"))
    monkeypatch.setattr(audit_run, "_version_warned", False)
    message = r"torch 2\.12\.1 is running; the table was checked against torch 2\.11 and 2\.13"
    with pytest.warns(UncheckedTorchWarning, match=message) as caught:
        first = audit_nondeterminism(lambda: torch.ones(2))
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = audit_nondeterminism(lambda: torch.ones(2))
    for report in (first, second):
        assert (report.torch_version, report.checked_against) == ("2.12.1", "2.11")
        assert any("the behaviours of 2.11 are used" in note for note in report.notes)
    assert str(first).startswith("No op call")
    assert "Table checked against torch 2.11 (observed on a GPU)." in str(first)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.11.0+cu130", "raise"),
        ("2.12.1", "raise"),
        ("2.13.0", "deterministic"),
        ("2.14.0", "deterministic"),
    ],
)
def test_behaviours_follow_the_running_release(monkeypatch, version, expected):
    # F.max_pool3d(return_indices=True) got its deterministic decomposition in torch 2.13.
    _torch_release(monkeypatch, version)
    x = torch.randn(1, 1, 4, 4, 4, requires_grad=True)
    report = audit_nondeterminism(lambda: F.max_pool3d(x, 2, return_indices=True)[0])
    assert [(f.entry, f.behaviour) for f in report.findings] == [
        ("max_pool3d-F.max_pool3d", expected)
    ]
    warn_only = audit_nondeterminism(
        lambda: F.max_pool3d(x, 2, return_indices=True)[0], warn_only=True
    )
    assert [f.behaviour for f in warn_only.findings] == [
        "warn" if expected == "raise" else expected
    ]
    assert report.checked_against == nearest_checked(version).release


# --- nothing global changes ----------------------------------------------------------------------


def test_nothing_global_changes_in_a_training_step():
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_before = json.dumps(str(optimizer.state_dict()))
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))

    def step(model: Small) -> torch.Tensor:
        optimizer.zero_grad()
        loss = small_step(model)
        optimizer.step()
        return loss

    world = World.now()
    report = audit_nondeterminism(step, model, reset=[optimizer])
    assert world.diff(World.now()) == []  # RNGs, flags, environment variables
    assert "embedding_bag-max" in keys(report)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert json.dumps(str(optimizer.state_dict())) == optimizer_before
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    assert _get_current_dispatch_mode_stack() == []


def test_audit_inside_a_deterministic_block_sees_ops_that_raise_there():
    # Inside the block deterministic algorithms are on, and put_ raises even on the CPU;
    # the audit turns them off for its run and the block's setting is back afterwards.
    def put() -> torch.Tensor:
        return torch.zeros(4).put_(torch.tensor([0, 0]), torch.ones(2))

    with deterministic(0):
        with pytest.raises(RuntimeError, match="put_ does not have a deterministic"):
            put()
        report = audit_nondeterminism(put)
        assert torch.are_deterministic_algorithms_enabled()
        with pytest.raises(RuntimeError, match="put_ does not have a deterministic"):
            put()
    assert keys(report) == ["put"]


def test_runs_are_seeded_by_seed():
    def draws() -> torch.Tensor:
        index = torch.randint(0, 2, (6,))
        return torch.zeros(2).index_put_((index,), torch.rand(6))

    assert keys(audit_nondeterminism(draws, seed=3)) == ["index_put"]


def test_exception_in_fn_propagates_and_cleans_up():
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))

    def fails() -> None:
        nn.Linear(2, 2)(torch.ones(1, 2))
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        audit_nondeterminism(fails)
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    assert _get_current_dispatch_mode_stack() == []


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable, got int 3"):
        audit_nondeterminism(3)
    with pytest.raises(TypeError, match="fn must be synchronous"):
        audit_nondeterminism(asyncio.sleep)
    with pytest.raises(TypeError, match="backward must be True or False, got 1"):
        audit_nondeterminism(lambda: None, backward=1)
    with pytest.raises(TypeError, match="warn_only must be True or False, got 'yes'"):
        audit_nondeterminism(lambda: None, warn_only="yes")
    with pytest.raises(ValueError, match="seed"):
        audit_nondeterminism(lambda: None, seed=-1)
    with pytest.raises(TypeError, match="reset must contain modules, optimizers"):
        audit_nondeterminism(lambda: None, reset=[3])
    with pytest.raises(TypeError, match="coroutine"):
        audit_nondeterminism(lambda: asyncio.sleep(0))


# --- the table ----------------------------------------------------------------------------------


def test_every_table_entry_is_well_formed():
    keys_seen = [entry.key for entry in TABLE]
    assert len(keys_seen) == len(set(keys_seen))
    assert tuple(check.release for check in CHECKS) == CHECKED_TORCH
    for release in CHECKED_TORCH:
        assert release.count(".") == 1 and all(p.isdigit() for p in release.split("."))
    assert sorted(CHECKED_TORCH, key=release_of) == list(CHECKED_TORCH)
    for entry in TABLE:
        assert set(entry.observed) <= set(CHECKED_TORCH), entry.key
        releases = [release for release, _ in entry.earlier]
        assert sorted(releases, key=release_of) == releases, entry.key
        for release, behaviour in entry.earlier:
            assert release_of(release) <= release_of(CHECKED_TORCH[-1]), entry.key
            assert behaviour in ("raise", "warn", "deterministic", "none"), entry.key
        # A warn_only behaviour of its own would hold on every release: none where it changed.
        assert not (entry.earlier and entry.warn_only_behaviour), entry.key
        assert entry.ops and len(set(entry.ops)) == len(entry.ops), entry.key
        assert entry.behaviour in ("raise", "warn", "deterministic", "none"), entry.key
        assert entry.warn_only_behaviour in (None, "raise", "warn", "deterministic"), entry.key
        assert entry.phase in ("forward", "backward"), entry.key
        assert entry.note.strip() and entry.note.endswith((".", ".)")), entry.key
        if entry.when is not None:
            assert entry.condition, f"{entry.key}: a condition needs its words"
        if entry.kind == "op":
            # An older, unchecked torch may lack some of an entry's ops (torch 2.1 has no
            # _scaled_dot_product_flash_attention_for_cpu_backward), not all of them.
            missing = [op for op in entry.ops if not hasattr(torch.ops.aten, op)]
            if _CHECKED:
                assert not missing, f"{entry.key}: no aten op {missing}"
            else:
                assert len(missing) < len(entry.ops), f"{entry.key}: no aten op {missing}"
            assert not entry.parameters and not entry.unless_dispatched, entry.key
        elif entry.kind == "function":
            assert entry.when is not None, entry.key
            for qualname in entry.ops:
                module, _, name = qualname.rpartition(".")
                assert callable(getattr(__import__(module, fromlist=[name]), name)), qualname
            missing = [op for op in entry.unless_dispatched if not hasattr(torch.ops.aten, op)]
            if _CHECKED:
                assert not missing, f"{entry.key}: no aten op {missing}"
            else:
                assert not missing or len(missing) < len(entry.unless_dispatched), (
                    f"{entry.key}: {missing}"
                )
        else:
            assert entry is uninitialized_entry() and entry.when is None
    # Entries of one op are tried in order: a conditional one must come before a catch-all.
    for op in {op for entry in TABLE if entry.kind == "op" for op in entry.ops}:
        entries = entries_for(op)
        assert all(e.when is not None for e in entries[:-1]), op


def test_entry_conditions():
    (interpolate, direct) = entries_for("upsample_bilinear2d_backward")
    call = OpCall("aten.upsample_bilinear2d_backward.default", "upsample_bilinear2d_backward", {})
    via = OpCall(call.op, call.name, {}, frozenset({"torch.nn.functional.interpolate"}))
    assert not interpolate.matches(call) and interpolate.matches(via) and direct.matches(call)
    assert [e.behaviour_under(warn_only=True) for e in (interpolate, direct)] == [
        "deterministic",
        "warn",
    ]
    assert entries_for("not_an_op") == ()


def test_every_entry_has_one_example_and_every_example_an_entry():
    assert sorted(EXAMPLES) == sorted(entry.key for entry in TABLE)


@pytest.mark.parametrize("entry", TABLE, ids=lambda entry: entry.key)
def test_every_example_is_found_by_the_audit_on_the_cpu(entry):
    report = audit_nondeterminism(EXAMPLES[entry.key], torch.device("cpu"))
    if entry.key == "replication_pad-F.pad" and _PAD_IN_C:
        assert {(f.entry, f.behaviour) for f in report.findings} == {_PAD_REPLICATE}, str(report)
        return
    assert keys(report) == [entry.key] * len(report.findings), str(report)
    assert report.findings, str(report)
    assert {f.behaviour for f in report.findings} == {entry.behaviour_on(torch.__version__)}


def test_entry_behaviours_by_release():
    (via_f, direct) = entries_for("max_pool3d_with_indices_backward")
    assert [via_f.behaviour_on(v) for v in ("2.11.0+cu130", "2.12.0", "2.13.0", "2.15.1")] == [
        "raise",
        "raise",
        "deterministic",
        "deterministic",
    ]
    assert via_f.behaviour_on() == via_f.behaviour == "deterministic"
    assert via_f.behaviour_under(warn_only=True, version="2.11.0") == "warn"
    assert direct.behaviour_on("2.13.0") == direct.behaviour_on("2.11.0") == "raise"
    assert [nearest_checked(v).describe() for v in ("2.11.0", "2.13.0")] == [
        "2.11 (observed on a GPU)",
        "2.13 (read from source)",
    ]


def test_autograd_nodes_are_named_across_their_python_objects():
    # torch 2.11 frees a C++ node's Python object once nothing refers to it, and the next
    # access makes a new one, possibly at the address (id, hash) of another node's.
    x = torch.randn(3, requires_grad=True)
    out = (x * 2).exp().sum()
    chain = []
    node = out.grad_fn
    while node is not None:
        chain.append(verify_ops._node_key(node))
        node = node.next_functions[0][0] if node.next_functions else None
    assert chain[-1] is None  # AccumulateGrad has no sequence number
    assert len(set(chain[:-1])) == 3 and chain[0] == verify_ops._node_key(out.grad_fn)
    assert audit_run._graph_leaves([out]) == [x]


@pytest.mark.parametrize("key", ["put", "max_unpool", "resize-quantized"])
def test_entries_that_raise_on_every_device_raise_on_the_cpu(key):
    (entry,) = [e for e in TABLE if e.key == key]
    with deterministic(0), pytest.raises(RuntimeError, match="does not have a deterministic"):
        EXAMPLES[entry.key](torch.device("cpu"))


def _data_file():
    return resources.files("deterministic_ctx.audit").joinpath(audit_table.DATA_FILE)


def test_the_table_is_package_data_read_through_importlib_resources():
    # Found wherever the package is installed (a wheel, a zip, a source tree), and shipped
    # in the wheel by pyproject.toml's package-data.
    data = _data_file()
    assert data.is_file()
    raw = json.loads(data.read_text(encoding="utf-8"))
    assert [entry["key"] for entry in raw["entries"]] == [entry.key for entry in TABLE]
    assert audit_table.parse(raw) == TABLE
    assert table() is TABLE  # read once
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["deterministic_ctx"]
    assert any(fnmatch.fnmatch(f"audit/{audit_table.DATA_FILE}", p) for p in patterns)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda raw: raw["entries"][0].update(behaviour="rase"),
            r"entry 0 \('index_add'\): behaviour must be one of 'raise', 'warn', "
            r"'deterministic', 'none', got 'rase'",
        ),
        (
            lambda raw: raw["entries"][1].update(when="no-such-predicate"),
            r"entry 1 \('index_put'\): when names no predicate of conditions.CONDITIONS",
        ),
        (lambda raw: raw["entries"][2].pop("note"), r"entry 2 \('put'\): missing field\(s\) note"),
        (lambda raw: raw["entries"][3].update(notes="x"), r"unknown field\(s\) notes \(known: "),
        (lambda raw: raw["entries"][0].update(ops="index_add"), "ops must be a list of strings"),
        (lambda raw: raw["entries"][0].update(parameters=[1]), r"parameters\[0\] must be a string"),
        (
            lambda raw: raw["entries"][0].update(earlier=[["2.13"]]),
            r"earlier\[0\] must be a \[release, behaviour\] pair",
        ),
        (lambda raw: raw["entries"][0].update(phase="both"), "phase must be one of"),
        (
            lambda raw: raw["entries"].append(dict(raw["entries"][0])),
            "keys must be unique, repeated: index_add",
        ),
        (lambda raw: raw["entries"].pop(), 'exactly one entry of kind "uninitialized"'),
        (
            lambda raw: raw["entries"][1].pop("when"),
            "no entry names these predicates of conditions.CONDITIONS: index_put-races",
        ),
        (lambda raw: raw.update(entries={}), "top level: must be an object with an entries list"),
    ],
)
def test_a_bad_edit_of_the_data_file_fails_loudly(edit, message):
    raw = json.loads(_data_file().read_text(encoding="utf-8"))
    edit(raw)
    with pytest.raises(audit_table.TableError, match=message):
        audit_table.parse(raw)


# --- on a real GPU ------------------------------------------------------------------------------

_GPU_SCRIPT = """
import json, sys, warnings
import torch
from deterministic_ctx import deterministic
from deterministic_ctx.audit import audit_nondeterminism
from deterministic_ctx.audit.table import table
from deterministic_ctx.verify.compare import first_difference
from tests.verify.audit_examples import EXAMPLES

device = torch.device("cuda")


def attempt(entry, warn_only, runs):
    \"\"\"Run the example ``runs`` times in deterministic blocks: error, warnings, agreement.\"\"\"
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(runs):
                with deterministic(0, warn_only=warn_only):
                    results.append(EXAMPLES[entry.key](device))
                    torch.cuda.synchronize()
        except RuntimeError as exc:
            return {"error": str(exc)[:300]}
    messages = [str(w.message)[:300] for w in caught if "determinis" in str(w.message).lower()]
    same = all(first_difference(results[0], r) is None for r in results[1:])
    return {"error": None, "warnings": messages, "same": same}


only = sys.argv[1:]  # keys: just their warn_only attempt, first thing in this process
report = {}
for entry in table():
    if entry.key in only:
        report[entry.key] = {"warn_only": attempt(entry, True, 1)}
    elif not only:
        report[entry.key] = {
            "warn_only": attempt(entry, True, 1),
            "strict": attempt(entry, False, 3),
            "audit": [f.entry for f in audit_nondeterminism(EXAMPLES[entry.key], device).findings],
        }
print(json.dumps(report))
"""


def _run_gpu_script(*keys: str) -> dict:
    proc = run_python(list(keys), code=textwrap.dedent(_GPU_SCRIPT), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _audited_on_cuda_as(entry) -> str:
    """The entry the audit lists for ``entry``'s example run on CUDA.

    A ``-math`` entry stands for CUDA's fused attention where the CPU ran the math kernel;
    on CUDA the fused kernel itself runs, and its entry lists it.
    """
    if entry.kind == "function" and entry.unless_dispatched:
        (fused,) = {e.key for op in entry.unless_dispatched for e in entries_for(op + "_backward")}
        return fused
    return entry.key


def _expectation_failures(entry, result) -> list[str]:
    """What differs between the table's entry, for the running torch, and what CUDA did."""
    failures = []
    version = torch.__version__
    for mode, behaviour in (
        ("strict", entry.behaviour_on(version)),
        ("warn_only", entry.behaviour_under(warn_only=True, version=version)),
    ):
        got = result[mode]
        if behaviour == "raise":
            if not (
                got["error"] and "does not have a deterministic implementation" in got["error"]
            ):
                failures.append(f"{mode}: expected a RuntimeError, got {got}")
        elif got["error"]:
            failures.append(f"{mode}: expected no error, got {got['error']}")
        elif behaviour == "warn" and not got["warnings"]:
            failures.append(f"{mode}: expected a warning, got none")
        elif behaviour in ("deterministic", "none") and got["warnings"]:
            failures.append(f"{mode}: expected no warning, got {got['warnings']}")
        elif behaviour == "deterministic" and mode == "strict" and not got["same"]:
            failures.append(f"{mode}: runs differ although the table says deterministic")
    if _audited_on_cuda_as(entry) not in result["audit"]:
        failures.append(f"the audit on CUDA did not list it: {result['audit']}")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_table_matches_what_cuda_does():
    # A fresh interpreter (CUDA's state is process-wide) runs every entry's example under
    # use_deterministic_algorithms(True) and (True, warn_only=True) and audits it on CUDA;
    # every mismatch with the table's behaviours for the running torch is reported at once.
    # On a release of CHECKED_TORCH whose check was read from source (not "observed"), a
    # pass is what turns it into an observed one: add it to the entries' observed.
    results = _run_gpu_script()
    # Some kernels warn once per process (TORCH_WARN_ONCE): each entry that should warn is
    # checked again first thing in a fresh interpreter of its own.
    version = torch.__version__
    for entry in TABLE:
        if (
            entry.behaviour_under(warn_only=True, version=version) == "warn"
            and entry.behaviour_on(version) != "raise"
        ):
            results[entry.key].update(_run_gpu_script(entry.key)[entry.key])
    failures = {
        entry.key: problems
        for entry in TABLE
        if (problems := _expectation_failures(entry, results[entry.key]))
    }
    assert not failures, json.dumps(failures, indent=1)
