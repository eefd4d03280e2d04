"""Ranking the culprits: the environment facts that differ between two traces, the most
likely causes of a divergence first.
"""

from __future__ import annotations

import dataclasses

from .facts import Fact
from .fileformat import Trace

#: The order of culprits: ``(category, why it changes results)``, most likely first.
_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("seed", "every random draw depends on the seed"),
    (
        "versions",
        "kernels, their defaults and their random streams change between torch, CUDA and "
        "cuDNN releases",
    ),
    (
        "device",
        "the GPU model, its compute capability and SM count choose kernels and how work is "
        "split (CUDA random streams depend on the SM count)",
    ),
    (
        "threads",
        "CPU kernels split reductions by the thread count, so floating-point sums round "
        "differently",
    ),
    ("precision", "TF32 and reduced-precision matmuls and convolutions round differently"),
    ("flags", "determinism flags and variables choose between kernels"),
    (
        "cpu",
        "the CPU's vector instructions (AVX2, AVX-512) and the BLAS library choose other kernels",
    ),
    ("other", ""),
)
_RANK = {name: rank for rank, (name, _) in enumerate(_CATEGORIES)}
_WHY = dict(_CATEGORIES)
_VERSION_FACTS = frozenset(
    {"versions.torch", "versions.torch_git", "cuda.compiled_version", "cuda.cudnn_version"}
)
_THREAD_FACTS = frozenset(
    {
        "process.num_threads",
        "process.num_interop_threads",
        "env.OMP_NUM_THREADS",
        "env.MKL_NUM_THREADS",
    }
)
_PRECISION_FACTS = frozenset(
    {
        "flags.float32_matmul_precision",
        "flags.cudnn_allow_tf32",
        "flags.onednn_allow_tf32",
        "env.NVIDIA_TF32_OVERRIDE",
    }
)


#: torch.compile's settings, recorded only where its config modules are loaded (``None``:
#: inductor is not): whether they are depends on what else the process imported, not on
#: what decides results, so they are compared only when both traces recorded them.
_LOADED_ONLY = ("torch_compile.", "flags.inductor_deterministic")


def _category(name: str) -> str:
    """Which kind of culprit the fact ``name`` is (see :data:`_CATEGORIES`)."""
    if name == "seed":
        return "seed"
    if name in _VERSION_FACTS:
        return "versions"
    if name.startswith("cuda.") or name == "env.CUDA_VISIBLE_DEVICES":
        return "device"
    if name in _THREAD_FACTS:
        return "threads"
    if name in _PRECISION_FACTS or name.startswith("flags.fp32_precision."):
        return "precision"
    if name.startswith(("flags.", "env.", "process.env_at_start.", "torch_compile.")):
        return "flags"
    if name == "process.hash_randomization":
        return "flags"
    if name.startswith("cpu."):
        return "cpu"
    return "other"


@dataclasses.dataclass(frozen=True)
class EnvironmentDifference:
    """One fact that differs between the environments of two traces.

    ``a`` and ``b`` are its values; ``in_a`` / ``in_b`` are false where a trace
    did not record it (CUDA facts of a run that never used CUDA, say).
    ``category`` is the kind of culprit (``"seed"``, ``"versions"``,
    ``"device"``, ``"threads"``, ``"precision"``, ``"flags"``, ``"cpu"``,
    ``"other"``: the order of :attr:`TraceComparison.environment`) and
    ``why`` how it changes results.

    Example:
        >>> d = EnvironmentDifference("process.num_threads", 8, 1, "threads", "...")
        >>> str(d)
        'process.num_threads: 8 (A) vs 1 (B)'
    """

    name: str
    a: Fact
    b: Fact
    category: str
    why: str
    in_a: bool = True
    in_b: bool = True

    def __str__(self) -> str:
        a = repr(self.a) if isinstance(self.a, str) else str(self.a)
        b = repr(self.b) if isinstance(self.b, str) else str(self.b)
        return (
            f"{self.name}: {a if self.in_a else '(not recorded)'} (A) vs "
            f"{b if self.in_b else '(not recorded)'} (B)"
        )


def environment_differences(a: Trace, b: Trace) -> tuple[EnvironmentDifference, ...]:
    """The facts that differ (the seed among them), most likely culprits first."""
    facts_a: dict[str, Fact] = {"seed": a.seed, **a.environment}
    facts_b: dict[str, Fact] = {"seed": b.seed, **b.environment}
    found = []
    for name in [*facts_a, *(n for n in facts_b if n not in facts_a)]:
        in_a, in_b = name in facts_a, name in facts_b
        x, y = facts_a.get(name), facts_b.get(name)
        if in_a and in_b and type(x) is type(y) and x == y:
            continue
        if name.startswith(_LOADED_ONLY) and (x is None or y is None):
            continue
        category = _category(name)
        found.append(EnvironmentDifference(name, x, y, category, _WHY[category], in_a, in_b))
    # sorted() is stable: in each category, A's order.
    return tuple(sorted(found, key=lambda d: _RANK[d.category]))
