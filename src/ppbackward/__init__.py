"""ppbackward: a leak-free, exact, hook-faithful stage backward for torch pipeline parallelism.

Public surface (see ``docs/api.md``):

* :func:`stage_backward`, :func:`stage_backward_input`, :func:`stage_backward_weight` — drop-in
  replacements of the functions of the same names in ``torch.distributed.pipelining._backward``;
* :func:`install`, :func:`uninstall`, :func:`is_installed`, :func:`installed` — swap them into torch;
  :func:`active_adapter` — which adapter :func:`install` chose; :func:`merge_bw_enabled` — whether
  schedules built now merge a B with the W that directly follows it (``install(merge_bw=True)``);
* :class:`ParamGroups` — the B→W hand-off (groups read like torch's dicts); :class:`StageBackwardError` — a bad call (a
  ``RuntimeError``, and a ``ValueError`` or ``TypeError``); :class:`UnsupportedTorchError`;
  :class:`UntestedTorchWarning` (``install(allow_untested=True)`` on a torch newer than the newest known);
* ``ppbackward.leaks`` — the tensor-leak checker and activation-lifetime tracker.
"""

from ppbackward._compat import SUPPORTED_TORCH, UnsupportedTorchError, UntestedTorchWarning
from ppbackward._errors import StageBackwardError
from ppbackward._handoff import ParamGroups
from ppbackward._install import active_adapter, install, installed, is_installed, merge_bw_enabled, uninstall
from ppbackward.backward import stage_backward, stage_backward_input, stage_backward_weight

__version__ = "0.3.0.dev0"

__all__ = [
    "SUPPORTED_TORCH",
    "ParamGroups",
    "StageBackwardError",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "active_adapter",
    "install",
    "installed",
    "is_installed",
    "merge_bw_enabled",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "uninstall",
]
