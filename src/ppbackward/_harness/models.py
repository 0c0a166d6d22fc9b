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

The loss is sum-reduced (:func:`sum_squared_error`) and schedules run with ``scale_grads=False``, so the
reference's grads are the plain sum of the microbatches' grads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "MODELS",
    "AttentionMask",
    "Batch",
    "ModelSpec",
    "ReferenceResult",
    "build_stages",
    "get_model",
    "make_batch",
    "param_names",
    "reference_step",
    "stage_examples",
    "sum_squared_error",
]

D = 16  # hidden size
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


# ----------------------------------------------------------------------------------------------------
# the zoo


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's whole batch: ``args`` go to stage 0, ``kwargs`` to every stage, ``target`` to the loss."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    features: str
    build_stage: Callable[[int, int], nn.Module]  # (stage_index, num_stages) -> module
    make_args: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]  # (batch, gen) -> stage-0 args
    make_kwargs: Callable[[], dict[str, Any]]
    target_shape: Callable[[int], tuple[int, ...]]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="mlp",
            features="Linear-GELU-Linear per stage",
            build_stage=lambda i, n: MLPStage(),
            make_args=lambda b, g: (torch.randn(b, D, generator=g),),
            make_kwargs=dict,
            target_shape=lambda b: (b, D),
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
            make_args=lambda b, g: (torch.randn(b, D, generator=g),),
            make_kwargs=dict,
            target_shape=lambda b: (b, D),
        ),
    )
}


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


def param_names(stage_index: int, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``("stage{i}.{name}", param)`` for every parameter of one stage, frozen ones included."""
    return [(f"stage{stage_index}.{name}", p) for name, p in module.named_parameters()]


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
