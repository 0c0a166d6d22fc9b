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

Note [lazy package]: ``import ppbackward`` imports nothing but this file; each public name is imported from its
module when first read (``ppbackward.install``, ``from ppbackward import install``: PEP 562's module
``__getattr__``), and then kept here as an ordinary attribute. So what only needs the package (the pytest plugin,
which pytest loads in every run wherever ppbackward is installed; ``python -m ppbackward.run``'s usage errors;
``__version__``) does not import torch (about 2 s) or torch._dynamo (about 1.5 s more). Nor are the submodules
imported with the package: ``ppbackward.backward`` is there once something imported it (a public function read, or
``import ppbackward.backward``). The module ``__getattr__`` exists at run time only, so that type checkers still
refuse a misspelt name.
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
from typing import TYPE_CHECKING

__version__ = "0.4.0.dev0"

# public name -> the module that defines it (Note [lazy package])
_HOMES = {
    "SUPPORTED_TORCH": "ppbackward._compat",
    "UnsupportedTorchError": "ppbackward._compat",
    "UntestedTorchWarning": "ppbackward._compat",
    "StageBackwardError": "ppbackward._errors",
    "ParamGroups": "ppbackward._handoff",
    "active_adapter": "ppbackward._install",
    "install": "ppbackward._install",
    "installed": "ppbackward._install",
    "is_installed": "ppbackward._install",
    "merge_bw_enabled": "ppbackward._install",
    "uninstall": "ppbackward._install",
    "stage_backward": "ppbackward.backward",
    "stage_backward_input": "ppbackward.backward",
    "stage_backward_weight": "ppbackward.backward",
}

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

if TYPE_CHECKING:  # what type checkers see: the names themselves, and no __getattr__ that would accept any name
    from ppbackward._compat import SUPPORTED_TORCH, UnsupportedTorchError, UntestedTorchWarning
    from ppbackward._errors import StageBackwardError
    from ppbackward._handoff import ParamGroups
    from ppbackward._install import active_adapter, install, installed, is_installed, merge_bw_enabled, uninstall
    from ppbackward.backward import stage_backward, stage_backward_input, stage_backward_weight
else:

    def __getattr__(name: str) -> object:
        """A public name, imported from its module on first read, then kept here (Note [lazy package]).

        Raises:
            AttributeError: ``name`` is neither public here nor a submodule imported already.
        """
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'ppbackward' has no attribute {name!r}")
        value = getattr(_importlib.import_module(home), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        """The public names, ``__version__`` and the submodules imported so far."""
        loaded = [m.split(".")[1] for m in _sys.modules if m.count(".") == 1 and m.startswith("ppbackward.")]
        return sorted({*__all__, "__version__", *loaded})
