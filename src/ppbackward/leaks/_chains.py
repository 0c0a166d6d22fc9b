"""Readable back-reference chains through cyclic garbage, and their GraphViz files; chains to what holds a
live object (Note [holder chains]).

Private module. objgraph's ``find_backref_chain`` walks ``gc.get_referrers``, which scans the whole
heap at every step and can wander out of the garbage through the checker's own bookkeeping. Garbage
is a closed set (no live object refers into it), so the chain is searched here over
``gc.get_referents`` restricted to that set: exact, and linear in the size of the garbage. The
``.dot`` files are drawn by objgraph's ``show_chain`` (forward references only, no heap scan).
"""

from __future__ import annotations

import functools
import gc
import os
import shutil
import subprocess
import sys
import types
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ppbackward._saved import saved_tensors
from ppbackward.leaks._heap import referrers_of
from ppbackward.leaks._storage import grad_fn_or_none, unique_storage_bytes

__all__ = [  # private module: what other modules use
    "Holders",
    "find_chain",
    "format_chain",
    "format_holders",
    "holder_chain",
    "referrer_index",
    "write_graph",
]

_MAX_KEYS_SHOWN = 4
_LOCALS_SEEN = sys.version_info >= (3, 13)  # frame.f_locals is a view, not a copy the frame keeps (PEP 667)


def _is(obj: Any, cls: type | tuple[type, ...]) -> bool:
    """``isinstance`` by the object's type alone: the heap holds objects whose ``__class__`` is a property that runs
    code or raises (a lazy proxy), and a chain search must neither run nor fail on it."""
    return issubclass(type(obj), cls)


def _is_node(obj: Any) -> bool:
    return _is(obj, torch.autograd.graph.Node)


def _where(code: types.CodeType, line: int | None = None) -> str:
    return f"{os.path.basename(code.co_filename)}:{line if line is not None else code.co_firstlineno}"


def _describe(obj: Any) -> str:
    """One line naming ``obj`` without calling its ``repr`` (which may be huge or run user code)."""
    try:
        if _is(obj, torch.Tensor):
            with torch._C.DisableTorchFunctionSubclass():
                _, nbytes = unique_storage_bytes([obj])
                dtype = str(obj.dtype).replace("torch.", "")
                text = f"{type(obj).__name__} {dtype}{list(obj.shape)} on {obj.device}, {nbytes} bytes"
                fn = grad_fn_or_none(obj)
                if fn is not None:
                    text += f", grad_fn={fn.name()}"
            return text
        if _is_node(obj):
            _, nbytes = unique_storage_bytes(saved_tensors(obj, unpack=False))
            return f"autograd node {obj.name()} (saved for backward: {nbytes} bytes)"
        if _is(obj, types.FunctionType):
            return f"function {obj.__qualname__} ({_where(obj.__code__)})"
        if _is(obj, types.MethodType):
            return f"bound method {getattr(obj.__func__, '__qualname__', '?')}"
        if _is(obj, types.CellType):
            return "cell"
        if _is(obj, types.FrameType):
            return f"frame of {obj.f_code.co_name} ({_where(obj.f_code, obj.f_lineno)})"
        if _is(obj, functools.partial):
            return f"functools.partial of {getattr(obj.func, '__qualname__', type(obj.func).__name__)}"
        if _is(obj, dict):
            keys = [repr(k) if _is(k, (str, int)) else type(k).__name__ for k in list(obj)[:_MAX_KEYS_SHOWN]]
            more = ", ..." if len(obj) > _MAX_KEYS_SHOWN else ""
            return f"{type(obj).__name__} with {len(obj)} key(s) [{', '.join(keys)}{more}]"
        if _is(obj, (list, tuple, set, frozenset)):
            return f"{type(obj).__name__} (len {len(obj)})"
        if _is(obj, types.ModuleType):
            return f"module {obj.__name__}"
    except Exception:  # describing must never fail the check
        pass
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__} object"


