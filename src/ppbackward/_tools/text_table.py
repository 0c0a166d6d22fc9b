"""Private: plain-text tables, the one formatter of ``ppbackward check``'s and ``ppbackward bench``'s tables."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: int | None = None, markdown: bool = False
) -> str:
    """A header, a rule of dashes and one line per row, columns two spaces apart, trailing blanks cut; or,
    with ``markdown``, the same table in GitHub-flavoured markdown (``| a | b |``).

    Args:
        header: the column titles.
        rows: the cells; a row shorter than ``header`` ends in a cell that spans the remaining columns
            (``ppbackward check``'s ``skipped: why``), which is not counted in any column's width (in
            markdown, the cells after it are left empty).
        left: how many leading columns are left-aligned, the others right-aligned (default: all left).
        markdown: GitHub-flavoured markdown instead of plain text (``|`` in a cell escaped).
    """
    n_left = len(header) if left is None else left
    if markdown:
        return _markdown(header, rows, n_left)
    widths = [len(h) for h in header]
    for row in rows:
        counted = row if len(row) == len(header) else row[:-1]
        for i, cell in enumerate(counted):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(widths[i]) if i < n_left or i == len(cells) - 1 < len(header) - 1 else c.rjust(widths[i])
            for i, c in enumerate(cells)
        ).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]], n_left: int) -> str:
    def line(cells: Sequence[str]) -> str:
        cells = [*cells, *[""] * (len(header) - len(cells))]
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join(":---" if i < n_left else "---:" for i in range(len(header))) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
