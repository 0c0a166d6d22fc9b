"""How far the split (B then W) can be from a full backward, in ulp, on random stage graphs.

Runs the random stages of ``tests/core/test_random_stages.py`` (its hypothesis strategy, with a fixed seed,
so a run with the same seed draws the same graphs) in float64: for each graph two microbatches through
``ppbackward.stage_backward`` and the same two through ``stage_backward_input`` then
``stage_backward_weight`` (B B W W, grads accumulating), then
the distance in units in the last place between the two ``.grad`` of every parameter, per element and in
ulp of the gradient's largest entry (a sum that cancels to a value near zero can be many ulp of that
value off while being exact to the gradient's own precision). Prints how many graphs differ at all and
the largest distances (docs/how-it-works.md, "Accumulation order").

    python scripts/ulp_random_graphs.py [N [SEED]]     # N graphs (default 600) drawn from hypothesis seed SEED (0)
"""

from __future__ import annotations

import copy
import pathlib
import sys

import torch
from _usage import exit_if_help
from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: ``tests`` is a package

from tests.core.helpers import clone_inputs, output_grads
from tests.core.test_random_stages import D, RandomStage, stage_st

import ppbackward as pb


def ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` (float64) in representable numbers."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int64)
        return torch.where(i < 0, torch.iinfo(torch.int64).min - i, i)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` in ulp of ``a``'s largest entry (the tensor's own precision)."""
    if not a.numel():
        return 0.0
    top = float(a.abs().max())
    return float((a - b).abs().max()) / (torch.finfo(a.dtype).eps * top) if top else 0.0


def main(n: int, draw: int) -> None:
    found: list[int] = []
    relative: list[float] = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @seed(draw)
    @given(**stage_st)
    def one(program, n_mat, n_vec, frozen, outputs, input_grad):
        torch.manual_seed(0)
        module = RandomStage(program, n_mat, n_vec, frozen, outputs)
        full, split = copy.deepcopy(module), copy.deepcopy(module)
        pending = []
        for k in range(2):  # as the property test: two microbatches, B B W W, grads accumulating
            g = torch.Generator().manual_seed(1 + k)
            inputs = [torch.randn(2, D, generator=g, dtype=torch.float64).requires_grad_(r) for r in input_grad]
            xf, xs = clone_inputs(inputs), clone_inputs(inputs)
            out_f = full(*xf)
            pb.stage_backward(out_f, output_grads(out_f, 100 + k), xf)
            out_s = split(*xs)
            pending.append(pb.stage_backward_input(out_s, output_grads(out_s, 100 + k), xs, split.parameters())[1])
        for groups in pending:
            pb.stage_backward_weight(split.parameters(), groups)
        worst, rel = 0, 0.0
        for p, q in zip(full.parameters(), split.parameters()):
            if p.grad is not None and q.grad is not None:
                worst, rel = max(worst, ulp(p.grad, q.grad)), max(rel, scaled(p.grad, q.grad))
        found.append(worst)
        relative.append(rel)

    one()
    differ = [u for u in found if u]
    print(
        f"seed {draw}: {len(found)} random graphs (float64, 2 microbatches, B B W W): {len(differ)} differ from a full "
        f"backward; max {max(found, default=0)} ulp (per element); distances {sorted(differ)}; max "
        f"{max(relative, default=0.0):.2f} ulp of the gradient's largest entry"
    )


if __name__ == "__main__":
    exit_if_help(__doc__)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 600, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
