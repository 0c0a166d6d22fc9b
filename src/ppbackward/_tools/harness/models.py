"""Private: the model zoo of the multiprocess harness, and its single-process reference.

Every model is a stack of ``num_stages`` stage modules built from one seed, so every rank builds the same
parameters and keeps only its own stages, and the reference runs the whole stack in one process. Models
are tiny (d=16) so that a case costs milliseconds; what matters is the *shape* of each stage's graph:

* ``mlp`` — Linear → GELU → Linear per stage; one tensor crosses each boundary.
* ``transformer`` — pre-LN blocks (LayerNorm, multi-head attention, MLP); stage 0 embeds integer tokens;
  ``gate`` is one parameter used by two ops of the stage (it scales both residual branches); ``frozen``
  is a weight with ``requires_grad=False`` used in forward; every stage takes the keyword argument
  ``mask=AttentionMask(...)``, a non-tensor object replicated to every microbatch and every stage
  (torch 2.5's stage hands keyword arguments to stage 0 only; later stages then use the default, the
  same causal mask).
* ``tuple`` — every boundary carries a tuple of two tensors; one of them is a view produced by a node
  with several outputs (``unbind``); the last stage returns one tensor.
* ``ckpt`` — the stage's inner MLP runs under non-reentrant activation checkpointing.

The training-setup models (:data:`TRAINING_MODELS`; issue 12):

* ``lora`` — a frozen prefix: stage 0 is a frozen linear layer, every later stage a frozen base layer
  plus a trainable low-rank adapter (LoRA). Stage 0's outputs need no grad, so stage 1 receives
  activations that need none: its input path is empty and W does all of its work, loss included on the
  last stage.
* ``lora-last`` — only the last stage carries an adapter; every earlier stage is frozen.
* ``compiled`` — each stage's MLP block has its ``forward`` compiled (``torch.compile``, ``aot_eager``,
  set on the instance, so the zero-bubble schedules' check for ``OptimizedModule`` children accepts it):
  the compiled region is one custom ``autograd.Function`` node in the graph, next to eager ops.
* ``compiled-blocks`` — each stage is ``BLOCKS`` residual MLP blocks, each a ``torch.compile(block)`` child
  (``aot_eager``; an ``OptimizedModule``, the spelling torch's zero-bubble schedules refuse): ``BLOCKS``
  compiled regions per stage, every one of which ppbackward's B must split into B and W
  (``ModelSpec.regions_per_b``, counted by the check's regions probe). Parameter names leave out the
  wrapper's ``_orig_mod.`` (:func:`param_names`), so the eager reference's names match.
* ``bf16`` — each stage runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, with a scaled loss
  (``LOSS_SCALE`` times the sum, as a GradScaler would): float32 parameters, bfloat16 activations.
* ``sac`` — selective activation checkpointing, its policy by stage (save the matmuls, nothing,
  everything, or a plain checkpoint around a selective one); each stage counts the runs of its
  checkpointed function, which must equal a full backward's (the forward and one recomputation).
* ``custom-fn`` — each stage multiplies by a weight through a custom ``autograd.Function`` whose
  backward has a side effect (a per-stage call counter): it must run once per microbatch. Static stage
  metadata: torch's shape inference runs one backward of every stage on the first step, which the
  counter would see too.

torchtitan's shape (:data:`TITAN_MODELS`; issue 20, Note [torchtitan's final norm]):

* ``titan`` — llama-style blocks (RMSNorm, SwiGLU MLP); the last stage ends in a final RMSNorm and holds
  ``lm_head``, which the loss applies (:func:`chunked_loss`: per-chunk ``backward()`` on detached hidden
  states, tied back by a custom autograd Function). With the ``fsdp-titan`` wrap it is sharded as
  torchtitan shards it, and the loss reshards ``[norm, lm_head]``.
* ``titan-sac`` — the same with torchtitan's default per-block selective activation checkpointing.

The loss is sum-reduced (:func:`sum_squared_error`, scaled for ``bf16``; titan's cross-entropy) and schedules run with
``scale_grads=False``, so the reference's grads are the plain sum of the microbatches' grads.

The bench's configurations (``ppbackward bench``; Note [bench configurations], at the end): stacks of
``nn.TransformerEncoderLayer`` named ``LAYERSxDMODELxSEQ`` (:class:`Config`, :func:`parse_configs`,
:func:`build`, :func:`build_stack`). This module is the tooling's one model zoo: the harness, ``check``
and the bench all read it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ppbackward._compat import torch_release
from ppbackward._saved import HOOKS_VISIBLE

__all__ = [
    "CORE_MODELS",
    "MODELS",
    "QUICK",
    "TITAN_MODELS",
    "TRAINING_MODELS",
    "AttentionMask",
    "Batch",
    "Config",
    "ModelSpec",
    "ReferenceResult",
    "Stage",
    "all_configs",
    "build",
    "build_stack",
    "build_stages",
    "get_model",
    "make_batch",
    "mean_reference",
    "model_names",
    "param_names",
    "parse_configs",
    "reference_step",
    "reset_grads",
    "stage_examples",
    "sum_squared_error",
    "unavailable",
]

D = 16  # hidden size
RANK = 4  # LoRA adapter rank
LOSS_SCALE = 1024.0  # the bf16 model's loss scale
COMPILE_BACKEND = "aot_eager"  # the compiled models' torch.compile backend
BLOCKS = 2  # compiled blocks per stage (compiled-blocks)
SEQ = 4  # sequence length (transformer)
HEADS = 2
VOCAB = 32
MB_SIZE = 2  # samples per microbatch


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """A non-tensor keyword argument given to every stage (like an attention-mask object).

    torch's microbatch splitter replicates objects it cannot chunk, so each stage's forward sees this
    object for every microbatch; it reaches the backward among the stage's ``input_values``.
    """

    causal: bool = True

    def build(self, seq: int) -> torch.Tensor:
        """Boolean ``(seq, seq)`` tensor, ``True`` where attention is masked out."""
        if not self.causal:
            return torch.zeros(seq, seq, dtype=torch.bool)
        return torch.ones(seq, seq, dtype=torch.bool).triu(1)


_CAUSAL = AttentionMask(causal=True)  # what every stage gets; the default where torch 2.5 passes nothing


def sum_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum-reduced loss (no mean): the pipeline's grads are then the plain sum over microbatches."""
    return ((output - target) ** 2).sum()


