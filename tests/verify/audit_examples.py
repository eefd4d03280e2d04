"""The examples of the audit's op table, by the entry's key: each builds its tensors on a
device ``d`` and runs its entry's case.  ``test_audit.py`` checks that every entry has one,
runs each through the audit on the CPU, and under deterministic mode on a real CUDA device
to check the entry's behaviour.  They live with the tests, which are their only users."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["EXAMPLES"]


def _grad_of(
    forward: Callable[[torch.Tensor], torch.Tensor], *shape: int
) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        x = torch.randn(*shape, device=d, requires_grad=True)
        out = forward(x)
        (grad,) = torch.autograd.grad(out, x, torch.randn_like(out))
        return grad

    return example


def _ex_index_add(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, 16, device=d).index_add_(0, index, torch.randn(4096, 16, device=d))


def _ex_index_put(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).index_put_((index,), torch.randn(4096, device=d))


def _ex_put(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).put_(index, torch.randn(4096, device=d))


def _ex_put_accumulate(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).put_(index, torch.randn(4096, device=d), accumulate=True)


def _ex_scatter_add(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).scatter_add_(0, index, torch.randn(4096, device=d))


def _ex_scatter_reduce(reduce: str) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        index = torch.randint(0, 4, (4096,), device=d)
        src = torch.rand(4096, device=d) + 0.5
        return torch.ones(4, device=d).scatter_reduce(0, index, src, reduce=reduce)

    return example


def _ex_scatter_reduce_signed_zeros(d: torch.device) -> Any:
    # 0.0 and -0.0 compare equal: which one an atomic maximum keeps depends on the order.
    index = torch.randint(0, 4, (1 << 16,), device=d)
    src = torch.where(torch.rand(1 << 16, device=d) < 0.5, 0.0, -0.0)
    return torch.zeros(4, device=d).scatter_reduce(0, index, src, "amax", include_self=False)


def _ex_scatter(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).scatter_(0, index, torch.randn(4096, device=d))


def _ex_scatter_old_reduce(reduce: str) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        index = torch.randint(0, 4, (4096,), device=d)
        # Factors near 1, so that a product of ~1000 of them neither overflows nor vanishes.
        src = 1 + torch.randn(4096, device=d) / 100
        with warnings.catch_warnings():  # torch's deprecation of reduce=, not the point here
            warnings.filterwarnings("ignore", message="The reduce argument of torch.scatter")
            return torch.ones(4, device=d).scatter_(0, index, src, reduce=reduce)

    return example


def _ex_index_reduce(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    src = 1 + torch.randn(4096, 8, device=d) / 100
    with warnings.catch_warnings():  # "index_reduce() is in beta": not the point here
        # Only that one: a bare "index_reduce" would also swallow deterministic mode's
        # warning, "index_reduce_cuda does not have a deterministic implementation".
        warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
        return torch.ones(4, 8, device=d).index_reduce_(0, index, src, "prod")


def _ex_index_copy(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, 8, device=d).index_copy_(0, index, torch.randn(4096, 8, device=d))


def _ex_bmm_sparse(d: torch.device) -> Any:
    sparse = (torch.rand(2, 64, 64, device=d) > 0.5).float().to_sparse()
    return torch.bmm(sparse, torch.randn(2, 64, 64, device=d))


def _ex_cumsum(d: torch.device) -> Any:
    return torch.randn(4096, device=d).cumsum(0)


def _ex_histc(d: torch.device) -> Any:
    return torch.rand(4096, device=d).histc(bins=10, min=0, max=1)


def _ex_bincount(d: torch.device) -> Any:
    return torch.bincount(
        torch.randint(0, 8, (4096,), device=d), weights=torch.rand(4096, device=d)
    )


def _ex_median(d: torch.device) -> Any:
    return torch.randn(8, 64, device=d).median(1)


def _ex_nll_loss2d(d: torch.device) -> Any:
    target = torch.randint(0, 3, (2, 8, 8), device=d)
    return F.nll_loss(torch.randn(2, 3, 8, 8, device=d).log_softmax(1), target)


def _ex_ctc_loss(d: torch.device) -> Any:
    log_probs = torch.randn(20, 2, 6, device=d).log_softmax(2).detach().requires_grad_()
    targets = torch.randint(1, 6, (2, 5), device=d)
    lengths = torch.tensor([20, 20], device=d), torch.tensor([5, 4], device=d)
    loss = F.ctc_loss(log_probs, targets, *lengths)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return grad


def _ex_embedding_bag_max(d: torch.device) -> Any:
    weight = torch.randn(10, 4, device=d, requires_grad=True)
    out = F.embedding_bag(torch.randint(0, 10, (8, 3), device=d), weight, mode="max")
    (grad,) = torch.autograd.grad(out, weight, torch.randn_like(out))
    return grad


def _ex_max_unpool(d: torch.device) -> Any:
    values = torch.randn(1, 1, 8, 8, device=d)
    indices = torch.zeros(1, 1, 8, 8, dtype=torch.long, device=d)  # all on one place
    return F.max_unpool2d(values, indices, (2, 2), output_size=(16, 16))


def _ex_resize_quantized(d: torch.device) -> Any:
    # Quantized tensors live on the CPU; the check runs wherever the example is run.
    q = torch.quantize_per_tensor(torch.rand(4), 0.1, 10, torch.quint8)
    return tuple(q.resize_((8,)).shape)


def _ex_sdpa(dropout_p: float) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        dtype = torch.float16 if d.type == "cuda" else torch.float32
        q, k, v = (
            torch.randn(2, 4, 128, 64, device=d, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    return example


def _ex_multi_head_attention(d: torch.device) -> Any:
    attention = torch.nn.MultiheadAttention(64, 4, dropout=0.25, batch_first=True, device=d)
    x = torch.randn(2, 128, 64, device=d, requires_grad=True)
    out = attention(x, x, x, need_weights=False)[0]
    return torch.autograd.grad(out, [x, *attention.parameters()], torch.randn_like(out))


def _ex_uninitialized(d: torch.device) -> Any:
    return torch.empty(16, device=d) + 1


#: One example per entry of the table, by the entry's key.
EXAMPLES: Mapping[str, Callable[[torch.device], Any]] = {
    "index_add": _ex_index_add,
    "index_put": _ex_index_put,
    "put": _ex_put,
    "put-accumulate": _ex_put_accumulate,
    "scatter_add": _ex_scatter_add,
    "scatter_reduce-sum": _ex_scatter_reduce("sum"),
    "scatter_reduce-prod": _ex_scatter_reduce("prod"),
    "scatter_reduce-amax": _ex_scatter_reduce_signed_zeros,
    "index_reduce": _ex_index_reduce,
    "scatter-add": _ex_scatter_old_reduce("add"),
    "scatter-multiply": _ex_scatter_old_reduce("multiply"),
    "scatter": _ex_scatter,
    "index_copy": _ex_index_copy,
    "bmm-sparse": _ex_bmm_sparse,
    "cumsum": _ex_cumsum,
    "histc": _ex_histc,
    "bincount-weights": _ex_bincount,
    "median-indices": _ex_median,
    "nll_loss2d": _ex_nll_loss2d,
    "ctc_loss": _ex_ctc_loss,
    "embedding_bag-max": _ex_embedding_bag_max,
    "avg_pool3d": _grad_of(lambda x: F.avg_pool3d(x, 3, stride=2), 2, 3, 9, 9, 9),
    "adaptive_avg_pool2d": _grad_of(lambda x: F.adaptive_avg_pool2d(x, 3), 2, 3, 8, 8),
    "adaptive_avg_pool3d": _grad_of(lambda x: F.adaptive_avg_pool3d(x, 3), 2, 3, 8, 8, 8),
    "adaptive_max_pool2d": _grad_of(lambda x: F.adaptive_max_pool2d(x, 3), 2, 3, 8, 8),
    "adaptive_max_pool3d": _grad_of(lambda x: F.adaptive_max_pool3d(x, 3), 2, 3, 8, 8, 8),
    "fractional_max_pool": _grad_of(
        lambda x: F.fractional_max_pool2d(x, 2, output_ratio=(0.5, 0.5)), 2, 3, 8, 8
    ),
    "max_unpool": _ex_max_unpool,
    "max_pool3d-F.max_pool3d": _grad_of(
        lambda x: F.max_pool3d(x, 3, stride=2, return_indices=True)[0], 2, 3, 9, 9, 9
    ),
    "max_pool3d": _grad_of(lambda x: F.max_pool3d(x, 3, stride=2), 2, 3, 9, 9, 9),
    "reflection_pad2d": _grad_of(lambda x: F.pad(x, (2, 3, 2, 3), mode="reflect"), 2, 3, 8, 8),
    "reflection_pad": _grad_of(lambda x: F.pad(x, (2, 3), mode="reflect"), 2, 3, 8),
    "replication_pad-F.pad": _grad_of(
        lambda x: F.pad(x, (2, 3, 2, 3), mode="replicate"), 2, 3, 8, 8
    ),
    "replication_pad": _grad_of(
        lambda x: torch.ops.aten.replication_pad2d(x, [2, 3, 2, 3]), 2, 3, 8, 8
    ),
    "upsample-F.interpolate": _grad_of(
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
        2,
        3,
        8,
        8,
    ),
    "upsample": _grad_of(
        lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False),
        2,
        3,
        8,
        8,
    ),
    "grid_sample": _grad_of(
        lambda x: F.grid_sample(
            x, torch.rand(2, 8, 8, 2, device=x.device) * 2 - 1, align_corners=False
        ),
        2,
        3,
        8,
        8,
    ),
    "convolution": _grad_of(
        lambda x: F.conv2d(x, torch.randn(8, 3, 3, 3, device=x.device)), 4, 3, 32, 32
    ),
    "scaled_dot_product_attention": _ex_sdpa(0.0),
    "scaled_dot_product_attention-math": _ex_sdpa(0.25),
    "multi_head_attention-math": _ex_multi_head_attention,
    "resize-quantized": _ex_resize_quantized,
    "uninitialized": _ex_uninitialized,
}
