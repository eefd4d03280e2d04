"""IPython / Jupyter extension: ``%%deterministic`` and ``%deterministic_report``.

Load it with ``%load_ext deterministic_ctx`` (or ``%load_ext
deterministic_ctx.integrations.ipython``); add ``"deterministic_ctx"`` to
``c.InteractiveShellApp.extensions`` to load it in every session.

* ``%%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill]
  [--compiled-rng=eager]`` runs the cell inside ``deterministic(SEED, ...)``
  (``SEED`` defaults to 0): the cell prints the same numbers every time it is
  run, and the cells after it draw as if it never ran.  The options are
  :class:`~deterministic_ctx.deterministic`'s ``warn_only=True``,
  ``flags=False``, ``fill_uninitialized_memory=False`` and
  ``compiled_rng="eager"``.  ``$name`` and ``{expr}`` in the arguments are
  expanded as in any magic.  A cell with top-level ``await`` is refused with a
  ``UsageError``.
* ``%deterministic_report [--json]`` prints the determinism report
  (:func:`deterministic_ctx.report`).

This module imports IPython; ``import deterministic_ctx`` never imports it.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from types import CodeType
from typing import Any, NoReturn

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..core.context import deterministic as _block
from .cli import add_block_options, block_settings, print_report

__all__ = ["DeterministicMagics", "load_ipython_extension", "unload_ipython_extension"]

CELL_USAGE = "%%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill] [--compiled-rng=eager]"


REPORT_USAGE = "%deterministic_report [--json]"


class _CellParser(argparse.ArgumentParser):
    """The arguments of a ``%%deterministic`` line: the block options of ``deterministic-ctx
    run`` (one definition, :func:`~.cli.add_block_options`), with the seed as ``SEED``.
    A bad argument or ``--help`` raises :class:`UsageError`, which IPython shows without a
    traceback.

    Example:
        >>> args = _CELL_PARSER.parse_args("7 --no-flags --compiled-rng eager".split())
        >>> block_settings(args)  # doctest: +NORMALIZE_WHITESPACE
        {'seed': 7, 'warn_only': False, 'flags': False, 'fill_uninitialized_memory': True,
         'compiled_rng': 'eager'}
        >>> _CELL_PARSER.parse_args(["abc"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        IPython.core.error.UsageError: %%deterministic: argument SEED: must be an integer ...
        usage: %%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill] [--compiled-rng=eager]
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}\nusage: {CELL_USAGE}")

    def print_help(self, file: object = None) -> NoReturn:
        raise UsageError(self.format_help().rstrip())


_CELL_PARSER = _CellParser(
    prog="%%deterministic",
    usage=CELL_USAGE.replace("%", "%%"),  # argparse %-formats it
    description="runs the cell in a deterministic block: seeded with SEED (default 0), restored "
    "after, so re-running the cell gives the same output and later cells are unaffected",
    allow_abbrev=False,
)
add_block_options(_CELL_PARSER, seed="SEED")


