"""The torch flags source restores every determinism and precision flag exactly.

"Exactly" is checked two ways, both through torch's public API only:

* every public getter reads as before the block (a getter that raises must
  raise again: some do after the legacy and new TF32 APIs were mixed);
* the *hidden* state is as before: each ``fp32_precision`` entry's own value
  (the getters report the value an entry inherits from its parents, not its
  own), the legacy matmul precision and the legacy cuDNN ``allow_tf32`` flag,
  each found by setting parents to known values and reading the children
  (:func:`hidden`).  Two states that agree here agree after any later
  sequence of setters.

torch 2.13 has one state no setter can write back: the initial precision of
cuDNN conv and rnn, which reads "tf32" and follows a parent once one is set.
A process that ran the property tests has lost it (``torch.backends.cudnn.
allow_tf32 = ...`` overwrites it for good), so the tests about it run in a
fresh interpreter.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deterministic_ctx import Snapshot, deterministic
from deterministic_ctx.sources.flags import TorchFlagsSource
from tests.helpers import ROOT as _ROOT
from tests.helpers import config_override, run_python, set_config_override

_C: Any = torch._C
B: Any = torch.backends

pytestmark = pytest.mark.skipif(
    not hasattr(_C, "_get_fp32_precision_getter") or torch.__version__ < (2, 9),
    reason="this torch has no fp32_precision API with 'none' entries",
)

ROOT = str(_ROOT)
PRECISIONS = ("none", "ieee", "tf32", "bf16")
CUDA_PRECISIONS = ("none", "ieee", "tf32")  # torch refuses "bf16" for cuda


# -- observing ----------------------------------------------------------------

GETTERS: dict[str, Callable[[], object]] = {
    "fp32_precision": lambda: B.fp32_precision,
    "cuda.matmul.fp32_precision": lambda: B.cuda.matmul.fp32_precision,
    "cudnn.fp32_precision": lambda: B.cudnn.fp32_precision,
    "cudnn.conv.fp32_precision": lambda: B.cudnn.conv.fp32_precision,
    "cudnn.rnn.fp32_precision": lambda: B.cudnn.rnn.fp32_precision,
    "mkldnn.fp32_precision": lambda: B.mkldnn.fp32_precision,
    "mkldnn.matmul.fp32_precision": lambda: B.mkldnn.matmul.fp32_precision,
    "mkldnn.conv.fp32_precision": lambda: B.mkldnn.conv.fp32_precision,
    "mkldnn.rnn.fp32_precision": lambda: B.mkldnn.rnn.fp32_precision,
    "cuda.matmul.allow_tf32": lambda: B.cuda.matmul.allow_tf32,
    "cudnn.allow_tf32": lambda: B.cudnn.allow_tf32,
    "mkldnn.allow_tf32": lambda: B.mkldnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "cudnn.deterministic": lambda: B.cudnn.deterministic,
    "cudnn.benchmark": lambda: B.cudnn.benchmark,
    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled,
    "fill_uninitialized_memory": lambda: torch.utils.deterministic.fill_uninitialized_memory,
    "mkldnn.deterministic": lambda: B.mkldnn.deterministic,
}


def observe() -> dict[str, object]:
    """Every public getter; an exception is a value too."""
    out: dict[str, object] = {}
    for name, get in GETTERS.items():
        try:
            out[name] = get()
        except Exception as exc:
            out[name] = f"raises {type(exc).__name__}"
    return out


#: The writable entries: getter and setter of each through the public API.
#: ``mkldnn.all`` has no attribute setter (``torch.backends.mkldnn.fp32_precision``
#: writes ``generic.all``); ``mkldnn.flags()`` writes it through ``set_flags``.
ENTRIES: dict[str, tuple[Callable[[], str], Callable[[str], None]]] = {
    "generic.all": (lambda: B.fp32_precision, lambda v: setattr(B, "fp32_precision", v)),
    "cuda.all": (lambda: B.cudnn.fp32_precision, lambda v: setattr(B.cudnn, "fp32_precision", v)),
    "cuda.matmul": (
        lambda: B.cuda.matmul.fp32_precision,
        lambda v: setattr(B.cuda.matmul, "fp32_precision", v),
    ),
    "cuda.conv": (
        lambda: B.cudnn.conv.fp32_precision,
        lambda v: setattr(B.cudnn.conv, "fp32_precision", v),
    ),
    "cuda.rnn": (
        lambda: B.cudnn.rnn.fp32_precision,
        lambda v: setattr(B.cudnn.rnn, "fp32_precision", v),
    ),
    "mkldnn.all": (
        lambda: B.mkldnn.fp32_precision,
        lambda v: B.mkldnn.set_flags(_fp32_precision=v),
    ),
    "mkldnn.matmul": (
        lambda: B.mkldnn.matmul.fp32_precision,
        lambda v: setattr(B.mkldnn.matmul, "fp32_precision", v),
    ),
    "mkldnn.conv": (
        lambda: B.mkldnn.conv.fp32_precision,
        lambda v: setattr(B.mkldnn.conv, "fp32_precision", v),
    ),
    "mkldnn.rnn": (
        lambda: B.mkldnn.rnn.fp32_precision,
        lambda v: setattr(B.mkldnn.rnn, "fp32_precision", v),
    ),
}
CHILDREN = [k for k in ENTRIES if not k.endswith(".all")]


def get(entry: str) -> str:
    return ENTRIES[entry][0]()


def put(entry: str, value: str) -> None:
    ENTRIES[entry][1](value)


def own_values() -> dict[str, str]:
    """Each entry's own value: ``"none"`` (inherits), an explicit precision, or
    ``"default"`` (cuDNN's initial state: "tf32" unless a parent is set).

    A backend's ``all`` reads as its own value while ``generic.all`` is unset.
    A child is read under its backend's ``all`` set to none, ieee and tf32 in
    turn: an inheriting child follows the last two, cuDNN's initial state
    reads tf32 under none, an explicit value never moves.  Everything set on
    the way is put back.
    """
    generic = get("generic.all")
    put("generic.all", "none")
    alls = {"cuda.all": get("cuda.all"), "mkldnn.all": get("mkldnn.all")}
    reads: dict[str, list[str]] = {child: [] for child in CHILDREN}
    try:
        for probe in ("none", "ieee", "tf32"):
            put("cuda.all", probe)
            put("mkldnn.all", probe)
            for child in CHILDREN:
                reads[child].append(get(child))
    finally:
        for entry, value in alls.items():
            put(entry, value)
        put("generic.all", generic)
    decoded = {
        ("none", "ieee", "tf32"): "none",
        ("tf32", "ieee", "tf32"): "default",
    }
    out = {"generic.all": generic, **alls}
    for child, seen in reads.items():
        value = decoded.get((seen[0], seen[1], seen[2]))
        if value is None:
            assert len(set(seen)) == 1, (child, seen)
            value = seen[0]
        out[child] = value
    return out


def legacy_matmul_precision(own: dict[str, str]) -> str:
    """``float32_matmul_precision`` even where its getter raises: it raises only
    because of what the matmul entries hold, so read it with both set to ieee."""
    try:
        put("cuda.matmul", "ieee")
        put("mkldnn.matmul", "ieee")
        return torch.get_float32_matmul_precision()
    finally:
        put("cuda.matmul", own["cuda.matmul"])
        put("mkldnn.matmul", own["mkldnn.matmul"])


def legacy_cudnn_allow_tf32(own: dict[str, str]) -> bool:
    """``cudnn.allow_tf32`` even where its getter raises: it answers only while
    conv and rnn both read tf32 or both not, so make them read tf32 (through
    their parent where they still hold cuDNN's initial state, which no setter
    can write back)."""
    cuda_all = own["cuda.all"]
    explicit = [c for c in ("cuda.conv", "cuda.rnn") if own[c] != "default"]
    try:
        put("cuda.all", "tf32")
        for child in explicit:
            put(child, "tf32")
        try:
            return bool(B.cudnn.allow_tf32)
        except RuntimeError:
            return False  # the flag disagrees with conv and rnn both at tf32
    finally:
        for child in explicit:
            put(child, own[child])
        put("cuda.all", cuda_all)


def inductor_override() -> object:
    """The user override of inductor's ``deterministic`` (torch's sentinel if unset);
    ``None`` if inductor is not imported.  Test-only access to torch internals."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return None
    return config_override(config, "deterministic")


