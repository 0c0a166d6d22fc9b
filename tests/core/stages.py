"""A zoo of small stage modules covering the graph shapes ppbackward must be exact on.

Each entry builds ``(module, make_inputs)``: ``make_inputs(seed)`` returns the stage's input values
(tensors and non-tensors, fresh leaves each call). Outputs may be tensors, tuples or dicts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DTYPE = torch.float64


class Scale(torch.autograd.Function):
    """``x * w`` as a custom Function: an intermediate with an edge into a weight."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Double(torch.autograd.Function):
    """``2 * v`` as a custom Function: applied to a weight alone, it is a weight-only node."""

    @staticmethod
    def forward(ctx, v):
        return v * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def make_mul_function() -> type[torch.autograd.Function]:
    """A new custom Function class per call (:class:`Scale`'s ``x * w``), as a closure or a recompile makes
    one: its backward class dies with it."""
    return type("Scale", (Scale,), {})


def _x(seed: int, *shape: int, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DTYPE).requires_grad_(requires_grad)


class KeepsInputOnCtx(torch.autograd.Function):
    """``x * w`` that saves nothing through ``save_for_backward`` (it keeps ``x`` on ``ctx``): its backward can
    run again after B, which released nothing of it (a write into its ``"grads"`` entry runs it again)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x = x.detach()
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g, (g * ctx.x).sum(0)


class MLP(nn.Module):
    def __init__(self, d: int = 6, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SharedLate(nn.Module):
    """One weight used by three ops, including twice on one path; registered after its users."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.shared = nn.Parameter(torch.randn(5, 5))  # registered last, used first

    def forward(self, x):
        h = x @ self.shared
        h = self.a(torch.relu(h)) @ self.shared  # used twice on one path
        return self.b(h) + (self.shared * 0.5).sum()


class MultiOutputNodes(nn.Module):
    """chunk / split / unbind: nodes with several outputs, some outputs unused."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(3, 4)
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.l1(x) * self.w
        a, b = h.chunk(2, dim=-1)
        p, q, _unused = h.split([2, 2, 2], dim=-1)
        rows = h.unbind(0)
        return (self.l2(a) + self.l2(b), p * q, rows[0] * rows[-1])


class ViewOutputs(nn.Module):
    """Outputs that are views (cannot be detached in place, pytorch/pytorch#142229)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 8)

    def forward(self, x):
        h = self.l(x)
        return h.view(-1, 2, 4)[:, 0], h.t()


class WeightOnlyPaths(nn.Module):
    """Outputs depending on weights through paths that never pass the input; one ignores it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.bias_net = nn.Linear(3, 4)
        self.seed = nn.Parameter(torch.randn(2, 3))
        self.alone = nn.Parameter(torch.randn(4))

    def forward(self, x):
        offset = self.bias_net(self.seed).sum(0)  # weight-only subgraph
        y = self.l(x) + offset
        z = torch.tanh(self.alone) * 2.0  # output ignoring the input
        return {"y": y, "z": z, "meta": "not-a-tensor"}


class MixedInputs(nn.Module):
    """Non-tensor inputs, inputs not requiring grad, an integer tensor, an unused input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.l = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x, ids, scale, mask, unused):
        h = self.l(x) + self.emb(ids).sum(1) * scale
        return self.frozen(h) * mask


class Checkpointed(nn.Module):
    """Non-reentrant activation checkpointing inside the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MLP(6, 2)
        self.out = nn.Linear(6, 6)

    def forward(self, x):
        h = checkpoint(self.inner, x, use_reentrant=False)
        return self.out(h)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=DTYPE)
        second = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=DTYPE)
        self.blocks = nn.ModuleList([layer, second])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class OutputFeedsAnotherOp(nn.Module):
    """An output that a later op of the stage saved (must not be detached in place after B)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.v = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w
        return h, h @ self.v


