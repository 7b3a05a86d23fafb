"""The CTR peers' DLRM in plain torch, as a user writes it: ``nn.Sequential`` MLPs, ``bmm``, ``triu_indices``.

Only the dense part lives here: it takes the batch's 26 field rows already
looked up (``[B, 26, dim]``), so the single process feeds it an
``nn.Embedding``'s output and the RPC workers feed it rows pulled from the ps.
Same shape and order as psdk's ``model=dlrm`` (:mod:`psdk.workloads.ctr.model`):
vectors ``[bottom output, field 0, ..., field 25]``, their dot products
``i < j`` in row-major order, then the top MLP over ``[bottom output, dots]``.
Plain autograd throughout (no custom backward): the loop a user writes.

This module imports torch: tasks import it, launchers never do.
"""

from __future__ import annotations

import argparse
from typing import Any

import _ctr
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.workloads.ctr.data import FIELDS


def set_threads(threads: int) -> None:
    """``--threads`` intra-op threads and one inter-op thread, as every peer process runs."""
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def _mlp(sizes: list[tuple[int, int]], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(sizes):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or i < len(sizes) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseDlrm(nn.Module):
    """Bottom MLP, pairwise dots of the 27 vectors, top MLP; ``forward(dense, rows)`` gives logits [B]."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        layers = _ctr.spec(args).layers()
        self.bottom = _mlp([(i, o) for name, i, o in layers if name.startswith("bottom")], last_relu=True)
        self.top = _mlp([(i, o) for name, i, o in layers if name.startswith("top")], last_relu=False)
        rows, cols = torch.triu_indices(FIELDS + 1, FIELDS + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        load_dense(self, _ctr.initial_weights(args))

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), rows], dim=1)  # [B, 27, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def linears(model: DenseDlrm) -> dict[str, nn.Linear]:
    """psdk's layer names (``bottom0``, ``bottom1``, ``top0``, ``top1``) -> the model's ``nn.Linear``s."""
    out: dict[str, nn.Linear] = {}
    for prefix, seq in (("bottom", model.bottom), ("top", model.top)):
        for i, layer in enumerate(m for m in seq if isinstance(m, nn.Linear)):
            out[f"{prefix}{i}"] = layer
    return out


def load_dense(model: DenseDlrm, weights: dict[str, np.ndarray]) -> None:
    """psdk's initial dense weights (kernels (in, out)) into torch's ``nn.Linear`` (weight (out, in))."""
    with torch.no_grad():
        for name, layer in linears(model).items():
            layer.weight.copy_(torch.from_numpy(weights[f"{name}/kernel"].T))
            layer.bias.copy_(torch.from_numpy(weights[f"{name}/bias"]))


def loss_fn(logits: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
    """Mean binary cross-entropy with logits."""
    return F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels))


def init_rows(rows: int, args: argparse.Namespace, seed: int) -> torch.Tensor:
    """``rows`` x ``dim`` float32 rows drawn N(0, init_scale**2) (psdk's 0.01) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(rows, args.dim).normal_(0.0, _ctr.spec(args).init_scale, generator=gen)


def predict(model: DenseDlrm, dense: np.ndarray, rows_of: Any, chunk: int = 4096) -> np.ndarray:
    """Logits of the test set; ``rows_of(cat [n, 26]) -> tensor [n, 26, dim]`` looks the rows up."""
    out = []
    with torch.no_grad():
        for start in range(0, len(dense), chunk):
            d = torch.from_numpy(dense[start : start + chunk])
            out.append(model(d, rows_of(start, start + chunk)).numpy())
    return np.concatenate(out)