def set_inductor_override(value: object) -> None:
    config: Any = sys.modules["torch._inductor.config"]
    set_config_override(config, "deterministic", value)


def hidden() -> dict[str, Any]:
    """The state behind the getters (see the module docstring)."""
    own = own_values()
    return {
        "own": own,
        "float32_matmul_precision": legacy_matmul_precision(own),
        "cudnn.allow_tf32": legacy_cudnn_allow_tf32(own),
        "mkldnn.allow_tf32": B.mkldnn.allow_tf32,
        "inductor": inductor_state(),
    }


def inductor_state() -> object:
    """The override, or "default" where nobody set one (not imported counts as
    default: an import cannot be undone, so a block that imports inductor must
    leave it at its default)."""
    override = inductor_override()
    return "default" if override is None or override is _unset() else override


def closest(own: dict[str, str]) -> str:
    """What cuDNN's unwritable initial state is replaced with: the explicit
    value that behaves like it under the parents ``own`` has."""
    parents_set = own["cuda.all"] != "none" or own["generic.all"] != "none"
    return "none" if parents_set else "tf32"


def without_default(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as it can be written back: cuDNN's initial state replaced by its
    closest explicit value."""
    own = dict(state["own"])
    for entry in ("cuda.conv", "cuda.rnn"):
        if own[entry] == "default":
            own[entry] = closest(own)
    return {**state, "own": own}


def reset(state: dict[str, Any]) -> None:
    """Put ``state`` (from :func:`hidden`) back through the public setters, the
    test's own way: legacy setters first (they overwrite entries), then each
    entry that differs."""
    now = hidden()
    if now["float32_matmul_precision"] != state["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    if now["cudnn.allow_tf32"] != state["cudnn.allow_tf32"]:
        B.cudnn.allow_tf32 = state["cudnn.allow_tf32"]
    if isinstance(state["mkldnn.allow_tf32"], bool):  # XPU builds only
        B.mkldnn.allow_tf32 = state["mkldnn.allow_tf32"]
    current = own_values()
    target = without_default(state)["own"]
    for entry, value in target.items():
        if current[entry] != value and not (current[entry] == "default" == state["own"][entry]):
            put(entry, value)
    if inductor_override() is not None:  # imported, maybe since ``state`` was taken
        want = _unset() if state["inductor"] == "default" else state["inductor"]
        if inductor_override() is not want:
            set_inductor_override(want)


def forget_cudnn_initial_state() -> None:
    """Replace cuDNN's initial conv/rnn state, which only the first examples of a
    property test would see, by its closest explicit value: examples then do
    not depend on their order.  Tests that need it run in a fresh interpreter."""
    own = own_values()
    for entry in ("cuda.conv", "cuda.rnn"):
        if own[entry] == "default":
            put(entry, closest(own))


# -- changing -----------------------------------------------------------------


def _use(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _mkldnn_allow_tf32(value: bool) -> None:
    with warnings.catch_warnings():  # on builds without XPU torch warns and ignores it
        warnings.simplefilter("ignore")
        B.mkldnn.allow_tf32 = value


BOOLS = (False, True)
SETTERS: dict[str, tuple[Callable[[Any], None], tuple[Any, ...]]] = {
    **{f"{entry} =": (ENTRIES[entry][1], CUDA_PRECISIONS) for entry in ENTRIES if "cuda" in entry},
    **{f"{entry} =": (ENTRIES[entry][1], PRECISIONS) for entry in ENTRIES if "cuda" not in entry},
    # mkldnn.fp32_precision reads mkldnn.all but writes generic.all
    "mkldnn.fp32_precision =": (lambda v: setattr(B.mkldnn, "fp32_precision", v), PRECISIONS),
    "cuda.matmul.allow_tf32 =": (lambda v: setattr(B.cuda.matmul, "allow_tf32", v), BOOLS),
    "cudnn.allow_tf32 =": (lambda v: setattr(B.cudnn, "allow_tf32", v), BOOLS),
    "mkldnn.allow_tf32 =": (_mkldnn_allow_tf32, BOOLS),
    "set_float32_matmul_precision": (
        torch.set_float32_matmul_precision,
        ("highest", "high", "medium"),
    ),
    "cudnn.deterministic =": (lambda v: setattr(B.cudnn, "deterministic", v), BOOLS),
    "cudnn.benchmark =": (lambda v: setattr(B.cudnn, "benchmark", v), BOOLS),
    "use_deterministic_algorithms": (
        _use,
        ((False, False), (False, True), (True, False), (True, True)),
    ),
    "fill_uninitialized_memory =": (
        lambda v: setattr(torch.utils.deterministic, "fill_uninitialized_memory", v),
        BOOLS,
    ),
    "mkldnn.deterministic =": (lambda v: setattr(B.mkldnn, "deterministic", v), BOOLS),
}

ops = st.lists(
    st.sampled_from(sorted(SETTERS)).flatmap(
        lambda name: st.tuples(st.just(name), st.sampled_from(SETTERS[name][1]))
    ),
    max_size=8,
)


def run(sequence: list[tuple[str, Any]]) -> None:
    for name, value in sequence:
        SETTERS[name][0](value)


def plain_flags() -> tuple[object, ...]:
    return (
        B.cudnn.deterministic,
        B.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        B.mkldnn.deterministic,
    )


def set_plain_flags(values: tuple[object, ...]) -> None:
    B.cudnn.deterministic, B.cudnn.benchmark = values[0], values[1]
    _C._set_deterministic_algorithms(values[2], warn_only=values[3])
    torch.utils.deterministic.fill_uninitialized_memory = values[4]
    B.mkldnn.deterministic = values[5]


@pytest.fixture
def world() -> Iterator[None]:
    """Whatever a test does to the flags is undone, the test's own way."""
    start, flags = hidden(), plain_flags()
    try:
        yield
    finally:
        set_plain_flags(flags)
        reset(start)


# -- a block ------------------------------------------------------------------


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(outer=ops, inner=ops, warn_only=st.booleans())
def test_a_block_restores_every_getter_and_the_hidden_state(world, outer, inner, warn_only):
    importlib.import_module("torch._inductor.config")  # imported in every example alike
    forget_cudnn_initial_state()  # every example alike (see test_..._keeps_cudnn_initial_state)
    start, flags = hidden(), plain_flags()
    try:
        run(outer)
        before, state = observe(), hidden()
        with deterministic(seed=0, warn_only=warn_only):
            assert torch.are_deterministic_algorithms_enabled()
            run(inner)
        assert observe() == before
        assert hidden() == state
    finally:
        set_plain_flags(flags)
        reset(start)


def test_precision_set_in_the_body_is_restored_after_its_parent(world):
    # The reported case: the parent was rewritten first, then the child compared
    # with what it read before, an inherited value.
    before, state = observe(), hidden()
    with deterministic(seed=0):
        B.fp32_precision = "tf32"
        B.cudnn.rnn.fp32_precision = "none"
    assert observe() == before
    # (cuDNN's initial rnn state, if this process still had it, is gone: the body wrote rnn.)
    assert without_default(hidden()) == without_default(state)


def test_an_explicit_value_equal_to_the_inherited_one_is_undone(world):
    B.fp32_precision = "tf32"  # cuda.matmul inherits tf32
    with deterministic(seed=0):
        B.cuda.matmul.fp32_precision = "tf32"  # same value, now its own
    B.fp32_precision = "ieee"
    assert B.cuda.matmul.fp32_precision == "ieee"  # it still inherits


def test_legacy_flags_hidden_behind_raising_getters_are_restored(world):
    B.cudnn.allow_tf32 = True
    B.cudnn.rnn.fp32_precision = "ieee"  # conv and rnn now disagree: the getter raises
    torch.set_float32_matmul_precision("highest")
    B.cuda.matmul.fp32_precision = "tf32"  # the matmul getter raises
    before, state = observe(), hidden()
    assert before["cudnn.allow_tf32"] == before["float32_matmul_precision"] == "raises RuntimeError"
    with deterministic(seed=0):
        B.cudnn.allow_tf32 = False
        B.cudnn.rnn.fp32_precision = "ieee"
        B.cudnn.conv.fp32_precision = "tf32"
        torch.set_float32_matmul_precision("medium")
        B.cuda.matmul.fp32_precision = "tf32"
        B.mkldnn.matmul.fp32_precision = "ieee"
    assert observe() == before
    assert hidden() == state


def test_snapshot_restore_of_flags_is_exact(world):
    B.fp32_precision = "bf16"
    B.mkldnn.set_flags(_fp32_precision="tf32")
    B.cudnn.conv.fp32_precision = "ieee"
    before, state = observe(), hidden()
    snap = Snapshot.capture()
    B.mkldnn.set_flags(_fp32_precision="none")
    B.mkldnn.conv.fp32_precision = "tf32"
    B.fp32_precision = "none"
    B.cudnn.conv.fp32_precision = "none"
    snap.restore()
    assert observe() == before
    assert hidden() == state


def test_captures_in_threads_never_see_each_others_probes(world):
    # With a parent set, a capture unsets parents for a moment: another
    # thread's capture must neither record that moment nor undo it.
    import threading

    B.fp32_precision = "tf32"
    B.cudnn.fp32_precision = "ieee"
    B.cuda.matmul.fp32_precision = "tf32"
    source = TorchFlagsSource()
    expected, before, state = source.capture(), observe(), hidden()
    seen: list[object] = []

    def work() -> None:
        for _ in range(200):
            got = source.capture()
            if got != expected:
                seen.append(got)
            source.restore(expected)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost any two bytecodes
    try:
        threads = [threading.Thread(target=work) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen == []
    assert observe() == before
    assert hidden() == state


def test_a_put_back_that_fails_twice_still_writes_the_rest_then_raises_the_first():
    # The undo entries of a capture's probe are written back last first; one
    # interrupted and failing on its retry must not leave the others unset.
    from deterministic_ctx.sources.precision import _put_back

    written: list[tuple[str, str, str]] = []
    failures = [KeyboardInterrupt("first"), ValueError("retry")]

    def put(backend: str, op: str, value: str) -> None:
        if backend == "cuda" and failures:
            raise failures.pop(0)
        written.append((backend, op, value))

    undo = [("generic", "all", "tf32"), ("cuda", "all", "ieee"), ("mkldnn", "all", "bf16")]
    with pytest.raises(KeyboardInterrupt, match="first"):
        _put_back(put, undo)
    assert written == [("mkldnn", "all", "bf16"), ("generic", "all", "tf32")]
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_while_another_thread_holds_the_precision_lock_can_take_it():
    # Held by another thread at the fork, it would be held forever in the child.
    _python("""
        import os, threading
        from deterministic_ctx.sources import precision

        held, done = threading.Event(), threading.Event()

        def hold():
            with precision._lock:
                held.set()
                done.wait()

        thread = threading.Thread(target=hold)
        thread.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if precision._lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
        done.set()
        thread.join()
        assert os.waitstatus_to_exitcode(status) == 0
    """)


def _python(code: str, env: dict[str, str] | None = None) -> None:
    """Run ``code`` in a fresh interpreter (an import, or cuDNN's initial
    precision, cannot be undone in this one)."""
    run_python([], code=textwrap.dedent(code), env=env, check=True)


def _as_without_blocks(code: str, blocks: dict[str, str]) -> None:
    """Run ``code`` in a fresh interpreter twice: with each ``{name}`` replaced by
    its block, then by nothing; require the same output.

    The oracle is torch itself: cuDNN's initial precision state behaves
    differently across torch versions (it follows a parent once one is set on
    2.13, not on 2.11), and a block must leave whatever this torch does as it
    would be without the block.
    """
    code = textwrap.dedent(code)
    with_blocks = code.format(**{k: textwrap.dedent(v) for k, v in blocks.items()})
    without = code.format(**dict.fromkeys(blocks, ""))
    prelude = "import torch\nfrom deterministic_ctx import deterministic\nB = torch.backends\n"

    def output(text: str) -> str:
        proc = run_python([], code=prelude + text, check=True)
        return proc.stdout

    expected = output(without)
    assert output(with_blocks) == expected
    assert expected.count("\n") >= 2  # the script did print what it observed


def _precisions() -> str:
    return (
        "print(B.fp32_precision, B.cudnn.fp32_precision, B.cudnn.conv.fp32_precision, "
        "B.cudnn.rnn.fp32_precision, B.cuda.matmul.fp32_precision)\n"
    )


@pytest.mark.slow
def test_cudnn_initial_precision_survives_a_block_that_sets_a_parent():
    # In a fresh process cuDNN conv/rnn hold a state no setter can write (on torch
    # 2.13 they read "tf32" and follow a parent once one is set).  A block that
    # only sets a parent must leave them so.
    _as_without_blocks(
        "{block}" + _precisions() + 'B.fp32_precision = "ieee"\n' + _precisions(),
        {
            "block": """
            with deterministic(seed=0):
                B.fp32_precision = "ieee"
                B.mkldnn.matmul.fp32_precision = "bf16"
            """
        },
    )


@pytest.mark.slow
def test_cudnn_initial_precision_under_a_parent_survives_a_block():
    _as_without_blocks(
        'B.fp32_precision = "ieee"\n{blocks}'
        + _precisions()
        + 'B.fp32_precision = "none"\n'
        + _precisions(),
        {
            "blocks": """
            with deterministic(seed=0):
                B.fp32_precision = "tf32"
                B.cudnn.fp32_precision = "tf32"
            with deterministic(seed=0):
                with deterministic(seed=1):
                    B.fp32_precision = "none"
            """
        },
    )


@pytest.mark.slow
def test_cudnn_initial_precision_overwritten_in_the_body_reads_as_before():
    # It cannot be written back, but what replaces it must read the same, under
    # the parent that is set and after that parent changes value.
    _as_without_blocks(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.sources.test_flags import observe\n"
        'B.fp32_precision = "ieee"\n{block}print(sorted(observe().items()))\n'
        'B.fp32_precision = "tf32"\n' + _precisions(),
        {
            "block": """
            with deterministic(seed=0):
                B.cudnn.conv.fp32_precision = "tf32"
                B.cudnn.allow_tf32 = False
            """
        },
    )


@pytest.mark.slow
def test_a_loaded_state_overrides_cudnn_initial_precision_where_it_differs():
    # Loading into a fresh process: cuDNN's initial state is kept only where it
    # behaves as the saved value.
    _python(
        """
        import torch
        from deterministic_ctx.sources.flags import TorchFlagsSource
        B = torch.backends
        source = TorchFlagsSource()
        data = source.export_state(source.capture())
        assert data["fp32_precision"]["cuda.conv"] == "tf32"   # how it is saved
        data["fp32_precision"]["cuda.rnn"] = "ieee"
        data["fp32_precision"]["generic.all"] = "ieee"
        data["cudnn_allow_tf32"] = True
        source.restore(source.import_state(data, "flags"))
        # conv: saved "tf32" is its own value; under generic "ieee" the initial
        # state would read "ieee", so it was written.
        got = (B.fp32_precision, B.cudnn.conv.fp32_precision, B.cudnn.rnn.fp32_precision)
        assert got == ("ieee", "tf32", "ieee"), got
        assert source.export_state(source.capture())["fp32_precision"] == data["fp32_precision"]
        """
    )


@pytest.mark.slow
@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="the probe's 'default' class of cuDNN conv/rnn (an initial state that follows "
    "a parent) is torch 2.13's; on 2.11 the initial state ignores parents",
)
def test_random_blocks_keep_cudnn_initial_state_when_nothing_writes_it():
    # The property test above, in a fresh interpreter where cuDNN conv/rnn
    # still hold their initial state, with only setters that leave it alone:
    # neither the block nor its probes may write it.
    _python(
        f"""
        import random, sys
        sys.path.insert(0, {ROOT!r})
        from tests.sources.test_flags import SETTERS, hidden, observe, run
        from deterministic_ctx import deterministic

        keeps = [n for n in sorted(SETTERS) if not n.startswith(("cuda.conv", "cuda.rnn", "cudnn.allow"))]
        rng = random.Random(0)

        def ops():
            names = rng.choices(keeps, k=rng.randrange(6))
            return [(n, rng.choice(SETTERS[n][1])) for n in names]

        assert hidden()["own"]["cuda.conv"] == "default"
        for _ in range(200):
            run(ops())
            before, state = observe(), hidden()
            with deterministic(seed=0):
                run(ops())
            assert observe() == before
            assert hidden() == state, (hidden(), state)
        assert hidden()["own"]["cuda.rnn"] == "default"
        """
    )


# -- inductor -----------------------------------------------------------------


@pytest.fixture
def inductor() -> Iterator[Any]:
    import torch._inductor.config as config

    prior = inductor_override()
    try:
        yield config
    finally:
        set_inductor_override(prior)


def test_inductor_flag_at_its_default_stays_a_default(inductor):
    set_inductor_override(_unset())
    assert inductor._is_default("deterministic")
    key = inductor.get_hash()
    with deterministic(seed=0):
        assert inductor.deterministic is True
    assert inductor._is_default("deterministic")
    assert inductor.get_hash() == key  # the compile-cache key of a later torch.compile


def test_inductor_flag_set_by_the_user_stays_set(inductor):
    inductor.deterministic = False
    key = inductor.get_hash()
    with deterministic(seed=0):
        torch.use_deterministic_algorithms(False)  # writes inductor's flag too
    assert not inductor._is_default("deterministic")
    assert inductor.deterministic is False
    assert inductor.get_hash() == key


def test_inductor_flag_restored_by_a_snapshot_is_exact(inductor):
    set_inductor_override(_unset())
    snap = Snapshot.capture()
    inductor.deterministic = True
    snap.restore()
    assert inductor._is_default("deterministic")


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 12),
    reason="torch < 2.12 keeps config overrides process-wide, not per thread",
)
def test_inductor_flag_is_the_calling_threads(inductor):
    # torch keeps inductor's overrides per thread: a block restores its own thread's.
    import threading

    set_inductor_override(_unset())
    seen: list[object] = []

    def worker() -> None:
        inductor.deterministic = False  # this thread's own override
        with deterministic(seed=0):
            seen.append(inductor.deterministic)
        seen.append(inductor_override())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [True, False]
    assert inductor._is_default("deterministic")  # this thread's never changed


