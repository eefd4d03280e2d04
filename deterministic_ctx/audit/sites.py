"""Where an op call comes from, for the audit's findings: the module that made the call (from
global module hooks), and whether torch's Python code made it; the user's ``file:line`` and
the torch functions on the way are :func:`~deterministic_ctx.verify.ops.user_frame`'s."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from ..internal import TORCH_MACHINERY
from ..verify.record import ModuleNames

__all__ = ["Modules", "Site", "called_outside_torch"]


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an op call was made: the user's line, the module, torch's Python callers."""

    location: str
    module: str | None
    module_type: str | None
    callers: frozenset[str]


def called_outside_torch(frame: FrameType | None) -> bool:
    """Whether the op was called by code outside torch (the user's, or an example of the
    table), rather than by torch's Python code.

    Memory that torch creates, torch fills, sometimes in C++ through a data pointer,
    which the dispatch mode cannot see (``F.ctc_loss`` builds a tensor of lengths so):
    only memory the user's code creates is watched for reads before writes.
    """
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(TORCH_MACHINERY):
            return name.partition(".")[0] != "torch"
        frame = frame.f_back
    return True


class Modules:
    """Which module is running, from global module hooks: names within their root models.

    Roots are the modules passed to the audit, then any module whose name is
    not known when it is first called (see :class:`~deterministic_ctx.verify.record.ModuleNames`).
    """

    def __init__(self, roots: Iterable[torch.nn.Module]) -> None:
        self._names = ModuleNames(roots)
        self._stack: list[tuple[torch.nn.Module, str, str]] = []
        self._thread = threading.get_ident()
        #: Class names of the recurrent modules that ran (see the package's docstring).
        self.recurrent: set[str] = set()

    def current(self) -> tuple[str | None, str | None]:
        if not self._stack:
            return None, None
        _, name, kind = self._stack[-1]
        return name, kind

    def pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == self._thread:
            _, name, kind = self._names.of(module)
            self._stack.append((module, name, kind))
            if isinstance(module, torch.nn.RNNBase):
                self.recurrent.add(type(module).__qualname__)

    def post_hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        # Calls nest: the last one started ends first (a module that raised and was
        # caught inside fn left its entry: found further down and cut there).
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] is module:
                del self._stack[depth:]
                return
