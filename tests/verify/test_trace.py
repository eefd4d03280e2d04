"""Traces: recorded in one process, compared in another; files that never unpickle.

The promises tested here:

* a trace holds every module call's fingerprints, the return value's and the final
  state's, and the environment as ``fn`` ran in it (its thread count, the block's flags);
* two traces of the same run agree; traces that differ name the first differing module
  call as ``locate_divergence`` names it, and the environment facts that differ, most
  likely culprits first (recorded in subprocesses with different thread counts, too);
* with ``ops=True`` every aten op call is in the timeline, before the output of the
  module call it ran in, and two traces name the first differing op and the user's
  ``file:line``; with ops in one trace only, the comparison is the module-level one;
* a bad trace file raises ``InvalidTraceError``, an ``InvalidSnapshotError``, like a bad
  snapshot, and nothing in it is ever unpickled;
* ``deterministic-ctx trace compare`` exits 0 / 1 / 2, ``trace record`` records a script.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import os
import pickle
import struct
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from deterministic_ctx import InvalidSnapshotError, Snapshot, _torch, deterministic, isolated
from deterministic_ctx.integrations import cli as cli_module
from deterministic_ctx.integrations.cli import _split, main
from deterministic_ctx.state import checkpoint
from deterministic_ctx.trace import (
    TRACE_FILE,
    EnvironmentDifference,
    InvalidTraceError,
    Trace,
    compare_traces,
    record_in,
    record_trace,
    script_result,
)
from deterministic_ctx.verify.record import Event
from tests.helpers import needs, run_python

#: "Shift." where Python names a code object's class (co_qualname, 3.11+); 3.10
#: names the function only, and the library cannot know better.
_SHIFT = "Shift." if sys.version_info >= (3, 11) else ""

#: A block's ``fill_uninitialized_memory=False`` needs the flag (torch >= 2.2).
needs_fill = needs(_torch.FILL_UNINITIALIZED_MEMORY)

TRACE_MAGIC = b"\x89DCT\r\n\x1a\n"  # as documented in deterministic_ctx/trace/__init__.py


class Total(nn.Module):
    """A reduction over every element: torch splits it across threads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