# ----------------------------------------------------------------------------------------------------
# stage modules


class MLPStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))


class TransformerStage(nn.Module):
    """One pre-LN block; stage 0 also embeds integer tokens."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D) if first else None
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        # one parameter used by two ops of this stage (both residual branches)
        self.gate = nn.Parameter(torch.full((D,), 0.5) + 0.1 * torch.randn(D))
        # a frozen weight used in forward
        self.frozen = nn.Parameter(torch.randn(D, D) / math.sqrt(D), requires_grad=False)

    def _attention(self, x: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D // HEADS)
        scores = scores.masked_fill(mask.build(t).to(scores.device), float("-inf"))
        out = scores.softmax(-1) @ v  # (b, heads, t, dh)
        return self.proj(out.transpose(1, 2).reshape(b, t, D))

    def forward(self, h: torch.Tensor, *, mask: AttentionMask = _CAUSAL) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        h = h + self.gate * self._attention(self.ln1(h), mask)
        h = h + self.gate * self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return h + 0.1 * (h @ self.frozen)


class TupleStage(nn.Module):
    """Takes ``(a, b)``, returns ``(a', b')`` where ``b'`` is a view from ``unbind`` (several outputs);
    the last stage returns one tensor."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.last = last
        self.lin_a = nn.Linear(D, D)
        self.lin_b = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        ya, yb = torch.stack([self.lin_a(a), self.lin_b(b)]).unbind(0)
        a2 = torch.tanh(ya) * torch.sigmoid(self.gate(b))
        if self.last:
            return a2 + yb
        return a2, yb


class CheckpointStage(nn.Module):
    """Linear, then a residual MLP run under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.inner = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inp(h)
        return h + checkpoint(self.inner, self.ln(h), use_reentrant=False)


class LoRAStage(nn.Module):
    """A frozen base layer; with ``adapter``, plus a trainable low-rank update ``up(down(h))``."""

    def __init__(self, adapter: bool) -> None:
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.down = nn.Linear(D, RANK, bias=False) if adapter else None
        self.up = nn.Linear(RANK, D, bias=False) if adapter else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.base(h)
        if self.down is not None and self.up is not None:
            out = out + self.up(self.down(h))
        return torch.tanh(out)


class CompiledStage(nn.Module):
    """Linear, then an MLP block whose forward is compiled (``COMPILE_BACKEND``) by the spec's ``prepare``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inp(h)
        return h + self.block(h)


class ResidualBlock(nn.Module):
    """``h + b(relu(a(h)))``: the block ``compiled-blocks`` compiles as a child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 2 * D)
        self.b = nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.relu(self.a(h)))


class CompiledBlocksStage(nn.Module):
    """``BLOCKS`` residual blocks in a row; the spec's ``prepare`` makes each a ``torch.compile(block)`` child."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock() for _ in range(BLOCKS)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


class BF16Stage(MLPStage):
    """The MLP stage under ``torch.autocast("cpu", dtype=torch.bfloat16)``: bfloat16 activations."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(h).float()


class _CountedScale(torch.autograd.Function):
    """``h * w`` whose backward counts its calls in ``calls`` (a side effect, like a fused kernel writing
    ``main_grad``): it must run once per microbatch, whatever the backward is split into."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, calls: list) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.calls = calls
        return h * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w = ctx.saved_tensors
        ctx.calls[0] += 1
        return grad * w, (grad * h).sum(0), None


class CustomFnStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.w = nn.Parameter(torch.full((D,), 0.5) + 0.1 * torch.randn(D))
        self.backward_calls = [0]  # read by the worker's side-effect check

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_CountedScale.apply(self.fc(h), self.w, self.backward_calls))


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _sac_policy(save: str) -> Callable[..., Any]:
    """A selective-checkpoint context function saving the matmuls, nothing, or everything."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if save == "all" or (save == "matmuls" and op in _MATMULS):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class SACStage(nn.Module):
    """Linear, then an MLP under selective activation checkpointing, its policy by stage: save the
    matmuls, save nothing, save everything, or a plain checkpoint around a selective one (nested). Counts
    the runs of its checkpointed functions (the forward and each recomputation) in ``runs``."""

    POLICIES = ("matmuls", "nothing", "all", "nested")

    def __init__(self, index: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.inner = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.how = self.POLICIES[index % len(self.POLICIES)]
        self.runs = [0]  # read by the worker's side-effect check

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        self.runs[0] += 1
        return self.inner(h)

    def _nested(self, h: torch.Tensor) -> torch.Tensor:
        return h + checkpoint(self._mlp, h, use_reentrant=False, context_fn=_sac_policy("matmuls"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inp(h)
        if self.how == "nested":
            return h + checkpoint(self._nested, h, use_reentrant=False)
        return h + checkpoint(self._mlp, h, use_reentrant=False, context_fn=_sac_policy(self.how))


def _side_effects_recompute(
    stages: Mapping[int, Any], reference: Sequence[Any], n_microbatches: int, shards: int
) -> list[str]:
    """Failures: a stage that recomputed its checkpointed region more often than a full backward of the
    same microbatches (the reference's count per shard: a rank runs one shard, the reference every one of
    them on the same modules, the same number of microbatches each)."""
    failures = []
    for index, module in stages.items():
        runs, reference_runs = module.runs[0], reference[index].runs[0]
        if runs * shards != reference_runs:  # exact: no rounding of the reference's count
            failures.append(
                f"side effects: stage {index}'s checkpointed function ran {runs} times for {n_microbatches} "
                f"microbatches; a full backward runs it {reference_runs / shards:g} times (forward and "
                "recomputation)"
            )
        module.runs[0] = 0
    for module in reference:
        module.runs[0] = 0
    return failures


def _compile_blocks(module: nn.Module) -> nn.Module:
    """Compile the block's ``forward`` in place (an instance attribute: no ``OptimizedModule`` child,
    which the zero-bubble schedules refuse; ``nn.Module.compile`` does not compile here on torch 2.13)."""
    if isinstance(module, CompiledStage):
        module.block.forward = torch.compile(module.block.forward, backend=COMPILE_BACKEND)  # type: ignore[method-assign]
    return module


def _compile_children(module: nn.Module) -> nn.Module:
    """Put ``torch.compile(block)`` (``COMPILE_BACKEND``) in place of each block: an ``OptimizedModule``
    child per block, the spelling torch's zero-bubble schedules refuse (``compiled-blocks``)."""
    if isinstance(module, CompiledBlocksStage):
        for i, block in enumerate(module.blocks):
            module.blocks[i] = torch.compile(block, backend=COMPILE_BACKEND)  # type: ignore[assignment]
    return module


def scaled_sum_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``LOSS_SCALE`` times :func:`sum_squared_error`: the loss a GradScaler-style step backpropagates."""
    return sum_squared_error(output, target) * LOSS_SCALE


def _side_effects_custom_fn(
    stages: Mapping[int, Any], reference: Sequence[Any], n_microbatches: int, shards: int
) -> list[str]:
    """Failures: a stage whose custom Function's backward did not run exactly once per microbatch."""
    failures = []
    for index, module in stages.items():
        calls = module.backward_calls[0]
        if calls != n_microbatches:
            failures.append(
                f"side effects: stage {index}'s custom Function backward ran {calls} times for {n_microbatches} "
                "microbatches (once each expected)"
            )
        module.backward_calls[0] = 0
    return failures


# ----------------------------------------------------------------------------------------------------
# torchtitan's shape (issue 20): Note [torchtitan's final norm]
#
# Note [torchtitan's final norm]: torchtitan (0.3.0, llama3) runs its last pipeline stage without the
# output projection: the stage ends in the final RMSNorm and returns the hidden states, and the loss
# (``ChunkedLossWrapper``) applies ``lm_head`` itself, chunk by chunk on detached copies of them, each chunk
# with its own ``backward()`` (lm_head's grads accumulate during the loss, in F), then returns a loss tied
# to the hidden states by a custom autograd Function whose backward returns the chunks' gradient.
# torchtitan also always applies FSDP2 (a mesh of size 1 without data parallelism), with
# ``fully_shard([norm, lm_head])`` as one unit and ``reshard_after_forward=False`` under pipelining, and
# the loss calls ``lm_head.reshard()`` when it is done. That reshards the whole unit: ``norm.weight``, the
# module attribute, goes back from the unsharded parameter the forward used to the sharded DTensor. Torch's
# zero-bubble B then looks the stage's weights up by object (``submod.parameters()``, in
# ``stage_backward_input``): the sharded ``norm.weight``'s AccumulateGrad is not in the graph, so the norm
# gets no param group, B (``autograd.grad`` on the inputs) accumulates nothing and W, which runs param
# groups only, never computes its grad: ``norm.weight.grad`` stays None, silently. The ``titan`` model
# rebuilds that shape; the ``fsdp-titan`` wrap (``ppbackward._tools.harness.parallel``) is torchtitan's FSDP2 layout.

