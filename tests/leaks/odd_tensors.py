"""Tensors the leak tools meet in a heap or in ``gc.garbage`` and must survive."""

from __future__ import annotations

import torch


class UnreadableGradFn(torch.Tensor):
    """A tensor whose ``grad_fn`` read raises as an undefined tensor's does: a tensor object the gc cleared in a
    cycle it could not free yet (a full-suite CI run met one in a heap scan on torch 2.5.1; the leak tools read
    ``grad_fn`` through ``ppbackward.leaks._storage.grad_fn_or_none``)."""

    @property
    def grad_fn(self):
        raise RuntimeError("cannot call get_autograd_meta() on undefined tensor")


class DeclinesStorageReads(torch.Tensor):
    """A subclass whose ``__torch_function__`` returns ``NotImplemented`` for the reads the leak tools make to count
    bytes (``layout``, ``is_meta``, ``untyped_storage``), as the protocol lets it for what it does not handle: Python
    then raises ``TypeError`` on the read."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.layout.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.untyped_storage):
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})
