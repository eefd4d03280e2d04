"""``allow_nondeterministic``: one op's call without the deterministic check.

Through the stand-in ops of :mod:`tests.standin_ops` (CPU kernels that alert as
torch's CUDA kernels without a deterministic implementation do).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from deterministic_ctx import (
    MisuseError,
    _torch,
    allow_nondeterministic,
    deterministic,
    reproducible,
)
from deterministic_ctx.core import exempt
from tests import standin_ops
from tests.core.test_interrupts import _Tracer
from tests.helpers import needs
from tests.standin_ops import BACKWARD, FORWARD, scatter_like, scatter_like_backward

pytestmark = needs(_torch.SCOPED_EXEMPTION)
needs_backward = pytest.mark.skipif(
    not standin_ops.has_autograd(),
    reason="the stand-in's backward needs torch.library.register_autograd (torch >= 2.4)",
)


@pytest.fixture(autouse=True)
def _ops() -> Iterator[None]:
    standin_ops.register()
    yield
    # Every exemption left: nothing named, the flag's window closed, the key not included.
    assert exempt.active_exemptions() == ()
    assert not exempt._holders and not exempt._bases
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch)


def flags() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def x() -> torch.Tensor:
    return torch.arange(3.0)


def test_the_stand_in_is_refused_in_a_block() -> None:
    with deterministic(0), pytest.raises(RuntimeError, match="scatter_like_cpu does not have"):
        scatter_like(x())


def test_exempted_op_runs_and_the_flag_is_back_after_each_call() -> None:
    seen: list[tuple[bool, bool]] = []
    with deterministic(0):
        with allow_nondeterministic(FORWARD):
            seen.append(flags())
            assert scatter_like(x()).tolist() == [0.0, 2.0, 4.0]
            seen.append(flags())
        seen.append(flags())
        with pytest.raises(RuntimeError, match="scatter_like_cpu"):  # the exemption is over
            scatter_like(x())
    assert seen == [(True, False)] * 3


def test_other_ops_stay_checked() -> None:
    with deterministic(0), allow_nondeterministic(FORWARD):
        with pytest.raises(RuntimeError, match="scatter_like_backward_cpu"):
            scatter_like_backward(x())
        assert scatter_like(x()).tolist() == [0.0, 2.0, 4.0]


def test_the_check_is_off_during_the_exempted_call_only() -> None:
    with deterministic(0), allow_nondeterministic(FORWARD):
        scatter_like(x())
        assert standin_ops.seen[-1] is False
        assert flags() == (True, False)


@needs_backward
def test_backward_op_is_reached() -> None:
    t = x().requires_grad_()
    with deterministic(0), allow_nondeterministic(FORWARD, BACKWARD):
        scatter_like(t).sum().backward()
        assert flags() == (True, False)
    assert t.grad is not None and t.grad.tolist() == [2.0, 2.0, 2.0]


@needs_backward
def test_exempting_the_forward_leaves_the_backward_checked() -> None:
    t = x().requires_grad_()
    with deterministic(0), allow_nondeterministic(FORWARD):
        y = scatter_like(t).sum()
        with pytest.raises(RuntimeError, match="scatter_like_backward_cpu"):
            y.backward()


@needs_backward
def test_backward_exempted_apart_from_its_forward() -> None:
    t = x().requires_grad_()
    with deterministic(0):
        with allow_nondeterministic(FORWARD):
            y = scatter_like(t).sum()
        with allow_nondeterministic(torch.ops.dctx_test.scatter_like_backward):
            y.backward()
    assert t.grad is not None and t.grad.tolist() == [2.0, 2.0, 2.0]


@needs_backward
def test_op_called_from_an_autograd_function() -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return scatter_like(t)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return scatter_like_backward(g)

    t = x().requires_grad_()
    with deterministic(0), allow_nondeterministic(FORWARD, BACKWARD):
        Twice.apply(t).sum().backward()
    assert t.grad is not None and t.grad.tolist() == [2.0, 2.0, 2.0]


def test_decorator() -> None:
    @allow_nondeterministic(FORWARD)
    def step(t: torch.Tensor) -> torch.Tensor:
        return scatter_like(t)

    with deterministic(0):
        assert step(x()).tolist() == [0.0, 2.0, 4.0]
        with pytest.raises(RuntimeError):
            scatter_like(x())


def test_decorator_refuses_generator_functions() -> None:
    def gen() -> Iterator[int]:
        yield 1

    with pytest.raises(TypeError, match="plain functions"):
        allow_nondeterministic(FORWARD)(gen)


def test_nesting() -> None:
    outer = allow_nondeterministic(FORWARD)
    with deterministic(0), outer:
        with allow_nondeterministic(BACKWARD):
            assert exempt.active_exemptions() == (FORWARD, BACKWARD)
            scatter_like(x())
            scatter_like_backward(x())
        assert exempt.active_exemptions() == (FORWARD,)
        scatter_like(x())
        with pytest.raises(RuntimeError):
            scatter_like_backward(x())
        with outer:  # the same object again, nested in itself
            scatter_like(x())
        scatter_like(x())


def test_warn_only_gives_no_warning_for_the_exempted_op() -> None:
    with deterministic(0, warn_only=True):
        with pytest.warns(UserWarning, match="scatter_like_cpu"):
            scatter_like(x())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with allow_nondeterministic(FORWARD):
                scatter_like(x())
                assert flags() == (True, True)
            with (
                pytest.raises(UserWarning, match="scatter_like_backward_cpu"),
                allow_nondeterministic(FORWARD),
            ):
                scatter_like_backward(x())


def test_outside_any_block_a_no_op() -> None:
    before = flags()
    assert before == (False, False)
    with allow_nondeterministic(FORWARD):
        assert scatter_like(x()).tolist() == [0.0, 2.0, 4.0]
        assert flags() == before
    assert flags() == before


def test_inside_reproducible() -> None:
    @reproducible(seed=3)
    @allow_nondeterministic(FORWARD)
    def step() -> list[float]:
        return scatter_like(torch.rand(2)).tolist()

    assert step() == step()


@pytest.mark.deterministic(seed=1)
def test_inside_the_pytest_marker() -> None:
    with pytest.raises(RuntimeError):
        scatter_like(x())
    with allow_nondeterministic(FORWARD):
        scatter_like(x())


@pytest.mark.parametrize(
    "spec",
    [
        FORWARD,
        "dctx_test.scatter_like",
        "dctx_test::scatter_like.default",
        "dctx_test.scatter_like.default",
    ],
)
def test_names(spec: str) -> None:
    standin_ops.register()
    assert allow_nondeterministic(spec).names == (FORWARD,)


def test_op_objects() -> None:
    assert allow_nondeterministic(torch.ops.dctx_test.scatter_like).names == (FORWARD,)
    packet = torch.ops.aten.index_add
    every = tuple(
        "aten::index_add" + ("" if name == "default" else f".{name}") for name in packet.overloads()
    )
    assert "aten::index_add.out" in every
    assert allow_nondeterministic(packet).names == every
    assert allow_nondeterministic("aten::index_add").names == every
    assert allow_nondeterministic(torch.ops.aten.index_add.out).names == ("aten::index_add.out",)


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("aten::no_such_op", ValueError, "'aten::no_such_op'"),
        ("no_such_namespace::op", ValueError, "'no_such_namespace::op'"),
        ("aten::index_add.no_such_overload", ValueError, "no_such_overload"),
        ("index_add", ValueError, "'index_add' is not an op name"),
        (3, TypeError, "not int"),
        (torch.index_add, TypeError, "op object"),
    ],
)
def test_unknown_ops_are_refused_at_construction(spec: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace(".", r"\.").replace("(", r"\(")):
        allow_nondeterministic(FORWARD, spec)


def test_no_ops() -> None:
    with pytest.raises(TypeError, match="at least one op"):
        allow_nondeterministic()


def test_another_thread_is_not_exempted() -> None:
    """The exemption reaches the ops of the thread that opened it, not another thread's."""
    results: list[str] = []

    def other() -> None:
        try:
            scatter_like(x())
            results.append("ran")
        except RuntimeError:
            results.append("refused")

    with deterministic(0), allow_nondeterministic(FORWARD):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        scatter_like(x())
    assert results == ["refused"]