def forward_pass(threads: int | None = None) -> dict[str, Any]:
    """Everything from the block's seed; with ``threads``, set inside the block (restored)."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Flatten(0), Total())
    out = model(torch.randn(16384, 64))
    return {"out": out, "steps": 1}


@pytest.fixture(scope="module")
def trace() -> Trace:
    return record_trace(forward_pass)


@pytest.fixture(scope="module")
def trace_bytes(trace: Trace) -> bytes:
    return trace.to_bytes()


def state_of(trace: Trace) -> dict[str, Any]:
    return checkpoint.decode(trace.to_bytes(), "test", TRACE_FILE)


def from_state(state: dict[str, Any]) -> Trace:
    return Trace.from_bytes(checkpoint.encode(state, TRACE_FILE), "file 'crafted.trace'")


# --- recording ----------------------------------------------------------------------------------


def test_a_trace_holds_the_calls_the_result_and_the_final_state(trace):
    assert trace.calls == 5  # Linear, GELU, Flatten, Total, then the Sequential itself
    assert [c[1:] for c in trace.structure] == [
        ("", "Sequential"),
        ("0", "Linear"),
        ("1", "GELU"),
        ("2", "Flatten"),
        ("3", "Total"),
    ]
    phases = [e.phase for e in trace.events]
    assert phases[:5] == ["forward"] * 5
    assert phases[5:7] == ["result", "result"]
    assert set(phases[7:]) == {"final"}
    result = {e.what: e for e in trace.events if e.phase == "result"}
    assert set(result) == {'result["out"]', 'result["steps"]'}
    assert result['result["out"]'].dtypes == ("float32",)
    assert result['result["steps"]'].dtypes == ("int",)
    assert all(len(d) == 16 for e in trace.events for d in trace.fingerprints(e) if d)
    assert (trace.seed, trace.backward, trace.status, trace.ops) == (0, False, None, False)
    assert trace.source == "function tests.verify.test_trace.forward_pass"


def test_the_environment_is_read_inside_the_block_as_fn_left_it():
    before = torch.get_num_threads()
    trace = record_trace(forward_pass, 1)
    assert torch.get_num_threads() == before  # the block put it back
    env = trace.environment
    assert env["process.num_threads"] == 1
    assert env["flags.deterministic_algorithms"] is True  # the block's flags, not the caller's
    assert env["versions.torch"] == torch.__version__
    for name in ("versions.python", "versions.numpy", "cpu.model", "cpu.capability", "cpu.count"):
        assert name in env
    assert env["cuda.initialized"] is torch.cuda.is_initialized()
    json.dumps(dict(env))  # plain data


@pytest.mark.slow
def test_environment_never_initializes_cuda():
    code = (
        "import torch; from deterministic_ctx.trace import environment; "
        "e = environment(); print(torch.cuda.is_initialized(), "
        "any(k.startswith('cuda.devices') for k in e))"
    )
    proc = run_python([], code=code, check=True)
    assert proc.stdout.split() == ["False", "False"]


def test_models_passed_in_are_put_back():
    with isolated():  # initializing draws from torch's global generator
        model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()

    def step(model: nn.Module) -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    trace = record_trace(step, model, reset=[opt])
    assert torch.equal(model.weight, before)
    assert model.weight.grad is None
    assert next(e.what for e in trace.events if e.phase == "final").startswith("gradient")


def test_save_and_load(tmp_path, trace):
    path = tmp_path / "run.trace"
    trace.save(path)
    assert path.read_bytes()[:8] == TRACE_MAGIC
    assert Trace.load(path) == trace
    assert Trace.load(str(path)) == trace
    written = record_trace(forward_pass, path=tmp_path / "direct.trace")
    assert compare_traces(tmp_path / "direct.trace", written).agree


def test_the_file_follows_the_documented_layout(trace_bytes):
    assert trace_bytes[:8] == TRACE_MAGIC
    version, reserved, h, d = struct.unpack_from("<IIQQ", trace_bytes, 8)
    assert (version, reserved) == (1, 0)
    assert len(trace_bytes) == 32 + h + d + 32
    assert hashlib.sha256(trace_bytes[:-32]).digest() == trace_bytes[-32:]
    state = json.loads(trace_bytes[32 : 32 + h])["state"]
    assert (state["format"], state["version"]) == ("deterministic_ctx.trace", 1)
    assert state["digests"] == {"$tensor": 0}
    assert d % 16 == 0
    key, phase, what, module, call, leaves = state["events"][0]
    assert (key, phase, what, call) == (["forward", 1, 0], "forward", "output", 1)
    assert state["modules"][module] == ["Sequential", "0", "Linear"]
    assert leaves == [["output", "float32", 0, 16384, 64]]  # path, dtype, digest, *shape


def test_script_result_keeps_tensors_and_arrays_only():
    import numpy as np

    namespace = {
        "loss": torch.ones(1),
        "history": {"w": [torch.zeros(2)], "lr": 0.1},
        "array": np.zeros(3),
        "start": 12.5,
        "name": "run",
        "model": nn.Identity(),
        "_private": torch.ones(1),
        "losses": [0.5, 0.25],
    }
    assert sorted(script_result(namespace)) == ["array", "history", "loss"]


# --- comparing ----------------------------------------------------------------------------------


def test_identical_runs_agree(trace):
    report = compare_traces(trace, record_trace(forward_pass))
    assert report.agree
    assert report.divergence is None
    assert report.environment == ()
    assert report.calls == (5, 5)
    assert report.compared == len(trace.events)
    text = str(report)
    assert text.startswith("Traces agree: 5 module calls")
    assert "the recorded facts are identical" in text
    assert json.loads(json.dumps(report.to_dict()))["agree"] is True


def test_thread_counts_name_the_reduction_and_the_fact(trace):
    other = record_trace(forward_pass, 1)
    report = compare_traces(trace, other)
    if torch.get_num_threads() == 1:
        pytest.skip("this process runs one thread: nothing to compare against")
    assert not report.agree
    d = report.divergence
    assert (d.phase, d.kind, d.module, d.module_type, d.call_index) == (
        "forward",
        "values",
        "3",
        "Total",
        4,
    )
    assert (d.index, d.max_abs_diff, d.run) == (None, None, 2)
    assert [e.name for e in report.environment] == ["process.num_threads"]
    fact = report.environment[0]
    assert (fact.a, fact.b, fact.category) == (torch.get_num_threads(), 1, "threads")
    text = str(report)
    assert "first at module call #4, 3 (Total), forward output" in text
    assert "process.num_threads: " in text and "[threads]" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["divergence"]["location"] == "3 (Total)"
    assert data["environment"][0]["name"] == "process.num_threads"


def test_a_patched_op_is_named(trace, monkeypatch):
    gelu = nn.functional.gelu
    monkeypatch.setattr(nn.functional, "gelu", lambda x, approximate="none": gelu(x) * 1.0001)
    report = compare_traces(trace, record_trace(forward_pass))
    d = report.divergence
    assert (d.module, d.module_type, d.call_index, d.what) == ("1", "GELU", 2, "output")
    assert report.compared == 1  # the Linear's output
    assert report.environment == ()


def test_a_differing_return_value_is_named():
    def run(scale: float) -> dict[str, Any]:
        return {"y": nn.Linear(2, 2)(torch.ones(1, 2)), "scale": scale}

    report = compare_traces(record_trace(run, 1.0), record_trace(run, 2.0))
    d = report.divergence
    assert (d.phase, d.what, d.module) == ("result", 'result["scale"]', None)
    assert 'the return value at result["scale"]' in str(report)


def test_another_module_called_is_named():
    def run(second: bool) -> torch.Tensor:
        x = nn.Linear(2, 2)(torch.ones(1, 2))
        return (nn.Tanh() if second else nn.ReLU())(x)

    report = compare_traces(record_trace(run, True), record_trace(run, False))
    d = report.divergence
    assert (d.kind, d.call_index) == ("call", 1)
    assert d.detail == "A called (root) (Tanh) here, B called (root) (ReLU)"


def test_gradients_of_one_trace_only_are_left_out_with_a_note(trace):
    with_grads = record_trace(lambda: forward_pass()["out"].backward(), backward=True)
    without = record_trace(lambda: forward_pass()["out"].backward())
    report = compare_traces(with_grads, without)
    assert report.agree
    assert report.notes == ("only A recorded gradients (backward=True): compared without them",)
    assert "note: only A recorded gradients" in str(report)


def test_environment_differences_most_likely_culprits_first(trace):
    env = dict(trace.environment)
    changed = {
        **env,
        "versions.python": "0.0.1",
        "cpu.model": "Another CPU",
        "flags.float32_matmul_precision": "high",
        "flags.cudnn_benchmark": True,
        "process.num_threads": 99,
        "versions.torch": "9.9.9",
        "cuda.devices[0].sm_count": 132,
    }
    other = dataclasses.replace(trace, environment=changed, seed=7)
    report = compare_traces(trace, other)
    assert [(e.name, e.category) for e in report.environment] == [
        ("seed", "seed"),
        ("versions.torch", "versions"),
        ("cuda.devices[0].sm_count", "device"),
        ("process.num_threads", "threads"),
        ("flags.float32_matmul_precision", "precision"),
        ("flags.cudnn_benchmark", "flags"),
        ("cpu.model", "cpu"),
        ("versions.python", "other"),
    ]
    sm = report.environment[2]
    assert (sm.in_a, sm.in_b, sm.b) == (False, True, 132)
    assert str(sm) == "cuda.devices[0].sm_count: (not recorded) (A) vs 132 (B)"
    assert report.agree  # the fingerprints are the same: the facts are listed all the same
    assert "8 fact(s) differ (the results agree all the same)" in str(report)
    # torch.compile's settings are recorded where its config modules are loaded: compared
    # only when both traces have them.
    compiled = "torch_compile.torch._inductor.config.fallback_random"
    loaded = dataclasses.replace(trace, environment={**env, compiled: False})
    assert compare_traces(trace, loaded).environment == ()
    eager = dataclasses.replace(trace, environment={**env, compiled: True})
    assert [e.name for e in compare_traces(loaded, eager).environment] == [compiled]
    assert str(EnvironmentDifference("cpu.model", "x", "y", "cpu", "")) == (
        "cpu.model: 'x' (A) vs 'y' (B)"
    )


def test_hand_made_op_events(trace):
    """The format holds op events and the comparison handles them, whoever made them."""
    events = list(trace.events)
    op = Event(
        ("op", 1, 0),
        "op",
        "aten.addmm.default",
        "Sequential",
        "0",
        "Linear",
        1,
        ("output",),
        ((16384, 64),),
        ("float32",),
        (events[0].slots[0],),
    )
    starts = list(trace.starts)
    with_ops = dataclasses.replace(
        trace,
        ops=True,
        events=(op, *events),
        starts=(starts[0], *(s + 1 for s in starts[1:])),
    )
    assert Trace.from_bytes(with_ops.to_bytes()) == with_ops
    report = compare_traces(with_ops, trace)
    assert report.agree
    assert report.notes == ("only A recorded op events (ops=True): compared without them",)
    bad = Event(*dataclasses.astuple(op)[:-1], (events[1].slots[0],))
    differing = dataclasses.replace(with_ops, events=(bad, *events))
    report = compare_traces(with_ops, differing)
    assert report.divergence.phase == "op"
    assert "first at aten.addmm.default in module call #1, 0 (Linear)" in str(report)


# --- op calls (ops=True) ----------------------------------------------------------------------------


class Shift(nn.Module):
    """``torch.<op>(x, delta)`` then ReLU; ``extra`` makes one more op call at the end."""

    def __init__(self, delta: float = 0.0, op: str = "add", extra: bool = False) -> None:
        super().__init__()
        self.delta, self.op, self.extra = delta, op, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(torch, self.op)(x, self.delta).relu()  # the shifted op
        if self.extra:
            torch.ones(1)
        return y


def shifted_step(delta: float = 0.0, op: str = "add", extra: bool = False) -> torch.Tensor:
    """A training step's forward and backward; module calls: Sequential #0, Linear #1,
    Shift #2, Linear #3."""
    model = nn.Sequential(nn.Linear(8, 8), Shift(delta, op, extra), nn.Linear(8, 2))
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    return loss.detach()