def _unset() -> object:
    from torch.utils._config_module import _UNSET_SENTINEL

    return _UNSET_SENTINEL


_FIRST_IMPORT = """
    import os, sys
    import torch
    from deterministic_ctx import deterministic
    assert "torch._inductor.config" not in sys.modules
    with deterministic(seed=0):
        import torch._inductor.config as config
        torch.use_deterministic_algorithms(True)
        assert config.deterministic is True
    assert config._is_default("deterministic"), "the block left inductor's flag set"
    expected = os.environ.get("TORCHINDUCTOR_DETERMINISTIC") == "1"
    assert config.deterministic is expected, config.deterministic
    with deterministic(seed=0):
        assert config.deterministic is True
    assert config._is_default("deterministic")
    """


@pytest.mark.slow
def test_inductor_first_imported_inside_a_block_is_left_at_its_default():
    _python(_FIRST_IMPORT)


@pytest.mark.slow
def test_inductor_first_imported_inside_a_block_keeps_an_env_default():
    _python(_FIRST_IMPORT, env={"TORCHINDUCTOR_DETERMINISTIC": "1"})


@pytest.mark.slow
def test_a_block_never_imports_inductor():
    _python(
        """
        import sys
        import torch
        from deterministic_ctx import Snapshot, deterministic
        with deterministic(seed=0):
            pass
        Snapshot.from_state_dict(Snapshot.capture().state_dict()).restore()
        assert not any(m.startswith("torch._inductor") for m in sys.modules), "imported"
        """
    )


