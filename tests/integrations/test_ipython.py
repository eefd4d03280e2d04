"""``%%deterministic`` and ``%deterministic_report`` in a real Jupyter kernel.

Every test drives a real ipykernel through nbclient, cell by cell or a whole
``.ipynb`` at a time.  Expected numbers come from private generators
(``random.Random``, ``np.random.RandomState``, ``torch.Generator``), never from
this process's global state.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
import torch
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.helpers import ROOT, run_python

EXAMPLE = ROOT / "examples" / "notebook.ipynb"
TIMEOUT = 180  # seconds per cell; a cold kernel imports torch
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def classic(seed: int) -> tuple[random.Random, np.random.RandomState, torch.Generator]:
    """Private generators in the state ``random.seed(s); np.random.seed(s); torch.manual_seed(s)`` gives."""
    return random.Random(seed), np.random.RandomState(seed), torch.Generator().manual_seed(seed)


def draws(seed: int, times: int = 1) -> list[list[Any]]:
    """What ``times`` runs of the DRAW line give after the classic recipe with ``seed``."""
    r, n, t = classic(seed)
    return [
        [r.random(), float(n.rand()), torch.rand(3, generator=t).tolist()] for _ in range(times)
    ]


DRAW = "print(json.dumps([random.random(), float(np.random.rand()), torch.rand(3).tolist()]))"


@dataclass
class Result:
    """What a cell showed: its streams, its value (``text/plain``) and its error, if any."""

    cell: Any
    failed: bool

    def _text(self, name: str) -> str:
        return "".join(
            o["text"]
            for o in self.cell.outputs
            if o["output_type"] == "stream" and o["name"] == name
        )

    @property
    def stdout(self) -> str:
        return self._text("stdout")

    @property
    def stderr(self) -> str:
        return self._text("stderr")

    @property
    def value(self) -> str | None:
        for o in self.cell.outputs:
            if o["output_type"] == "execute_result":
                return str(o["data"]["text/plain"])
        return None

    @property
    def error(self) -> tuple[str, str, str] | None:
        """``(ename, evalue, traceback without colours)`` of an error output."""
        for o in self.cell.outputs:
            if o["output_type"] == "error":
                return o["ename"], o["evalue"], ANSI.sub("", "\n".join(o["traceback"]))
        return None

    def json(self) -> Any:
        return json.loads(self.stdout)


class Kernel(AbstractContextManager["Kernel"]):
    """A real ipykernel, fed one cell at a time through nbclient, as a person runs cells."""

    def __init__(self, cwd: Path) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.client = NotebookClient(
            self.nb,
            timeout=TIMEOUT,
            kernel_name="python3",
            resources={"metadata": {"path": str(cwd)}},
        )
        self._setup: Any = None

    def __enter__(self) -> Kernel:
        self._setup = self.client.setup_kernel()
        self._setup.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._setup.__exit__(*exc)

    def run(self, source: str, *, fails: bool = False) -> Result:
        """Execute ``source`` as the next cell; ``fails``: the kernel must answer with an error."""
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        index = len(self.nb.cells) - 1
        try:
            self.client.execute_cell(cell, index, store_history=True)
        except CellExecutionError:
            if not fails:
                raise
            return Result(cell, failed=True)
        assert not fails, f"the cell should have failed:\n{source}\n{cell.outputs}"
        return Result(cell, failed=False)


def execute_notebook(path: Path, cwd: Path) -> Any:
    """Run a whole ``.ipynb`` top to bottom in a fresh kernel, as "Restart and run all" does."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    return nb


def shown(cell: Any) -> list[tuple[str, str]]:
    """A cell's visible outputs, for comparing runs."""
    out = []
    for o in cell.outputs:
        if o["output_type"] == "stream":
            out.append((o["name"], o["text"]))
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append((o["output_type"], o["data"].get("text/plain", "")))
        else:
            out.append((o["output_type"], o.get("ename", "")))
    return out


# --- the notebook of the issue --------------------------------------------------------------------

CELLS = [
    "%load_ext deterministic_ctx",
    "import json, random\nimport numpy as np\nimport torch\n"
    "random.seed(1); np.random.seed(1); torch.manual_seed(1);",
    f"%%deterministic 3\n{DRAW}\ntorch.randint(0, 1000, (4,)).tolist()",
    DRAW,
]
LOAD, SEED, DETERMINISTIC, PLAIN = range(4)


def expected_deterministic_cell() -> tuple[str, str]:
    r, n, t = classic(3)
    printed = [r.random(), float(n.rand()), torch.rand(3, generator=t).tolist()]
    value = torch.randint(0, 1000, (4,), generator=t).tolist()
    return json.dumps(printed) + "\n", repr(value)


