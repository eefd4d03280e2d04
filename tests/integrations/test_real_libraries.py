"""Real libraries inside blocks: Lightning and transformers leave nothing behind.

Seeding functions of other libraries keep state outside the RNGs: Lightning's ``seed_everything``
exports ``PL_GLOBAL_SEED`` / ``PL_SEED_WORKERS`` (a later ``seed_everything()`` or DDP
``reset_seed()`` reuses the seed, and every later ``Trainer`` adds its worker init function), and
transformers' ``enable_full_determinism`` sets ``CUDA_LAUNCH_BLOCKING``,
``FLASH_ATTENTION_DETERMINISTIC``, ``HCCL_DETERMINISTIC``, ``ASCEND_LAUNCH_BLOCKING`` and
``CUBLAS_WORKSPACE_CONFIG``.  Each test runs the real thing inside a block and checks that the
whole environment, every RNG and every flag (through the independent oracle of
``tests/_oracle.py``) are exactly as before.

Each test skips only where its library is not installed (``pip install -e ".[test]"`` installs
both).  Neither needs torchvision, which has no CPU build here: nothing below imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deterministic_ctx import deterministic, managed_env_vars
from tests._oracle import World

SKIP_LIGHTNING = "Lightning is not installed (pip install -e '.[test]' installs it)"
SKIP_TRANSFORMERS = "transformers is not installed (pip install -e '.[test]' installs it)"

# Lightning's notes about workers, logging and hardware are not what these tests check.
# Slow: importing Lightning or transformers alone takes seconds.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _import(name: str, reason: str) -> Any:
    """The library, with the one-time side effects of first imports done, in a block.

    An import cannot be undone, and two first imports leave traces no block should restore: a
    dependency of Lightning draws from ``random`` while it is imported, and the first
    ``torch.use_deterministic_algorithms()`` call imports ``torch._inductor``, which records its
    cache directory in ``TORCHINDUCTOR_CACHE_DIR``.  Done here, so that only what the tests do
    is under test.
    """
    with deterministic(seed=0):
        module = pytest.importorskip(name, reason=reason)
        torch.use_deterministic_algorithms(True)  # the block puts the flag back
    return module


@pytest.fixture
def lightning() -> Any:
    return _import("lightning", SKIP_LIGHTNING)


@pytest.fixture
def transformers(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a model built from a config: never a download
    return _import("transformers", SKIP_TRANSFORMERS)


def run_and_compare(body: Callable[[], Any], *, seed: int = 0) -> Any:
    """Run ``body`` in a block; assert the environment, RNGs and flags are as before."""
    env, world = dict(os.environ), World.now()
    with deterministic(seed=seed):
        result = body()
    assert dict(os.environ) == env, _env_diff(env, dict(os.environ))
    assert not world.diff(World.now()), f"leaked: {world.diff(World.now())}"
    return result


def _env_diff(before: dict[str, str], after: dict[str, str]) -> str:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return "changed: " + ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in changed)


def seeding_vars_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from a process that has not seeded through these libraries yet."""
    for name in managed_env_vars()[2:]:
        monkeypatch.delenv(name, raising=False)


# --- Lightning --------------------------------------------------------------------------------------


def test_lightning_seed_everything_leaves_no_env_var_or_rng_behind(lightning, monkeypatch):
    seeding_vars_unset(monkeypatch)

    def body() -> dict[str, str | None]:
        lightning.seed_everything(123, workers=True, verbose=False)
        torch.rand(3)
        return {n: os.environ.get(n) for n in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}

    inside = run_and_compare(body)
    assert inside == {"PL_GLOBAL_SEED": "123", "PL_SEED_WORKERS": "1"}  # it did export them
    assert "PL_GLOBAL_SEED" not in os.environ and "PL_SEED_WORKERS" not in os.environ


