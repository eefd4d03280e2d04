"""What the verification tools, the audit and ``report()`` say about ``allow_nondeterministic``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deterministic_ctx import (
    _torch,
    allow_nondeterministic,
    assert_reproducible,
    audit_nondeterminism,
    deterministic,
    locate_divergence,
    report,
)
from tests import standin_ops
from tests.helpers import needs
from tests.standin_ops import FORWARD, scatter_like

pytestmark = needs(_torch.SCOPED_EXEMPTION)


@pytest.fixture(autouse=True)
def _ops() -> None:
    standin_ops.register()


def test_report_lists_the_open_exemptions() -> None:
    with deterministic(0), allow_nondeterministic(FORWARD, torch.ops.aten.kthvalue.values):
        inside = report()
    after = report()
    assert inside.exempted_ops == ("aten::kthvalue.values", FORWARD)
    assert f"allow_nondeterministic): aten::kthvalue.values, {FORWARD}" in str(inside)
    assert inside.to_dict()["exempted_ops"] == list(inside.exempted_ops)
    assert after.exempted_ops == () and "allow_nondeterministic" not in str(after)


def _leaky(leak: torch.Generator) -> torch.Tensor:
    """Differs on every run (a generator no block manages), through the exempted op."""
    with allow_nondeterministic(FORWARD):
        return scatter_like(torch.rand(3, generator=leak))


def test_assert_reproducible_names_an_exempted_op_that_ran_as_a_suspect() -> None:
    leak = torch.Generator().manual_seed(0)
    with pytest.raises(AssertionError, match=f"Suspect: {FORWARD} ran in run 2 exempted"):
        assert_reproducible(_leaky, leak)


def test_assert_reproducible_names_no_suspect_where_no_exempted_op_ran() -> None:
    leak = torch.Generator().manual_seed(0)
    with pytest.raises(AssertionError) as info:
        assert_reproducible(lambda: torch.rand(3, generator=leak))
    assert "Suspect" not in str(info.value)


class _Leaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leak = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _leaky(self.leak) + x


@pytest.mark.usefixtures("restore_world")
def test_locate_divergence_names_an_exempted_op_that_ran_as_a_suspect() -> None:
    found = locate_divergence(_Leaky(), torch.zeros(3))
    assert not found.agree
    assert found.exempted == (FORWARD,)
    assert f"Suspect: {FORWARD} ran in run 2" in str(found)
    assert locate_divergence(nn.Linear(3, 1), torch.zeros(3)).exempted == ()


class _Up(nn.Module):
    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return F.interpolate(image, scale_factor=2, mode="bicubic")


@pytest.mark.usefixtures("restore_world")
def test_audit_marks_the_exempted_ops() -> None:
    image = torch.randn(1, 1, 4, 4, requires_grad=True)
    plain = audit_nondeterminism(_Up(), image)
    with allow_nondeterministic("aten::upsample_bicubic2d_backward"):
        exempted = audit_nondeterminism(_Up(), image)
    assert [(f.op, f.exempted) for f in plain.findings] == [
        ("aten.upsample_bicubic2d_backward.default", False)
    ]
    assert [(f.op, f.exempted) for f in exempted.findings] == [
        ("aten.upsample_bicubic2d_backward.default", True)
    ]
    assert "exempted by allow_nondeterministic" in str(exempted)
    assert "exempted by" not in str(plain)
