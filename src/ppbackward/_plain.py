"""Probes of torch's autograd (the node types ppbackward matches, per-process behaviour checks), run as plain eager
autograd whatever the caller's context.

Note [probes run in plain autograd]: ppbackward's modules are imported when a public name is first read (Note [lazy
package] in ``ppbackward/__init__.py``), so a module-level probe can run inside the caller's context: under
``torch.no_grad()`` or inference mode its ops record no ``grad_fn`` (importing ``ppbackward.backward`` there raised
``AttributeError``), and under a ``TorchFunctionMode`` an op can come back wrapped (``view_as`` as a view of the
mode's own: the ``AccumulateGrad`` type read wrong, every weight then missed and W gave none a gradient, silently).
:func:`plain_autograd` turns grad mode on and inference mode and ``__torch_function__`` (subclass overrides and
modes) off for the probe's ops. A ``TorchDispatchMode`` active at import is not undone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["plain_autograd"]  # private module


@contextlib.contextmanager
def plain_autograd() -> Iterator[None]:
    """Grad mode on, inference mode off, ``__torch_function__`` off, for a probe's torch ops (Note [probes run in
    plain autograd])."""
    with torch.inference_mode(False), torch.enable_grad(), torch._C.DisableTorchFunction():
        yield