def _where_shifted() -> str:
    """``file:line`` of the shifted op, as a trace names it (relative to the working
    directory)."""
    lines, start = inspect.getsourcelines(Shift.forward)
    line = start + next(i for i, text in enumerate(lines) if "# the shifted op" in text)
    return f"{os.path.relpath(__file__)}:{line}"


@pytest.fixture(scope="module")
def shifted() -> Trace:
    return record_trace(shifted_step, ops=True)


def _check_timeline(trace: Trace) -> None:
    """Each op event sits after its module call started and before that call's output;
    its key counts the module calls started before it."""
    events = trace.events
    output = {e.call_index: i for i, e in enumerate(events) if e.phase == "forward"}
    numbers: dict[int, int] = {}
    for position, e in enumerate(events):
        if e.phase != "op":
            continue
        started = sum(start <= position for start in trace.starts)
        assert e.key == ("op", started, numbers.get(started, 0))
        numbers[started] = numbers.get(started, 0) + 1
        if e.call_index is not None:
            assert trace.starts[e.call_index] <= position < output[e.call_index]


def test_ops_are_recorded_in_the_timeline(shifted):
    trace = shifted
    assert trace.ops and trace.calls == 4
    _check_timeline(trace)
    ops = [e for e in trace.events if e.phase == "op"]
    inside = [e.what for e in ops if e.call_index == 2]
    assert inside[0] == f"aten.add.Tensor at {_where_shifted()} (in {_SHIFT}forward)"
    assert inside[1].startswith("aten.relu.default at ")
    assert {e.module_type for e in ops if e.call_index is not None} == {"Linear", "Shift"}
    assert any(e.call_index is None and "aten.randn" in e.what for e in ops)  # outside modules
    backward = [e.what for e in ops if ", in the backward of " in e.what]
    assert backward and all(e.call_index is None for e in ops if ", in the backward of " in e.what)
    with isolated():  # initializing draws from torch's global generator
        linear = nn.Linear(4, 2)
    outside = record_trace(linear, torch.ones(3, 4), ops=True)
    addmm = next(e for e in outside.events if e.what.startswith("aten.addmm.default"))
    # The parameters and the batch came from outside the recorded ops: inputs, then outputs.
    assert addmm.paths == ("input 'self'", "input 'mat1'", "output")
    assert all(len(d) == 16 for e in ops for d in trace.fingerprints(e) if d)
    # Ops end before the return value and the final state.
    phases = [e.phase for e in trace.events]
    last_op = len(phases) - 1 - phases[::-1].index("op")
    assert set(phases[last_op + 1 :]) == {"result", "final"}
    with_grads = record_trace(shifted_step, ops=True, backward=True)
    _check_timeline(with_grads)
    kinds = [e.phase for e in with_grads.events if e.phase in ("op", "backward")]
    first_grad = kinds.index("backward")
    assert "op" in kinds[first_grad:]  # gradients and backward op calls interleave


