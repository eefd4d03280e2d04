"""``deterministic-ctx check-resume`` and the records it reads (``record_step``,
``checkpoint_saved``).

The comparison is checked on hand-made records; the command on the real entry point in
fresh processes, with a toy script that imports only the standard library (fast) and with
``examples/check_resume_loop.py``, a real torch training loop (``slow``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from deterministic_ctx import checkpoint_saved, record_step
from deterministic_ctx.integrations import check_resume as cr
from deterministic_ctx.integrations.check_resume import (
    KILL_AT_VAR,
    RECORDS_VAR,
    StepRecord,
    compare_resume,
    first_difference,
    read_records,
)
from deterministic_ctx.integrations.cli import _CHECK_VALUE_OPTIONS, _split, main
from tests.helpers import ROOT, python_command

EXAMPLE = ROOT / "examples" / "check_resume_loop.py"
#: The runs end by SIGKILL and in process groups of their own.
POSIX = pytest.mark.skipif(os.name == "nt", reason="SIGKILL and process groups are POSIX")

# --- the comparison, on hand-made records -------------------------------------------------------


def rec(step: int, loss: str = "l", data: str = "d", rng: str = "r") -> StepRecord:
    return StepRecord(step, loss=loss + str(step), data=data + str(step), rng=rng + str(step))


WHOLE = [rec(s) for s in range(1, 7)]


def test_identical_records_have_no_difference() -> None:
    assert first_difference(WHOLE, list(WHOLE)) is None
    result = compare_resume(3, WHOLE, WHOLE[:3], WHOLE[3:])
    assert result.status == "ok"
    assert result.resumed_steps == (4, 5, 6)
    assert "6 steps match" in result.message


@pytest.mark.parametrize(
    ("changed", "kind", "fields"),
    [
        ({"data": "x", "rng": "x", "loss": "x"}, "data", ("data", "rng", "loss")),
        ({"rng": "x", "loss": "x"}, "rng", ("rng", "loss")),
        ({"loss": "x"}, "loss", ("loss",)),
        ({"data": "x", "loss": "x"}, "data", ("data", "loss")),
    ],
)
def test_what_differs_is_named_data_then_rng_then_loss(
    changed: dict[str, str], kind: str, fields: tuple[str, ...]
) -> None:
    bad = StepRecord(5, **{"loss": "l5", "data": "d5", "rng": "r5", **changed})
    difference = first_difference(WHOLE, [*WHOLE[:4], bad, WHOLE[5]])
    assert difference is not None
    assert (difference.step, difference.kind, difference.fields) == (5, kind, fields)
    names = dict(cr.FIELDS)
    assert str(difference).startswith(f"step 5: {names[kind]} differs")


def test_the_first_difference_in_step_order_wins() -> None:
    # Records out of step order: the comparison goes by step number, not by position.
    actual = [rec(6, loss="x"), *WHOLE[:3], rec(4, data="x"), WHOLE[4]]
    difference = first_difference(WHOLE, actual)
    assert difference is not None
    assert (difference.step, difference.kind) == (4, "data")


def test_missing_and_extra_steps() -> None:
    missing = first_difference(WHOLE, WHOLE[:4])
    assert missing is not None and (missing.step, missing.kind) == (5, "missing")
    assert str(missing) == "step 5 is missing"
    extra = first_difference(WHOLE, [*WHOLE, rec(7)])
    assert extra is not None and (extra.step, extra.kind) == (7, "extra")
    twice = first_difference(WHOLE, [*WHOLE[:4], WHOLE[3], *WHOLE[4:]])
    assert twice is not None and (twice.step, twice.kind, twice.actual) == (4, "extra", 2)
    assert "recorded 2 times" in str(twice)


def test_repeated_step_numbers_compare_as_sequences() -> None:
    # Gradient accumulation: two micro-batches per optimizer step, recorded under one number.
    whole = [rec(s, data=f"d{m}-") for s in (1, 2, 3) for m in (0, 1)]
    assert first_difference(whole, list(whole)) is None
    changed = list(whole)
    changed[3] = StepRecord(2, loss=whole[3].loss, data="other", rng=whole[3].rng)
    difference = first_difference(whole, changed)
    assert difference is not None
    assert (difference.step, difference.kind, difference.index) == (2, "data", 1)
    assert "record 2 of the step" in str(difference)
    short = first_difference(whole, whole[:3] + whole[4:])
    assert short is not None
    assert (short.step, short.kind, short.expected, short.actual) == (2, "missing", 2, 1)


def test_a_resumed_run_that_trains_nothing_is_named() -> None:
    result = compare_resume(3, WHOLE, WHOLE[:3], [])
    assert result.status == "differs"
    assert result.missing == (4, 5, 6)
    assert result.message == "steps 4-6 are missing: the resumed run recorded no step"


def test_a_resumed_run_that_starts_over_is_named() -> None:
    result = compare_resume(3, WHOLE, WHOLE[:3], list(WHOLE))
    assert result.status == "differs"
    assert result.extra == (1, 2, 3)
    assert "started at step 1, not after step 3" in result.message


def test_a_resumed_run_that_skips_steps_is_named() -> None:
    result = compare_resume(2, WHOLE, WHOLE[:2], WHOLE[4:])
    assert result.missing == (3, 4)
    assert "started at step 5, not 3" in result.message


def test_a_difference_after_the_restart() -> None:
    resumed = [rec(4, rng="x", loss="x"), *WHOLE[4:]]
    result = compare_resume(3, WHOLE, WHOLE[:3], resumed)
    assert result.status == "differs" and not result.before_restart
    assert result.difference is not None and result.difference.kind == "rng"
    assert result.message.startswith("step 4: the RNG state differs (and the loss)")
    assert "first step after the restart" in result.message
    assert (
        "likely cause: the random state is not restored: with a plain loop, a Snapshot"
        in result.message
    )


def test_a_step_recorded_before_the_kill_counts_after_the_restart() -> None:
    # The checkpoint of step 3 reached the disk only after step 4 was recorded.
    result = compare_resume(3, WHOLE, WHOLE[:4], WHOLE[4:])
    assert result.status == "ok", result.message
    late = compare_resume(3, WHOLE, [*WHOLE[:3], rec(4, loss="x")], WHOLE[4:])
    assert not late.before_restart
    assert late.message.startswith("step 4: the loss differs: the first step after the restart")


def test_a_difference_before_the_restart_says_the_script_is_not_reproducible() -> None:
    interrupted = [WHOLE[0], rec(2, loss="x"), WHOLE[2]]
    result = compare_resume(3, WHOLE, interrupted, WHOLE[3:])
    assert result.before_restart
    assert result.difference is not None and result.difference.step == 2
    assert "not reproducible even without a restart" in result.message
    assert json.loads(json.dumps(result.to_dict()))["before_restart"] is True


def test_spans() -> None:
    assert cr._spans([7, 1, 2, 3, 9, 10]) == "1-3, 7, 9-10"
    assert cr._spans([]) == "none"


def test_read_records(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    assert read_records(path) == ([], [])  # a run that recorded nothing
    path.write_text(
        '{"step": 1, "loss": "a", "data": null, "rng": "r"}\n{"checkpoint": 1}\n\n'
        '{"step": 2, "loss": null, "data": "d", "rng": "s"}\n'
    )
    steps, checkpoints = read_records(path)
    assert steps == [StepRecord(1, "a", None, "r"), StepRecord(2, None, "d", "s")]
    assert checkpoints == [1]
    path.write_text('{"step": 1}\n{"step": -1}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: not a check-resume record"):
        read_records(path)


# --- the records a run makes ----------------------------------------------------------------------


def test_outside_check_resume_nothing_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RECORDS_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    record_step(1, loss=0.5, batch=[1])
    checkpoint_saved(1)
    assert list(tmp_path.iterdir()) == []


def test_outside_check_resume_a_loss_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reading a GPU loss's bits waits for the device: a meta tensor, which has no bits to
    # read, stands for one.
    monkeypatch.delenv(RECORDS_VAR, raising=False)
    record_step(1, loss=torch.empty((), device="meta"), batch=torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match="loss must be a float or a tensor"):
        record_step(1, loss="0.5")


def test_records_hold_the_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv(RECORDS_VAR, str(path))
    monkeypatch.delenv(KILL_AT_VAR, raising=False)
    batch = {"x": torch.arange(4.0)}
    record_step(1, loss=torch.tensor(0.0), batch=batch)
    record_step(1, loss=torch.tensor(-0.0), batch={"x": torch.arange(4.0)})
    record_step(2, loss=0.25, batch={"x": torch.arange(4.0) + 1e-7})
    checkpoint_saved(2)
    steps, checkpoints = read_records(path)
    assert [s.step for s in steps] == [1, 1, 2] and checkpoints == [2]
    assert steps[0].data == steps[1].data != steps[2].data
    assert steps[0].loss != steps[1].loss  # 0.0 and -0.0: other bits
    assert steps[2].loss == (0.25).hex()
    assert steps[0].rng == steps[1].rng  # nothing drew in between


def test_registered_rngs_are_part_of_the_rng_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    import numpy as np

    from deterministic_ctx import register_rng, unregister_rng

    path = tmp_path / "r.jsonl"
    monkeypatch.setenv(RECORDS_VAR, str(path))
    monkeypatch.delenv(KILL_AT_VAR, raising=False)
    py, gen, tg = random.Random(0), np.random.default_rng(0), torch.Generator().manual_seed(0)
    rngs: list[object] = [py, gen, tg]
    for i, rng in enumerate(rngs):
        register_rng(rng, key=f"check-resume-test-{i}")
    try:
        record_step(1)
        py.random()
        record_step(1)
        gen.random()
        record_step(1)
        torch.rand(1, generator=tg)
        record_step(1)
    finally:
        for rng in rngs:
            unregister_rng(rng)
    fingerprints = [r.rng for r in read_records(path)[0]]
    assert len(set(fingerprints)) == 4  # each draw from a registered RNG shows


@pytest.mark.parametrize(("step", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_steps_are_refused(step: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="step must be a non-negative int"):
        record_step(step)  # type: ignore[arg-type]
    with pytest.raises(error, match="step must be a non-negative int"):
        checkpoint_saved(step)  # type: ignore[arg-type]


@POSIX
def test_checkpoint_saved_kills_at_its_step(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    code = (
        "from deterministic_ctx import checkpoint_saved, record_step\n"
        "for s in (1, 2, 3):\n"
        "    record_step(s, loss=float(s))\n"
        "    checkpoint_saved(s)\n"
        "print('not killed')\n"
    )
    command, env = python_command([], code=code, env={RECORDS_VAR: str(path), KILL_AT_VAR: "2"})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert "not killed" not in proc.stdout
    steps, checkpoints = read_records(path)
    assert [s.step for s in steps] == [1, 2] and checkpoints == [1, 2]


def test_the_command_line_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "from deterministic_ctx.integrations import check_resume, cli\n"
        "assert cli.main(['check-resume', '--at', '1', 'no-such.py']) == 2\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    command, env = python_command([], code=code)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- usage errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x.py"], "the following arguments are required: --at"),
        (["--at", "0", "x.py"], "argument --at: must be a positive integer, got '0'"),
        (["--at", "two", "x.py"], "argument --at: must be a positive integer, got 'two'"),
        (["--at", "1", "--timeout", "-1", "x.py"], "must be a positive number"),
        (["--at", "1"], "a script (or -m module) is required"),
        (["--at", "1", "no-such-script.py"], "can't open file 'no-such-script.py'"),
    ],
)
def test_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-resume", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "check-resume" in err


def test_options_end_at_the_script() -> None:
    words = ["--at", "3", "--keep", "train.py", "--at", "5"]
    assert _split(words, values=_CHECK_VALUE_OPTIONS) == (
        ["--at", "3", "--keep"],
        ["train.py", "--at", "5"],
    )
    assert _split(["--at", "3", "-m", "pkg.train", "-v"], values=_CHECK_VALUE_OPTIONS) == (
        ["--at", "3", "-m", "pkg.train"],
        ["-v"],
    )


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-resume", "--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and "SIGKILL" in out and "record_step" in out


# --- the command, on a toy script ---------------------------------------------------------------

TOY = textwrap.dedent(
    """\
    import json, os, random, sys, time
    from deterministic_ctx import checkpoint_saved, record_step

    STEPS = int(os.environ.get("TOY_STEPS", "6"))
    BUG = os.environ.get("TOY_BUG", "")
    CKPT = os.path.join("state", "ckpt.json")  # relative: in the working directory
    if BUG == "hang":
        time.sleep(600)
    if BUG == "refuse-kill" and os.environ.get("DETERMINISTIC_CTX_RESUME_KILL_AT"):
        sys.exit(3)

    random.seed(None if BUG == "unseeded" else 0)
    step = 0
    if os.path.exists(CKPT):
        if BUG == "crash-on-resume":
            raise RuntimeError("cannot resume")
        with open(CKPT) as f:
            saved = json.load(f)
        step = saved["step"]
        if BUG != "no-rng":
            version, internal, gauss = saved["rng"]
            random.setstate((version, tuple(internal), gauss))
    while step < STEPS:
        step += 1
        loss = random.random()
        if BUG != "silent":
            record_step(step, loss=loss, batch=[step, "batch"])
        if BUG != "never" and step % 2 == 0:
            os.makedirs("state", exist_ok=True)
            with open(CKPT, "w") as f:
                json.dump({"step": step, "rng": random.getstate()}, f)
            checkpoint_saved(step)
    print("trained", step, "steps")
    """
)


def check_resume(
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    command, merged = python_command(["-m", "deterministic_ctx", "check-resume", *args], env=env)
    return subprocess.run(
        command, cwd=cwd, env=merged, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    return script


@POSIX
def test_a_resumable_script_passes(toy: Path, tmp_path: Path) -> None:
    # A stale checkpoint where the command starts: the runs must never see it.
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ckpt.json").write_text('{"step": 4, "rng": null}')
    proc = check_resume(["--at", "2", "--at", "6", "toy.py"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "uninterrupted run: 6 steps (1-6), checkpoints at steps 2, 4, 6" in proc.stdout
    assert "--at 2: OK: 6 steps match the uninterrupted run" in proc.stdout
    assert "the resumed run trained steps 3-6" in proc.stdout
    assert "--at 6: OK" in proc.stdout  # the last step: nothing left to train, rightly


@POSIX
def test_environment_passes_through(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "2", "--", str(toy)], cwd=tmp_path, env={"TOY_STEPS": "4"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "uninterrupted run: 4 steps" in proc.stdout


@POSIX
def test_keep_keeps_each_run_in_its_own_directory(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--keep", "--at", "2", "--at", "4", "--json", str(toy)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    top = Path(out["directory"])
    try:
        assert out["status"] == 0 and [r["status"] for r in out["results"]] == ["ok", "ok"]
        assert sorted(p.name for p in top.iterdir() if p.is_dir()) == ["at-2", "at-4", "whole"]
        for name in ("whole", "at-2", "at-4"):
            # Each run's relative checkpoint in its own directory, the last one of step 6.
            saved = json.loads((top / name / "state" / "ckpt.json").read_text())
            assert saved["step"] == 6
        interrupted, _ = read_records(top / "at-4.interrupted.records.jsonl")
        resumed, _ = read_records(top / "at-4.resumed.records.jsonl")
        assert [r.step for r in interrupted] == [1, 2, 3, 4]
        assert [r.step for r in resumed] == [5, 6]
    finally:
        import shutil

        shutil.rmtree(top)


@POSIX
def test_without_keep_nothing_is_left(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(
        ["--json", "--at", "2", str(toy)], cwd=tmp_path, env={"TMPDIR": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["directory"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("check-resume-")]


@POSIX
def test_a_module(toy: Path, tmp_path: Path) -> None:
    toy.rename(tmp_path / "toy_module.py")
    proc = check_resume(["--at", "4", "-m", "toy_module"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--at 4: OK" in proc.stdout


@POSIX
def test_state_the_checkpoint_lacks_is_named(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "no-rng"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--at 2: DIFFERS: step 3: the RNG state differs (and the loss)" in proc.stdout
    assert "the first step after the restart" in proc.stdout


@POSIX
def test_a_script_that_is_not_reproducible(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "4", str(toy)], cwd=tmp_path, env={"TOY_BUG": "unseeded"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--at 4: DIFFERS: step 1: the RNG state differs (and the loss)" in proc.stdout
    assert "not reproducible even without a restart" in proc.stdout


@POSIX
def test_a_script_that_never_checkpoints_at_k(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "3", str(toy)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--at 3: NOT CHECKED: the uninterrupted run reported no checkpoint of step 3" in (
        proc.stdout
    )
    assert "its checkpoints: steps 2, 4, 6" in proc.stdout
    proc = check_resume(["--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "never"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoints: steps none" in proc.stdout


@POSIX
def test_a_run_that_does_not_end_at_its_checkpoint(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "refuse-kill"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "did not end by SIGKILL after the checkpoint of step 2" in proc.stdout
    assert "exited with status 3 without reporting a checkpoint of step 2" in proc.stdout


@POSIX
def test_a_resumed_run_that_fails(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "crash-on-resume"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the resumed run exited with status 1" in proc.stdout
    assert "RuntimeError: cannot resume" in proc.stdout  # its output's end
    assert "steps 3-6 are missing" in proc.stdout


@POSIX
def test_a_script_that_records_nothing(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(["--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "silent"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the uninterrupted run recorded no step: call record_step" in proc.stdout


@POSIX
def test_an_uninterrupted_run_that_fails(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('broken on purpose')\n")
    proc = check_resume(["--at", "2", str(script)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the uninterrupted run exited with status 1" in proc.stdout
    assert "broken on purpose" in proc.stdout


@POSIX
def test_timeout(toy: Path, tmp_path: Path) -> None:
    proc = check_resume(
        ["--timeout", "2", "--at", "2", str(toy)], cwd=tmp_path, env={"TOY_BUG": "hang"}
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the uninterrupted run ran past the timeout" in proc.stdout


# --- the command, on a real training loop ---------------------------------------------------------


@POSIX
@pytest.mark.slow
def test_the_example_resumes_mid_epoch_and_at_an_epoch_end(tmp_path: Path) -> None:
    proc = check_resume(["--at", "6", "--at", "9", str(EXAMPLE)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "uninterrupted run: 12 steps (1-12), checkpoints at steps 3, 6, 9, 12" in proc.stdout
    assert (
        "--at 6: OK: 12 steps match the uninterrupted run; the resumed run trained steps 7-12"
        in (proc.stdout)
    )
    assert "--at 9: OK" in proc.stdout


@POSIX
@pytest.mark.slow
def test_the_example_without_its_snapshot_diverges_after_the_restart(tmp_path: Path) -> None:
    proc = check_resume(
        ["--at", "9", str(EXAMPLE), "--workers", "0"],
        cwd=tmp_path,
        env={"CHECK_RESUME_EXAMPLE_BUG": "snapshot"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The data are keyed per sample: they still match; dropout's stream does not.
    assert "--at 9: DIFFERS: step 10: the RNG state differs (and the loss)" in proc.stdout


@POSIX
@pytest.mark.slow
def test_the_example_that_skips_after_an_epoch_end_misses_steps(tmp_path: Path) -> None:
    proc = check_resume(
        ["--at", "6", str(EXAMPLE), "--workers", "0"],
        cwd=tmp_path,
        env={"CHECK_RESUME_EXAMPLE_BUG": "skip"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--at 6: DIFFERS: steps 7-12 are missing: the resumed run recorded no step" in (
        proc.stdout
    )


def test_no_stray_environment() -> None:
    assert RECORDS_VAR not in os.environ and KILL_AT_VAR not in os.environ
    assert sys.modules["deterministic_ctx.integrations.check_resume"] is cr


#: The trainers' examples as check-resume runs them: (library, arguments, the steps to crash at).
TRAINER_EXAMPLES = {
    "lightning": (
        [str(ROOT / "examples" / "lightning_resume.py"), "--train", ".", "--resume", "auto"],
        ("8", "12"),  # mid-epoch, an epoch's last batch
    ),
    "transformers": (
        [
            str(ROOT / "examples" / "transformers_resume.py"),
            "--child",
            json.dumps(
                {"output_dir": "out", "workers": 2, "resume": True, "callback": True}
                | {"report": "report.json"}
            ),
        ],
        ("4", "6"),  # mid-epoch, an epoch's last step
    ),
}


@POSIX
@pytest.mark.slow
@pytest.mark.parametrize("library", sorted(TRAINER_EXAMPLES))
def test_the_trainers_examples_pass_with_their_callbacks_and_no_code_of_theirs(
    tmp_path: Path, library: str
) -> None:
    import importlib.util

    if importlib.util.find_spec(library) is None:  # looked up: importing draws from random
        pytest.skip(f"needs {library}")
    script, steps = TRAINER_EXAMPLES[library]
    proc = check_resume([arg for k in steps for arg in ("--at", k)] + script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for k in steps:
        assert f"--at {k}: OK" in proc.stdout, proc.stdout