@pytest.fixture
def notebook_file(tmp_path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "deterministic.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_rerunning_a_cell_in_the_same_kernel(tmp_path):
    stdout, value = expected_deterministic_cell()
    with Kernel(tmp_path) as k:
        k.run(CELLS[LOAD])
        k.run(CELLS[SEED])
        first = k.run(CELLS[DETERMINISTIC])
        assert (first.stdout, first.value) == (stdout, value)  # the classic recipe's numbers
        again = k.run(CELLS[DETERMINISTIC])
        assert shown(again.cell) == shown(first.cell)
        # The plain cell draws as if the deterministic cells never ran: seed 1's first numbers...
        after = k.run(CELLS[PLAIN])
        assert after.json() == draws(1)[0]
        # ... and running the deterministic cell between two plain cells changes nothing either.
        third = k.run(CELLS[DETERMINISTIC])
        assert shown(third.cell) == shown(first.cell)
        assert k.run(CELLS[PLAIN]).json() == draws(1, times=2)[1]


@pytest.mark.slow
def test_fresh_kernels_give_the_same_outputs(notebook_file, tmp_path):
    stdout, value = expected_deterministic_cell()
    runs = [execute_notebook(notebook_file, tmp_path) for _ in range(2)]
    assert [shown(c) for c in runs[0].cells] == [shown(c) for c in runs[1].cells]
    det = runs[0].cells[DETERMINISTIC]
    assert shown(det) == [("stdout", stdout), ("execute_result", value)]
    plain = runs[0].cells[PLAIN]
    assert json.loads(plain.outputs[0]["text"]) == draws(1)[0]


@pytest.mark.slow
def test_the_example_notebook_runs(tmp_path):
    nb = execute_notebook(EXAMPLE, tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(o["output_type"] != "error" for c in code for o in c.outputs)
    # Cells tagged "same-as-previous" repeat the code cell before them, and must show the same.
    repeats = [i for i, c in enumerate(code) if "same-as-previous" in c.metadata.get("tags", [])]
    assert repeats
    for i in repeats:
        assert code[i].source == code[i - 1].source
        assert shown(code[i]) == shown(code[i - 1])


# --- everything else, in one kernel shared by the tests below ---------------------------------------


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    with Kernel(tmp_path_factory.mktemp("kernel")) as k:
        k.run("%load_ext deterministic_ctx\nimport json, random\nimport numpy as np\nimport torch")
        yield k


STATE = (
    "print(json.dumps([hash(repr(random.getstate())), hash(repr(np.random.get_state())), "
    "torch.get_rng_state().tolist()[:64], torch.are_deterministic_algorithms_enabled(), "
    "torch.backends.cudnn.deterministic, os.environ.get('CUBLAS_WORKSPACE_CONFIG')]))"
)


def global_state(k: Kernel) -> Any:
    return k.run("import os\n" + STATE).json()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("abc", "argument SEED: must be an integer in 0 .. 4294967295, got 'abc'\n"),
        ("-5", "argument SEED: must be an integer in 0 .. 4294967295, got '-5'\n"),
        ("4294967296", "got '4294967296'\n"),
        ("1.5", "got '1.5'\n"),
        ("1 2", "unrecognized arguments: 2\n"),
        ("--fast", "unrecognized arguments: --fast\n"),
        ("3 --warn_only", "unrecognized arguments: --warn_only\n"),
        ("--warn", "unrecognized arguments: --warn\n"),  # no abbreviations
        ("--compiled-rng=inductor", "argument --compiled-rng: invalid choice: 'inductor' ("),
    ],
)
def test_bad_arguments_show_usage_and_run_nothing(kernel, line, message):
    kernel.run("ran = False")
    before = global_state(kernel)
    bad = kernel.run(f"%%deterministic {line}\nran = True\nrandom.random()", fails=True)
    assert bad.stderr.startswith("UsageError: %%deterministic: ")
    assert message in bad.stderr
    assert (
        "\nusage: %%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill] "
        "[--compiled-rng=eager]\n" in bad.stderr
    )
    assert bad.error is None  # a usage message, not a traceback
    assert kernel.run("ran").value == "False"
    assert global_state(kernel) == before