NUM_CHUNKS = 2  # the loss's sequence chunks (SEQ must be a multiple)


class _HiddenGradBridge(torch.autograd.Function):
    """``loss`` (detached) tied to ``hidden``: the backward hands ``hidden`` the gradient the loss's chunks
    computed (times the loss's incoming gradient), like torchtitan's ``_DecoderOutputGradientBackProp``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, hidden_grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden_grad)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (hidden_grad,) = ctx.saved_tensors
        return hidden_grad * grad, None, None


def _fsdp_module(module: nn.Module) -> Any:
    """``module`` if FSDP2 wraps it (``fully_shard``), else ``None``."""
    from ppbackward._tools.harness.parallel import fsdp2

    return module if isinstance(module, fsdp2().FSDPModule) else None


def chunked_loss(lm_head: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torchtitan's chunked loss, for hidden states ``(batch, SEQ, D)`` and soft targets ``(batch, SEQ,
    VOCAB)`` (the harness draws float targets; their softmax over the vocabulary is the target
    distribution): sum-reduced cross-entropy of ``lm_head(hidden)``, computed in ``NUM_CHUNKS`` sequence
    chunks, each on a detached copy with its own ``backward()``; returns a scalar tied to ``hidden`` by
    :class:`_HiddenGradBridge`. Under FSDP2 it keeps ``lm_head``'s unit unsharded across the chunks and
    reshards it at the end, as torchtitan does (Note [torchtitan's final norm])."""
    fsdp = _fsdp_module(lm_head)
    if fsdp is not None:
        fsdp.set_reshard_after_forward(False)
        fsdp.set_reshard_after_backward(False)
        fsdp.unshard()
    chunks = [c.detach().requires_grad_(hidden.requires_grad) for c in hidden.chunk(NUM_CHUNKS, dim=1)]
    grads: list[torch.Tensor] = []
    total = hidden.new_zeros(())
    for chunk, want in zip(chunks, target.chunk(NUM_CHUNKS, dim=1)):
        logits = lm_head(chunk)
        loss = F.cross_entropy(logits.flatten(0, 1), want.flatten(0, 1).softmax(-1), reduction="sum")
        total = total + loss.detach()
        if hidden.requires_grad:
            loss.backward()
            assert chunk.grad is not None  # a leaf of this backward
            grads.append(chunk.grad)
    if fsdp is not None:
        fsdp.set_reshard_after_forward(True)
        fsdp.set_reshard_after_backward(True)
        fsdp.reshard()
    if not hidden.requires_grad:
        return total
    return _HiddenGradBridge.apply(hidden, torch.cat(grads, dim=1), total)


class TitanStage(nn.Module):
    """A llama-style block (RMSNorm, SwiGLU MLP, residual); stage 0 embeds integer tokens; the last stage
    ends in the final RMSNorm ``norm`` and holds ``lm_head``, which its forward does not apply (the loss
    does: :func:`chunked_loss`). With ``sac`` the block runs under selective activation checkpointing
    (torchtitan's default, saving the matmuls). Note [torchtitan's final norm]."""

    def __init__(self, first: bool, last: bool, sac: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D) if first else None
        self.block_norm = nn.RMSNorm(D)
        self.w1 = nn.Linear(D, 2 * D, bias=False)
        self.w3 = nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)
        self.norm = nn.RMSNorm(D) if last else None
        self.lm_head = nn.Linear(D, VOCAB, bias=False) if last else None
        self.sac = sac

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        x = self.block_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))

    def fsdp_units(self) -> list[Any]:
        """torchtitan's FSDP2 units of this stage: the embedding, the block, ``[norm, lm_head]``."""
        units: list[Any] = [self.tok_embeddings] if self.tok_embeddings is not None else []
        units.append([self.block_norm, self.w1, self.w3, self.w2])
        if self.norm is not None and self.lm_head is not None:
            units.append([self.norm, self.lm_head])
        return units

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        if self.sac:
            h = checkpoint(self._block, h, use_reentrant=False, context_fn=_sac_policy("matmuls"))
        else:
            h = self._block(h)
        return self.norm(h) if self.norm is not None else h


def _titan_accumulations(name: str) -> int:
    """``lm_head`` accumulates once per loss chunk (its own backwards, in the loss); the rest once."""
    return NUM_CHUNKS if name.endswith(".lm_head.weight") else 1