_ATTRS = (
    "__dict__", "__self__", "__func__", "__closure__", "__defaults__", "__kwdefaults__", "__globals__",
    "cell_contents", "func", "args", "keywords", "_backward_hooks", "grad_fn", "f_locals", "metadata",
)


def _edge_label(src: Any, dst: Any) -> str:
    """How ``src`` refers to ``dst``: ``"['key']"``, ``"[3]"``, ``".cell_contents"``, or ``""``."""
    try:
        if _is(src, dict):
            for k, v in src.items():
                if v is dst:
                    return f"[{k!r}]" if _is(k, (str, int)) else f"[<{type(k).__name__} key>]"
                if k is dst:
                    return "(a key)"
        if _is(src, (list, tuple)):
            for i, v in enumerate(src):
                if v is dst:
                    return f"[{i}]"
        if _is(src, (set, frozenset)):
            return "(a member)"
        if _is_node(src) and _is(dst, dict):
            return "(its hook dict)"  # the only Python objects a C++ node lets gc traverse
        if _is(src, types.FrameType) and _LOCALS_SEEN:  # before 3.13 f_locals is a copy the frame keeps
            for k, v in src.f_locals.items():
                if v is dst:
                    return f".f_locals[{k!r}]"
        for attr in _ATTRS:
            try:  # an instance __dict__ through the interpreter's descriptor only (_instance_dict)
                value = _instance_dict(src) if attr == "__dict__" else object.__getattribute__(src, attr)
            except Exception:
                continue
            if value is dst:
                return f".{attr}"
        label = _instance_attribute(src, dst)
        if label:
            return label
    except Exception:
        pass
    return ""


def _instance_attribute(src: Any, dst: Any) -> str:
    """``".name"`` when ``dst`` is an instance attribute of ``src`` (in its ``__dict__`` or a slot).

    Python 3.11+ keeps a plain object's attributes inline: ``gc.get_referents`` then yields the
    attribute values themselves, with no ``__dict__`` in between, so the attribute is named here.
    """
    attrs = _instance_dict(src) or {}
    for name, value in attrs.items():
        if value is dst:
            return f".{name}"
    for cls in type(src).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            try:
                if object.__getattribute__(src, slot) is dst:
                    return f".{slot}"
            except Exception:
                continue
    return ""


def referrer_index(garbage: Sequence[Any]) -> dict[int, list[Any]]:
    """``{id(obj): [objects of the garbage that refer to obj]}`` over the garbage only."""
    index: dict[int, list[Any]] = {id(o): [] for o in garbage}
    for src in garbage:
        for dst in gc.get_referents(src):
            bucket = index.get(id(dst))
            if bucket is not None:
                bucket.append(src)
    return index


def find_chain(obj: Any, index: dict[int, list[Any]], max_depth: int) -> tuple[list[Any], int | None]:
    """Shortest back-reference path from ``obj`` until a reference cycle closes.

    Returns:
        ``(chain, back_to)``: ``chain[0]`` is ``obj`` and ``chain[i + 1]`` refers to ``chain[i]``;
        ``back_to`` is the position in ``chain`` that ``chain[-1]`` is referred to by (the cycle
        closes there), or ``None`` when no cycle was found within ``max_depth`` steps.
    """
    parent: dict[int, Any] = {id(obj): None}
    depth = {id(obj): 0}
    queue = deque([obj])
    last = obj
    while queue:
        cur = queue.popleft()
        last = cur
        if depth[id(cur)] >= max_depth:
            continue
        for ref in index.get(id(cur), ()):
            if id(ref) in parent:
                path = _path(cur, parent)
                for pos, item in enumerate(path):
                    if item is ref:  # ``ref`` is on the path: the cycle closes at it
                        return path, pos
                continue
            parent[id(ref)] = cur
            depth[id(ref)] = depth[id(cur)] + 1
            queue.append(ref)
    return _path(last, parent), None


def _path(end: Any, parent: dict[int, Any]) -> list[Any]:
    path = [end]
    while parent[id(path[-1])] is not None:
        path.append(parent[id(path[-1])])
    path.reverse()  # from the leaked object outwards
    return path