def test_overlapping_calls_in_threads_leave_the_flag_on() -> None:
    """The first call turns the flag off, the last puts it back, whatever the order."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def worker(seconds: float) -> None:
        standin_ops.delay.seconds = seconds
        try:
            barrier.wait()
            with allow_nondeterministic(FORWARD):
                for _ in range(3):
                    scatter_like(x())
        except BaseException as exc:
            errors.append(exc)

    with deterministic(0):
        threads = [threading.Thread(target=worker, args=(s,)) for s in (0.01, 0.03, 0.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert flags() == (True, False)
    assert errors == []


def _interrupted(body: Callable[[], None], fire_at: int) -> tuple[str, bool] | None:
    """``KeyboardInterrupt`` raised at the ``fire_at``-th line the package runs (what a
    signal handler can raise between any two lines): ``(function, whether at its first
    line)``, or ``None`` once ``body`` runs fewer lines."""
    tracer = _Tracer(fire_at)
    error = tracer.run(body)
    if error is not None and not isinstance(error, KeyboardInterrupt):
        raise error
    return None if tracer.fired is None else (tracer.fired[0], tracer.fired[2])


@needs_backward
@pytest.mark.parametrize("warn_only", [False, True])
def test_interrupt_at_any_line_leaves_nothing_changed(warn_only: bool) -> None:
    exemption = allow_nondeterministic(FORWARD, BACKWARD)

    def body() -> None:
        with exemption:
            t = x().requires_grad_()
            scatter_like(t).sum().backward()

    with deterministic(0, warn_only=warn_only):
        with exemption:  # the kernels installed, outside the tracer
            pass
        fire_at = 1
        while fired := _interrupted(body, fire_at):
            if fired == ("__exit__", True):
                # The one instant no code can protect (PEP 419): entering __exit__, before
                # its first line.  The exemption is still open; leaving it again closes it.
                assert exempt.active_exemptions() == (FORWARD, BACKWARD)
                exemption.__exit__(None, None, None)
            assert flags() == (True, warn_only), fire_at
            assert exempt.active_exemptions() == (), fire_at
            assert not exempt._holders and exempt._saved == [None], fire_at
            assert not exempt._bases, fire_at
            assert not torch._C._dispatch_tls_is_dispatch_key_included(
                torch._C.DispatchKey.PreDispatch
            ), fire_at
            fire_at += 1
    assert fire_at > 20  # it went through the whole exemption, not stopped early


def test_compile_refuses_a_traced_exempted_op() -> None:
    """Under a tracer (as torch.compile and torch.export trace) an exempted op's call
    is refused with the library's error, never recorded with the check off."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        deterministic(0),
        allow_nondeterministic(FORWARD),
        FakeTensorMode() as mode,
        pytest.raises(MisuseError, match="cannot exempt"),
    ):
        scatter_like(mode.from_tensor(x()))