# -- saving and loading -------------------------------------------------------


def _exported() -> dict[str, Any]:
    source = TorchFlagsSource()
    return source.export_state(source.capture())


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(outer=ops, inner=ops)
def test_a_loaded_state_restores_fully_or_saving_refuses(world, outer, inner):
    importlib.import_module("torch._inductor.config")  # imported in every example alike
    forget_cudnn_initial_state()
    source = TorchFlagsSource()
    start, flags = hidden(), plain_flags()
    try:
        run(outer)
        before, state = observe(), without_default(hidden())
        try:
            data = source.export_state(source.capture())
        except ValueError:
            # Only a state whose float32_matmul_precision torch itself refuses to read.
            assert before["float32_matmul_precision"] == "raises RuntimeError"
            return
        loaded = source.import_state(copy.deepcopy(data), "flags")
        run(inner)
        source.restore(loaded)
        assert observe() == before
        assert without_default(hidden()) == state
    finally:
        set_plain_flags(flags)
        reset(start)


def test_a_file_of_todays_format_loads_and_restores(world):
    # What version 1 wrote before the hidden state was saved: no cudnn_allow_tf32.
    data = {
        "cudnn_deterministic": False,
        "cudnn_benchmark": True,
        "deterministic_algorithms": False,
        "deterministic_warn_only": False,
        "fill_uninitialized_memory": True,
        "mkldnn_deterministic": False,
        "float32_matmul_precision": "high",
        "fp32_precision": {
            "generic.all": "none",
            "cuda.all": "none",
            "cuda.matmul": "tf32",
            "cuda.conv": "tf32",
            "cuda.rnn": "tf32",
            "mkldnn.all": "none",
            "mkldnn.matmul": "tf32",
            "mkldnn.conv": "none",
            "mkldnn.rnn": "none",
        },
    }
    source = TorchFlagsSource()
    source.restore(source.import_state(data, "flags"))
    seen = observe()
    assert seen["float32_matmul_precision"] == "high"
    assert seen["cuda.matmul.fp32_precision"] == seen["mkldnn.matmul.fp32_precision"] == "tf32"
    assert seen["cudnn.benchmark"] is True
    assert seen["fill_uninitialized_memory"] is True
    assert _exported()["fp32_precision"] == data["fp32_precision"]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("cudnn_allow_tf32",), 1, r"flags\.cudnn_allow_tf32: expected True or False"),
        (("inductor_deterministic",), "yes", r"flags\.inductor_deterministic: expected True"),
        (("fp32_precision", "generic.all"), "default", r"flags\.fp32_precision\.generic\.all"),
        (("fp32_precision", "cuda.conv"), "bf16", r"fp32_precision\.cuda\.conv: torch refuses"),
        (("fp32_precision", "cuda.all"), "bf16", r"fp32_precision\.cuda\.all: torch refuses"),
        (("fp32_precision", "mkldnn.rnn"), "fp8", r"fp32_precision\.mkldnn\.rnn: expected one"),
        (("fp32_precision", "generic.matmul"), "ieee", "unexpected field"),
        (("float32_matmul_precision",), "High", "float32_matmul_precision: expected one of"),
        (("onednn_allow_tf32",), 1, r"flags\.onednn_allow_tf32"),
        (("later",), True, "unexpected field"),
    ],
)
def test_bad_fields_are_refused_at_load_by_name(path, value, message):
    data = _exported()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=message):
        TorchFlagsSource().import_state(data, "flags")


