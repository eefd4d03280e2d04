"""Real-CUDA checks of the core: they run where a GPU is present and skip elsewhere.

CPU machines exercise the same code paths with a fake device module
(tests/sources/test_sources.py).  Whether CUDA is initialized is process-wide and
cannot be undone, so each scenario runs in a fresh interpreter.
"""

from __future__ import annotations

import json
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
    """Inside: the block's seed.  After: what initialization gives without the block,
    i.e. torch's own per-process random seed, or the stream of a seed queued before."""
    code = """
        import torch
        from deterministic_ctx import deterministic
        with deterministic(seed=3):
            inside = torch.rand(4, device="cuda").tolist()   # first CUDA use
        print(inside); print(torch.rand(4, device="cuda").tolist(), torch.cuda.initial_seed())
    """
    out, again = _run(code), _run(code)
    reference = _run("""
        import torch
        torch.manual_seed(3)
        print(torch.rand(4, device="cuda").tolist())
    """)
    inside, after = out.strip().splitlines()
    assert inside == reference.strip() == again.splitlines()[0]
    after_draws, after_seed = after.rsplit(" ", 1)
    # Initialization seeds from the OS: two processes differ after the block, as they
    # would without it, and nothing is left of the block's seed.
    assert after != again.splitlines()[1]
    assert int(after_seed) != 3
    assert (
        after_draws
        != _run("""
        import torch
        torch.manual_seed(3)
        torch.rand(4, device="cuda")
        print(torch.rand(4, device="cuda").tolist())
    """).strip()
    )
    # A seed queued before the block is what the program draws from afterwards.
    queued = _run("""
        import torch
        from deterministic_ctx import deterministic
        torch.manual_seed(5)                     # queued for CUDA: not initialized yet
        with deterministic(seed=3):
            torch.rand(4, device="cuda")
        print(torch.rand(4, device="cuda").tolist())
    """)
    expected = _run("""
        import torch
        torch.manual_seed(5)
        print(torch.rand(4, device="cuda").tolist())
    """)
    assert queued.strip() == expected.strip()


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


def test_cuda_training_loop_bitwise_under_block_and_nondeterministic_without():
    """cuDNN convolutions, cuBLAS matmuls, dropout, batch norm, AdamW and an
    ``index_add_`` (atomics) in the forward: two runs in ``deterministic(seed=0)``
    agree bit for bit; without the block the atomics make runs differ."""
    out = _run("""
        import torch
        from deterministic_ctx import deterministic

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 32, 3, padding=1)
                self.bn = torch.nn.BatchNorm2d(32)
                self.drop = torch.nn.Dropout(0.2)
                self.fc = torch.nn.Linear(32 * 16 * 16, 64)
                self.head = torch.nn.Linear(64, 10)
            def forward(self, x, index):
                h = self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1)
                h = self.fc(h)
                # 64 rows summed into 8 with atomics: the order decides the rounding
                pooled = torch.zeros(8, h.shape[1], device=h.device).index_add_(0, index, h)
                return self.head(pooled)

        def train(steps=5):
            torch.manual_seed(0)
            model = Net().cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(64, 3, 16, 16, device="cuda")
            index = torch.randint(0, 8, (64,), device="cuda")
            for _ in range(steps):
                opt.zero_grad()
                model(x, index).square().mean().backward()
                opt.step()
            torch.cuda.synchronize()
            return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()

        with deterministic(seed=0):
            a = train()
        with deterministic(seed=0):
            b = train()
        print(torch.equal(a.view(torch.int32), b.view(torch.int32)))

        # Without the block: index_add_ on floats uses atomics.  A large pile-up makes
        # a different summation order (and so a different result) all but certain.
        torch.manual_seed(0)
        values = torch.randn(1 << 22, device="cuda")
        index = torch.randint(0, 4, (1 << 22,), device="cuda")
        sums = {tuple(torch.zeros(4, device="cuda").index_add_(0, index, values).tolist())
                for _ in range(20)}
        print(len(sums) > 1)
        with deterministic(seed=0):
            sums = {tuple(torch.zeros(4, device="cuda").index_add_(0, index, values).tolist())
                    for _ in range(20)}
        print(len(sums) == 1)
    """)
    assert out.split() == ["True", "True", "True"]


def test_deterministic_algorithms_raise_on_cuda_inside_the_block_only():
    out = _run("""
        import torch
        from deterministic_ctx import deterministic
        x = torch.rand(1000, device="cuda")
        with deterministic(seed=0):
            try:
                torch.histc(x, bins=10)   # no deterministic CUDA kernel
                print("no error")
            except RuntimeError as exc:
                print("raised", "deterministic" in str(exc))
        torch.histc(x, bins=10)
        torch.cuda.synchronize()
        print("after ok", torch.are_deterministic_algorithms_enabled())
    """)
    assert out.splitlines() == ["raised True", "after ok False"]


def test_cublas_workspace_config_set_by_the_block_takes_effect():
    """A block sets ``CUBLAS_WORKSPACE_CONFIG`` before the first cuBLAS call and unsets it
    after.  torch before 2.10 refuses cuBLAS under deterministic algorithms without it;
    later torch gives each handle and stream its own workspace and no longer asks
    (pytorch/pytorch#161749: seen on torch 2.11 + CUDA 13, H200)."""
    control = _run("""
        import os, torch
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.use_deterministic_algorithms(True)
        a = torch.rand(64, 64, device="cuda")
        try:
            a @ a
            print("no error")
        except RuntimeError as exc:
            print("raised", "CUBLAS_WORKSPACE_CONFIG" in str(exc))
    """).strip()
    assert control in ("raised True", "no error")
    ours = _run("""
        import os, torch
        from deterministic_ctx import deterministic
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        a = torch.rand(64, 64, device="cuda")
        with deterministic(seed=0):
            inside = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            first = (a @ a).sum().item()      # the process's first cuBLAS call
            second = (a @ a).sum().item()
        print(inside, first == second, "CUBLAS_WORKSPACE_CONFIG" in os.environ)
    """)
    assert ours.strip() == ":4096:8 True False"


