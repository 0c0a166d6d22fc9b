"""Leak hunting for autograd pipelines: a tensor-leak checker and an activation-lifetime tracker.

Public surface (see ``docs/leak-hunting.md``):

* :func:`check_tensor_leaks` -- a context manager that fails (:class:`TensorLeakError`) when a block
  leaves tensors or autograd nodes in reference cycles; reports counts, bytes and back-reference
  chains in a :class:`LeakReport`. Fixes the faults of torch's ``check_leaked_tensors`` test helper.
* :func:`track_activations` -- a context manager (:class:`ActivationTracker`) recording every tensor
  autograd saves, keeping none alive; its :class:`ActivationReport` tells which
  :class:`SavedActivation` s are alive, freed only by gc, or held after gc.
* The pytest plugin ``ppbackward.pytest_plugin`` (marker ``no_tensor_leaks``, fixture
  ``tensor_leak_check``) is registered through the ``pytest11`` entry point.

Everything else in this package is private.
"""

from ppbackward.leaks._activations import ActivationReport, SavedActivation
from ppbackward.leaks._checker import check_tensor_leaks
from ppbackward.leaks._lifetime import ActivationTracker, track_activations
from ppbackward.leaks._report import LeakReport, TensorLeakError

__all__ = [
    "ActivationReport",
    "ActivationTracker",
    "LeakReport",
    "SavedActivation",
    "TensorLeakError",
    "check_tensor_leaks",
    "track_activations",
]