def test_identical_traces_with_ops_agree(shifted):
    report = compare_traces(shifted, record_trace(shifted_step, ops=True))
    assert report.agree and report.ops and report.environment == ()
    assert report.compared == sum(e.phase != "result" for e in shifted.events) + 1
    assert "fingerprints (op calls, module outputs and gradients" in str(report)
    assert report.to_dict()["ops"] is True


def test_the_first_differing_op_and_its_line_are_named(shifted):
    other = record_trace(shifted_step, 1e-3, ops=True)
    report = compare_traces(shifted, other)
    d = report.divergence
    where = _where_shifted()
    assert (d.phase, d.kind, d.op, d.op_location) == ("op", "values", "aten.add.Tensor", where)
    assert (d.module, d.module_type, d.call_index, d.root) == ("1", "Shift", 2, "Sequential")
    assert d.op_detail.startswith(f"aten.add.Tensor at {where} (in {_SHIFT}forward), op call #")
    assert d.op_detail.endswith(
        "its output differs between A and B while every tensor it read agreed: "
        "the op made the difference"
    )
    text = str(report)
    assert f"first at aten.add.Tensor at {where} in module call #2, 1 (Shift)" in text
    assert f"  first differing op: aten.add.Tensor at {where}" in text
    data = json.loads(json.dumps(report.to_dict()))["divergence"]
    assert (data["op"], data["op_location"], data["location"]) == (
        "aten.add.Tensor",
        where,
        "1 (Shift)",
    )
    # Without ops, the same traces name the module call, as before.
    plain = compare_traces(record_trace(shifted_step), record_trace(shifted_step, 1e-3))
    d = plain.divergence
    assert (d.phase, d.call_index, d.what, d.op, d.op_detail) == (
        "forward",
        2,
        "output",
        None,
        None,
    )
    assert "first differing op" not in str(plain) and not plain.ops
    # Ops in one trace only: the module-level comparison, and a note.
    for mixed, side in ((compare_traces(shifted, record_trace(shifted_step, 1e-3)), "A"),
                        (compare_traces(record_trace(shifted_step), other), "B")):  # fmt: skip
        assert mixed.notes == (f"only {side} recorded op events (ops=True): compared without them",)
        d = mixed.divergence
        assert (d.phase, d.call_index, d.op) == ("forward", 2, None)
        assert mixed.compared == plain.compared and not mixed.ops


def test_another_op_or_fewer_op_calls_are_named(shifted):
    report = compare_traces(shifted, record_trace(shifted_step, 1.0, op="sub", ops=True))
    d = report.divergence
    assert (d.kind, d.op, d.call_index) == ("call", "aten.add.Tensor", 2)
    assert "A called aten.add.Tensor at " in d.op_detail
    assert ", B called aten.sub.Tensor at " in d.op_detail
    extra = record_trace(shifted_step, extra=True, ops=True)
    missing = compare_traces(extra, shifted).divergence
    assert (missing.kind, missing.op, missing.call_index) == ("missing", "aten.ones.default", 2)
    assert missing.op_detail.endswith(
        "B made only 3 op call(s) since module call #2 started"
    )  # the add, the ReLU, and the detach that saves the ReLU's output for backward
    found = compare_traces(shifted, extra).divergence
    assert (found.kind, found.op, found.call_index) == ("extra", "aten.ones.default", 2)
    assert found.op_detail.startswith("B called aten.ones.default at ")


