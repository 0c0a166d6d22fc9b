"""Probes of torch's autograd (the node types ppbackward matches, per-process behaviour checks) and the tensors
ppbackward keeps for the life of the process, made as plain eager autograd whatever the caller's context.

Note [probes run in plain autograd]: ppbackward's modules are imported when a public name is first read (Note [lazy
package] in ``ppbackward/__init__.py``), so a module-level probe can run inside the caller's context: under
``torch.no_grad()`` or inference mode its ops record no ``grad_fn`` (importing ``ppbackward.backward`` there raised
``AttributeError``); under a ``TorchFunctionMode`` an op can come back wrapped (``view_as`` as a view of the mode's
own: the ``AccumulateGrad`` type read wrong, every weight then missed and W gave none a gradient, silently); the
caller's saved-tensor pack hooks (an offloader, a strict checker) were handed the probes' tensors; and W's anchors,
made at the first W on a device and kept (Note [W's anchor runs no kernel] in ``ppbackward._weight_edges``), kept a
mode's subclass or a ``FakeTensorMode``'s tensor, and with it the mode, for good. :func:`plain_autograd` turns grad
mode on, inference mode and ``__torch_function__`` (subclass overrides and modes) off, and hands the probe's saved
tensors to a pack hook of its own (a detached alias: no cycle), for the ops inside. Under
``torch.autograd.graph.disable_saved_tensors_hooks`` no hook is pushed (none may be), and a probe that saves a tensor
raises there as any op of the caller's would. A ``TorchDispatchMode`` still sees a probe's ops (a kernel counter
counts them: they run); the tensors kept for good are made with the dispatch modes off (:func:`kept_tensors`: a
counter does not see those two one-element ops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["hooks_enabled", "kept_tensors", "plain_autograd"]  # private module


def hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed here (not under ``disable_saved_tensors_hooks``)."""
    check = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if check is None else bool(check())


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _as_saved(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def plain_autograd() -> Iterator[None]:
    """Grad mode on; inference mode, ``__torch_function__`` and the caller's saved-tensor hooks off; for
    ppbackward's own torch ops (Note [probes run in plain autograd])."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch._C.DisableTorchFunction())
        if hooks_enabled():
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_detached, _as_saved))
        yield


@contextlib.contextmanager
def kept_tensors() -> Iterator[None]:
    """:func:`plain_autograd` with grad mode off and the ``TorchDispatchMode`` stack set aside, for tensors ppbackward
    keeps for the life of the process (a ``FakeTensorMode`` would make them fake, and be kept with them)."""
    with plain_autograd(), torch.no_grad(), _disable_current_modes():
        yield
