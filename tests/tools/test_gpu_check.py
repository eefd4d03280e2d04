"""``tools/gpu_check.py``, the one command that proves a GPU, run here with a short suite.

On a machine without CUDA (CI, every lent CPU box) it must still run every step it can,
name what it skipped, and fail when a step fails.  Its GPU steps proper need a device;
there the same tests run them (with the GPU tests cut down to one file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"
#: One quick test, so that the suite step runs pytest for real in a few seconds.
ONE_TEST = "tests/test_layout.py::test_the_rng_entry_point_group_keeps_its_name -n 0"
CUDA = torch.cuda.is_available()


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--quick",
            "--gpu-tests-args",
            "tests/core/test_gpu.py -m gpu -n 0 -k report_names",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def summary(out: str) -> dict[str, str]:
    """Each step's line of the closing summary, by step name."""
    tail = out[out.index("gpu_check summary") :].splitlines()
    rows = {}
    for line in tail[1:]:
        words = line.split()
        if len(words) >= 2 and words[1] in ("PASSED", "FAILED", "SKIPPED"):
            rows[words[0]] = line
        elif len(words) >= 3 and words[2] in ("PASSED", "FAILED", "SKIPPED"):
            rows[" ".join(words[:2])] = line  # "gpu tests"
    return rows


@pytest.mark.slow
def test_it_runs_every_step_it_can_and_says_what_it_skipped() -> None:
    proc = gpu_check("--suite-args", ONE_TEST)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = summary(proc.stdout)
    assert set(rows) == {"determinism", "exemption", "gpu tests", "suite", "benchmark"}
    assert (
        "PASSED" in rows["determinism"] and "bitwise equal twice in a block" in rows["determinism"]
    )
    assert "PASSED" in rows["suite"] and "1 passed" in rows["suite"]
    assert "with isolated()" in rows["benchmark"]
    if CUDA:
        assert "PASSED" in rows["gpu tests"]
        assert "PASSED" in rows["exemption"] or "no candidate op" in rows["exemption"]
        assert "fork_rng(devices=[0])" in rows["benchmark"]
        assert "result: OK" in proc.stdout
    else:  # everything that needs a device is named as left out
        assert "SKIPPED" in rows["gpu tests"] and "no CUDA device" in rows["gpu tests"]
        assert "the CUDA check was not made" in rows["determinism"]
        assert "fork_rng(devices=[])" in rows["benchmark"]
        assert "not measured" in rows["benchmark"]
        assert "SKIPPED" in rows["exemption"] and "no CUDA device" in rows["exemption"]
        assert "result: OK (skipped: exemption, gpu tests)" in proc.stdout


@pytest.mark.slow
def test_a_failing_step_fails_the_command_and_the_others_still_run() -> None:
    proc = gpu_check("--suite-args", "tests/no_such_test_file.py -n 0")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = summary(proc.stdout)
    assert "FAILED" in rows["suite"] and "(exit 4)" in rows["suite"]  # pytest's usage error
    assert "PASSED" in rows["determinism"] and "PASSED" in rows["benchmark"]
    assert "result: FAILED: suite" in proc.stdout
