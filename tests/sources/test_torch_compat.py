"""Trust outside one configuration: the capability probes of ``deterministic_ctx._torch``,
and the errors a user sees when something cannot load.

These hold on every supported torch (tools/compat.py runs them in each corner): they
check behaviour against the running torch, not against a version number.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

import pytest
import torch

import deterministic_ctx
from deterministic_ctx import _torch, deterministic, report
from tests.helpers import run_python

# -- the lazy public names ------------------------------------------------------------


class _Failing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds one module name and fails while executing it, with ``error``."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name, self.error = name, error

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise self.error


@pytest.fixture
def failing_name(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A public name whose module raises what the test chooses when it loads."""

    def make(error: BaseException) -> str:
        module = "deterministic_ctx._compat_test_failing"
        finder = _Failing(module, error)
        monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
        monkeypatch.setitem(deterministic_ctx._WHERE, "compat_test_name", (module[17:], "x"))
        return "compat_test_name"

    return make


def test_an_attribute_error_while_loading_is_named_not_swallowed(failing_name):
    # ``from package import name`` turns an AttributeError from ``__getattr__`` into
    # "cannot import name" and drops it: the user must see the real cause.
    failing_name(AttributeError("module 'torch._C' has no attribute '_get_something'"))
    with pytest.raises(ImportError) as caught:
        from deterministic_ctx import compat_test_name  # noqa: F401
    assert "cannot import name" not in str(caught.value)
    assert "module 'torch._C' has no attribute '_get_something'" in str(caught.value)
    assert "deterministic_ctx.compat_test_name" in str(caught.value)
    assert isinstance(caught.value.__cause__, AttributeError)
    with pytest.raises(ImportError, match="_get_something"):
        _ = deterministic_ctx.compat_test_name


@pytest.mark.parametrize("error", [RuntimeError("no device"), ImportError("no module x")])
def test_other_errors_while_loading_propagate_as_they_are(failing_name, error):
    failing_name(error)
    with pytest.raises(type(error)) as caught:
        from deterministic_ctx import compat_test_name  # noqa: F401
    assert caught.value is error


def test_a_failing_engine_module_is_named_in_a_fresh_process():
    # What a user of torch 2.1 saw before the capability probes: a source module failing
    # on a missing torch attribute, reported as "cannot import name 'deterministic'".
    done = run_python(
        [],
        check=True,
        code="""
import importlib.machinery
import sys


class Failing:  # fails the flags source while it loads, as torch 2.1 did
    def find_spec(self, fullname, path, target=None):
        if fullname == "deterministic_ctx.sources.flags":
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise AttributeError("module 'torch._C' has no attribute '_get_deterministic_fill'")


sys.meta_path.insert(0, Failing())
try:
    from deterministic_ctx import deterministic
except ImportError as exc:
    print(type(exc).__name__, exc)
""",
    )
    out = done.stdout
    assert "cannot import name" not in out
    assert "no attribute '_get_deterministic_fill'" in out


# -- the capabilities -----------------------------------------------------------------


def test_every_capability_says_what_it_reads_since_when_and_the_fallback():
    from deterministic_ctx._torch import _capability

    for capability in _capability._REGISTRY.values():
        assert capability.reads and capability.fallback
        assert capability.since[:1].isdigit()
        assert capability.name in capability.describe()


def test_the_capabilities_agree_with_the_running_torch():
    # Behaviour, not version numbers: each probe finds what this torch has.
    assert _torch.FILL_UNINITIALIZED_MEMORY.available == hasattr(
        torch._C, "_get_deterministic_fill_uninitialized_memory"
    )
    assert _torch.MKLDNN_DETERMINISTIC.available == hasattr(torch._C, "_get_mkldnn_deterministic")
    assert _torch.LAZY_DEVICES["cuda"].available  # every supported torch has it
    assert _torch.accelerator_type() in ("", "cuda", "xpu", "mtia", "mps", "hpu", "npu")
    assert _torch.default_device() == torch.empty(0).device
    assert _torch.is_compiling() is False


def test_the_report_has_one_note_per_missing_capability(monkeypatch):
    capability = _torch.MKLDNN_DETERMINISTIC
    monkeypatch.setattr(capability, "_value", None)  # probed, and missing
    notes = [p for p in report().problems if p.code == "torch-lacks-mkldnn-deterministic"]
    assert [p.level for p in notes] == ["note"]
    assert "torch >= 2.5" in notes[0].message and "mkldnn" in notes[0].message


def test_the_report_on_this_torch_names_exactly_what_it_lacks():
    codes = {p.code for p in report().problems if p.code.startswith("torch-lacks-")}
    expected = {"torch-lacks-" + c.name.replace("_", "-") for c in _torch.missing_capabilities()}
    assert codes == expected


def test_a_missing_capability_asked_for_explicitly_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setattr(_torch.FILL_UNINITIALIZED_MEMORY, "_value", None)
    with pytest.raises(_torch.TorchFeatureError, match=r"torch >= 2\.2.*does not have"):
        deterministic(seed=12345, fill_uninitialized_memory=False)


def test_rng_state_on_a_torch_without_dcp_stateful_refuses_naming_the_version(monkeypatch):
    # torch 2.1's save_state_dict would pickle the object, never call its state_dict().
    from deterministic_ctx import RngState

    monkeypatch.setattr(_torch.DCP_STATEFUL, "_value", None)
    with pytest.raises(_torch.TorchFeatureError, match=r"RngState needs .*stateful.*torch >= 2\.2"):
        RngState()


def test_the_dcp_capability_agrees_with_the_running_torch():
    import importlib.util

    has = (
        torch.distributed.is_available()
        and importlib.util.find_spec("torch.distributed.checkpoint.stateful") is not None
    )
    assert _torch.DCP_STATEFUL.available == has
    if not has:
        from deterministic_ctx import RngState

        with pytest.raises(_torch.TorchFeatureError, match=r"torch >= 2\.2"):
            RngState()


def test_a_probe_that_needs_an_import_is_asked_again_later():
    probes: list[int] = []

    def probe() -> object:
        probes.append(1)
        if len(probes) == 1:
            raise _torch.ProbeLater
        return "found"

    capability = _torch.Capability(
        "compat_test_later", reads="x", since="2.1", fallback="y", probe=probe, quiet=True
    )
    try:
        assert capability.value is None and not capability.probed
        assert capability.value == "found" and capability.probed
        assert capability.value == "found" and len(probes) == 2  # probed once, then kept
    finally:
        from deterministic_ctx._torch import _capability

        del _capability._REGISTRY["compat_test_later"]