def _titan_loss(last_stage: nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss bound to the last stage's ``lm_head`` (:func:`chunked_loss`)."""
    lm_head = last_stage.lm_head
    if not isinstance(lm_head, nn.Module):
        raise TypeError(f"the titan loss needs the last stage's lm_head module, got {type(lm_head).__name__}")
    return functools.partial(chunked_loss, lm_head)


# ----------------------------------------------------------------------------------------------------
# the zoo


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's whole batch: ``args`` go to stage 0, ``kwargs`` to every stage, ``target`` to the loss."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor


def _no_side_effects(
    stages: dict[int, nn.Module], reference: Sequence[nn.Module], n_microbatches: int, shards: int
) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the zoo.

    Attributes:
        build_stage: ``(stage_index, num_stages) -> module``.
        make_args: ``(batch, generator) -> stage-0 args`` (default: one ``(batch, D)`` tensor);
            ``make_kwargs``: stage-0 keyword arguments; ``target_shape``: ``batch -> the loss target's
            shape`` (default ``(batch, D)``).
        loss_fn: the schedule's and the reference's loss.
        prepare: applied to each rank's own stage modules after the reference copied them (compiling).
        side_effects: ``(this rank's stages by index, the reference's stages, n_microbatches, shards) ->
            failures`` after each step (the reference has just run the same microbatches with a full
            backward, once per data-parallel shard: ``shards`` times, :attr:`ReferenceResult.shards`);
            it resets the counts it reads.
        metadata: ``"static"`` where the model needs static stage metadata (unless asked otherwise).
        warmup_steps: unmeasured steps before the measured ones (the first call of a compiled region
            compiles it, which leaves cyclic garbage of its own).
        loss_for: ``last stage module -> loss`` for a loss that uses the last stage's modules (torchtitan's
            ``lm_head`` applied in the loss: ``titan``); see :meth:`loss_of`.
        accumulations: ``parameter name ("stage{i}.{name}") -> AccumulateGrad calls per microbatch`` (1;
            titan's ``lm_head`` accumulates once per loss chunk, in the loss's own backwards).
        regions_per_b: the torch.compile'd regions of each stage, which every B ppbackward runs must split into
            B and W (Note [compiled regions split in two] in ``ppbackward._compiled``; the check's regions
            probe counts them); 0 for a model without compiled regions (nothing counted).
        selective_checkpointing: the stages run selective activation checkpointing (Note [what torch 2.5
            cannot run]).
    """

    name: str
    features: str
    build_stage: Callable[[int, int], nn.Module]
    make_args: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]] = lambda b, g: (
        torch.randn(b, D, generator=g),
    )
    make_kwargs: Callable[[], dict[str, Any]] = dict
    target_shape: Callable[[int], tuple[int, ...]] = lambda b: (b, D)
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = sum_squared_error
    prepare: Callable[[nn.Module], nn.Module] = lambda module: module
    side_effects: Callable[[dict[int, nn.Module], Sequence[nn.Module], int, int], list[str]] = _no_side_effects
    metadata: str | None = None
    warmup_steps: int = 0
    loss_for: Callable[[nn.Module], Callable[[Any, torch.Tensor], torch.Tensor]] | None = None
    accumulations: Callable[[str], int] = lambda name: 1
    regions_per_b: int = 0
    selective_checkpointing: bool = False

    def loss_of(self, last_stage: nn.Module | None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The loss for a pipeline whose last stage module is ``last_stage`` (``None`` on a rank without
        it): :attr:`loss_fn`, or :attr:`loss_for` bound to the module where the model's loss uses it."""
        if self.loss_for is None or last_stage is None:
            return self.loss_fn
        return self.loss_for(last_stage)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="mlp",
            features="Linear-GELU-Linear per stage",
            build_stage=lambda i, n: MLPStage(),
        ),
        ModelSpec(
            name="transformer",
            features="LayerNorm+attention+MLP blocks, integer tokens into stage 0, a parameter used by two "
            "ops, a frozen weight, non-tensor mask kwarg to every stage",
            build_stage=lambda i, n: TransformerStage(first=i == 0),
            make_args=lambda b, g: (torch.randint(0, VOCAB, (b, SEQ), generator=g),),
            make_kwargs=lambda: {"mask": AttentionMask(causal=True)},
            target_shape=lambda b: (b, SEQ, D),
        ),
        ModelSpec(
            name="tuple",
            features="tuple of two tensors across every boundary, one a view from a multi-output node",
            build_stage=lambda i, n: TupleStage(last=i == n - 1),
            make_args=lambda b, g: (torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)),
            make_kwargs=dict,
            target_shape=lambda b: (b, D),
        ),
        ModelSpec(
            name="ckpt",
            features="non-reentrant activation checkpointing inside every stage",
            build_stage=lambda i, n: CheckpointStage(),
        ),
        ModelSpec(
            name="lora",
            features="frozen prefix: stage 0 frozen, a LoRA adapter on a frozen base in every later stage",
            build_stage=lambda i, n: LoRAStage(adapter=i > 0),
        ),
        ModelSpec(
            name="lora-last",
            features="every stage frozen but the last, which carries a LoRA adapter",
            build_stage=lambda i, n: LoRAStage(adapter=i == n - 1),
        ),
        ModelSpec(
            name="compiled",
            features="an MLP block compiled in place (torch.compile, aot_eager) inside every stage",
            build_stage=lambda i, n: CompiledStage(),
            prepare=_compile_blocks,
            warmup_steps=1,
            regions_per_b=1,
        ),
        ModelSpec(
            name="compiled-blocks",
            features=f"{BLOCKS} residual MLP blocks per stage, each a torch.compile(block) child (aot_eager): "
            "the compiled stages torch's zero-bubble schedules refuse",
            build_stage=lambda i, n: CompiledBlocksStage(),
            prepare=_compile_children,
            warmup_steps=1,  # the first call of a compiled region compiles it
            regions_per_b=BLOCKS,
        ),
        ModelSpec(
            name="bf16",
            features="bfloat16 autocast in every stage, loss scaled by LOSS_SCALE",
            build_stage=lambda i, n: BF16Stage(),
            loss_fn=scaled_sum_squared_error,
        ),
        ModelSpec(
            name="custom-fn",
            features="a custom autograd.Function whose backward counts its calls (a side effect) in every stage",
            build_stage=lambda i, n: CustomFnStage(),
            side_effects=_side_effects_custom_fn,
            # torch's shape inference (dynamic metadata) runs one extra backward of every stage on the
            # first step (backward metadata inference): the side effect would count it
            metadata="static",
        ),
        ModelSpec(
            name="sac",
            features="selective activation checkpointing (save matmuls / nothing / everything / nested) by stage",
            build_stage=lambda i, n: SACStage(i),
            side_effects=_side_effects_recompute,
            metadata="static",  # as for custom-fn: shape inference would recompute once more
            selective_checkpointing=True,
        ),
        ModelSpec(
            name="titan",
            features="torchtitan's shape: final RMSNorm, lm_head applied in a chunked loss with its own "
            "backward, tied back by a custom autograd.Function (with the fsdp-titan wrap: FSDP2 units as "
            "torchtitan's, the loss resharding [norm, lm_head])",
            build_stage=lambda i, n: TitanStage(first=i == 0, last=i == n - 1, sac=False),
            make_args=lambda b, g: (torch.randint(0, VOCAB, (b, SEQ), generator=g),),
            target_shape=lambda b: (b, SEQ, VOCAB),
            loss_for=_titan_loss,
            accumulations=_titan_accumulations,
            metadata="static",  # the loss runs its own backward; shape inference needs none of it
        ),
        ModelSpec(
            name="titan-sac",
            features="titan with torchtitan's default per-block selective activation checkpointing",
            build_stage=lambda i, n: TitanStage(first=i == 0, last=i == n - 1, sac=True),
            make_args=lambda b, g: (torch.randint(0, VOCAB, (b, SEQ), generator=g),),
            target_shape=lambda b: (b, SEQ, VOCAB),
            loss_for=_titan_loss,
            accumulations=_titan_accumulations,
            metadata="static",
            selective_checkpointing=True,
        ),
    )
}

