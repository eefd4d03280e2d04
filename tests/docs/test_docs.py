"""Every Python code block of the README and of the docs site runs, so a snippet cannot rot.

The blocks are those of ``README.md`` and of every page under ``docs/`` (:data:`PAGES`).
All of them run in one child interpreter (``DOCS_RUNNER``), each in a fresh
namespace, from a restored snapshot and in a scratch directory, so what one
block changes (``seed_everything``, ``register_env_var``, a saved file) reaches
neither the next block nor this test process.  A block that uses names the
page leaves to the reader (``train()``, ``MyModel``, ``model``, ``x``) gets
them from :data:`PLACEHOLDERS`, chosen by a line of the block; a block that
cannot run in a plain interpreter is listed in :data:`SKIPPED` with the test
that runs it for real instead.  A block in neither list that uses an undefined
name fails here.  Each test's id names the page the block is on.

A notebook cell (a block with an IPython magic line, ``%...``, or a top-level
``await``) runs instead in a fresh Jupyter kernel, one per page, with the page's
other notebook cells before it, as a reader types them into a new notebook; a
``%%deterministic`` cell is run twice there and must show the same output.

The site itself is built here too (``mkdocs build --strict``) when the ``docs``
extra is installed, and every public name must have its entry in the API reference.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from deterministic_ctx import _torch
from tests.helpers import ROOT, run_python

README = ROOT / "README.md"
DOCS = ROOT / "docs"
API_PAGE = DOCS / "reference" / "api.md"

#: The pages whose code blocks run: the README first, then the site's pages in path order.
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


class Block(NamedTuple):
    page: str  # relative to the repository root
    code: str

    @property
    def label(self) -> str:
        first = next(line for line in self.code.splitlines() if line.strip())
        return f"{self.page}: {first.strip()[:50]}"


BLOCKS = [
    Block(page.relative_to(ROOT).as_posix(), code)
    for page in PAGES
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]

_MODEL = """
import torch

class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))

    def aux_loss(self):
        return self.lin.weight.square().sum()
"""

#: A line of a block -> the placeholders it uses, defined before it runs.
PLACEHOLDERS: dict[str, str] = {
    "losses = train()": """
import torch

def train():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
""",
    "model = MyModel()\noptimizer": _MODEL
    + """
resuming, total_steps, save_every = False, 2, 1

def batch(step, generator):
    return torch.rand(8, 4, generator=generator)

def train_step(model, optimizer, x):
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss
""",
    "def init_and_forward():": _MODEL + "\nbatch = torch.rand(8, 4)\n",
    "def train_step():": _MODEL
    + """
from deterministic_ctx import assert_reproducible

model = MyModel()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
x, y = torch.rand(8, 4), torch.rand(8, 2)
loss_fn = torch.nn.functional.mse_loss
""",
    "report = locate_divergence(model, x)": _MODEL
    + """
model = MyModel()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.rand(8, 4)

