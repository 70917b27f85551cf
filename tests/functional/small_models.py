"""The small torch models and data the standalone-API functional tests share (``fully_shard`` V1 and
V2, frozen and root-owned parameters): a residual MLP block, a learnable classification rule with
each rank's own reproducible batches, and its loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

WIDTH = 32
CLASSES = 8


class Block(torch.nn.Module):
    """``x + down(gelu(up(x)))``: the unit the tests shard."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def projection_batches(
    rank: int, dtype: torch.dtype = torch.float32
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own reproducible data, a function of the iteration (a resumed run continues): a
    learnable rule, class = argmax of a fixed projection."""
    projection = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(99))

    def batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * rank + iteration)
        x = torch.randn(16, WIDTH, generator=g)
        return x.to(dtype), (x @ projection).argmax(dim=1)

    return batch


def classification_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross entropy in fp32 (a bf16 model's logits too)."""
    x, y = batch
    return F.cross_entropy(model(x).float(), y)