def _ends_with_semicolon(source: str) -> bool:
    """Whether the last token of ``source`` is ``;`` (IPython's way to hide a cell's value)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    for token in reversed(tokens):
        if token.type in skip:
            continue
        return token.type == tokenize.OP and token.string == ";"
    return False


def _top_level_await(tree: ast.Module) -> ast.AST | None:
    """The first ``await``, ``async for``, ``async with`` or async comprehension of
    ``tree`` outside any function, or ``None``.

    IPython runs such a cell on its event loop, but a cell magic is a plain
    call: the cell would be compiled as a coroutine that never runs (or fail
    with "'await' outside function"), so ``%%deterministic`` refuses it up front.

    Example:
        >>> import ast
        >>> _top_level_await(ast.parse("x = await f()")).lineno
        1
        >>> _top_level_await(ast.parse("async def g(): await f()")) is None
        True
    """
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            return node
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) and any(
            c.is_async for c in node.generators
        ):
            return node
        if not isinstance(node, scopes):  # a function's awaits run when it is awaited
            pending.extend(ast.iter_child_nodes(node))
    return None


def _compile_cell(shell: Any, line: str, cell: str) -> tuple[CodeType, CodeType | None]:
    """Compile a cell body as IPython would: the statements, and the last expression if any.

    The body is registered in ``linecache`` under a name IPython shows as
    ``Cell In[n]``, with the magic's own line first, so tracebacks and syntax
    errors point at the right line of the cell.  (``shell`` is ``Any``:
    IPython's annotations of its compiler accept only source strings.)
    """
    transformed = shell.transform_cell(cell)
    number = _cell_number(shell)
    # Line 1 is the %%deterministic line itself; the body starts on line 2.
    shown = f"%%deterministic {line}".rstrip() + "\n" + transformed
    filename = shell.compile.cache(shown, number)
    tree = shell.compile.ast_parse("\n" + transformed, filename=filename)
    tree = shell.transform_ast(tree)  # as IPython's run_cell applies it: it returns the tree
    awaiting = _top_level_await(tree)
    if awaiting is not None:
        _CELL_PARSER.error(
            f"top-level await (line {getattr(awaiting, 'lineno', '?')} of the cell) cannot run "
            f"inside the magic, which runs the cell as a plain call. Put the awaiting code in "
            f"an async function decorated with @reproducible(seed=SEED) (it swaps the block's "
            f"state in and out at every await) and await it in a cell without the magic"
        )
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = shell.compile(ast.Module(tree.body, type_ignores=[]), filename, "exec")
    value = None if last is None else shell.compile(last, filename, "eval")
    return body, value


def _cell_number(shell: Any) -> int:
    """The ``In[n]`` number of the running cell: that of the innermost cell code on the stack."""
    numbers: dict[str, int] = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if number is not None:
            return number
        frame = frame.f_back  # type: ignore[assignment]
    return int(shell.execution_count)


@magics_class
class DeterministicMagics(Magics):
    """The magics of the extension."""

    @cell_magic
    def deterministic(self, line: str, cell: str) -> Any:
        """Run the cell inside a deterministic block.

        Usage::

          %%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill] [--compiled-rng=eager]

        Every RNG (Python ``random``, NumPy's global RNG, torch CPU and
        accelerators, generators registered with ``register_rng``) is seeded
        with SEED (default 0) exactly as ``random.seed(SEED);
        np.random.seed(SEED); torch.manual_seed(SEED)`` would, deterministic
        algorithms are on, and all of it is restored when the cell ends, even
        by an exception or an interrupt: the cell gives the same output every
        time it is run, and the cells after it draw as if it never ran.

        ``--warn-only``: operations without a deterministic implementation
        warn instead of raising.  ``--no-flags``: seed and isolate only, the
        determinism flags and variables stay as they are.  ``--no-fill``:
        ``torch.utils.deterministic.fill_uninitialized_memory`` off in the cell.
        ``--compiled-rng=eager``: code compiled with ``torch.compile`` draws
        eager's random numbers in the cell.  Top-level ``await`` is refused
        with a ``UsageError``.  The value of the cell's last expression is
        shown as usual (``;`` hides it).  Generators that live in the
        notebook's own variables (``rng = np.random.default_rng()``) are not
        global state: register them with ``register_rng`` to have them seeded
        and restored too.
        """
        __tracebackhide__ = True
        args = _CELL_PARSER.parse_args(line.split())
        shell = self.shell
        assert shell is not None
        body, last = _compile_cell(shell, line, cell)  # a SyntaxError here runs nothing
        with _block(**block_settings(args)):
            exec(body, shell.user_global_ns, shell.user_ns)
            value = None if last is None else eval(last, shell.user_global_ns, shell.user_ns)
        return None if _ends_with_semicolon(cell) else value

    @line_magic
    def deterministic_report(self, line: str) -> None:
        """Print the determinism report of this kernel.

        Usage::

          %deterministic_report [--json]

        Library versions, determinism flags, the relevant environment
        variables, which RNGs are seeded, CUDA facts and warnings for known
        problems (see ``deterministic_ctx.report``).  ``--json`` prints
        it as JSON.  Reading it changes nothing and never initializes CUDA.
        """
        words = line.split()
        unknown = [w for w in words if w != "--json"]
        if unknown:
            raise UsageError(
                f"%deterministic_report: unknown argument {unknown[0]!r}\nusage: {REPORT_USAGE}"
            )
        print_report(as_json=bool(words))


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register ``%%deterministic`` and ``%deterministic_report`` (``%load_ext``)."""
    ipython.register_magics(DeterministicMagics)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """Remove the magics again (``%unload_ext``); blocks already run keep their effect."""
    manager = ipython.magics_manager
    for kind, name in (("cell", "deterministic"), ("line", "deterministic_report")):
        function = manager.magics[kind].get(name)
        if isinstance(getattr(function, "__self__", None), DeterministicMagics):
            del manager.magics[kind][name]
    manager.registry.pop(DeterministicMagics.__name__, None)
