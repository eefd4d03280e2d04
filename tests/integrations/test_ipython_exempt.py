"""``allow_nondeterministic`` inside a ``%%deterministic`` cell.

An in-process IPython shell in a fresh interpreter (the global shell would stay in the
test process and change what later tests see); test_ipython.py drives a real kernel.
"""

from __future__ import annotations

import json

import pytest

from deterministic_ctx import _torch
from tests import standin_ops
from tests.helpers import needs, run_python

pytest.importorskip("IPython", reason="the %%deterministic magic needs IPython")
pytestmark = needs(_torch.SCOPED_EXEMPTION)

CELL = f"""
try:
    standin_ops.scatter_like(torch.ones(2))
    refused = False
except RuntimeError:
    refused = True
with allow_nondeterministic("{standin_ops.FORWARD}"):
    out = standin_ops.scatter_like(torch.ones(2)).tolist()
    flag = torch.are_deterministic_algorithms_enabled()
"""

SHELL = f"""
import json
import torch
from IPython.testing.globalipapp import start_ipython
from deterministic_ctx import allow_nondeterministic
from tests import standin_ops

standin_ops.register()
shell = start_ipython()
shell.run_line_magic("load_ext", "deterministic_ctx.integrations.ipython")
shell.user_ns.update(standin_ops=standin_ops, torch=torch, allow_nondeterministic=allow_nondeterministic)
shell.run_cell_magic("deterministic", "0", {CELL!r})
ns = shell.user_ns
print(json.dumps([ns["refused"], ns["out"], ns["flag"], torch.are_deterministic_algorithms_enabled()]))
"""


def test_exemption_in_a_deterministic_cell() -> None:
    proc = run_python([], code=SHELL, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, out, flag, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (refused, out, flag, after) == (True, [2.0, 2.0], True, False)
