"""What :func:`ppbackward.leaks.check_tensor_leaks` found: :class:`LeakReport` and :class:`TensorLeakError`.

Public names (re-exported by ``ppbackward.leaks``): ``LeakReport``, ``TensorLeakError``.
A report holds only numbers and strings, never the leaked objects (see
Note [checker clears gc.garbage] in ``_checker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ppbackward.leaks._storage import format_bytes

__all__ = ["LeakReport", "TensorLeakError"]


@dataclass
class LeakReport:
    """The result of one :func:`check_tensor_leaks` block, filled when the block exits.

    Everything counted was found in the cyclic garbage of the block: objects that no live reference
    reaches and that only the cycle collector could free. A reference cycle pins the memory of every
    tensor in it until the next collection, which may come much later (or never, with ``gc`` off).

    Attributes:
        num_tensors: ``torch.Tensor`` objects (parameters and subclasses included) in the garbage.
        num_nodes: ``torch.autograd.graph.Node`` objects (``grad_fn`` s, custom-function contexts)
            in the garbage. Such a node pins the activations it saved for backward even when no
            Python tensor is part of the cycle -- torch's ``check_leaked_tensors`` reports 0 then.
        tensor_bytes: bytes of the unique storages held by the leaked tensors plus the tensors the
            leaked nodes saved for backward (a view counts its whole storage; shared storages once).
            Nodes further up the graph, pinned through the leaked nodes' edges, are not counted.
        num_storages: how many unique storages ``tensor_bytes`` adds up.
        num_garbage: all objects the block left in the cyclic garbage, of any type.
        garbage_types: ``{type name: count}`` over those objects.
        chains: readable back-reference chains, one per leaked object for the first ``max_chains``
            of them (tensors first): the object, then who refers to it, until the cycle closes.
        dot_paths: GraphViz ``.dot`` files of those chains (written by objgraph into ``output_dir``).
        png_paths: PNG renderings of the ``.dot`` files, only when graphviz's ``dot`` is installed.
        output_dir: the folder holding the graph files (a fresh temporary folder by default), or
            ``None`` when nothing was written.
        graph_error: why graph files are missing (the folder could not be made or a file not written:
            ``"PATH: error"``), or ``None``; the chains are complete either way.
        done: ``True`` once the block has exited and the report is filled.
        body_raised: ``True`` when the block exited with an exception (the report is still filled,
            but no :class:`TensorLeakError` is raised over the original exception).
    """

    num_tensors: int = 0
    num_nodes: int = 0
    tensor_bytes: int = 0
    num_storages: int = 0
    num_garbage: int = 0
    garbage_types: dict[str, int] = field(default_factory=dict)
    chains: list[str] = field(default_factory=list)
    dot_paths: list[str] = field(default_factory=list)
    png_paths: list[str] = field(default_factory=list)
    output_dir: str | None = None
    graph_error: str | None = None
    done: bool = False
    body_raised: bool = False

    @property
    def ok(self) -> bool:
        """``True`` when no tensor and no autograd node leaked (other garbage is tolerated)."""
        return self.num_tensors == 0 and self.num_nodes == 0

    def format(self) -> str:
        """A multi-line human-readable summary: counts, bytes, chains and graph file paths."""
        if not self.done:
            return "ppbackward.leaks: the check_tensor_leaks block has not exited yet"
        if self.ok:
            return (
                "ppbackward.leaks: no tensor and no autograd node leaked into a reference cycle "
                f"({self.num_garbage} other garbage objects)"
            )
        types = ", ".join(f"{name}: {n}" for name, n in sorted(self.garbage_types.items()))
        lines = [
            f"ppbackward.leaks: {self.num_tensors} tensor(s) and {self.num_nodes} autograd node(s) "
            "leaked into reference cycles (freed only by the cycle collector, if ever)",
            f"  memory pinned: {format_bytes(self.tensor_bytes)} in {self.num_storages} unique "
            "storage(s)",
            f"  garbage objects: {self.num_garbage} ({types})",
        ]
        for i, chain in enumerate(self.chains, 1):
            lines.append(f"back-reference chain {i} of {self.num_tensors + self.num_nodes}:")
            lines.extend("  " + line for line in chain.splitlines())
        if self.dot_paths:
            lines.append("graph files (.dot): " + ", ".join(self.dot_paths))
        if self.png_paths:
            lines.append("graph pictures (.png): " + ", ".join(self.png_paths))
        if self.graph_error is not None:
            lines.append(f"graph files not written: {self.graph_error}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field plus ``ok``."""
        return {
            "ok": self.ok,
            "num_tensors": self.num_tensors,
            "num_nodes": self.num_nodes,
            "tensor_bytes": self.tensor_bytes,
            "num_storages": self.num_storages,
            "num_garbage": self.num_garbage,
            "garbage_types": dict(self.garbage_types),
            "chains": list(self.chains),
            "dot_paths": list(self.dot_paths),
            "png_paths": list(self.png_paths),
            "output_dir": self.output_dir,
            "graph_error": self.graph_error,
            "done": self.done,
            "body_raised": self.body_raised,
        }


class TensorLeakError(RuntimeError):
    """Raised by a strict :func:`check_tensor_leaks` block that leaked a tensor or an autograd node.

    Attributes:
        report: the filled :class:`LeakReport`; ``str(error)`` is ``report.format()``.
    """

    def __init__(self, report: LeakReport) -> None:
        super().__init__(report.format())
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.report,))
