"""A click-through model with an embedding table, trained through psdk's public API with torch.

A recommendation model is mostly one embedding table of which a batch reads a few rows.
Here each example has three hashed int64 features (a user, an item, a category), taken
modulo the table's size as TensorFlow 1.x scripts hashed them into buckets; the model sums
their rows (``nn.Embedding(..., sparse=True)``) into a linear head that predicts a click.
The table lives on the ps tasks, sharded by id: each step pulls only the rows of the
batch's ids and pushes only their gradients (``opt.step(next_ids=...)`` does both in one
round trip), never the table.

The script starts two ps tasks in threads of its own process (``psdk.serve``), without
CURVE (one trusted host), then trains as the chief worker and prints the loss falling:

    python examples/torch_click_model.py --steps 600

Clicks are synthetic: every feature value has a hidden score, and an example is clicked
with probability sigmoid(sum of its scores). tests/test_examples.py runs this script.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import psdk

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--batch_size", type=int, default=256)
parser.add_argument("--vocab", type=int, default=1 << 16, help="rows of the table: ids are hashed modulo this")
parser.add_argument("--dim", type=int, default=8)
parser.add_argument("--every", type=int, default=100, help="print the mean loss of this many steps")
FLAGS = parser.parse_args()

FIELDS = 3
VALUES = 2000
"""Distinct values per feature, each a random int64 (a hashed string, as it would arrive)."""


class ClickModel(nn.Module):
    """Rows of the example's features, summed, into a linear head: the logit of a click."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        # The rows only ever come from the ps: torch.empty maps no memory until rows are written.
        self.emb = nn.Embedding.from_pretrained(torch.empty(vocab, dim), freeze=False, sparse=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(dim=1)).squeeze(1)


class Clicks:
    """Synthetic impressions: Zipf-like feature values, each with a hidden score; clicked at sigmoid(sum)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.values = self.rng.integers(0, 1 << 62, size=(FIELDS, VALUES), dtype=np.int64)
        self.scores = self.rng.normal(0.0, 1.5, size=(FIELDS, VALUES))
        popularity = 1.0 / np.arange(1, VALUES + 1)
        self.p = popularity / popularity.sum()

    def batch(self, size: int) -> tuple[np.ndarray, torch.Tensor]:
        """(raw int64 feature ids of shape size x FIELDS, click labels)."""
        which = self.rng.choice(VALUES, size=(size, FIELDS), p=self.p)
        raw = self.values[np.arange(FIELDS), which]
        logit = self.scores[np.arange(FIELDS), which].sum(axis=1)
        clicked = self.rng.random(size) < 1.0 / (1.0 + np.exp(-logit))
        return raw, torch.from_numpy(clicked.astype(np.float32))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hosts = {"ps": ["127.0.0.1:0", "127.0.0.1:0"], "worker": ["localhost"]}
    servers = [psdk.serve(hosts, task_index=i, secure=False) for i in range(2)]
    cluster = psdk.ClusterSpec({"ps": [s.address for s in servers], "worker": ["localhost"]})

    model = ClickModel(FLAGS.vocab, FLAGS.dim)
    data = Clicks()
    with psdk.connect(cluster, task_index=0, steps=FLAGS.steps, secure=False) as session:
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)  # never stepped: it selects the ps's rule
        opt = psdk.DistributedOptimizer(optimizer, model, session, tables={"emb": {"sharding": "hash"}}, seed=1)
        opt.broadcast_parameters()
        raw, clicked = data.batch(FLAGS.batch_size)
        ids = raw % FLAGS.vocab  # hashed into the table's rows
        opt.pull_rows({"emb": ids})
        losses: list[float] = []
        while not session.should_stop():
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(torch.from_numpy(ids)), clicked)
            loss.backward()
            losses.append(loss.item())
            raw, clicked = data.batch(FLAGS.batch_size)  # the next batch, whose rows come back with this push
            ids = raw % FLAGS.vocab
            opt.step(next_ids={"emb": ids})
            if len(losses) % FLAGS.every == 0:
                print(f"step {session.global_step}: mean loss {np.mean(losses[-FLAGS.every :]):.4f}", flush=True)
        session.finish()  # ends the job: the ps tasks stop
    for server in servers:
        server.join(timeout=30)
    first, last = np.mean(losses[: FLAGS.every]), np.mean(losses[-FLAGS.every :])
    print(f"loss fell from {first:.4f} to {last:.4f}" if last < first else f"loss did not fall: {first} -> {last}")


if __name__ == "__main__":
    main()