def format_chain(chain: list[Any], back_to: int | None) -> str:
    """The chain as text: ``[0]`` the leaked object, then one ``<- [i] referrer via edge`` line per step.

    ``via`` says how the referrer holds the object on the line above (``['key']``, ``[index]``,
    ``.attribute``); the last line says where the reference cycle closes.
    """
    lines = [f"[0] {_describe(chain[0])}"]
    for i in range(1, len(chain)):
        label = _edge_label(chain[i], chain[i - 1])
        lines.append(f"  <- [{i}] {_describe(chain[i])}" + (f" via {label}" if label else ""))
    last = len(chain) - 1
    if back_to is not None:
        label = _edge_label(chain[back_to], chain[-1])
        lines.append(
            f"  (reference cycle: [{last}] is held by [{back_to}]" + (f" via {label})" if label else ")")
        )
    else:
        lines.append("  (no cycle found within max_depth references; raise max_depth to see more)")
    return "\n".join(lines)


def write_graph(chain: list[Any], path: str) -> str | None:
    """Write the chain as a GraphViz file with objgraph; render a PNG next to it if ``dot`` exists.

    Returns:
        the PNG path, or ``None`` when graphviz's ``dot`` is missing or failed.
    """
    import objgraph  # a declared dependency; imported lazily (only when something leaked)

    # objgraph wants the chain from the referrer end; backrefs=False draws forward references with
    # gc.get_referents only, restricted to the chain's objects (no heap scan).
    with open(path, "w", encoding="utf-8") as out:
        objgraph.show_chain(list(reversed(chain)), backrefs=False, output=out, extra_info=_describe)
    dot = shutil.which("dot")
    if dot is None:
        return None
    png = os.path.splitext(path)[0] + ".png"
    try:
        done = subprocess.run([dot, "-Tpng", "-o", png, path], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return png if done.returncode == 0 and os.path.exists(png) else None


# Note [holder chains]: what a *live* reference holds after a step (a training loop keeping the step's
# outputs on ``self``) is not garbage, so the closed-set search above does not apply. The chain is then
# searched backwards over the referrers (a heap scan per step, acceptable in a report; through
# ``_heap.referrers_of``, which never hands out a tuple another thread may still be building: Note [heap
# scans beside other threads]): from the object to a module, a frame, or an object nothing visible
# refers to. A running function's local variables are not seen by the collector (its frame is no
# container to ``gc.get_referrers`` while it runs, from Python 3.11 on). On Python 3.13+ the frames of
# every thread's stack are searched too: a list local to a test function ends the chain at that
# function's frame, ``via .f_locals['name']``. Not on 3.11 and 3.12: there ``frame.f_locals`` copies
# the locals into a dict the frame keeps, which would hold the very tensor the report is about after the
# caller's ``del`` (3.13's ``f_locals`` is a view, PEP 667; on 3.9 and 3.10 the collector sees running
# frames itself). A tuple held only by a local variable is a referrer the collector cannot tell from a
# half-built one (Note [heap scans beside other threads]): on 3.13+ the frames' locals name it; before, it
# is left out. A chain that ends at an object with no referrer the search can see says so on its last
# line (not one that ends in a cycle back into the chain); so does a search that stopped at ``max_depth``
# steps without reaching a module or a frame (its chain is then the path to the furthest object it reached).
# The search's own containers and frames, and this package's frames, are skipped, and an instance
# ``__dict__`` is folded into its object (``Loop via .outputs``, not ``dict ... via .__dict__``), in the
# depth too: a step is one line of the printed chain (a model inside an ``nn.Sequential`` inside a module is
# two steps, not four).


def _is_root(obj: Any) -> bool:
    return _is(obj, (types.ModuleType, types.FrameType))


class Holders(NamedTuple):
    """A holder chain (Note [holder chains]): ``chain[0]`` is the object, ``chain[i + 1]`` refers to
    ``chain[i]``; ``unheld`` when its last object has no referrer at all that the search can see (not a
    cycle back into the chain); ``stopped`` (the search's ``max_depth``, else 0) when the search ran out of
    steps before reaching a module or a frame."""

    chain: list[Any]
    unheld: bool
    stopped: int = 0


def holder_chain(obj: Any, max_depth: int = 12) -> Holders:
    """Back-references from ``obj`` to what holds it (Note [holder chains]). Shortest path to a module or
    frame if there is one within ``max_depth`` steps (an instance ``__dict__`` is no step of its own), else
    the path to an object with no visible referrer, one of a user's class first, the furthest first among
    those; or, where the search stopped at ``max_depth``, to the furthest object it reached."""
    queue = deque([obj])
    parent: dict[int, Any] = {id(obj): None}
    depth = {id(obj): 0}
    values, frames = _frames_by_local()
    skip = {id(sys._getframe()), id(queue), id(parent), id(depth), id(values), id(frames)}  # frame not kept
    try:
        return _search(obj, queue, parent, depth, skip, (values, frames), max_depth)
    finally:
        queue.clear()
        parent.clear()  # it refers to every object met: dropped at once, never left to the gc
        values.clear()
        frames.clear()


def _frames_by_local() -> tuple[list[Any], list[types.FrameType]]:
    """Every local variable of every thread's running frames but this package's, with its frame (two
    lists of one length), on Python 3.13+ (else empty: Note [holder chains]); the values stay alive
    through their frames meanwhile, and are matched by identity (an ``id`` alone could be reused while
    other threads run)."""
    values: list[Any] = []
    frames: list[types.FrameType] = []
    if not _LOCALS_SEEN:
        return values, frames
    for top in sys._current_frames().values():
        frame: types.FrameType | None = top
        while frame is not None:
            if not _is_own_frame(frame):
                for value in frame.f_locals.values():
                    values.append(value)
                    frames.append(frame)
            frame = frame.f_back
    return values, frames


def _held_by_locals(cur: Any, locals_of: tuple[list[Any], list[types.FrameType]]) -> list[Any]:
    """The frames whose local variable is ``cur``, and the tuples held by a local variable that hold
    ``cur`` (complete: a variable holds them; ``referrers_of`` cannot tell them from a half-built one)."""
    found: list[Any] = []
    for value, frame in zip(*locals_of):
        if value is cur:
            found.append(frame)
        elif type(value) is tuple and any(item is cur for item in value):
            found.append(value)
    return found


def _search(
    obj: Any, queue: deque[Any], parent: dict[int, Any], depth: dict[int, int], skip: set[int],
    locals_of: tuple[list[Any], list[types.FrameType]], max_depth: int,
) -> Holders:
    skip.add(id(sys._getframe()))
    deepest = obj
    bare: set[int] = set()  # ids of the objects met with no referrer at all
    cut = None  # the nearest object the search did not expand for max_depth (the furthest reached)
    done: set[int] = set()  # expanded already: a later, deeper entry of one is passed over
    while queue:
        cur = queue.popleft()
        if id(cur) in done:
            continue
        done.add(id(cur))
        if _is_root(cur) and cur is not obj:
            return Holders(_path(cur, parent), False)
        if depth[id(cur)] >= max_depth and not (type(cur) is dict and depth[id(cur)] == max_depth):
            if type(cur) is not dict and (cut is None or depth[id(cur)] < depth[id(cut)]):
                cut = cur  # a dict at the last step is expanded: its object is that step (Note [holder chains])
            continue
        referrers = referrers_of(cur) + _held_by_locals(cur, locals_of)
        skip.add(id(referrers))
        found = False
        seen_any = False
        for ref in referrers:
            if id(ref) in skip or _is_own_frame(ref):
                continue
            seen_any = True
            # an instance __dict__ and its object are one step, as format_holders prints them; such an object
            # goes first in the queue, which so stays in order of depth (a 0-1 BFS: the first root is the
            # nearest), and one met before at a greater depth (through a slot) is moved up
            folded = type(cur) is dict and _is_dict_of(ref, cur)
            step = depth[id(cur)] + (0 if folded else 1)
            if id(ref) in parent and not (folded and id(ref) not in done and depth[id(ref)] > step):
                continue
            found = True
            parent[id(ref)] = cur
            depth[id(ref)] = step
            if folded:
                queue.appendleft(ref)
            else:
                queue.append(ref)
        del referrers
        if not seen_any:
            bare.add(id(cur))
        if not found and _end_rank(cur, depth) > _end_rank(deepest, depth):
            deepest = cur
    if cut is not None and id(deepest) not in bare:  # no object nothing holds: paths ran past max_depth
        return Holders(_path(cut, parent), False, max_depth)
    return Holders(_path(deepest, parent), id(deepest) in bare)


def _end_rank(obj: Any, depth: dict[int, int]) -> tuple[bool, bool, int]:
    """Which dead end names the holder best: any object that holds the start (a list local to a function
    rather than the tensor itself), then an object of a user's class (not an iterator or a container of
    the interpreter's), then the furthest from the start."""
    return depth[id(obj)] > 0, type(obj).__module__ != "builtins", depth[id(obj)]


def _is_own_frame(obj: Any) -> bool:
    """A frame of this package's reporting code (the search is not what holds the object)."""
    return _is(obj, types.FrameType) and obj.f_code.co_filename.startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def format_holders(holders: Holders) -> str:
    """``[0] Tensor float32[] ..., grad_fn=PowBackward0 <- [1] list (len 1) via [0] <- [2] Loop via .outputs``
    on one line per step (instance ``__dict__`` steps folded: Note [holder chains]); a last line when
    nothing visible holds the chain's last object."""
    chain = holders.chain
    folded = [
        item for i, item in enumerate(chain)
        if not (_is(item, dict) and i + 1 < len(chain) and _is_dict_of(chain[i + 1], item))
    ]
    lines = [f"[0] {_describe(folded[0])}"]
    for i in range(1, len(folded)):
        label = _edge_label(folded[i], folded[i - 1])
        lines.append(f"  <- [{i}] {_describe(folded[i])}" + (f" via {label}" if label else ""))
    if holders.unheld:
        last = len(folded) - 1
        why = (
            f"nothing the gc sees refers to [{last}], nor a local variable of a running function: C code holds it"
            " (an autograd node's hooks or saved tensors, an extension)"
            if _LOCALS_SEEN else
            f"nothing the gc sees refers to [{last}]: C code holds it (an autograd node's hooks or saved tensors, "
            "an extension), or a local variable of a running function (those are searched on Python 3.13+)"
        )
        frozen = gc.get_freeze_count()
        if frozen:  # gc.freeze() hides objects from gc.get_referrers as from collections
            why += f"; or one of the {frozen} objects gc.freeze() put out of the gc's sight"
        lines.append(f"  ({why})")
    elif holders.stopped:
        lines.append(
            f"  (the search stopped {holders.stopped} steps from [0] without reaching a module or a running "
            "function; the chain shows how far it got)"
        )
    return "\n".join(lines)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (or type()), not a C type
_MODULE_DICT = vars(types.ModuleType)["__dict__"]


def _instance_dict(obj: Any) -> Any:
    """``obj``'s instance ``__dict__`` (``None`` if none), read through the interpreter's own descriptor only, for
    a module or an object of a class defined in Python: never a class's ``__dict__`` property (user code),
    never on another C type's object (reading a function's ``__dict__`` makes one: a module's globals dict
    has every function of the module among its referrers)."""
    kind = type(obj)
    if _is(obj, types.ModuleType):
        descriptor: Any = _MODULE_DICT
    elif kind.__flags__ & _HEAPTYPE:
        for klass in kind.__mro__:
            descriptor = vars(klass).get("__dict__")
            if descriptor is not None:
                break
        else:
            return None
        if type(descriptor) is not types.GetSetDescriptorType:
            return None
    else:
        return None
    try:
        return descriptor.__get__(obj, kind)
    except Exception:  # a broken object
        return None


def _is_dict_of(obj: Any, d: dict) -> bool:
    """Whether ``d`` is ``obj``'s instance ``__dict__`` (:func:`_instance_dict`)."""
    return _instance_dict(obj) is d
