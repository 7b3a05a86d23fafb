"""psdk's update rules on embedding rows against torch's own optimizers on ``nn.Embedding(sparse=True)``.

Each test runs torch's optimizer on an embedding and pushes the very same
sparse gradient (its indices, duplicates and all, and values) through a
real ps (:mod:`psdk.testing.row_rules`), then compares every row after every
step. Batches leave rows out on some steps, so a rule that moved an
untouched row's slots (not lazy) would show.

* ``torch.optim.SparseAdam`` = psdk ``Adam(epsilon_mode="tf")``: SparseAdam
  adds eps to the root of the uncorrected ``v`` and folds the bias
  corrections into the step size, and counts its step per parameter (every
  ``step()``, whichever rows the batch touched), as the ps counts its shard's
  applies.
* ``torch.optim.Adagrad`` (sparse) = psdk ``Adagrad`` with the same
  ``initial_accumulator_value`` and ``eps`` (outside the root).
* ``torch.optim.SGD`` (sparse) = psdk ``SGD``. With momentum torch takes a
  sparse gradient but keeps a buffer that goes on moving rows a batch did
  not touch (dense momentum, stored sparsely); psdk's rows follow
  TensorFlow 1.x's sparse momentum, which moves only touched rows: rows
  touched on every step agree with torch, the others are checked against
  TensorFlow 1.x's formula.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from psdk.ps.rules import SGD, Adagrad, Adam, UpdateRule
from psdk.testing.row_rules import table_on_a_ps

pytestmark = pytest.mark.timeout(60)

ROWS, DIM = 8, 3
BATCHES = [[1, 4, 4, 6], [1, 2], [4, 6, 6, 6, 0], [1], [2, 4], [6, 1, 1]]
"""Ids per step, with duplicates; rows 3, 5 and 7 are never touched, the others skip some steps."""
RTOL, ATOL = 1e-5, 1e-6

TorchOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Run:
    """Both sides of one run: where the rows started, each step's gradient, and both sides' rows after it."""

    initial: np.ndarray
    grads: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    after: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """(torch's rows, the ps's rows) after each step."""


def run_both(rule: UpdateRule, make: TorchOptimizer, batches: list[list[int]]) -> Run:
    """torch's optimizer and the ps's ``rule`` over ``batches``, from the same rows and the same gradients."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    with table_on_a_ps(rule, ROWS, DIM) as table:
        run = Run(table.initial())
        embedding = torch.nn.Embedding(ROWS, DIM, sparse=True)
        with torch.no_grad():
            embedding.weight.copy_(torch.from_numpy(run.initial))
        optimizer = make([embedding.weight])
        for ids in batches:
            weights = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
            optimizer.zero_grad(set_to_none=True)
            (embedding(torch.tensor(ids)) * weights).sum().backward()
            grad = embedding.weight.grad
            assert grad is not None and grad.is_sparse
            # As a worker sends it: ids and rows uncoalesced (the client sums duplicates, as torch coalesces).
            run.grads.append((grad._indices()[0].numpy().copy(), grad._values().numpy().copy()))
            table.push(*run.grads[-1])
            optimizer.step()
            run.after.append((embedding.weight.detach().numpy().copy(), table.rows(range(ROWS))))
    return run


def assert_same(run: Run) -> None:
    for step, (theirs, ours) in enumerate(run.after, start=1):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=f"step {step}")


def test_adam_on_rows_is_sparse_adam_with_tf_epsilon() -> None:
    """eps=0.05 makes its placement matter: the torch placement must part from SparseAdam where tf's agrees."""
    options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.9, "eps": 0.05}
    sparse_adam: TorchOptimizer = lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.9), eps=0.05)  # noqa: E731
    assert_same(run_both(Adam(**options, epsilon_mode="tf"), sparse_adam, BATCHES))
    theirs, ours = run_both(Adam(**options, epsilon_mode="torch"), sparse_adam, BATCHES).after[-1]
    assert float(np.abs(theirs - ours).max()) > 100 * ATOL


def test_adam_on_rows_leaves_untouched_rows_and_their_moments_alone() -> None:
    """Row 2 sits out steps 3 and 4 and comes back: its moments did not decay meanwhile, as SparseAdam's."""
    run = run_both(
        Adam(lr=0.1, epsilon_mode="tf"), lambda p: torch.optim.SparseAdam(p, lr=0.1), [[2, 0], [2], [0], [0], [2]]
    )
    assert_same(run)
    np.testing.assert_array_equal(run.after[1][1][2], run.after[3][1][2])  # not touched: not moved


@pytest.mark.parametrize("eps", [1e-10, 0.05])
def test_adagrad_on_rows_is_torch_adagrad_on_a_sparse_gradient(eps: float) -> None:
    rule = Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=eps)
    make: TorchOptimizer = lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=eps)  # noqa: E731
    assert_same(run_both(rule, make, BATCHES))


def test_sgd_on_rows_is_torch_sgd_on_a_sparse_gradient() -> None:
    assert_same(run_both(SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), BATCHES))


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_on_rows_is_tf1_sparse_momentum_which_torch_matches_on_rows_touched_every_step(
    nesterov: bool,
) -> None:
    batches = [[0, 1, 2], [0, 1, 1], [0, 2, 1], [1, 0]]  # row 2 sits out steps 2 and 4
    make: TorchOptimizer = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=nesterov)  # noqa: E731
    run = run_both(SGD(lr=0.1, momentum=0.9, nesterov=nesterov), make, batches)
    after = run.after
    every_step = [0, 1, 3, 4, 5, 6, 7]  # touched every time, or never
    for step, (theirs, ours) in enumerate(after, start=1):
        np.testing.assert_allclose(ours[every_step], theirs[every_step], rtol=RTOL, atol=ATOL, err_msg=f"{step}")
    assert float(np.abs(after[1][0][2] - after[0][0][2]).max()) > 1e-3, "torch's momentum moves untouched row 2"
    np.testing.assert_array_equal(after[1][1][2], after[0][1][2])  # psdk's does not

    # TensorFlow 1.x's sparse momentum (SparseApplyMomentum): only the touched rows' accumulators move.
    p, acc = run.initial.astype(np.float64), np.zeros((ROWS, DIM))
    for step, (ids, values) in enumerate(run.grads):
        touched, where = np.unique(ids, return_inverse=True)
        g = np.zeros((len(touched), DIM))
        np.add.at(g, where.reshape(-1), values)
        acc[touched] = 0.9 * acc[touched] + g
        p[touched] -= 0.1 * (g + 0.9 * acc[touched] if nesterov else acc[touched])
        np.testing.assert_allclose(run.after[step][1], p, rtol=RTOL, atol=ATOL, err_msg=f"step {step + 1}")
