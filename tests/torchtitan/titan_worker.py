"""Tests-only launcher of one torchtitan rank on CPU: the CPU adaptations, a step recorder, then the target.

Run by ``tests/torchtitan/test_torchtitan.py`` under torchrun, through the project's harness launcher
(``ppbackward._tools.harness.launch.launch(..., module="titan_worker")``), in the environment of
``nox -s torchtitan``::

    python -m titan_worker --out DIR --launched-at T --backward {torch,ppbackward} -- TORCHTITAN ARGS...

With ``--backward ppbackward`` it hands the rest to ``ppbackward.run.main(["-m", "torchtitan.train",
...])`` -- the zero-code launcher a torchtitan user runs; with ``--backward torch`` it runs
``torchtitan.train`` as ``__main__`` without installing anything.

The CPU adaptations (none edits torchtitan's files; each is needed only because there is no accelerator):

1. ``torchtitan.tools.utils`` picks ``"cuda"`` when no accelerator is present; ``device_type`` is pointed at
   ``"cpu"`` and ``device_module`` at a shim (``torch.cpu`` plus the memory-statistics calls torchtitan
   makes), before any other torchtitan module copies them. torchtitan then picks gloo itself.
2. torch refuses flex attention's backward on CPU (``flex_attention._validate_device``) and torchtitan
   compiles flex attention and its block masks; the guard is lifted and both run eagerly. torchtitan's
   ``--debug.deterministic`` would compile flex attention again (with inductor), so it is not passed; the
   launcher calls ``torch.use_deterministic_algorithms(True)`` itself (the rest of what that flag does
   concerns CUDA). With ``--compile.enable --compile.backend aot_eager`` torchtitan hands the flex region
   inside each compiled block to inductor (``regional_inductor``), which cannot compile flex attention's
   training graph on CPU; that scoop is switched off, so flex runs its dense implementation inside the
   block's aot_eager graph (Note [torchtitan compiled on CPU] in the test).

What it leaves in ``DIR`` (the harness launcher's files, Note [hang clock] in ``ppbackward._tools.harness.launch``):
``rank<r>.pid``; ``rank<r>.json``, rewritten after every optimizer step (a ``records.RankVerdict``: one
case record per step, ``complete``, ``fatal``); ``rank<r>.events.jsonl`` (``started``, then one ``case_end``
per step, Note [event stream] in ``ppbackward._tools.harness.records``); ``grads-rank<r>.pt``:
``{step: {parameter fqn: grad before clipping, or None}}``; ``steps-rank<r>.json``: ``{step: {"loss": the
step's loss on the rank that holds the last stage, else null, "regions": [per stage backward input (B) of
the step, how many compiled regions its param groups split: sum(len(group.regions)), 0 for torch's]}}``;
``rank<r>.log``: this process's stdout and stderr, where ``faulthandler`` dumps every thread's stack on
``SIGUSR1`` or a fatal signal.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the accelerator-only calls torchtitan makes on its ``device_module``."""

    def __init__(self) -> None:
        super().__init__("titan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0  # torch.cpu's is the string "cpu"; torchtitan passes it on as a device index

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def adapt_to_cpu() -> None:
    """The CPU adaptations of the module docstring; call before torchtitan's other modules are imported."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _CpuDeviceModule()
    titan_utils.get_device_info = lambda: (titan_utils.device_type, titan_utils.device_module)

    import torch.nn.attention.flex_attention as flex

    flex._validate_device = lambda query, key, value: None
    import torchtitan.models.common.attention as attention

    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask
    import torchtitan.distributed.compile as titan_compile

    titan_compile._maybe_regional_inductor_backend = lambda model, backend: backend
    torch.use_deterministic_algorithms(True)  # not --debug.deterministic: it recompiles flex attention


class _Verdict:
    """This rank's ``rank<r>.json`` and ``grads-rank<r>.pt``, rewritten after every step."""

    def __init__(self, out: Path, rank: int, backward: str) -> None:
        self.out, self.rank = out, rank
        from ppbackward._tools.harness.records import EventWriter, RankVerdict

        self.record = RankVerdict(rank, int(os.environ.get("WORLD_SIZE", "1")), backward)
        self.events = EventWriter(out, rank, log=out / f"rank{rank}.log")
        self.grads: dict[int, dict[str, torch.Tensor | None]] = {}
        self.steps: dict[int, dict[str, Any]] = {}
        self.t0 = time.monotonic()

    def write(self) -> None:
        from ppbackward._tools.harness.records import write_verdict

        write_verdict(self.out / f"rank{self.rank}.json", self.record)

    def step(self, step: int, grads: dict[str, torch.Tensor | None], loss: float | None, regions: list[int]) -> None:
        self.grads[step] = grads
        torch.save(self.grads, self.out / f"grads-rank{self.rank}.pt")
        self.steps[step] = {"loss": loss, "regions": regions}
        (self.out / f"steps-rank{self.rank}.json").write_text(json.dumps(self.steps))
        now = time.monotonic()
        from ppbackward._tools.harness.records import CaseRecord

        case = CaseRecord(f"step {step}", seconds=now - self.t0)
        self.record.cases.append(case)
        self.t0 = now
        self.write()
        self.events.emit("case_end", case=case.id, record=case)


def _fqn(name: str) -> str:
    """``name`` as the model names it without activation checkpointing.

    torchtitan's activation checkpointing wraps every block in torch's ``CheckpointWrapper``, whose
    ``named_parameters`` insert ``_checkpoint_wrapped_module.`` (``layers.0._checkpoint_wrapped_module.
    attention.wo.weight``); a checkpointed run's parameters must be seeded and compared by the same names as
    the reference's, which runs without checkpointing.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return name.replace(_CHECKPOINT_PREFIX, "")


def _plain(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``grad`` as a plain tensor (a DTensor's local shard: the whole grad without FSDP/TP)."""
    if grad is None:
        return None
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return local.detach().clone()


def record_steps(verdict: _Verdict) -> None:
    """Wrap ``Trainer.train_step``, ``Trainer.forward_backward_step``, torchtitan's ``clip_grad_norm_`` and the
    pipeline stage's ``stage_backward_input`` to record, per step, every parameter's grad before clipping (by
    fully qualified name as the model without checkpointing names it, :func:`_fqn`), the loss (on the rank
    that holds the last stage) and how many compiled regions each B split.

    ``stage_backward_input`` is looked up by name in ``torch.distributed.pipelining.stage`` at every call, and
    ``ppbackward.run`` puts ppbackward's in before torchtitan starts; so it is wrapped at the first step, over
    whichever function is in place then. ppbackward's returns ParamGroups, each with a ``regions`` list
    (Note [compiled regions split in two] in ``ppbackward._compiled``); torch's returns dicts: 0.
    """
    import torch.distributed.pipelining.stage as stage_mod
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.trainer as trainer_mod

    current: dict[str, Any] = {"regions": []}
    clip = dist_utils.clip_grad_norm_
    train_step = trainer_mod.Trainer.train_step
    forward_backward_step = trainer_mod.Trainer.forward_backward_step

    def clip_recorded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = current["trainer"]
        current["grads"] = {
            _fqn(name): _plain(p.grad) for part in trainer.model_parts for name, p in part.named_parameters()
        }
        return clip(parameters, *args, **kwargs)

    def forward_backward_step_recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        loss = forward_backward_step(self, *args, **kwargs)
        if self.pp_has_last_stage:
            current["loss"] = current.get("loss", 0.0) + float(loss.detach().sum().item())
        return loss

    def count_regions(stage_backward_input: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            grads, groups = stage_backward_input(*args, **kwargs)
            current["regions"].append(sum(len(getattr(group, "regions", ())) for group in groups or ()))
            return grads, groups

        counted.titan_counted = True  # type: ignore[attr-defined]
        return counted

    def train_step_recorded(self: Any, data_iterator: Any) -> Any:
        if not getattr(stage_mod.stage_backward_input, "titan_counted", False):
            stage_mod.stage_backward_input = count_regions(stage_mod.stage_backward_input)
        current["trainer"] = self
        result = train_step(self, data_iterator)
        verdict.step(self.step, current.pop("grads"), current.pop("loss", None), current["regions"])
        current["regions"] = []
        return result

    dist_utils.clip_grad_norm_ = clip_recorded
    trainer_mod.Trainer.train_step = train_step_recorded
    trainer_mod.Trainer.forward_backward_step = forward_backward_step_recorded


def _std(name: str) -> float | None:
    """The init scale of the debug model's parameter ``name`` (``None``: keep it, a constant norm weight)."""
    if name.endswith("norm.weight"):
        return None
    if name.startswith("tok_embeddings."):
        return 1.0
    if name.startswith("lm_head."):
        return 256**-0.5
    return 0.02


def init_by_name() -> None:
    """After torchtitan built the model, draw every parameter from a generator seeded by its name.

    torchtitan initializes each rank's model parts from one seeded stream, so a layer's initial values
    depend on which stages the rank holds: the V placement (ZBVZeroBubble) and the loop placement
    (Interleaved1F1B) would start from different weights. Drawn by name, every placement starts from the
    same weights, and the grads of any schedule can be compared with Interleaved1F1B's by name.
    """
    import zlib

    import torchtitan.trainer as trainer_mod

    init = trainer_mod.Trainer.__init__

    def init_then_reseed(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        with torch.no_grad():
            for part in self.model_parts:
                for wrapped_name, p in part.named_parameters():
                    name = _fqn(wrapped_name)
                    std = _std(name)
                    if std is None:
                        continue
                    local = p.to_local() if hasattr(p, "to_local") else p
                    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * std)

    trainer_mod.Trainer.__init__ = init_then_reseed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan_worker")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--launched-at", type=float, default=0.0)
    parser.add_argument("--backward", choices=("torch", "ppbackward"), required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    rank = int(os.environ.get("RANK", "0"))
    log = open(args.out / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 - open for the process's life
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    from ppbackward._tools.torchrun import write_pid_file

    write_pid_file(args.out, rank)  # whole, for the launcher that may stop this rank
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    verdict = _Verdict(args.out, rank, args.backward)
    verdict.write()
    verdict.events.emit("started")  # Note [hang clock]
    try:
        adapt_to_cpu()
        init_by_name()
        record_steps(verdict)
        code = _run_target(args.backward, rest)
    except BaseException as exc:  # every failure is this rank's verdict
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            code = 0
        else:
            verdict.record.fatal = "".join(traceback.format_exception(exc))
            verdict.write()
            raise
    verdict.record.complete = code == 0
    verdict.write()
    return code


def _run_target(backward: str, rest: list[str]) -> int:
    if backward == "ppbackward":
        from ppbackward.run import main as run_main

        return run_main(["-m", "torchtitan.train", *rest])
    sys.argv = ["torchtitan.train", *rest]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
