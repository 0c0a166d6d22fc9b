"""Benchmark configurations and the models they build.

Private module. A configuration is a stack of ``nn.TransformerEncoderLayer`` (batch-first, dropout
0, ``nhead`` 4, ``dim_feedforward`` 4*d) in training mode, fed a ``(batch, seq, d)`` input that
requires grad, as a pipeline stage's input does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

__all__: list[str] = []  # private module

LAYERS = (4, 16)
D_MODELS = (64, 256)
SEQS = (16, 128)
QUICK = "4x64x16"


class Config(NamedTuple):
    """One benchmark configuration: ``layers`` x ``d_model`` x ``seq`` (written ``4x64x16``)."""

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


def all_configs() -> list[Config]:
    """The issue's grid, small to large."""
    return [Config(layer, d, s) for layer in LAYERS for d in D_MODELS for s in SEQS]


def parse_configs(text: str) -> list[Config]:
    """Parse ``"all"`` or a comma-separated list of ``LAYERSxDMODELxSEQ`` (e.g. ``4x64x16,16x256x128``).

    Raises:
        ValueError: an item is not three positive integers joined by ``x``, or ``d_model`` is not a
            multiple of ``nhead`` (4).
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
        out.append(cfg)
    if not out:
        raise ValueError("--configs: no configuration given")
    return out


def build_stack(layers: int, d_model: int, nhead: int = 4, seed: int = 0) -> nn.Sequential:
    """A training-mode stack of ``layers`` encoder layers with deterministic weights."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
            )
            for _ in range(layers)
        ]
    ).train()


class Stage(NamedTuple):
    """A model with its input (requires grad) and the gradient arriving at its output."""

    model: nn.Sequential
    params: list[nn.Parameter]
    x: torch.Tensor
    grad: torch.Tensor


def build(cfg: Config, seed: int = 0) -> Stage:
    """Build ``cfg``'s model, input and output gradient (deterministic)."""
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
