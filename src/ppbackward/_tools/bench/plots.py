"""PNG figures of ``ppbackward bench --split``: the split's cost against the stage's size, and the replayed
schedule steps per rank.

Private module; needs matplotlib (the ``plot`` extra), imported here only, with its
non-interactive ``Agg`` backend (no display). Note [bench plots]: two kinds of figure, from the ``--split``
result alone (no new measurement):

* ``split-cost.png``: per configuration, ordered from the smallest full backward (host-bound) to the
  largest (compute-bound), ppbackward's B and W stacked as fractions of one full backward, torch's B+W
  beside them, and the line where B+W equals the full backward;
* ``replayed-<config>.png``: for each configuration, the replayed step (Note [replayed step], 2 ranks, 8
  microbatches, accumulating costs) of ``Interleaved1F1B`` and of each zero-bubble schedule (measured,
  ideal, merged) as one row of boxes per rank: F, full backward, B, W; the blank between them is the bubble.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppbackward._tools.bench.records import SplitConfig, SplitResult

__all__ = ["write_plots"]

COLORS = {"F": "#4c72b0", "full backward": "#8172b2", "B": "#dd8452", "W": "#55a868"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def split_cost_figure(split: SplitResult, path: Path) -> Path:
    """``split-cost.png`` (Note [bench plots])."""
    plt = _pyplot()
    times = sorted(((c.label, c.times("accumulating")) for c in split.configs), key=lambda lt: lt[1].full)
    labels = [f"{label}\n{t.full:.1f} ms" for label, t in times]
    b, w, torch_bw = [], [], []
    for _, t in times:
        b.append(t.variants["pp"].b / t.full)
        w.append(t.variants["pp"].w / t.full)
        torch_bw.append(t.variants["torch"].bw / t.full)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(times) + 2), 4.5))
    xs = range(len(times))
    ax.bar([x - 0.2 for x in xs], b, 0.4, label="ppbackward B", color=COLORS["B"])
    ax.bar([x - 0.2 for x in xs], w, 0.4, bottom=b, label="ppbackward W", color=COLORS["W"])
    ax.bar([x + 0.2 for x in xs], torch_bw, 0.4, label="torch's B+W", color="#999999")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="one full backward")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("time / full backward (accumulating)")
    ax.set_title("B+W over one full backward, by the full backward's time", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def replay_figure(config: SplitConfig, path: Path, ranks: int = 2, microbatches: int = 8) -> Path:
    """``replayed-<config>.png`` (Note [bench plots]) of a configuration with its ``costs_ms``."""
    from ppbackward._tools.bench.replay import SCHEDULES, action_lists, costings_of, timeline

    assert config.costs_ms is not None
    plt = _pyplot()
    costings = costings_of(config.costs_ms)
    rows = [("Interleaved1F1B", action_lists(SCHEDULES[0], ranks, microbatches), costings["measured"])]
    for zb in SCHEDULES[1:]:
        short = zb.removeprefix("Schedule")
        lists = action_lists(zb, ranks, microbatches)
        rows.append((f"{short} measured", lists, costings["measured"]))
        rows.append((f"{short} ideal", lists, costings["ideal"]))
        merged = action_lists(zb, ranks, microbatches, merged=True)
        rows.append((f"{short} merged", merged, costings["measured"]))
    names = {"F": "F", "B": "full backward", "I": "B", "W": "W"}
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.1 * len(rows) + 1), sharex=True)
    for ax, (title, lists, costs) in zip(axes, rows):
        runs = timeline(lists, costs)
        for rank, acts in enumerate(runs):
            for a, start, end in acts:
                ax.barh(rank, end - start, left=start, color=COLORS[names[a.kind]], edgecolor="white", linewidth=0.3)
        step = max(end for acts in runs for _, _, end in acts)
        ax.set_yticks(range(len(runs)), [f"rank {r}" for r in range(len(runs))], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title}: {step:.1f} ms", fontsize=8, loc="left")
    axes[-1].set_xlabel("ms (replayed: measured costs, zero communication; blank = bubble)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=4)
    fig.suptitle(f"Replayed step, {config.label}, {ranks} ranks, {microbatches} microbatches", fontsize=9, x=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(folder: str | Path, split: SplitResult) -> list[Path]:
    """Every figure of Note [bench plots] for a ``--split`` result, in ``folder`` (made if missing)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = [split_cost_figure(split, out / "split-cost.png")]
    for config in split.configs:
        if config.costs_ms is not None:
            paths.append(replay_figure(config, out / f"replayed-{config.name}.png"))
    return paths