class Norms(nn.Module):
    """Linear layers between LayerNorms (affine weight and bias) or RMSNorms (weight): norm weight
    gradients are computed in B (Note [cheap weight gradients in B])."""

    def __init__(self, norm: type = nn.LayerNorm, d: int = 6, layers: int = 2) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norms = nn.ModuleList(norm(d) for _ in range(layers))

    def forward(self, x):
        for lin, norm in zip(self.lins, self.norms):
            x = x + lin(norm(x))
        return x


class Matmul(torch.autograd.Function):
    """``a @ b`` as a custom Function that saves both operands (W runs it again only from written grads)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g @ b.t() if ctx.needs_input_grad[0] else None), (a.t() @ g if ctx.needs_input_grad[1] else None)


class _LinearFn(torch.autograd.Function):
    """A fused linear as Megatron-style code writes it: one backward computing all three gradients."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        return g @ w, g2.t() @ x.reshape(-1, x.shape[-1]), g2.sum(0)


class CustomLinear(nn.Module):
    """A custom ``autograd.Function`` linear between norms: its backward runs once (in B)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.b = nn.Parameter(torch.randn(d))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return self.out(torch.relu(_LinearFn.apply(self.norm(x), self.w, self.b)))


class MoE(nn.Module):
    """MoE-style routing: a router picks the top-1 expert per token (data-dependent), tokens are
    gathered per expert, scaled by their router weight and scattered back."""

    def __init__(self, d: int = 6, experts: int = 3) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts)
        )

    def forward(self, x):
        h = self.norm(x).reshape(-1, x.shape[-1])
        weight, choice = torch.softmax(self.router(h), -1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]) * weight[idx, None])
        return x + out.reshape(x.shape)


class Tied(nn.Module):
    """One projection used at two depths and one LayerNorm applied twice (tied weights)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mid = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(self.norm(x))
        h = self.mid(torch.tanh(h))
        return self.proj(self.norm(h))


class LoRA(nn.Module):
    """Frozen base projections with trainable low-rank adapters and a trainable norm."""

    def __init__(self, d: int = 6, rank: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.a = nn.Linear(d, rank, bias=False)
        self.b = nn.Linear(rank, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.base(h) + self.b(self.a(h)) * 0.5


def _plain(seed: int, *shape: int):
    return [_x(seed, *shape)]


ZOO = {
    "mlp": (lambda: MLP(), lambda s: _plain(s, 3, 6)),
    "shared_late": (SharedLate, lambda s: _plain(s, 2, 5)),
    "multi_output_nodes": (MultiOutputNodes, lambda s: _plain(s, 3, 6)),
    "view_outputs": (ViewOutputs, lambda s: _plain(s, 4, 4)),
    "weight_only_paths": (WeightOnlyPaths, lambda s: _plain(s, 3, 4)),
    "mixed_inputs": (
        MixedInputs,
        lambda s: [
            _x(s, 2, 4),
            torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(s)),
            0.5,
            _x(s + 1, 2, 4, requires_grad=False),
            _x(s + 2, 2, 2),
        ],
    ),
    "output_feeds_another_op": (OutputFeedsAnotherOp, lambda s: _plain(s, 3, 4)),
    "checkpointed": (Checkpointed, lambda s: _plain(s, 3, 6)),
    "transformer": (Transformer, lambda s: _plain(s, 2, 3, 8)),
    "input_not_requiring_grad": (
        lambda: MLP(4, 2),
        lambda s: [_x(s, 2, 4, requires_grad=False)],
    ),
    "layer_norms": (Norms, lambda s: _plain(s, 2, 3, 6)),
    "rms_norms": (lambda: Norms(nn.RMSNorm), lambda s: _plain(s, 2, 3, 6)),
    "custom_linear": (CustomLinear, lambda s: _plain(s, 2, 3, 6)),
    "moe_routing": (MoE, lambda s: _plain(s, 2, 4, 6)),
    "tied": (Tied, lambda s: _plain(s, 3, 6)),
    "lora": (LoRA, lambda s: _plain(s, 3, 6)),
}


def build(name: str) -> tuple[nn.Module, Callable[..., tuple]]:
    make_module, make_inputs = ZOO[name]
    torch.manual_seed(0)
    module = make_module().to(DTYPE)
    return module, make_inputs
