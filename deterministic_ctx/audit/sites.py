"""Where an op call comes from, for the audit's findings: the user's ``file:line`` (frames of
torch, of this package and of the standard library skipped), the torch functions on the way,
and the module that made the call (from global module hooks)."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from types import CodeType, FrameType
from typing import Any

import torch

from ..internal import TORCH_MACHINERY
from ..verify.ops import is_library_file
from ..verify.record import ModuleNames

__all__ = ["Frames", "Modules", "Site", "called_outside_torch"]


#: Top-level modules of this project: library frames wherever they are installed (the
#: pytest plugin is a top-level module beside the package).
_OWN = frozenset({"deterministic_ctx"})


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an op call was made: the user's line, the module, torch's Python callers."""

    location: str
    module: str | None
    module_type: str | None
    callers: frozenset[str]


class Frames:
    """Names the user's line of a call: each code object is classified once per audit
    (user code, a torch function, or another library frame), so a stack walk is a few
    dictionary look-ups per frame."""

    def __init__(self) -> None:
        self._kinds: dict[CodeType, str | None] = {}
        self._paths: dict[str, str] = {}
        self._cwd = os.getcwd() + os.sep

    @staticmethod
    def _classify(frame: FrameType) -> str | None:
        """``None`` for a user frame; the qualified name for a torch frame
        (``torch.nn.functional.pad``); ``""`` for another library frame.

        Library code is told by file path, the rule :mod:`.ops` uses: a module name
        says too little (``sys.stdlib_module_names`` has ``test``, ``code`` and
        ``types``, common names of a user's own modules)."""
        module = str(frame.f_globals.get("__name__", ""))
        top = module.partition(".")[0]
        code = frame.f_code
        if top == "torch":
            return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"  # Python 3.11+
        if top in _OWN or is_library_file(code.co_filename):
            return ""
        return None

    def _path(self, filename: str) -> str:
        path = self._paths.get(filename)
        if path is None:
            inside = filename.startswith(self._cwd)
            path = self._paths[filename] = filename[len(self._cwd) :] if inside else filename
        return path

    def user_frame(self, frame: FrameType | None) -> tuple[str, frozenset[str]]:
        """The first frame outside torch, this package and the standard library, as
        ``file:line``, and the torch functions on the way (``torch.nn.functional.pad``)."""
        callers: list[str] = []
        kinds = self._kinds
        while frame is not None:
            code = frame.f_code
            try:
                kind = kinds[code]
            except KeyError:
                kind = kinds[code] = self._classify(frame)
            if kind is None:
                return f"{self._path(code.co_filename)}:{frame.f_lineno}", frozenset(callers)
            if kind:
                callers.append(kind)
            frame = frame.f_back
        return "<unknown>", frozenset(callers)


#: Modules of the machinery between an op's caller and ``__torch_dispatch__``.
_MACHINERY = TORCH_MACHINERY


def called_outside_torch(frame: FrameType | None) -> bool:
    """Whether the op was called by code outside torch (the user's, or an example of the
    table), rather than by torch's Python code.

    Memory that torch creates, torch fills, sometimes in C++ through a data pointer,
    which the dispatch mode cannot see (``F.ctc_loss`` builds a tensor of lengths so):
    only memory the user's code creates is watched for reads before writes.
    """
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(_MACHINERY):
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
