"""Find the layer that makes a training step nondeterministic.

Run:  python examples/find_divergence.py

A small 6-block model hides one activation that adds noise from its own
``torch.Generator``: a private stream that no seeding recipe reaches (the same
happens with a third-party layer that keeps its own generator, or with a
nondeterministic CUDA kernel).  Dropout, which draws from torch's global
generator, is fine.  ``assert_reproducible`` shows the training step is not
reproducible; ``locate_divergence`` names the layer; registering its
generator with ``register_rng`` fixes it.
"""

from __future__ import annotations

import torch
from torch import nn

from deterministic_ctx import (
    NotReproducibleError,
    assert_reproducible,
    locate_divergence,
    register_rng,
    unregister_rng,
)


class NoisyGELU(nn.Module):
    """GELU plus a little noise from the layer's own generator: the planted bug."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.generator, device=x.device)
        return nn.functional.gelu(x) + 1e-4 * noise


class Block(nn.Module):
    def __init__(self, width: int, act: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.act = act
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.act(self.linear(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6, noisy_block: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            Block(width, NoisyGELU() if i == noisy_block else nn.GELU()) for i in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 8), torch.randn(128, 1)

    def train_step() -> float:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    # The step changes the model and the optimizer: reset= puts both back before every run
    # (and after the last), so each run starts from the same weights.
    state = [model, opt]

    # 1. Is one training step reproducible?
    try:
        assert_reproducible(train_step, reset=state)
    except NotReproducibleError as err:
        print("assert_reproducible:", str(err).splitlines()[0])
        print()

    # 2. Where do two runs first differ?
    report = locate_divergence(train_step, reset=state, backward=True)
    print(report)
    print()
    assert report.divergence is not None
    assert report.divergence.module == "blocks.3.act"

    # 3. The fix: put the layer's private generator under the blocks' control.
    generator = register_rng(model.blocks[3].act.generator, key="blocks.3.act")
    try:
        report = locate_divergence(train_step, reset=state, backward=True)
        print("after register_rng:", report)
        assert report.agree
        assert_reproducible(train_step, reset=state, runs=3)
        print("assert_reproducible: the training step is reproducible")
    finally:
        unregister_rng(generator)


if __name__ == "__main__":
    main()
