"""Stand-in ops for ``allow_nondeterministic``: no CPU kernel of torch alerts under
deterministic algorithms, so these, registered with ``torch.library`` in a namespace
of the suite's own, behave on the CPU as torch's CUDA kernels without a deterministic
implementation do: raise ``RuntimeError`` (a ``UserWarning`` under ``warn_only=True``)
with torch's words.  ``dctx_test::scatter_like(x)`` is ``2 * x``; its backward is
another such op, ``dctx_test::scatter_like_backward(g)`` (``2 * g``).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import torch

NAMESPACE = "dctx_test"
FORWARD = f"{NAMESPACE}::scatter_like"
BACKWARD = f"{NAMESPACE}::scatter_like_backward"

#: Seconds ``scatter_like`` sleeps in its kernel (threads tests make calls overlap).
delay = threading.local()
_library: Any = None


def alert(caller: str) -> None:
    """``at::globalContext().alertNotDeterministic(caller)``, as torch words it."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"{caller} does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for "
        "this operation, or you can use the 'warn_only=True' option, if that's acceptable "
        "for your application. You can also file an issue at "
        "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic "
        "support for this operation."
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        raise RuntimeError(message)


#: ``torch.are_deterministic_algorithms_enabled()`` as each call of ``scatter_like``'s
#: kernel saw it, newest last.
seen: list[bool] = []


#: A function ``scatter_like``'s kernel calls after its alert, where set (tests hold the
#: call open with it).
pause_with: Any = None


def _forward(x: torch.Tensor) -> torch.Tensor:
    seen.append(torch.are_deterministic_algorithms_enabled())
    alert("scatter_like_cpu")
    if pause_with is not None:
        pause_with(x)
    pause = getattr(delay, "seconds", 0.0)
    if pause:
        time.sleep(pause)
    return x * 2


def _backward(g: torch.Tensor) -> torch.Tensor:
    alert("scatter_like_backward_cpu")
    return g * 2


def has_autograd() -> bool:
    """Whether the stand-in has a backward (``torch.library.register_autograd``, torch >= 2.4)."""
    return hasattr(torch.library, "register_autograd")


def register() -> None:
    """Register the stand-in ops, once per process."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library(NAMESPACE, "DEF")
    library.define("scatter_like(Tensor x) -> Tensor")
    library.define("scatter_like_backward(Tensor g) -> Tensor")
    library.impl("scatter_like", _forward, "CPU")
    library.impl("scatter_like_backward", _backward, "CPU")
    if has_autograd():
        torch.library.register_autograd(
            FORWARD,
            lambda ctx, g: torch.ops.dctx_test.scatter_like_backward(g),
            lib=library,
        )
    _library = library


def scatter_like(x: torch.Tensor) -> torch.Tensor:
    register()
    out: torch.Tensor = torch.ops.dctx_test.scatter_like(x)
    return out


def scatter_like_backward(g: torch.Tensor) -> torch.Tensor:
    register()
    out: torch.Tensor = torch.ops.dctx_test.scatter_like_backward(g)
    return out
