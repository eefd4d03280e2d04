"""report() and torch.compile: the random-number settings section and the
``compiled-rng`` / ``compiled-numpy-rng`` notes.

Whether the notes' claims hold for real compiled code is
``tests/core/test_compile.py``'s business; here, what the report says.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from deterministic_ctx import deterministic, report
from deterministic_ctx.internal import compiled_settings
from deterministic_ctx.reporting import DeterminismReport, Problem
from tests.helpers import needs_config_entries, run_python

inductor = importlib.import_module("torch._inductor.config")
dynamo = importlib.import_module("torch._dynamo.config")

FALLBACK = "torch._inductor.config.fallback_random"
NUMPY_STREAM = "torch._dynamo.config.use_numpy_random_stream"


@contextlib.contextmanager
def patched(config: Any, **changes: object) -> Iterator[None]:
    """Override config entries for the body, then put back each entry's override.

    torch's own patcher for the hot path: ``config.patch`` puts back the old
    *value*, which leaves an override behind (the leak guard sees it), and
    ``del config.key`` also hides the entry from torch's config dumps.
    """
    make = getattr(config, "_make_closure_patcher", None)
    if make is not None:
        revert = make(**changes)()
    else:  # torch 2.1's config modules keep no overrides: the value is all there is
        old = {key: getattr(config, key) for key in changes}
        for key, value in changes.items():
            setattr(config, key, value)

        def revert() -> None:
            for key, value in old.items():
                setattr(config, key, value)

    try:
        yield
    finally:
        revert()


def problem(r: DeterminismReport, code: str) -> Problem | None:
    return next((p for p in r.problems if p.code == code), None)


def section(r: DeterminismReport) -> list[str]:
    """The lines of the text's torch.compile section, title included."""
    lines = str(r).splitlines()
    start = lines.index("torch.compile")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    return lines[start:end]


def test_the_section_lists_every_imported_setting_in_text_and_data():
    r = report()
    assert r.torch_compile == compiled_settings()
    assert FALLBACK in r.torch_compile
    assert (NUMPY_STREAM in r.torch_compile) == hasattr(dynamo, "use_numpy_random_stream")
    assert r.to_dict()["torch_compile"] == r.torch_compile
    assert json.loads(json.dumps(r.to_dict()))["torch_compile"] == r.torch_compile
    shown = section(r)
    assert len(shown) == 1 + len(r.torch_compile)  # inductor is imported: no "not used" line
    for line, (name, value) in zip(shown[1:], r.torch_compile.items(), strict=True):
        assert line.split() == [name, str(value)]


#: torch < 2.12 has no align_random_eager.
_ALIGN = {"align_random_eager": False} if hasattr(inductor, "align_random_eager") else {}


def test_fallback_random_off_is_a_note_with_the_advice():
    with patched(inductor, fallback_random=False, **_ALIGN):
        r = report()
    assert r.torch_compile[FALLBACK] is False
    note = problem(r, "compiled-rng")
    assert note is not None and note.level == "note"  # reproducible run to run: not a warning
    assert note not in r.warnings
    for text in (
        "fallback_random is off",
        "not equal to eager's under the same seed",
        'deterministic(seed, compiled_rng="eager")',
        "torch._inductor.config.fallback_random = True",
        "torch._dynamo.reset()",
        "unfused",
    ):
        assert text in note.message
    assert "align_random_eager" not in note.message
    assert f"note [compiled-rng] {note.message}" in str(r)


def test_fallback_random_on_is_no_problem_and_shown():
    with patched(inductor, fallback_random=True):
        r = report()
    assert r.torch_compile[FALLBACK] is True
    assert problem(r, "compiled-rng") is None
    assert any(line.split() == [FALLBACK, "True"] for line in section(r))


@pytest.mark.skipif(not _ALIGN, reason="torch < 2.12 has no align_random_eager")
def test_align_random_eager_does_not_silence_the_note_but_is_named():
    with patched(inductor, fallback_random=False, align_random_eager=True):
        r = report()
    note = problem(r, "compiled-rng")
    assert note is not None and "align_random_eager, on here" in note.message


def test_a_block_with_compiled_rng_eager_shows_fallback_random_on():
    with patched(inductor, fallback_random=False):
        with deterministic(seed=0, compiled_rng="eager"):
            inside = report()
        after = report()
    assert inside.in_block and inside.torch_compile[FALLBACK] is True
    assert problem(inside, "compiled-rng") is None
    assert after.torch_compile[FALLBACK] is False and problem(after, "compiled-rng") is not None


@needs_config_entries("torch._dynamo.config", "use_numpy_random_stream")
def test_numpy_random_stream():
    with patched(dynamo, use_numpy_random_stream=False):
        off = report()
    with patched(dynamo, use_numpy_random_stream=True):
        on = report()
    note = problem(off, "compiled-numpy-rng")
    assert note is not None and note.level == "note"
    assert "np.random" in note.message and "use_numpy_random_stream" in note.message
    assert problem(on, "compiled-numpy-rng") is None


@pytest.mark.slow
def test_without_inductor_the_report_says_so_and_imports_nothing():
    code = (
        "import json, sys; import deterministic_ctx as dc; r = dc.report(); "
        "print(json.dumps({'loaded': [m for m in ('torch._inductor', 'torch._dynamo', "
        "'torch._functorch.config') if m in sys.modules], 'data': r.to_dict()['torch_compile'], "
        "'codes': [p.code for p in r.problems], 'text': str(r)}))"
    )
    out = run_python([], code=code, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["loaded"] == []
    assert got["data"] == {}
    assert not {"compiled-rng", "compiled-numpy-rng", "inductor"} & set(got["codes"])
    shown = "\ntorch.compile\n  not used in this process: torch._inductor is not imported\n"
    assert shown in got["text"]