def test_locate_divergence_fingerprints_on_the_device_without_host_copies():
    """What moves to the host during ``locate_divergence`` is fingerprints, not tensors:
    a dispatch mode counts every element copied from CUDA to the CPU."""
    out = _run("""
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from deterministic_ctx import deterministic, locate_divergence

        class HostCopies(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.elements = 0
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                sources = [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
                results = out if isinstance(out, (tuple, list)) else [out]
                for r in results:
                    if isinstance(r, torch.Tensor) and r.device.type == "cpu" and sources:
                        self.elements += r.numel()
                return out

        with deterministic(seed=0):
            model = torch.nn.Sequential(*[torch.nn.Sequential(
                torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1))
                for _ in range(4)]).cuda()
            x = torch.randn(512, 1024, device="cuda")
        activations = 4 * 3 * x.numel() + sum(p.numel() for p in model.parameters())
        with HostCopies() as copies:
            report = locate_divergence(model, x, backward=True)
        print(report.divergence is None, copies.elements, activations)
    """)
    agreed, copied, total = out.split()
    assert agreed == "True"
    assert int(copied) < int(total) // 50, (copied, total)


def test_snapshot_of_cuda_states_saves_and_loads_in_a_fresh_process(tmp_path):
    path = tmp_path / "rng.snapshot"
    first = _run(f"""
        import torch
        from deterministic_ctx import Snapshot
        torch.cuda.manual_seed_all(5)
        torch.rand(7, device="cuda")
        Snapshot.capture().save({str(path)!r})
        print(torch.rand(4, device="cuda").tolist())
    """)
    second = _run(f"""
        import torch
        from deterministic_ctx import Snapshot
        torch.rand(100, device="cuda")      # a different CUDA stream before the load
        Snapshot.load({str(path)!r}).restore()
        print(torch.rand(4, device="cuda").tolist())
    """)
    assert first.strip() == second.strip()


def test_report_names_the_cuda_device_and_libraries():
    out = _run("""
        import json, torch
        from deterministic_ctx import report
        torch.cuda.init()
        data = report().to_dict()
        cuda = data["cuda"]
        print(json.dumps([cuda["initialized"], cuda["device_count"],
                          cuda["devices"][0]["name"], cuda["devices"][0]["capability"]]))
    """)
    initialized, count, name, capability = json.loads(out)
    assert initialized is True and count >= 1
    assert name == _run("import torch; print(torch.cuda.get_device_name(0))").strip()
    assert capability.count(".") == 1


def test_philox_state_rules_match_a_real_cuda_generator():
    """What loading refuses of a CUDA generator state is what torch's ``set_state`` refuses
    (the fake of ``tests/state/checkpoint_helpers.py`` follows the same rules), and a snapshot whose
    CUDA offset torch would refuse fails at load, before anything is restored."""
    out = _run("""
        import json, random, struct, torch
        from deterministic_ctx import InvalidSnapshotError, Snapshot
        from deterministic_ctx.sources.accelerators import check_philox_state
        from tests.state.checkpoint_helpers import PhiloxGenerator

        def verdict(setter, state):
            try:
                setter(state)
                return "ok"
            except Exception:
                return "refused"

        def ours(state):
            try:
                check_philox_state(state, "s", "cuda")
                return "ok"
            except ValueError:
                return "refused"

        torch.cuda.init()  # default_generators is an empty tuple until CUDA is initialized
        gen = torch.cuda.default_generators[0]
        gen.manual_seed(11)
        torch.rand(1000, device="cuda")
        layout = gen.get_state().numpy().tobytes() == struct.pack(
            "=Qq", gen.initial_seed(), gen.get_offset())
        rows = []
        for seed, offset in [(0, 0), (2**64 - 1, 4), (5, 1), (5, 2), (5, 6), (5, -4), (5, -1),
                             (5, 2**63 - 1), (5, 2**63 - 4)]:
            state = torch.frombuffer(bytearray(struct.pack("=Qq", seed, offset)),
                                     dtype=torch.uint8).clone()
            rows.append([seed, offset, verdict(gen.set_state, state),
                         verdict(PhiloxGenerator(0).set_state, state), ours(state)])
        gen.manual_seed(3)
        snap = Snapshot.capture().state_dict()
        snap["devices"]["cuda"]["states"][0] = torch.frombuffer(
            bytearray(struct.pack("=Qq", 1, 6)), dtype=torch.uint8).clone()
        random.seed(1)
        before = (random.random(), gen.get_state())
        random.seed(1)
        try:
            Snapshot.from_state_dict(snap)
            refused = "loaded"
        except InvalidSnapshotError as exc:
            refused = str(exc)
        unchanged = random.random() == before[0] and torch.equal(gen.get_state(), before[1])
        print(json.dumps([layout, rows, refused, unchanged]))
    """)
    layout, rows, refused, unchanged = json.loads(out.strip().splitlines()[-1])
    assert layout
    for seed, offset, torch_says, fake_says, we_say in rows:
        assert torch_says == fake_says == we_say, (seed, offset, torch_says, fake_says, we_say)
    assert "devices.cuda.states[0]: the cuda generator's Philox offset is 6" in refused
    assert unchanged
