"""Shared helpers for the core tests: output gradients, plain-autograd reference, comparisons."""

from __future__ import annotations

import copy

import torch

# Split B/W sums the same contributions as a full backward but possibly in another order; in
# float64 the difference is at most a few ulps. Stated once, used everywhere.
ATOL = 1e-12
RTOL = 1e-10


def output_grads(out, seed: int = 100):
    """A gradient structure matching ``out``: random tensors for differentiable leaves, else None."""
    g = torch.Generator().manual_seed(seed)

    def walk(o):
        if isinstance(o, torch.Tensor):
            if o.requires_grad or o.grad_fn is not None:
                return torch.randn(o.shape, generator=g, dtype=o.dtype)
            return None
        if isinstance(o, (tuple, list)):
            return type(o)(walk(v) for v in o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        return None

    return walk(out)


def flat_pairs(out, grads):
    """Differentiable (output, grad) pairs in a fixed order, for the plain-autograd reference."""
    if isinstance(out, torch.Tensor):
        if out.requires_grad or out.grad_fn is not None:
            return [(out, grads)]
        return []
    if isinstance(out, (tuple, list)):
        return [p for o, g in zip(out, grads) for p in flat_pairs(o, g)]
    if isinstance(out, dict):
        return [p for k in out for p in flat_pairs(out[k], grads[k])]
    return []


def clone_inputs(inputs):
    return [
        v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
        for v in inputs
    ]


def reference(module, inputs_per_mb, seed=100):
    """Plain ``torch.autograd.backward`` on a deepcopy: (input grads per microbatch, param grads)."""
    ref = copy.deepcopy(module)
    in_grads = []
    for k, inputs in enumerate(inputs_per_mb):
        xs = clone_inputs(inputs)
        out = ref(*xs)
        pairs = flat_pairs(out, output_grads(out, seed + k))
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads.append(
            [
                (v.grad if v.requires_grad and v.is_floating_point() else None)
                if isinstance(v, torch.Tensor)
                else None
                for v in xs
            ]
        )
    return in_grads, {n: p.grad for n, p in ref.named_parameters()}


def assert_grads_equal(actual, expected, what):
    if expected is None:
        assert actual is None, f"{what}: expected no gradient, got {type(actual)}"
        return
    assert actual is not None, f"{what}: gradient missing"
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_param_grads(module, expected, what):
    for name, p in module.named_parameters():
        assert_grads_equal(p.grad, expected[name], f"{what}: {name}.grad")