#: The models ``--models core`` (and ``all`` before issue 12) runs: one graph shape each.
CORE_MODELS = ("mlp", "transformer", "tuple", "ckpt")
#: The training-setup models (issue 12).
TRAINING_MODELS = ("lora", "lora-last", "compiled", "bf16", "custom-fn", "sac")
#: torchtitan's shape (issue 20): Note [torchtitan's final norm].
TITAN_MODELS = ("titan", "titan-sac")


def model_names(text: str) -> list[str]:
    """``all``, ``core``, ``training`` or a comma-separated list, as names (each checked)."""
    groups = {"all": list(MODELS), "core": list(CORE_MODELS), "training": list(TRAINING_MODELS)}
    names = groups.get(text) or [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        get_model(name)
    return names


# Note [what torch 2.5 cannot run]: the cases the harness skips on torch 2.5, each for something that torch
# cannot do, with its own backward as with ppbackward's (found by ``nox -s torch-2.5.1``, 2026-12-02):
#
# * ``compiled``: torch 2.5.1's ``torch.compile`` (aot_eager) keeps tensors the compiled region saved alive
#   after every backward, a plain ``autograd.backward`` of the stage too (2.13.0 frees them): the lifetime
#   check would fail on torch's compiler, whatever the backward;
# * a model with selective activation checkpointing under a schedule that runs B and W apart: this torch
#   does not expose saved-tensor hooks to Python (``ppbackward._saved.HOOKS_VISIBLE``), so B cannot do the
#   checkpointed region's weight work itself and W recomputes the region once more, which selective
#   checkpointing refuses ("Trying to backward an extra time"), as with torch's own split
#   (docs/compatibility.md);
# * FSDP2 (the ``fsdp``, ``fsdp-keep`` and ``fsdp-titan`` wraps) on CPU: torch 2.5's FSDP2 runs on CUDA only
#   (its forward raises "FSDP requires CUDA for streams"): ``parallel.wrap_unavailable``.


def unavailable(spec: ModelSpec, split_backward: bool) -> str | None:
    """Why ``spec`` cannot run on the installed torch under a schedule that runs B and W apart
    (``split_backward``) or not, or ``None`` (Note [what torch 2.5 cannot run])."""
    if spec.name == "compiled" and torch_release()[:2] == (2, 5):
        return (
            f"torch {torch.__version__}'s torch.compile (aot_eager) keeps the compiled region's saved tensors "
            "alive after the backward (a plain autograd.backward too)"
        )
    if spec.selective_checkpointing and split_backward and not HOOKS_VISIBLE:
        return (
            f"torch {torch.__version__} does not expose saved-tensor hooks to Python: W would recompute the "
            "selectively checkpointed region a second time, which it refuses (as with torch's own split)"
        )
    return None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def build_stages(spec: ModelSpec, num_stages: int, seed: int) -> list[nn.Module]:
    """All ``num_stages`` stage modules of ``spec``, initialised from ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [spec.build_stage(i, num_stages) for i in range(num_stages)]


def make_batch(spec: ModelSpec, n_microbatches: int, seed: int) -> Batch:
    """The whole batch of one step: ``n_microbatches * MB_SIZE`` samples drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    size = n_microbatches * MB_SIZE
    args = spec.make_args(size, gen)
    target = torch.randn(spec.target_shape(size), generator=gen)
    return Batch(args=args, kwargs=spec.make_kwargs(), target=target)


@dataclasses.dataclass
class ReferenceResult:
    losses: list[torch.Tensor]  # one detached scalar per microbatch
    grads: dict[str, torch.Tensor | None]  # "stage{i}.{param}" -> grad (None: no grad)
    shards: int = 1  # the data-parallel shards it ran, one full step each, on the same stage modules


def param_names(stage_index: int, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``("stage{i}.{name}", param)`` for every parameter of one stage, frozen ones included; a
    ``torch.compile(module)`` child's ``_orig_mod.`` left out, so that a compiled stage and its eager
    reference name their parameters alike."""
    return [(f"stage{stage_index}.{name.replace('_orig_mod.', '')}", p) for name, p in module.named_parameters()]


def reference_step(
    stages: Sequence[nn.Module],
    batch: Batch,
    n_microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = sum_squared_error,
) -> ReferenceResult:
    """Run the whole stack in this process, microbatch by microbatch, like the pipeline does.

    Grads are zeroed first, then each microbatch's sum-reduced loss is back-propagated with plain
    ``torch.autograd.backward`` (grads accumulate over microbatches; nothing is scaled).
    """
    for module in stages:
        module.zero_grad(set_to_none=True)
    arg_chunks = [a.tensor_split(n_microbatches, dim=0) for a in batch.args]
    target_chunks = batch.target.tensor_split(n_microbatches, dim=0)
    losses = []
    for mb in range(n_microbatches):
        values: tuple[Any, ...] = tuple(chunks[mb] for chunks in arg_chunks)
        out: Any = None
        for module in stages:
            out = module(*values, **batch.kwargs)
            values = out if isinstance(out, tuple) else (out,)
        loss = loss_fn(out, target_chunks[mb])
        loss.backward()
        losses.append(loss.detach())
    grads = {}
    for i, module in enumerate(stages):
        for name, p in param_names(i, module):
            grads[name] = None if p.grad is None else p.grad.detach().clone()
    return ReferenceResult(losses=losses, grads=grads)


def mean_reference(
    stages: Sequence[nn.Module],
    shards: Sequence[Batch],
    n_microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = sum_squared_error,
    own: int = 0,
) -> ReferenceResult:
    """The reference of data-parallel training on ``shards`` (one batch per dp rank): the grads of the mean
    of the per-shard losses (what DDP's and FSDP2's averaging produce), and the losses of shard ``own``.
    One shard is :func:`reference_step` itself."""
    results = [reference_step(stages, shard, n_microbatches, loss_fn) for shard in shards]
    if len(results) == 1:
        return results[0]
    grads: dict[str, torch.Tensor | None] = {}
    for name, first in results[0].grads.items():
        grads[name] = None if first is None else sum(r.grads[name] for r in results) / len(results)  # type: ignore[misc, assignment]
    return ReferenceResult(losses=results[own].losses, grads=grads, shards=len(results))


def stage_examples(
    stages: Sequence[nn.Module], batch: Batch, n_microbatches: int
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """``(inputs, outputs)`` of every stage on microbatch 0: static metadata for ``PipelineStage``.

    Detached copies that keep each tensor's ``requires_grad`` (a receive buffer is created to require
    grad only when its example does). Giving every stage its metadata makes torch skip its dynamic
    metadata inference (whose object send/recv needs numpy).
    """
    values: tuple[Any, ...] = tuple(a.tensor_split(n_microbatches, dim=0)[0] for a in batch.args)
    examples = []
    with torch.enable_grad():
        for module in stages:
            out = module(*values, **batch.kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            examples.append(
                (
                    tuple(v.detach().requires_grad_(v.requires_grad) for v in values),
                    tuple(o.detach().requires_grad_(o.requires_grad) for o in outs),
                )
            )
            values = outs
    return examples


# ----------------------------------------------------------------------------------------------------
# the bench's configurations

# Note [bench configurations]: a bench configuration is a stack of ``layers`` ``nn.TransformerEncoderLayer``
# (batch-first, dropout 0, ``nhead`` 4, ``dim_feedforward`` 4*d) in training mode, fed a ``(batch, seq,
# d_model)`` input that requires grad, as a pipeline stage's input does, with a ``(batch, seq, d_model)``
# gradient arriving at its output. Named ``LAYERSxDMODELxSEQ`` (``4x64x16``); ``all`` is the grid of
# :data:`BENCH_LAYERS` x :data:`BENCH_D_MODELS` x :data:`BENCH_SEQS`. Weights come from
# ``torch.manual_seed(seed)`` (the global generator, as the bench's published figures were measured), the
# input and the gradient from a generator seeded ``seed + 1``: the same configuration and seed always build
# the same stage. The schedule benchmarks build stage ``i`` of a pipeline with :func:`build_stack` from seed
# ``100 + i``.

BENCH_LAYERS = (4, 16)
BENCH_D_MODELS = (64, 256)
BENCH_SEQS = (16, 128)
QUICK = "4x64x16"  # ``ppbackward bench --quick``


class Config(NamedTuple):
    """One bench configuration: ``layers`` x ``d_model`` x ``seq`` (written ``4x64x16``), ``batch`` samples,
    ``nhead`` attention heads (Note [bench configurations])."""

    layers: int
    d_model: int
    seq: int
    batch: int = 2
    nhead: int = 4

    @property
    def name(self) -> str:
        return f"{self.layers}x{self.d_model}x{self.seq}"

    @property
    def label(self) -> str:
        return f"L{self.layers} d{self.d_model} s{self.seq}"

    @property
    def parameter_bytes(self) -> int:
        """float32 bytes of the stage's parameters, about: ``layers`` x 12 d² (attention 4 d², feed-forward of
        4 d: 8 d²)."""
        return self.layers * 12 * self.d_model**2 * 4


def _memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0


def all_configs() -> list[Config]:
    """The issue's grid, small to large (``--configs all``)."""
    return [Config(layer, d, s) for layer in BENCH_LAYERS for d in BENCH_D_MODELS for s in BENCH_SEQS]