@needs_fill
def test_uninitialized_memory_is_explained():
    """Without fill_uninitialized_memory (``--no-fill``), torch.empty's output is whatever
    the memory held: when it is the first op that differs, the report says why."""

    def build() -> torch.Tensor:
        return nn.Linear(64, 64)(torch.ones(2, 64))

    for fill in (False, True):
        trace = record_in(deterministic(0, fill_uninitialized_memory=fill), build, ops=True)
        assert trace.environment["flags.fill_uninitialized_memory"] is fill
        # Other bytes in the memory torch.empty returned (the allocator decides: made here).
        first = next(i for i, e in enumerate(trace.events) if e.phase == "op")
        empty = trace.events[first]
        assert empty.what.startswith("aten.empty.memory_format at ")
        other = dataclasses.replace(empty, slots=(trace.events[-1].slots[0],))
        events = (*trace.events[:first], other, *trace.events[first + 1 :])
        d = compare_traces(trace, dataclasses.replace(trace, events=events)).divergence
        assert d.op == "aten.empty.memory_format"
        assert ("flags.fill_uninitialized_memory off" in d.op_detail) is not fill
        if not fill:
            assert d.op_detail.endswith("the command line's --no-fill and --no-flags turn it off)")


def test_op_events_survive_the_file(tmp_path, shifted):
    path = tmp_path / "ops.trace"
    shifted.save(path)
    loaded = Trace.load(path)
    assert loaded == shifted and loaded.ops
    state = state_of(shifted)
    assert state["ops"] is True
    key, phase, what, module, call, _ = next(e for e in state["events"] if e[1] == "op")
    assert (key[0], phase, module, call) == ("op", "op", None, None)  # before any module call
    assert what.startswith("aten.empty.memory_format at ")  # the first Linear's weight
    assert compare_traces(path, shifted).agree
    without = dataclasses.replace(shifted, ops=False)
    with pytest.raises(
        InvalidTraceError, match=r"expected one of forward, backward, result, final"
    ):
        Trace.from_bytes(without.to_bytes())


# --- bad arguments --------------------------------------------------------------------------------


def test_bad_arguments(tmp_path, trace):
    with pytest.raises(TypeError, match=r"^a must be a Trace or the path of a trace file, got int"):
        compare_traces(3, trace)
    with pytest.raises(TypeError, match=r"^b must be a Trace or the path"):
        compare_traces(trace, None)
    with pytest.raises(FileNotFoundError):
        compare_traces(tmp_path / "missing.trace", trace)
    with pytest.raises(TypeError, match=r"^path must be a str or os.PathLike, got int"):
        record_trace(forward_pass, path=3)
    with pytest.raises(TypeError, match="backward must be True or False"):
        record_trace(forward_pass, backward="yes")
    calls = []
    with pytest.raises(TypeError, match=r"^ops must be True or False, got 'yes'"):
        record_trace(calls.append, 1, ops="yes")
    assert calls == []
    with pytest.raises(TypeError, match="fn must be callable"):
        record_trace(3)
    with pytest.raises(ValueError, match="seed"):
        record_trace(forward_pass, seed=-1)


def test_an_unwritable_path_fails_before_the_run(tmp_path):
    calls = []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        record_trace(calls.append, 1, path=tmp_path / "missing" / "a.trace")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        record_trace(calls.append, 1, path=tmp_path)
    assert calls == []


# --- bad files, like bad snapshots --------------------------------------------------------------


def _raises_ours(data: bytes, tmp_path: Path) -> InvalidTraceError:
    path = tmp_path / "bad.trace"
    path.write_bytes(data)
    with pytest.raises(InvalidTraceError) as info:
        Trace.load(path)
    err = info.value
    assert isinstance(err, InvalidSnapshotError) and isinstance(err, ValueError)
    assert str(err).startswith(f"invalid trace file {str(path)!r}: ")
    assert err.origin == f"file {str(path)!r}"
    assert pickle.loads(pickle.dumps(err)).problem == err.problem
    return err