def train_step():
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()
""",
}

#: A line of a block -> why it does not run here, and where it runs for real.
SKIPPED: dict[str, str] = {
    "model = DDP(Net())": "needs a torch.distributed process group and a dataset: "
    "examples/ddp_training.py runs this pattern on real gloo ranks (tests/docs/test_examples.py)",
    "callbacks=[TransformersCallback(seed=0)],": "needs a model and a dataset: "
    "examples/transformers_resume.py trains, crashes and resumes this Trainer "
    "(tests/integrations/test_transformers.py)",
    "loader = StatefulDataLoader(dataset, batch_size=32": "needs torchdata and a dataset: "
    "examples/resume_mid_epoch.py runs this loop and resumes it in a fresh process "
    "(tests/parallel/test_resume_mid_epoch.py)",
    "accelerator.register_for_checkpointing(sampler, RngState())": "needs accelerate and a "
    "model: tests/parallel/test_accelerate.py runs this loop in a fresh Accelerator",
    "model = MyModel()  # as written": "needs lightning and a model: "
    "examples/lightning_resume.py trains with LightningCallback, killed and resumed in fresh "
    "processes (tests/integrations/test_lightning.py, tests/docs/test_examples.py)",
}

# allow_nondeterministic needs torch's PreDispatch key (torch >= 2.2): its page runs where torch has it.
if not _torch.SCOPED_EXEMPTION.available:
    SKIPPED["import allow_nondeterministic"] = (
        f"needs {_torch.SCOPED_EXEMPTION.reads} (torch >= {_torch.SCOPED_EXEMPTION.since}); "
        "tests/core/test_exempt.py skips likewise"
    )
#: A line of a block that needs a CUDA device -> what runs instead where there is none.
NEEDS_CUDA: dict[str, str] = {
    "g = torch.cuda.CUDAGraph()": "needs a CUDA device: tests/core/test_cuda_graphs.py runs this "
    "pattern with a fake device",
}


def _is_notebook_cell(block: Block) -> bool:
    """Whether ``block`` is a Jupyter cell: an IPython magic line, or a top-level ``await``
    (which only IPython's event loop runs)."""
    if any(line.startswith("%") for line in block.code.splitlines()):
        return True
    code = compile(block.code, "<block>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return bool(code.co_flags & inspect.CO_COROUTINE)


#: The pages with notebook cells -> those cells, in page order.
NOTEBOOK_CELLS: dict[str, list[str]] = {}
for _block in BLOCKS:
    if _is_notebook_cell(_block):
        NOTEBOOK_CELLS.setdefault(_block.page, []).append(_block.code)


def _runs_here(block: Block) -> bool:
    if _pick(SKIPPED, block) is not None or _is_notebook_cell(block):
        return False
    return _pick(NEEDS_CUDA, block) is None or torch.cuda.is_available()


DOCS_RUNNER = """
import contextlib, io, json, os, sys, tempfile, traceback, types
from deterministic_ctx import Snapshot, registered_rngs, unregister_rng

with open(os.environ["DOCS_JOBS"]) as f:
    jobs = json.load(f)
results = []
for page, prelude, code in jobs:
    snap = Snapshot.capture()
    before = [obj for _key, obj in registered_rngs()]
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        # A real module: dynamo (torch 2.11) imports the module a compiled function is from.
        module = types.ModuleType("docs_block")
        sys.modules["docs_block"] = module
        namespace = module.__dict__
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(prelude, "<placeholders>", "exec"), namespace)
                exec(compile(code, f"<{page} block>", "exec"), namespace)
            results.append(None)
        except BaseException:
            results.append(traceback.format_exc(limit=4))
        finally:
            os.chdir(cwd)
            sys.modules.pop("docs_block", None)
            for _key, obj in registered_rngs():  # NumPy's are held until unregistered
                if not any(obj is other for other in before):
                    unregister_rng(obj)
            snap.restore()
print(json.dumps(results))
"""


def _pick(table: dict[str, str], block: Block) -> str | None:
    found = [value for line, value in table.items() if line in block.code]
    assert len(found) <= 1, f"two entries match one block of {block.page}:\n{block.code}"
    return found[0] if found else None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[str | None]:
    """Each runnable block's traceback (``None``: it ran), in :data:`BLOCKS` order."""
    jobs = [
        (block.page, _pick(PLACEHOLDERS, block) or "", block.code)
        for block in BLOCKS
        if _runs_here(block)
    ]
    path = tmp_path_factory.mktemp("docs") / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = run_python([], code=DOCS_RUNNER, env={"DOCS_JOBS": str(path)}, check=True)
    results: list[str | None] = json.loads(proc.stdout.splitlines()[-1])
    return results


def test_every_entry_of_the_tables_still_matches_a_block():
    for table in (PLACEHOLDERS, SKIPPED, NEEDS_CUDA):
        for line in table:
            assert any(line in block.code for block in BLOCKS), f"no page has a block with {line!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, marks=pytest.mark.gpu) if _pick(NEEDS_CUDA, b) else i
        for i, b in enumerate(BLOCKS)
    ],
    ids=[b.label for b in BLOCKS],
)
def test_docs_block_runs(outcomes, index):
    block = BLOCKS[index]
    reason = _pick(SKIPPED, block)
    if reason is None and _is_notebook_cell(block):
        reason = "a notebook cell: test_notebook_cells_run_in_a_fresh_kernel runs it"
    if reason is None and not _runs_here(block):
        reason = _pick(NEEDS_CUDA, block)
    if reason is not None:
        pytest.skip(reason)
    position = sum(1 for b in BLOCKS[:index] if _runs_here(b))
    error = outcomes[position]
    assert error is None, f"{block.page} block:\n{block.code}\nfailed:\n{error}"


