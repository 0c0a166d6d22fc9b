"""The tracker's saved-tensor hooks: detaching pack/unpack, and composing with the user's own hooks.

Private module.

Note [tracker pack hook detaches]
A pack hook that returns its input unchanged makes a reference cycle for every saved *output*
(output -> grad_fn -> saved variable -> packed object = the output) that lives in C++ and that gc
cannot break: torch's ``saved_tensors_hooks`` docstring warns about exactly this. So the tracker's own
pack hook returns ``(t.detach(), t._version)``: the same storage, kept exactly as long as autograd
would keep it, without the grad_fn. Any pack hook also turns off autograd's check that a saved
tensor was not modified in place before backward; the unpack hook redoes that check with the
version counter (``detach`` shares it), so the tracker does not hide in-place errors.

Note [tracker composes with saved-tensor hooks]
Only the innermost ``saved_tensors_hooks`` pair is applied by autograd, so a naive tracker would
either hide the user's hooks (activation checkpointing, offloading) or be hidden by them. Instead:
hooks active when the tracker is entered are wrapped (record, then call the user's pack; unpack is
the user's); hooks entered *inside* the block are seen per op by :class:`OpMode` (a
``TorchFunctionMode``), which wraps them the same way for the duration of that op. The tracker
records the tensor autograd asked to save, before the user's pack hook transforms it. It refuses
(``RuntimeError``) to start where saved-tensor hooks are disabled
(``torch.autograd.graph.disable_saved_tensors_hooks``). Not seen: a custom ``autograd.Function``
run under hooks entered inside the block (``Function.apply`` does not go through torch-function modes).

Note [tracker steps aside in compiled regions]
Dynamo traces the torch-function modes in force into a ``torch.compile``'d region, and :class:`OpMode`'s
calls (the hooks in force, the thread, autograd's sequence number) are builtins it cannot trace: it broke
the graph at every op, so under the tracker a compiled region ran op by op, eagerly, never as the one
compiled node it is without the tracker. While dynamo traces, :class:`OpMode` steps aside (it passes the
op through), so the region compiles as it would untracked; what the region saves for backward is still
recorded, by the tracker's pack hook, when the compiled region's node saves it. Not seen inside a compiled
region: the nodes of its ops (it is one node) and hooks entered inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ppbackward._plain import hooks_enabled
from ppbackward._saved import observing_only

if TYPE_CHECKING:
    from ppbackward.leaks._lifetime import ActivationTracker

__all__ = [  # private module: what other modules use
    "OpMode",
    "hooks_enabled",
    "peek_sequence_nr",
    "top_hooks",
    "unpack",
]

#: Current autograd sequence number of this thread (the next node gets it); None on a torch without it.
peek_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
#: The innermost (pack, unpack) pair in force, or None.
top_hooks: Callable[[bool], Any] | None = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


#: Whether dynamo is tracing right now (Note [tracker steps aside in compiled regions]); never on a torch
#: without ``torch.compiler.is_compiling``.
_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The tracker's unpack hook: autograd's in-place check, then the saved alias.

    Note [tracker pack hook detaches]
    """
    data, version = packed
    if data._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{data.dtype} {list(data.shape)}] is at version {data._version}; expected "
            f"version {version} instead. (Checked by ppbackward.leaks.track_activations, whose "
            "saved-tensor hooks replace autograd's own check while it is active.)"
        )
    return data


# The tracker's hooks only observe what autograd saves (it keeps the same storage, detached): the stage
# backward treats tensors saved through them as unhooked (Note [hooked saved tensors run once] in
# ppbackward._saved), so that tracking does not change which work B and W do. One thing it does change:
# a saved tensor takes one pair of hooks, so B cannot release the unread ones early under the tracker
# (docs/leak-hunting.md, the tracker's limits).
observing_only(unpack)


class OpMode(TorchFunctionMode):
    """Sees every torch call in the block: names the nodes it creates, decides the leaves it saved, and
    wraps saved-tensor hooks the user entered inside the block (Note [tracker composes with
    saved-tensor hooks])."""

    def __init__(self, tracker: ActivationTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _compiling():  # Note [tracker steps aside in compiled regions]
            return func(*args, **(kwargs or {}))
        tracker = self._tracker
        frame: list[Any] = []  # (record, storages) of leaves saved by this op, decided after it
        tracker._frames.append(frame)
        try:
            with tracker._inner_hooks_composed():
                out = func(*args, **(kwargs or {}))
        finally:
            tracker._frames.pop()
        tracker._after_op(out, frame, args, kwargs)
        return out
