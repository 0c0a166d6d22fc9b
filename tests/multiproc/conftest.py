"""``tests/multiproc``: every pipeline schedule under torchrun (gloo, CPU), leak-free, lifetime-checked and exact.

Layers, cheapest first (wall times measured on 2 CPU cores, torch 2.13.0; the whole directory takes
about 2.5 minutes):

1. ``test_harness_units.py`` — no process group, no subprocess (~5 s): the schedule matrix covers
   every ``Schedule*`` class of the installed torch with a placement rule; placements put every stage
   on exactly one rank; the model zoo and its reference are deterministic; each probe and the failure
   formatter catch what they must (perturbed grads, left-over caches, missing verdicts).
2. ``test_matrix.py`` — the matrix: every schedule × model (``mlp``, ``transformer``, ``tuple``,
   ``ckpt``) with ``ppbackward.install()`` active, 2 measured steps each, in **one torchrun launch per
   configuration**: world size 2 (~20 s) and 4 (~35 s) with torch's dynamic shape inference, and world
   size 2 with static stage metadata (~12 s). One pytest test per (configuration, case) reads the
   per-rank JSON verdicts of that launch; the launch runs once, in the first test that needs it.
3. ``test_upstream.py`` — the same worker with torch's own backward, world size 2 (~40 s): every rank
   reports every case (what ``ppbackward check`` relies on); full-backward schedules pass, so the
   harness agrees with torch itself; torch's zero-bubble failures are reported, not asserted.
4. ``test_negative_controls.py`` — ``leaky_backward.py`` swapped in (2 launches, ~5 s each): the
   suite reports a reference-cycle leak as *garbage* with its exact count of tensors and autograd
   nodes, and a live-reference leak as *lifetime* with its exact count of saved activations.
5. ``test_hang.py`` — a rank blocked in ``dist.recv`` (~21 s): the launcher kills every process of the
   launch at its 20 s timeout and the failure shows each rank's log with the stack it hung in.
6. ``test_gloo_p2p.py`` — two bare gloo launches (~12 s): the worker's workaround for torch 2.5-2.7
   schedules dropping P2P works delivers a whole batch, and the dropped-work shape hangs (negative
   control).

On torch 2.5 the same tests run the schedules 2.5 has (see ``docs/compatibility.md``, "torch 2.5.1
under torchrun"); ``test_upstream.py`` then requires torch's own full backward to fail, by its leak.

Where things run: pytest (this process) only launches ``python -m torch.distributed.run --standalone``
through :func:`ppbackward._harness.launch.launch`; torchrun starts the ranks, each running
``python -m ppbackward._harness.worker`` (``src/ppbackward/_harness/``), which writes
``rank<r>.json`` and ``rank<r>.log`` into a temporary folder. Each launch has its own rendezvous
(``--standalone``: no fixed port).

What each case asserts, per rank and per step (see ``ppbackward._harness.worker`` and ``.probes``):
garbage (``check_tensor_leaks``: 0 tensors, 0 autograd nodes), lifetime (gc disabled: every saved
activation freed once ``clear_runtime_states()`` ran and the receive buffers -- what torch's stage keeps
by design -- are released), caches (``fwd_cache``, ``backward_state`` empty; ``bwd_cache`` and
``dw_runner`` only tensor-free leftovers; ``output_chunks`` one per microbatch on the last stage, on
every stage with torch 2.5;
the schedule's losses and pending receives empty), numerics (each loss and every parameter's grad
within ``|x - ref| <= 1e-6 + 1e-5 |ref|`` of a single-process float32 reference, sum-reduced loss,
``scale_grads=False``), hooks (post-accumulate-grad hooks once per trainable parameter per microbatch).

Bounded time: process-group timeouts in the workers (world 60 s, per case 30 s), the launcher's
timeout (kills torchrun's and every worker's process group), ``@pytest.mark.timeout`` as a backstop.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from multiproc_specs import LAUNCHES

from ppbackward._harness.launch import LaunchResult, launch


@pytest.fixture(scope="session")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LaunchResult]:
    """``launches(name)``: the :class:`LaunchResult` of launch ``name`` of :data:`LAUNCHES`, run once."""
    cache: dict[str, LaunchResult] = {}

    def get(name: str) -> LaunchResult:
        if name not in cache:
            spec = LAUNCHES[name]
            out = tmp_path_factory.mktemp(f"multiproc-{name}")
            cache[name] = launch(  # on_case: record progress (LaunchResult.progress) as the launch runs
                spec.nproc, list(spec.args), out, timeout=spec.timeout, env=dict(spec.env), on_case=lambda r: None
            )
        return cache[name]

    return get