_AWAIT_ADVICE = (
    "cannot run inside the magic, which runs the cell as a plain call. Put the awaiting code in "
    "an async function decorated with @reproducible(seed=SEED)"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "line"),
    [
        ("import asyncio\nran = True\nawait asyncio.sleep(0)", 4),
        ("ran = True\nasync for x in aiter([]):\n    pass", 3),
        ("async with contextlib.nullcontext():\n    ran = True", 2),
        ("ran = [x async for x in aiter([])]", 2),
        ("x = (await asyncio.sleep(0) for _ in range(1))", 2),
    ],
)
def test_top_level_await_is_refused_with_a_usage_error(kernel, body, line):
    kernel.run("import asyncio, contextlib\nran = False")
    before = global_state(kernel)
    bad = kernel.run(f"%%deterministic 3\n{body}", fails=True)
    assert bad.stderr.startswith(
        f"UsageError: %%deterministic: top-level await (line {line} of the cell) {_AWAIT_ADVICE}"
    ), bad.stderr
    assert bad.error is None  # a usage message, not a traceback
    assert kernel.run("ran").value == "False"
    assert global_state(kernel) == before


@pytest.mark.slow
def test_awaits_inside_functions_and_the_advised_decorator_work(kernel):
    # An await inside a function is not top-level: the cell defines it and runs.
    kernel.run("%%deterministic 3\nasync def draw():\n    await asyncio.sleep(0)\n    return 1")
    # What the UsageError advises, awaited in a cell without the magic.
    kernel.run(
        "from deterministic_ctx import reproducible\n"
        "@reproducible(seed=3)\n"
        "async def sample():\n"
        "    await asyncio.sleep(0)\n"
        "    return random.random()"
    )
    before = global_state(kernel)
    assert kernel.run("await sample()").value == repr(random.Random(3).random())
    assert kernel.run("await sample()").value == repr(random.Random(3).random())
    assert global_state(kernel) == before


@pytest.mark.slow
def test_help(kernel):
    result = kernel.run("%%deterministic --help\nran = True", fails=True)
    assert "runs the cell in a deterministic block" in result.stderr
    assert (
        "usage: %%deterministic [SEED] [--warn-only] [--no-flags] [--no-fill] "
        "[--compiled-rng=eager]" in result.stderr
    )


@pytest.mark.slow
def test_default_seed_is_zero_and_variables_expand(kernel):
    assert kernel.run(f"%%deterministic\n{DRAW}").json() == draws(0)[0]
    kernel.run("s = 3")
    assert kernel.run(f"%%deterministic $s\n{DRAW}").json() == draws(3)[0]
    assert kernel.run(f"%%deterministic {{s + 1}}\n{DRAW}").json() == draws(4)[0]


@pytest.mark.slow
def test_an_exception_in_the_cell_restores_everything_and_fails_the_cell(kernel):
    kernel.run("random.seed(5); np.random.seed(5); torch.manual_seed(5);")
    before = global_state(kernel)
    result = kernel.run(
        "%%deterministic 3\nrandom.random(); torch.rand(2)\ndef f():\n    raise ValueError('boom')\nf()",
        fails=True,
    )
    assert result.error is not None
    ename, evalue, tb = result.error
    assert (ename, evalue) == ("ValueError", "boom")
    # The traceback points at the cell's own lines (the magic's line is line 1).
    assert "line 5" in tb and "----> 5 f()" in tb
    assert "----> 4     raise ValueError('boom')" in tb
    assert "deterministic_ctx" not in tb
    assert global_state(kernel) == before


@pytest.mark.slow
def test_a_syntax_error_runs_nothing(kernel):
    kernel.run("ran = False")
    before = global_state(kernel)
    result = kernel.run("%%deterministic 3\nran = True\nx = (", fails=True)
    assert result.error is not None
    assert result.error[0] == "SyntaxError"
    assert "line 3" in result.error[2]
    assert kernel.run("ran").value == "False"
    assert global_state(kernel) == before


@pytest.mark.slow
def test_the_last_expression_is_shown_unless_hidden_with_a_semicolon(kernel):
    assert kernel.run("%%deterministic 3\nrandom.random()").value == repr(random.Random(3).random())
    assert kernel.run("%%deterministic 3\nrandom.random();").value is None
    assert kernel.run("%%deterministic 3\nx = random.random()").value is None
    assert kernel.run("%%deterministic 3\nx = 1\nx  # a comment").value == "1"
    # The value is the cell's Out[n], as for any cell.
    kernel.run("%%deterministic 3\n[1, 2]")
    assert kernel.run("_").value == "[1, 2]"


@pytest.mark.slow
def test_warn_only(kernel):
    flags = "torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()"
    assert kernel.run(f"{flags}").value == "(False, False)"
    assert kernel.run(f"%%deterministic\n{flags}").value == "(True, False)"
    assert kernel.run(f"%%deterministic 3 --warn-only\n{flags}").value == "(True, True)"
    assert kernel.run(f"%%deterministic --warn-only 3\n{flags}").value == "(True, True)"
    assert kernel.run(f"{flags}").value == "(False, False)"
    # --no-flags seeds only: the caller's flags stay in force.
    assert kernel.run(f"%%deterministic 3 --no-flags\n{flags}").value == "(False, False)"
    fill = "torch.utils.deterministic.fill_uninitialized_memory"
    assert kernel.run(f"%%deterministic --no-fill\n{fill}").value == "False"
    assert kernel.run(fill).value == "True"
    rng = "import torch._inductor.config as inductor\ninductor.fallback_random"
    assert kernel.run(f"%%deterministic 3 --compiled-rng=eager\n{rng}").value == "True"
    assert kernel.run(rng).value == "False"