def _shown(cell: Any) -> list[tuple[str, str]]:
    """What a cell showed: its streams and values, in order (errors fail the cell before)."""
    return [
        (o["output_type"], o.get("text") or str(o.get("data", {}).get("text/plain")))
        for o in cell.outputs
    ]


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(NOTEBOOK_CELLS))
def test_notebook_cells_run_in_a_fresh_kernel(page, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    cells = NOTEBOOK_CELLS[page]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    # A cold kernel imports torch: minutes on a busy machine, not hours.
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)  # raises CellExecutionError with the traceback
        # "Re-running the cell shows the same output": a %%deterministic cell, run again.
        for index, cell in enumerate(list(nb.cells)):
            if cell.source.startswith("%%deterministic"):
                again = nbformat.v4.new_code_cell(cell.source)
                nb.cells.append(again)
                client.execute_cell(again, len(nb.cells) - 1)
                assert _shown(again) == _shown(cell), f"{page}: cell {index} changed on a re-run"
                assert _shown(cell), f"{page}: cell {index} showed nothing to compare"


def test_the_pages_import_public_names_from_the_package_only():
    # One import path per name: no page reaches into a submodule for a name the
    # package exports.
    import deterministic_ctx

    for page in PAGES:
        text = page.read_text()
        for module, names in re.findall(r"from deterministic_ctx\.(\w+) import ([\w, ]+)", text):
            for name in (n.strip() for n in names.split(",")):
                assert name not in deterministic_ctx.__all__, (
                    f"{page.relative_to(ROOT)} imports {name} from deterministic_ctx.{module}; "
                    f"use: from deterministic_ctx import {name}"
                )


def test_the_pages_have_their_code_blocks():
    # The pattern still finds them, on the README and across the site.
    assert sum(1 for b in BLOCKS if b.page == "README.md") >= 3
    assert len(BLOCKS) >= 40


def test_the_readme_is_short():
    # The README sells and starts; the site teaches, solves, explains and lists (issue #31).
    assert len(README.read_text().splitlines()) <= 250


def _api_entries() -> list[str]:
    return re.findall(r"^::: deterministic_ctx\.(\w+)\s*$", API_PAGE.read_text(), re.M)


def test_every_public_name_has_an_entry_in_the_api_reference():
    import deterministic_ctx

    entries = _api_entries()
    assert len(entries) == len(set(entries)), "a name has two entries in docs/reference/api.md"
    missing = sorted(set(deterministic_ctx.__all__) - set(entries))
    assert not missing, f"no ::: entry in docs/reference/api.md for {missing}"
    private = sorted(set(entries) - set(deterministic_ctx.__all__))
    assert not private, f"docs/reference/api.md documents names outside __all__: {private}"


def _docs_extra_missing() -> bool:
    """Whether MkDocs, Material or mkdocstrings' Python handler is not installed."""
    for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(name) is None:
            return True
    return importlib.util.find_spec("mkdocstrings_handlers.python") is None


@pytest.mark.slow
@pytest.mark.skipif(_docs_extra_missing(), reason='needs the docs extra: pip install -e ".[docs]"')
def test_the_site_builds_strictly_with_an_anchor_for_every_public_name(tmp_path: Path):
    import deterministic_ctx

    site = tmp_path / "site"
    # Strict (mkdocs.yml): any warning, a broken link or anchor included, fails the build.
    build = ["-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    proc = run_python(build, env={"NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    api = (site / "reference" / "api" / "index.html").read_text()
    missing = [n for n in deterministic_ctx.__all__ if f'id="deterministic_ctx.{n}"' not in api]
    assert not missing, f"the API reference has no anchor for {missing}"