def parse_configs(text: str) -> list[Config]:
    """Parse ``"all"`` or a comma-separated list of ``LAYERSxDMODELxSEQ`` (e.g. ``4x64x16,16x256x128``).

    Raises:
        ValueError: an item is not three positive integers joined by ``x``, or ``d_model`` is not a
            multiple of ``nhead`` (4), or its parameters alone would not fit in this machine's memory; or the
            list is empty.
    """
    if text.strip() == "all":
        return all_configs()
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--configs: {item!r} is not LAYERSxDMODELxSEQ, e.g. 16x64x16")
        cfg = Config(*map(int, parts))
        if cfg.d_model % cfg.nhead:
            raise ValueError(f"--configs: {item!r}: d_model must be a multiple of {cfg.nhead}")
        need, have = cfg.parameter_bytes, _memory_bytes()
        if have and need > have:
            raise ValueError(
                f"--configs: {item!r}: its parameters alone take {need / 2**30:.3g} GiB, more than this machine's "
                f"{have / 2**30:.3g} GiB of memory"
            )
        out.append(cfg)
    if not out:
        raise ValueError("--configs: no configuration given")
    return out


def build_stack(layers: int, d_model: int, nhead: int = 4, seed: int = 0) -> nn.Sequential:
    """A training-mode stack of ``layers`` encoder layers, weights from ``torch.manual_seed(seed)`` (the
    global generator: Note [bench configurations])."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ]
    ).train()


class Stage(NamedTuple):
    """A bench configuration built: the model, its parameters, its input ``x`` (``(batch, seq, d_model)``,
    requires grad) and the gradient ``grad`` arriving at its output (same shape)."""

    model: nn.Sequential
    params: list[nn.Parameter]
    x: torch.Tensor
    grad: torch.Tensor


def build(cfg: Config, seed: int = 0) -> Stage:
    """Build ``cfg``'s model, input and output gradient (deterministic: Note [bench configurations])."""
    model = build_stack(cfg.layers, cfg.d_model, cfg.nhead, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen).requires_grad_()
    grad = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen)
    return Stage(model, list(model.parameters()), x, grad)


def reset_grads(stage: Stage) -> None:
    """Forget accumulated gradients so every run accumulates into empty ``.grad`` alike."""
    for p in stage.params:
        p.grad = None
    stage.x.grad = None