@pytest.mark.parametrize("cut", [0, 1, 8, 31, 32, 100, -33, -1])
def test_truncated(tmp_path, trace_bytes, cut):
    err = _raises_ours(trace_bytes[:cut], tmp_path)
    assert "truncated" in err.problem or "empty" in err.problem


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path, trace_bytes):
    data = bytearray(trace_bytes)
    data[len(data) // 2] ^= 0x10
    assert "checksum does not match" in _raises_ours(bytes(data), tmp_path).problem


def test_files_of_other_kinds(tmp_path):
    snapshot = tmp_path / "rng.snap"
    Snapshot.capture().save(snapshot)
    err = _raises_ours(snapshot.read_bytes(), tmp_path)
    assert err.problem == "it is a deterministic-ctx snapshot file, not a trace file"
    assert "the trace signature" in _raises_ours(b"hello world", tmp_path).problem


def test_a_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "marker"

    class Touch:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    err = _raises_ours(pickle.dumps(Touch()), tmp_path)
    assert "pickle" in err.problem
    _raises_ours(TRACE_MAGIC + pickle.dumps(Touch()), tmp_path)
    assert not marker.exists()


def test_a_huge_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.trace"
    with open(path, "wb") as f:
        f.truncate(checkpoint.MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(InvalidTraceError, match="larger than any trace"):
        Trace.load(path)


def _set(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("version",), 2, "version 2 is newer than this deterministic-ctx reads (1)"),
        (("version",), "1", "version: expected an int in 1 .. 1, got str '1'"),
        (
            ("format",),
            "deterministic_ctx.snapshot",
            "format: expected 'deterministic_ctx.trace'",
        ),
        (("seed",), -1, "seed: expected an int in 0 .. "),
        (("backward",), 1, "backward: expected True or False, got int 1"),
        (("ops",), "yes", "ops: expected True or False"),
        (("environment",), [], "environment: expected a dict, got a list"),
        (("environment", "cpu.model"), [1], "environment['cpu.model']: expected a string, number"),
        (("modules", 0), ["a", "b"], "modules[0]: expected a list of 3 .. 3 items"),
        (("calls", 0, 0), 10**6, "calls[0][0]: expected an int in 0 .. 4"),
        (("calls", 3, 1), 0, "calls[3][1]: expected an int in 1 .. "),
        (
            ("events", 0, 1),
            "op",
            "events[0][1]: expected one of forward, backward, result, final, got 'op'",
        ),
        (
            ("events", 0, 1),
            3,
            "events[0][1]: expected one of forward, backward, result, final, got int 3",
        ),
        (("events", 0, 1), "sideways", "events[0][1]: expected one of"),
        (("events", 0, 3), -1, "events[0][3]: expected an int in 0 .. 4"),
        (("events", 0, 4), 5, "events[0][4]: expected an int in 0 .. 4"),
        (("events", 0, 0), [], "events[0][0]: expected a list of 1 .. 16 items"),
        (("events", 0, 0, 0), 1.5, "events[0][0][0]: expected a string"),
        (("events", 0, 5, 0, 3), 2**64, "events[0][5][0][3]: expected an int in 0 .. "),
        (("events", 0, 5, 0, 4), -1, "events[0][5][0][4]: expected an int in 0 .. "),
        (("events", 0, 5, 0), ["out", "float32", 0, *[1] * 65], "expected a list of 3 .. 67"),
        (("events", 0, 5, 0, 2), 10**9, "events[0][5][0][2]: expected an int in 0 .. "),
        (("events", 0, 5, 0, 0), "x" * 70000, "events[0][5][0][0]: expected a string of at most"),
        (("events", 0, 5, 0, 1), None, "events[0][5][0][1]: expected a string"),
        (("events", 0), "forward", "events[0]: expected a list of 6 .. 6 items, got str"),
        (("status",), 1.0, "status: expected an int"),
        (("extra",), 1, "trace: unexpected field(s) 'extra'"),
    ],
)
def test_bad_fields_name_the_field(tmp_path, trace, path, value, message):
    state = _set(state_of(trace), path, value)
    with pytest.raises(InvalidTraceError) as info:
        from_state(state)
    assert info.value.origin == "file 'crafted.trace'"
    assert message in info.value.problem


def test_missing_fields_and_bad_digests(trace):
    state = state_of(trace)
    del state["environment"]
    with pytest.raises(InvalidTraceError, match="missing field"):
        from_state(state)
    state = state_of(trace)
    state["digests"] = state["digests"][:-1]
    with pytest.raises(InvalidTraceError, match="16 bytes per fingerprint"):
        from_state(state)
    state = state_of(trace)
    del state["ops"]  # optional: files without it read as ops=False
    assert from_state(state) == trace


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_files_load_or_raise_ours(trace_bytes, data):
    raw = bytearray(trace_bytes)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "reseal"]))
        if kind == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        elif kind == "truncate":
            del raw[at:]
        elif kind == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        if kind == "reseal" or data.draw(st.booleans()):
            # A valid envelope around the damage, so the JSON and the field checks are reached.
            body = bytes(raw[:-32]) if len(raw) > 32 else bytes(raw)
            raw = bytearray(body + hashlib.sha256(body).digest())
        if len(raw) < 2:
            break
    with contextlib.suppress(InvalidTraceError):  # anything else fails the test
        Trace.from_bytes(bytes(raw))


# --- the command line -------------------------------------------------------------------------------


def test_cli_knows_the_trace_signature():
    assert cli_module.TRACE_MAGIC == TRACE_FILE.magic == TRACE_MAGIC


def test_cli_compare_exit_statuses(tmp_path, capsys, trace):
    a, same, other, bad = (tmp_path / f"{n}.trace" for n in ("a", "same", "other", "bad"))
    trace.save(a)
    record_trace(forward_pass, path=same)
    record_trace(forward_pass, 1, path=other)
    bad.write_bytes(a.read_bytes()[:100])
    assert main(["trace", "compare", str(a), str(same)]) == 0
    assert capsys.readouterr().out.startswith("Traces agree")
    expected = 0 if torch.get_num_threads() == 1 else 1
    assert main(["trace", "compare", str(a), str(other)]) == expected
    out = capsys.readouterr().out
    assert out.startswith("Traces diverge" if expected else "Traces agree")
    assert main(["trace", "compare", "--json", str(a), str(same)]) == 0
    assert json.loads(capsys.readouterr().out)["agree"] is True
    assert main(["trace", "compare", str(a), str(bad)]) == 2
    err = capsys.readouterr().err
    assert (
        f"deterministic-ctx trace compare: error: invalid trace file {str(bad)!r}: truncated" in err
    )
    assert main(["trace", "compare", str(a), str(tmp_path / "missing.trace")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace"], "the following arguments are required: {record,compare}"),
        (["trace", "frob"], "invalid choice: 'frob'"),
        (["trace", "compare", "a.trace"], "the following arguments are required: B"),
        (["trace", "compare", "a", "b", "c"], "unrecognized arguments: c"),
        (["trace", "record"], "the following arguments are required: OUT"),
        (["trace", "record", "out.trace"], "a script (or -m module) is required"),
        (["trace", "record", "out.trace", "missing.py"], "can't open file 'missing.py'"),
        (["trace", "record", "--seed", "x", "out.trace", "s.py"], "argument --seed: must be"),
        (["trace", "record", "--frob", "out.trace", "s.py"], "unrecognized arguments: --frob"),
        (
            ["trace", "record", "no/such/dir/out.trace", "s.py"],
            "can't write 'no/such/dir/out.trace'",
        ),
        (["trace", "record", "s.py", "out.trace"], "OUT 's.py' exists and is not a trace file"),
        (["trace", "record", ".", "s.py"], "OUT '.' is a directory"),
    ],
)
def test_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("print('ran')\n")
    (tmp_path / "out.trace").write_text("")  # an empty file may be replaced
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "ran" not in captured.out
    assert (tmp_path / "s.py").read_text() == "print('ran')\n"