def test_lightning_seed_of_an_outer_run_survives_a_block(lightning, monkeypatch):
    # A program seeded with Lightning at the top keeps its seed for DDP's reset_seed().
    seeding_vars_unset(monkeypatch)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    run_and_compare(lambda: lightning.seed_everything(123, workers=True, verbose=False))
    assert os.environ["PL_GLOBAL_SEED"] == "7" and os.environ["PL_SEED_WORKERS"] == "0"


def _fit(lightning: Any, root: Any) -> list[float]:
    """Build and train a tiny model with a deterministic Trainer; the per-step losses."""
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            x, y = torch.randn(32, 4), torch.randn(32, 1)
            return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)

    lightning.seed_everything(123, workers=True, verbose=False)
    model = Tiny()
    trainer = lightning.Trainer(
        deterministic=True,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        accelerator="cpu",
    )
    trainer.fit(model)
    return model.losses


def test_lightning_trainer_fit_leaves_nothing_behind_and_repeats(lightning, monkeypatch, tmp_path):
    seeding_vars_unset(monkeypatch)
    first = run_and_compare(lambda: _fit(lightning, tmp_path / "a"))
    second = run_and_compare(lambda: _fit(lightning, tmp_path / "b"))
    assert len(first) == 4
    assert first == second  # bit for bit, every step


# --- transformers -----------------------------------------------------------------------------------

FULL_DETERMINISM = (
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "ASCEND_LAUNCH_BLOCKING",
    "HCCL_DETERMINISTIC",
    "FLASH_ATTENTION_DETERMINISTIC",
)


@pytest.mark.parametrize("deterministic_algorithms", [False, True])
def test_transformers_set_seed_leaves_nothing_behind(
    transformers, monkeypatch, deterministic_algorithms
):
    seeding_vars_unset(monkeypatch)

    def body() -> list[float]:
        transformers.set_seed(42, deterministic=deterministic_algorithms)
        return torch.rand(3).tolist()

    assert run_and_compare(body) == run_and_compare(body)


@pytest.mark.parametrize("outer", [None, "0"], ids=["unset-before", "set-before"])
def test_transformers_enable_full_determinism_leaves_no_env_var_behind(
    transformers, monkeypatch, outer
):
    seeding_vars_unset(monkeypatch)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    if outer is not None:
        for name in FULL_DETERMINISM[:1] + FULL_DETERMINISM[2:]:
            monkeypatch.setenv(name, outer)

    def body() -> dict[str, str | None]:
        transformers.enable_full_determinism(42)
        assert torch.are_deterministic_algorithms_enabled()
        return {name: os.environ.get(name) for name in FULL_DETERMINISM}

    inside = run_and_compare(body)
    assert inside == {**dict.fromkeys(FULL_DETERMINISM, "1"), "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert {name: os.environ.get(name) for name in FULL_DETERMINISM} == {
        **dict.fromkeys(FULL_DETERMINISM, outer),
        "CUBLAS_WORKSPACE_CONFIG": None,
    }


def _bert_step(transformers: Any, seed: int) -> tuple[list[float], float]:
    """A tiny BERT built from a config (no download), one forward and backward pass."""
    transformers.enable_full_determinism(seed)  # seeds like set_seed(seed), inside the block
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
    )
    model = transformers.BertModel(config)
    model.train()  # dropout draws from the seeded generator
    input_ids = torch.randint(0, 50, (2, 6))
    out = model(input_ids=input_ids).last_hidden_state
    loss = out.square().mean()
    loss.backward()
    grad = model.embeddings.word_embeddings.weight.grad
    assert grad is not None
    return out.flatten().tolist(), float(grad.abs().sum())


def test_transformers_tiny_model_leaves_nothing_behind_and_repeats(transformers, monkeypatch):
    seeding_vars_unset(monkeypatch)
    first = run_and_compare(lambda: _bert_step(transformers, 3))
    second = run_and_compare(lambda: _bert_step(transformers, 3))
    assert first == second
    other = run_and_compare(lambda: _bert_step(transformers, 4))
    assert other != first  # the seed decides the weights and the dropout