def test_onednn_flag_is_refused_where_torch_cannot_set_it():
    if isinstance(_C._get_onednn_allow_tf32(), bool):
        pytest.skip("this torch build has the oneDNN TF32 flag")
    data = {**_exported(), "onednn_allow_tf32": False}
    with pytest.raises(ValueError, match="onednn_allow_tf32: this torch build"):
        TorchFlagsSource().import_state(data, "flags")


loadable = st.fixed_dictionaries(
    {
        "float32_matmul_precision": st.sampled_from(("highest", "high", "medium")),
        "fp32_precision": st.fixed_dictionaries(
            {entry: st.sampled_from(PRECISIONS) for entry in ENTRIES}
        ),
        "cudnn_allow_tf32": st.sampled_from((None, False, True)),
        "inductor_deterministic": st.sampled_from((None, False, True)),
    }
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(saved=loadable, inner=ops)
def test_every_accepted_value_is_set_by_torch_and_read_back(world, saved, inner):
    importlib.import_module("torch._inductor.config")  # imported in every example alike
    forget_cudnn_initial_state()
    data = _exported()
    data["float32_matmul_precision"] = saved["float32_matmul_precision"]
    data["fp32_precision"] = saved["fp32_precision"]
    for key in ("cudnn_allow_tf32", "inductor_deterministic"):
        data.pop(key, None)
        if saved[key] is not None:
            data[key] = saved[key]
    source = TorchFlagsSource()
    try:
        loaded = source.import_state(copy.deepcopy(data), "flags")
    except ValueError as exc:
        text = str(exc)
        assert "torch refuses" in text and text.startswith("flags.fp32_precision"), text
        return
    run(inner)
    source.restore(loaded)  # torch accepts every value: this never raises
    own = own_values()
    for entry, value in data["fp32_precision"].items():
        # cuDNN's initial state is kept where the saved value is what it is saved as
        assert own[entry] == value or (own[entry] == "default" and value == closest(own)), entry
    assert legacy_matmul_precision(own) == data["float32_matmul_precision"]
    assert torch.get_float32_matmul_precision() == data["float32_matmul_precision"]
    if "cudnn_allow_tf32" in data:
        assert legacy_cudnn_allow_tf32(own) is data["cudnn_allow_tf32"]
    again = source.export_state(source.capture())
    assert again["fp32_precision"] == data["fp32_precision"]
    assert again["float32_matmul_precision"] == data["float32_matmul_precision"]
