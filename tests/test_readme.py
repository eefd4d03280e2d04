"""Every Python code block of the README runs, so a snippet cannot rot.

All blocks run in one child interpreter (``README_RUNNER``), each in a fresh
namespace, from a restored snapshot and in a scratch directory, so what one
block changes (``seed_everything``, ``register_env_var``, a saved file) reaches
neither the next block nor this test process.  A block that uses names the
README leaves to the reader (``train()``, ``MyModel``, ``model``, ``x``) gets
them from :data:`PLACEHOLDERS`, chosen by a line of the block; a block that
cannot run in a plain interpreter is listed in :data:`SKIPPED` with the test
that runs it for real instead.  A block in neither list that uses an undefined
name fails here.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers import ROOT, run_python

README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

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
    "examples/ddp_training.py runs this pattern on real gloo ranks (tests/test_examples.py)",
    "%load_ext deterministic_ctx": "an IPython magic: tests/test_ipython.py runs it in a kernel",
    "%%deterministic 3": "an IPython magic: tests/test_ipython.py runs it in a kernel",
}

#: A line of a block that needs a CUDA device -> what runs instead where there is none.
NEEDS_CUDA: dict[str, str] = {
    "g = torch.cuda.CUDAGraph()": "needs a CUDA device: tests/test_cuda_graphs.py runs this "
    "pattern with a fake device",
}


def _runs_here(block: str) -> bool:
    if _pick(SKIPPED, block) is not None:
        return False
    return _pick(NEEDS_CUDA, block) is None or torch.cuda.is_available()


README_RUNNER = """
import contextlib, io, json, os, sys, tempfile, traceback, types
from deterministic_ctx import Snapshot, registered_rngs, unregister_rng

with open(os.environ["README_JOBS"]) as f:
    jobs = json.load(f)
results = []
for prelude, code in jobs:
    snap = Snapshot.capture()
    before = [obj for _key, obj in registered_rngs()]
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        # A real module: dynamo (torch 2.11) imports the module a compiled function is from.
        module = types.ModuleType("readme_block")
        sys.modules["readme_block"] = module
        namespace = module.__dict__
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(prelude, "<placeholders>", "exec"), namespace)
                exec(compile(code, "<README block>", "exec"), namespace)
            results.append(None)
        except BaseException:
            results.append(traceback.format_exc(limit=4))
        finally:
            os.chdir(cwd)
            sys.modules.pop("readme_block", None)
            for _key, obj in registered_rngs():  # NumPy's are held until unregistered
                if not any(obj is other for other in before):
                    unregister_rng(obj)
            snap.restore()
print(json.dumps(results))
"""


def _pick(table: dict[str, str], block: str) -> str | None:
    found = [value for line, value in table.items() if line in block]
    assert len(found) <= 1, f"two entries match one block:\n{block}"
    return found[0] if found else None


def _label(block: str) -> str:
    first = next(line for line in block.splitlines() if line.strip())
    return first.strip()[:50]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[str | None]:
    """Each runnable block's traceback (``None``: it ran), in README order."""
    jobs = [(_pick(PLACEHOLDERS, block) or "", block) for block in BLOCKS if _runs_here(block)]
    path = tmp_path_factory.mktemp("readme") / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = run_python([], code=README_RUNNER, env={"README_JOBS": str(path)}, check=True)
    results: list[str | None] = json.loads(proc.stdout.splitlines()[-1])
    return results


def test_every_entry_of_the_tables_still_matches_a_block():
    for table in (PLACEHOLDERS, SKIPPED, NEEDS_CUDA):
        for line in table:
            assert any(line in block for block in BLOCKS), f"no README block has {line!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, marks=pytest.mark.gpu) if _pick(NEEDS_CUDA, b) else i
        for i, b in enumerate(BLOCKS)
    ],
    ids=[_label(b) for b in BLOCKS],
)
def test_readme_block_runs(outcomes, index):
    block = BLOCKS[index]
    reason = _pick(SKIPPED, block)
    if reason is None and not _runs_here(block):
        reason = _pick(NEEDS_CUDA, block)
    if reason is not None:
        pytest.skip(reason)
    position = sum(1 for b in BLOCKS[:index] if _runs_here(b))
    error = outcomes[position]
    assert error is None, f"README block:\n{block}\nfailed:\n{error}"


def test_the_readme_imports_public_names_from_the_package_only():
    # One import path per name: the README never reaches into a submodule for a
    # name the package exports.
    import deterministic_ctx

    text = README.read_text()
    for module, names in re.findall(r"from deterministic_ctx\.(\w+) import ([\w, ]+)", text):
        for name in (n.strip() for n in names.split(",")):
            assert name not in deterministic_ctx.__all__, (
                f"the README imports {name} from deterministic_ctx.{module}; "
                f"use: from deterministic_ctx import {name}"
            )


def test_the_readme_has_its_code_blocks():
    assert len(BLOCKS) >= 15  # the pattern still finds them