@pytest.mark.parametrize(
    ("words", "ours", "script"),
    [
        (["a.trace", "s.py"], ["a.trace"], ["s.py"]),
        (
            ["a.trace", "--seed", "3", "s.py", "--seed", "5"],
            ["a.trace", "--seed", "3"],
            ["s.py", "--seed", "5"],
        ),
        (
            ["--backward", "a.trace", "--", "--odd.py", "x"],
            ["--backward", "a.trace"],
            ["--odd.py", "x"],
        ),
        (["--", "a.trace", "s.py"], ["--", "a.trace"], ["s.py"]),
        (["a.trace", "-m", "pkg.mod", "-v"], ["a.trace", "-m", "pkg.mod"], ["-v"]),
        (
            ["--ops", "a.trace", "--ops", "s.py", "--ops"],
            ["--ops", "a.trace", "--ops"],
            ["s.py", "--ops"],
        ),
        (["-h"], ["-h"], []),
        ([], [], []),
    ],
)
def test_split_trace_record(words, ours, script):
    assert _split(words, out=True) == (ours, script)


def test_cli_record_in_process(tmp_path, monkeypatch, capsys):
    """Called with a list, ``trace record`` runs the script here, in a block (restored)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""\
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        out = model(torch.randn(2, 4))
        started = 1.5
        print("ran", sys.argv[1:])
        if sys.argv[1:] == ["fail"]:
            raise ValueError("boom")
        if sys.argv[1:] == ["exit"]:
            sys.exit(3)
        if sys.argv[1:] == ["exit130"]:
            sys.exit(130)  # its own status, not an interrupt
        """)
    )
    out = tmp_path / "a.trace"
    assert main(["trace", "record", "--seed", "3", str(out), str(script), "x"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "ran ['x']\n"
    assert f"trace record: wrote {out} (3 module calls, seed 3)" in captured.err
    trace = Trace.load(out)
    assert (trace.seed, trace.status, trace.calls) == (3, 0, 3)
    assert trace.source == f"script {script} x"
    assert [e.what for e in trace.events if e.phase == "result"] == ['globals["out"]']

    assert main(["trace", "record", "--seed", "3", str(out), str(script), "fail"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: boom" in err
    assert "deterministic_ctx" not in err.split("wrote")[0]  # the traceback is the script's
    assert Trace.load(out).status == 1
    with pytest.raises(SystemExit) as info:
        main(["trace", "record", "--seed", "3", str(out), str(script), "exit"])
    assert info.value.code == 3
    assert Trace.load(out).status == 3
    report = compare_traces(trace, out)
    assert "the scripts exited with status 0 (A) and 3 (B)" in report.notes
    other = tmp_path / "b.trace"
    with pytest.raises(SystemExit) as info:
        main(["trace", "record", "--seed", "3", str(other), str(script), "exit130"])
    assert info.value.code == 130
    assert Trace.load(other).status == 130  # written: only Ctrl-C writes none
    d = report.divergence
    assert (d.kind, d.phase, d.what) == ("missing", "result", 'globals["out"]')


SHIFT_SCRIPT = """\
import sys, torch
from torch import nn

class Shift(nn.Module):
    def forward(self, x):
        return torch.add(x, float(sys.argv[1]))

model = nn.Sequential(nn.Linear(8, 8), Shift(), nn.Linear(8, 2))
out = model(torch.randn(4, 8))
"""


def test_cli_record_ops(tmp_path, monkeypatch, capsys):
    """``trace record --ops``: op calls placed at the script's lines (relative to the
    working directory), and named by ``trace compare``."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shift.py").write_text(SHIFT_SCRIPT)
    assert main(["trace", "record", "--ops", "a.trace", "shift.py", "0"]) == 0
    err = capsys.readouterr().err
    trace = Trace.load(tmp_path / "a.trace")
    count = sum(e.phase == "op" for e in trace.events)
    assert trace.ops and count > 10
    assert f"wrote a.trace (4 module calls, {count} op calls, seed 0)" in err
    assert main(["trace", "record", "b.trace", "--ops", "--", "shift.py", "0.001"]) == 0
    capsys.readouterr()
    assert main(["trace", "record", "c.trace", "shift.py", "0.001"]) == 0
    assert "wrote c.trace (4 module calls, seed 0)" in capsys.readouterr().err
    assert not Trace.load(tmp_path / "c.trace").ops
    assert main(["trace", "compare", "a.trace", "b.trace"]) == 1
    out = capsys.readouterr().out
    assert "first at aten.add.Tensor at shift.py:6 in module call #2, 1 (Shift)" in out
    assert f"first differing op: aten.add.Tensor at shift.py:6 (in {_SHIFT}forward), " in out
    assert main(["trace", "compare", "--json", "a.trace", "c.trace"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["notes"] == ["only A recorded op events (ops=True): compared without them"]
    assert (data["divergence"]["location"], data["divergence"]["op"]) == ("1 (Shift)", None)


# --- across processes -------------------------------------------------------------------------------

RECORDER = """\
import sys, torch
from torch import nn
from deterministic_ctx.trace import record_trace
torch.set_num_threads(int(sys.argv[2]))

class Total(nn.Module):
    def forward(self, x):
        return x.sum()

def forward_pass():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Flatten(0), Total())
    return model(torch.randn(16384, 64))

record_trace(forward_pass, path=sys.argv[1])
"""


@pytest.mark.slow
def test_traces_recorded_in_two_processes_with_different_thread_counts(tmp_path):
    paths = [str(tmp_path / f"{threads}.trace") for threads in (1, 2, 2)]
    for path, threads in zip(paths, (1, 2, 2), strict=True):
        run_python([path, str(threads)], code=RECORDER, check=True)
    report = compare_traces(paths[0], paths[1])
    assert not report.agree
    d = report.divergence
    assert (d.module, d.module_type, d.what) == ("3", "Total", "output")
    assert [(e.name, e.a, e.b) for e in report.environment] == [("process.num_threads", 1, 2)]
    assert compare_traces(paths[1], paths[2]).agree


OP_RECORDER = """\
import os, sys, torch
from torch import nn
from deterministic_ctx.trace import record_trace

class Shift(nn.Module):
    def forward(self, x):
        return torch.add(x, float(os.environ.get("NUDGE", "0"))).relu()

def step():
    model = nn.Sequential(nn.Linear(64, 64), Shift(), nn.Linear(64, 8))
    loss = model(torch.randn(256, 64)).square().mean()
    loss.backward()
    return loss

record_trace(step, path=sys.argv[1] + ".ops", ops=True)
record_trace(step, path=sys.argv[1])
"""


@pytest.mark.slow
def test_traces_with_ops_recorded_in_two_processes(tmp_path):
    """An op whose result differs only where an environment variable is set: traces
    with ops name it and its line, traces without the module call."""
    script = tmp_path / "record.py"
    script.write_text(OP_RECORDER)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_python([str(script), a], check=True)
    run_python([str(script), b], env={"NUDGE": "1e-6"}, check=True)
    report = compare_traces(a + ".ops", b + ".ops")
    d = report.divergence
    where = f"{script}:7"  # the script is outside the working directory: its full path
    assert (d.phase, d.kind, d.op, d.op_location) == ("op", "values", "aten.add.Tensor", where)
    assert (d.module, d.module_type, d.call_index) == ("1", "Shift", 2)
    assert f"first at aten.add.Tensor at {where} in module call #2, 1 (Shift)" in str(report)
    assert report.environment == ()  # NUDGE is no fact that decides results
    plain = compare_traces(a, b).divergence
    assert (plain.phase, plain.call_index, plain.op) == ("forward", 2, None)
    mixed = compare_traces(a + ".ops", b)
    assert mixed.divergence == plain and mixed.notes
    assert compare_traces(a + ".ops", a + ".ops").agree


SCRIPT = """\
import sys, torch
from torch import nn
torch.set_num_threads(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
x, y = torch.randn(16384, 64), torch.randn(16384, 64)
loss = nn.MSELoss()(model(x), y)
print("loss", loss.item())
"""


@pytest.mark.slow
def test_cli_record_and_compare_a_script_in_subprocesses(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # run restarts
    paths = {}
    for name, threads in (("a", 1), ("b", 2)):
        paths[name] = str(tmp_path / f"{name}.trace")
        proc = run_python(
            ["-m", "deterministic_ctx", "trace", "record", "--backward", paths[name], "--",
             str(script), str(threads)],
            env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("loss ")
    differ = run_python(["-m", "deterministic_ctx", "trace", "compare", paths["a"], paths["b"]])
    assert differ.returncode == 1, differ.stderr
    assert "first at module call #4, (root) (MSELoss), forward output" in differ.stdout
    assert "process.num_threads: 1 (A) vs 2 (B)" in differ.stdout
    trace = Trace.load(paths["a"])
    assert trace.backward and trace.status == 0
    assert trace.environment["env.PYTHONHASHSEED"] == "0"
    assert {e.what for e in trace.events if e.phase == "result"} == {
        'globals["x"]',
        'globals["y"]',
        'globals["loss"]',
    }


@pytest.mark.slow
def test_trace_help_loads_no_torch():
    for command in (["trace", "--help"], ["trace", "record", "--help"], ["trace", "compare"]):
        proc = run_python(["-X", "importtime", "-m", "deterministic_ctx", *command])
        imported = {
            line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line
        }
        assert "deterministic_ctx.integrations.cli" in imported
        assert {"torch", "numpy"} & imported == set(), command


def test_a_header_of_empty_lists_is_refused_before_it_is_parsed():
    # A crafted file can be checksummed like a real one: a header made of
    # millions of empty lists would cost gigabytes to parse before any field
    # is checked; the loader refuses it from its size first.
    state = {"state": {"events": [[]] * 200_000}}
    with pytest.raises(InvalidTraceError, match="more lists and objects than its size allows"):
        Trace.from_bytes(checkpoint.encode(state, TRACE_FILE), "file 'crafted.trace'")
