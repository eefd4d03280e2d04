"""Real-CUDA checks of the core: they run where a GPU is present and skip elsewhere.

CPU machines exercise the same code paths with a fake device module
(tests/test_sources.py).  Whether CUDA is initialized is process-wide and
cannot be undone, so each scenario runs in a fresh interpreter.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.helpers import run_python

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(code: str) -> str:
    proc = run_python([], code=textwrap.dedent(code))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_block_never_initializes_cuda():
    out = _run("""
        import torch
        from deterministic_ctx import deterministic
        with deterministic(seed=0):
            torch.rand(3)
            torch.manual_seed(1)
        print(torch.cuda.is_initialized())
    """)
    assert out.strip() == "False"


def test_cuda_first_initialized_inside_block():
    out = _run("""
        import torch
        from deterministic_ctx import deterministic
        with deterministic(seed=3):
            inside = torch.rand(4, device="cuda").tolist()   # first CUDA use
        after = torch.rand(4, device="cuda").tolist()
        print(inside); print(after)
    """)
    reference = _run("""
        import torch
        torch.manual_seed(3)
        print(torch.rand(4, device="cuda").tolist())
    """)
    untouched = _run("""
        import torch
        print(torch.rand(4, device="cuda").tolist())   # a fresh process's CUDA stream
    """)
    inside, after = out.strip().splitlines()
    assert inside == reference.strip()
    assert after == untouched.strip()


def test_live_cuda_generators_restored_bitwise():
    out = _run("""
        import torch
        from deterministic_ctx import deterministic
        torch.cuda.init()
        n = torch.cuda.device_count()
        before = [torch.cuda.get_rng_state(i) for i in range(n)]
        with deterministic(seed=0):
            for i in range(n):
                torch.rand(1000, device=f"cuda:{i}")
        after = [torch.cuda.get_rng_state(i) for i in range(n)]
        print(all(torch.equal(a, b) for a, b in zip(before, after)))
    """)
    assert out.strip() == "True"


def test_cuda_training_step_is_deterministic():
    out = _run("""
        import torch
        from deterministic_ctx import deterministic
        def step():
            model = torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                torch.nn.Flatten(), torch.nn.LazyLinear(10)).cuda()
            x = torch.randn(32, 3, 32, 32, device="cuda")
            loss = model(x).square().mean()
            loss.backward()
            return loss.item(), sum(p.grad.double().sum().item() for p in model.parameters())
        with deterministic(seed=0):
            a = step()
        with deterministic(seed=0):
            b = step()
        print(a == b, a)
    """)
    assert out.startswith("True")
