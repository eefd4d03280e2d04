"""torch determinism and precision flags.

Applied inside a block (they choose *which* algorithm runs):

* ``torch.backends.cudnn.deterministic = True`` and ``.benchmark = False``;
* ``torch.use_deterministic_algorithms(True, warn_only=...)``: both booleans;
* ``torch.utils.deterministic.fill_uninitialized_memory = True``;
* ``torch.backends.mkldnn.deterministic = True``;
* ``torch._inductor.config.deterministic = True``, *only if inductor is
  already imported*: ``use_deterministic_algorithms`` imports it (~1.2 s) to
  set this; we call the C setter directly and never import it ourselves.

Captured and restored but never changed (they choose precision, and TF32
results are themselves deterministic): ``torch.get_float32_matmul_precision()``
and the ``fp32_precision`` of every backend/op.  They are read through the
new ``fp32_precision`` getters because the legacy ``allow_tf32`` getters raise
once the two APIs have been mixed.

``torch.backends.cudnn.flags()`` is not used: it defaults to ``enabled=False``
and would turn cuDNN off.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import torch

from .._settings import Settings
from . import _plain

__all__ = ["FlagState", "TorchFlagsSource"]

_C: Any = torch._C

_get_precision = getattr(_C, "_get_fp32_precision_getter", None)


def _supported(pair: tuple[str, str]) -> bool:
    if _get_precision is None:
        return False
    try:
        _get_precision(*pair)
    except Exception:
        return False
    return True


_PRECISION_OPS: tuple[tuple[str, str], ...] = tuple(
    pair
    for pair in (
        ("generic", "all"),
        ("cuda", "all"),
        ("cuda", "matmul"),
        ("cuda", "conv"),
        ("cuda", "rnn"),
        ("mkldnn", "all"),
        ("mkldnn", "matmul"),
        ("mkldnn", "conv"),
        ("mkldnn", "rnn"),
    )
    if _supported(pair)
)
# Read with one ``map`` over a C function: no Python frame per op.
_PRECISION_BACKENDS = tuple(b for b, _ in _PRECISION_OPS)
_PRECISION_OPNAMES = tuple(o for _, o in _PRECISION_OPS)


def _precisions() -> tuple[str, ...]:
    if _get_precision is None:  # a torch without the fp32_precision API
        return ()
    return tuple(map(_get_precision, _PRECISION_BACKENDS, _PRECISION_OPNAMES))


class FlagState(NamedTuple):
    """Every flag value; ``inductor_deterministic`` is ``None`` if not imported."""

    cudnn_deterministic: bool
    cudnn_benchmark: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool
    mkldnn_deterministic: bool
    inductor_deterministic: bool | None
    float32_matmul_precision: str | None  # None: torch cannot report it (mixed APIs)
    fp32_precision: tuple[str, ...]


def _inductor_config() -> Any:
    return sys.modules.get("torch._inductor.config")


def _matmul_precision() -> str | None:
    # The getter raises once some mixes of the legacy and new precision APIs
    # were used; a snapshot must still be possible.  The per-op fp32_precision
    # entries, read separately, hold the same information for restoring.
    try:
        return str(_C._get_float32_matmul_precision())
    except RuntimeError:
        return None


def _inductor_default(config: Any) -> bool:
    entry = getattr(config, "_config", {}).get("deterministic")
    if entry is not None and hasattr(entry, "default"):
        return bool(entry.default)
    return os.getenv("TORCHINDUCTOR_DETERMINISTIC") == "1"


class TorchFlagsSource:
    """Algorithm-selection flags of torch, cuDNN, oneDNN and inductor."""

    name = "torch.flags"

    def capture(self) -> FlagState:
        inductor = _inductor_config()
        return self._read(None if inductor is None else bool(inductor.deterministic))

    @staticmethod
    def _read(inductor_deterministic: bool | None) -> FlagState:
        return FlagState(
            _C._get_cudnn_deterministic(),
            _C._get_cudnn_benchmark(),
            _C._get_deterministic_algorithms(),
            _C._get_deterministic_algorithms_warn_only(),
            _C._get_deterministic_fill_uninitialized_memory(),
            _C._get_mkldnn_deterministic(),
            inductor_deterministic,
            _matmul_precision(),
            _precisions(),
        )

    def apply(self, settings: Settings) -> None:
        _C._set_cudnn_deterministic(True)
        _C._set_cudnn_benchmark(False)
        _C._set_deterministic_algorithms(True, warn_only=settings.warn_only)
        _C._set_deterministic_fill_uninitialized_memory(True)
        _C._set_mkldnn_deterministic(True)
        inductor = _inductor_config()
        if inductor is not None:
            inductor.deterministic = True

    def restore(self, state: FlagState) -> None:
        inductor = _inductor_config()
        if inductor is not None:
            # Inductor's config object makes a read (~1.2 µs) dearer than a
            # write (~0.8 µs): write the value back without reading it.
            if state.inductor_deterministic is not None:
                inductor.deterministic = state.inductor_deterministic
            else:
                # First imported inside the block: put back the value it would
                # have had without the block, its declared default.
                inductor.deterministic = _inductor_default(inductor)
        # Only what differs is written: cheap, and it never mixes the legacy
        # and new precision APIs behind the user's back.
        now = self._read(state.inductor_deterministic)
        if now == state:
            return
        if now.cudnn_deterministic != state.cudnn_deterministic:
            _C._set_cudnn_deterministic(state.cudnn_deterministic)
        if now.cudnn_benchmark != state.cudnn_benchmark:
            _C._set_cudnn_benchmark(state.cudnn_benchmark)
        if (now.deterministic_algorithms, now.deterministic_warn_only) != (
            state.deterministic_algorithms,
            state.deterministic_warn_only,
        ):
            _C._set_deterministic_algorithms(
                state.deterministic_algorithms, warn_only=state.deterministic_warn_only
            )
        if now.fill_uninitialized_memory != state.fill_uninitialized_memory:
            _C._set_deterministic_fill_uninitialized_memory(state.fill_uninitialized_memory)
        if now.mkldnn_deterministic != state.mkldnn_deterministic:
            _C._set_mkldnn_deterministic(state.mkldnn_deterministic)
        current = now.fp32_precision
        if (
            state.float32_matmul_precision is not None
            and now.float32_matmul_precision != state.float32_matmul_precision
        ):
            # Drives the matmul entries of fp32_precision: read them again after.
            torch.set_float32_matmul_precision(state.float32_matmul_precision)
            current = _precisions()
        for op, was, is_ in zip(_PRECISION_OPS, state.fp32_precision, current, strict=True):
            if was != is_:
                _C._set_fp32_precision_setter(*op, was)

    def export_state(self, state: FlagState) -> dict[str, Any]:
        """The state as plain data: one entry per field, ``fp32_precision`` as
        ``{"backend.op": value}``, ``inductor_deterministic`` left out if ``None``."""
        out: dict[str, Any] = {f: getattr(state, f) for f in _BOOLS}
        if state.inductor_deterministic is not None:
            out["inductor_deterministic"] = state.inductor_deterministic
        if state.float32_matmul_precision is None:
            raise ValueError(
                "torch cannot report its float32 matmul precision (the legacy allow_tf32 and "
                "the new fp32_precision APIs were mixed), so these flags cannot be saved; "
                "set them through one API only"
            )
        out["float32_matmul_precision"] = state.float32_matmul_precision
        out["fp32_precision"] = dict(zip(_PRECISION_KEYS, state.fp32_precision, strict=True))
        return out

    def import_state(self, data: object, path: str) -> FlagState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The saved ``fp32_precision`` entries must be exactly this torch's: a
        flag that could not be restored is an error, not a skip.
        """
        d = _plain.fields(
            data,
            path,
            [*_BOOLS, "float32_matmul_precision", "fp32_precision"],
            ["inductor_deterministic"],
        )
        precision = _plain.fields(d["fp32_precision"], f"{path}.fp32_precision", _PRECISION_KEYS)

        def flag(name: str) -> bool:
            return _plain.flag(d[name], f"{path}.{name}")

        legacy = _plain.text(
            d["float32_matmul_precision"],
            f"{path}.float32_matmul_precision",
            choices=("highest", "high", "medium"),
        )
        for key in _PRECISION_KEYS:
            value = _plain.text(
                precision[key], f"{path}.fp32_precision.{key}", choices=_FP32_VALUES
            )
            if (key.split(".")[0], value) in _SET_REFUSED:
                raise ValueError(f"{path}.fp32_precision.{key}: torch refuses {value!r} there")
        for backend in ("cuda", "mkldnn"):
            # "none" inherits: the op's value, else the backend's "all", else "generic.all".
            chain = (f"{backend}.matmul", f"{backend}.all", "generic.all")
            effective = next(
                (precision[k] for k in chain if precision.get(k, "none") != "none"), "none"
            )
            if (legacy, backend, effective) in _READ_REFUSED:
                raise ValueError(
                    f"{path}.fp32_precision: torch refuses {backend} matmul precision "
                    f"{effective!r} together with float32_matmul_precision={legacy!r}"
                )
        return FlagState(
            cudnn_deterministic=flag("cudnn_deterministic"),
            cudnn_benchmark=flag("cudnn_benchmark"),
            deterministic_algorithms=flag("deterministic_algorithms"),
            deterministic_warn_only=flag("deterministic_warn_only"),
            fill_uninitialized_memory=flag("fill_uninitialized_memory"),
            mkldnn_deterministic=flag("mkldnn_deterministic"),
            inductor_deterministic=(
                flag("inductor_deterministic") if "inductor_deterministic" in d else None
            ),
            float32_matmul_precision=legacy,
            fp32_precision=tuple(precision[key] for key in _PRECISION_KEYS),
        )


_BOOLS = (
    "cudnn_deterministic",
    "cudnn_benchmark",
    "deterministic_algorithms",
    "deterministic_warn_only",
    "fill_uninitialized_memory",
    "mkldnn_deterministic",
)
_PRECISION_KEYS = tuple(f"{backend}.{op}" for backend, op in _PRECISION_OPS)
_FP32_VALUES = ("none", "ieee", "tf32", "bf16")
#: (backend, value) that torch's setter refuses.
_SET_REFUSED = {("cuda", "bf16")}
#: (float32_matmul_precision, backend, effective matmul precision) that torch
#: sets but then refuses to read back ("mix of the legacy and new APIs",
#: ``Context::float32MatmulPrecision``): restoring one would make every later
#: capture of the flags raise.  A test checks this against the installed torch.
_READ_REFUSED = {
    ("highest", "cuda", "tf32"),
    ("highest", "mkldnn", "tf32"),
    ("medium", "mkldnn", "tf32"),
    ("highest", "mkldnn", "bf16"),
    ("high", "mkldnn", "bf16"),
}