@pytest.mark.slow
def test_ipython_syntax_inside_the_cell(kernel):
    """Line magics, shell escapes and nested cell magics work inside the cell."""
    result = kernel.run(
        "%%deterministic 3\n%time x = random.random()\nfiles = !echo hi\nx, files[0]"
    )
    assert result.value == repr((random.Random(3).random(), "hi"))
    timed = kernel.run("%%time\n%%deterministic 3\nrandom.random()")
    assert timed.value == repr(random.Random(3).random())
    assert "Wall time" in timed.stdout
    kernel.run("%%deterministic 3\n%%capture captured\nprint(random.random())")
    assert kernel.run("captured.stdout").value == repr(f"{random.Random(3).random()}\n")


@pytest.mark.slow
def test_user_rngs_registered_in_the_kernel(kernel):
    """Generators in the notebook's variables are seeded and restored once registered."""
    kernel.run(
        "from deterministic_ctx import deterministic, register_rng, unregister_rng\n"
        "rng = register_rng(np.random.default_rng(), key='aug')"
    )
    outside = kernel.run("rng.bit_generator.state['state']['state']").value
    first = kernel.run("%%deterministic 3\nrng.random()").value
    assert kernel.run("%%deterministic 3\nrng.random()").value == first
    assert kernel.run("rng.bit_generator.state['state']['state']").value == outside
    assert kernel.run("with deterministic(3):\n    v = rng.random()\nv").value == first
    kernel.run("unregister_rng(rng)")


@pytest.mark.slow
def test_interrupting_the_cell_restores_everything(kernel):
    kernel.run("random.seed(9); np.random.seed(9); torch.manual_seed(9);")
    before = global_state(kernel)
    kernel.client.interrupt_on_timeout = True
    kernel.client.timeout = 5
    try:
        result = kernel.run(
            "%%deterministic 3\nimport time\nrandom.random(); torch.rand(2)\ntime.sleep(120)",
            fails=True,
        )
    finally:
        kernel.client.timeout = TIMEOUT
        kernel.client.interrupt_on_timeout = False
    assert result.error is not None and result.error[0] == "KeyboardInterrupt"
    assert global_state(kernel) == before


@pytest.mark.slow
def test_report_magic(kernel):
    text = kernel.run("%deterministic_report").stdout
    assert text.startswith("Determinism report\n")
    assert "inside a deterministic block: no" in text
    inside = kernel.run("%%deterministic 3\n%deterministic_report").stdout
    assert "inside a deterministic block: yes" in inside
    data = json.loads(kernel.run("%deterministic_report --json").stdout)
    assert data["in_block"] is False
    assert "deterministic_algorithms" in data["flags"]
    bad = kernel.run("%deterministic_report --yaml", fails=True)
    assert "UsageError: %deterministic_report: unknown argument '--yaml'" in bad.stderr
    assert "usage: %deterministic_report [--json]" in bad.stderr


@pytest.mark.slow
def test_unload_and_reload(kernel):
    try:
        kernel.run("%unload_ext deterministic_ctx")
        gone = kernel.run("%%deterministic 3\nran = True", fails=True)
        assert "Cell magic `%%deterministic` not found" in gone.stderr + str(gone.error)
        kernel.run(
            "%load_ext deterministic_ctx.integrations.ipython"
        )  # the submodule is an extension too
        assert kernel.run("%%deterministic 3\nrandom.random()").value == repr(
            random.Random(3).random()
        )
        kernel.run("%unload_ext deterministic_ctx.integrations.ipython")
    finally:
        kernel.run("%load_ext deterministic_ctx")
    kernel.run("%reload_ext deterministic_ctx")
    assert kernel.run("%%deterministic 3\nrandom.random()").value == repr(random.Random(3).random())


# --- packaging --------------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_ipython():
    code = (
        "import sys, deterministic_ctx, deterministic_ctx.integrations.cli, deterministic_ctx.reporting\n"
        "assert callable(deterministic_ctx.load_ipython_extension)\n"
        "assert callable(deterministic_ctx.unload_ipython_extension)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'ipykernel', 'jupyter_client')))"
    )
    proc = run_python([], code=code, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