def test_report_of_calls_counts_the_exempted_calls() -> None:
    before = exempt.exempted_calls().get(FORWARD, 0)
    with deterministic(0), allow_nondeterministic(FORWARD):
        scatter_like(x())
        scatter_like(x())
    assert exempt.exempted_calls()[FORWARD] == before + 2


@pytest.mark.slow
def test_torch_compile_refuses_an_exempted_op_in_the_region_it_traces() -> None:
    """Compiling, inside an exemption, a function that calls an exempted op: the library's
    error (dynamo wraps it), never a graph that runs the op with the check off or on."""
    import torch._dynamo

    def step(t: torch.Tensor) -> torch.Tensor:
        return torch.ops.dctx_test.scatter_like(t) + 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager")
        with (
            deterministic(0),
            allow_nondeterministic(FORWARD),
            pytest.raises(Exception, match="allow_nondeterministic cannot exempt") as info,
        ):
            compiled(x())
        assert "torch.compile" in str(info.value)
    finally:
        torch._dynamo.reset()


def test_a_torch_without_the_key_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from deterministic_ctx._torch import internals

    monkeypatch.setattr(internals, "_probe_exemption", lambda: None)
    monkeypatch.setattr(internals, "_key", None)
    with pytest.raises(_torch.TorchFeatureError, match=r"allow_nondeterministic needs .*torch >="):
        allow_nondeterministic(FORWARD)


def test_exemptions_left_out_of_order_keep_the_other_open() -> None:
    """Interleaved tasks of one thread leave their exemptions in any order."""
    first, second = allow_nondeterministic(FORWARD), allow_nondeterministic(BACKWARD)
    with deterministic(0):
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # before the exemption opened after it
        scatter_like_backward(x())  # the second one still reaches its op
        with pytest.raises(RuntimeError):
            scatter_like(x())
        second.__exit__(None, None, None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_another_threads_exempted_call_gets_the_flag_back() -> None:
    """The thread whose call turned the flag off does not exist in the child."""
    inside, release = threading.Event(), threading.Event()

    def slow(t: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(10)
        return t

    def worker() -> None:
        with allow_nondeterministic(FORWARD):
            standin_ops.pause_with = slow
            try:
                scatter_like(x())
            finally:
                standin_ops.pause_with = None

    with deterministic(0):
        thread = threading.Thread(target=worker)
        thread.start()
        try:
            assert inside.wait(10)
            assert not torch.are_deterministic_algorithms_enabled()  # the window is open
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report the flag and whether an exemption is left
                os.close(read)
                state = (torch.are_deterministic_algorithms_enabled(), exempt.active_exemptions())
                os.write(write, repr(state).encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as pipe:
                seen = pipe.read()
            os.waitpid(pid, 0)
        finally:
            release.set()
            thread.join()
    assert seen == "(True, ())"
