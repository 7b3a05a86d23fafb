"""Checkpoints: a consistent cut by variable name, written atomically, resumed anywhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psdk.client import checkpoint
from psdk.errors import DataError, PsdkError
from psdk.plugins.models import ModelSpec
from psdk.ps.rules import SGD, Adam

from .conftest import running_ps
from .helpers import train_threads

SPEC = ModelSpec(hidden=(16,), input_dim=32, num_classes=10)
RNG = np.random.default_rng(7)
X = RNG.random((60, 2, 10, 32), dtype=np.float32)  # global step, worker, batch, features
Y = RNG.integers(0, 10, (60, 2, 10))


def by_step(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    return X[step % 60, worker], Y[step % 60, worker]


def sample(step: int = 5) -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(
        global_step=step,
        variables={"a/kernel": np.ones((2, 3), np.float32), "a/bias": np.zeros(3, np.float32)},
        slots={"m": {"a/kernel": np.full((2, 3), 0.5, np.float32), "a/bias": np.ones(3, np.float32)}},
        rule={"name": "adam", "lr": 0.1},
        rule_step=step,
        config="seed: 1\n",
    )


def test_a_checkpoint_round_trips_by_variable_name(tmp_path: Path) -> None:
    path = checkpoint.save(sample(), checkpoint.path_for(tmp_path, 5))
    assert path.name == "ckpt-5.npz" and [p.name for p in tmp_path.iterdir()] == ["ckpt-5.npz"]
    back = checkpoint.load(path)
    assert (back.global_step, back.rule, back.rule_step, back.config) == (
        5,
        {"name": "adam", "lr": 0.1},
        5,
        "seed: 1\n",
    )
    np.testing.assert_array_equal(back.slots["m"]["a/bias"], np.ones(3))
    assert list(back.variables) == ["a/kernel", "a/bias"]


def test_a_folder_resumes_from_its_latest_checkpoint(tmp_path: Path) -> None:
    for step in (5, 40, 12):
        checkpoint.save(sample(step), checkpoint.path_for(tmp_path, step))
    assert checkpoint.load(tmp_path).global_step == 40
    with pytest.raises(DataError, match="no checkpoint"):
        checkpoint.load(tmp_path / "empty")


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (5, 40, 12, 100):
        checkpoint.save(sample(step), checkpoint.path_for(tmp_path, step))
    removed = checkpoint.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["ckpt-12.npz", "ckpt-5.npz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-100.npz", "ckpt-40.npz"]
    assert checkpoint.prune(tmp_path, 0) == []


def test_what_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"cannot be read as a psdk checkpoint \(not an \.npz file\); "):
        checkpoint.load(tmp_path / "junk.npz")
    np.save(tmp_path / "array.npy", np.ones(2))  # numpy reads it, but as one array: no checkpoint either
    with pytest.raises(DataError, match=r"\(not an \.npz file\)"):
        checkpoint.load(tmp_path / "array.npy")
    np.savez(tmp_path / "params.npz", w=np.ones(2))
    with pytest.raises(DataError, match="cannot be read"):
        checkpoint.load(tmp_path / "params.npz")
    assert list(checkpoint.load_weights(tmp_path / "params.npz")) == ["w"]


def test_a_checkpoint_for_another_model_names_the_differences() -> None:
    with pytest.raises(DataError) as info:
        sample().check_matches({"a/kernel": (2, 3), "b/bias": (3,)})
    assert "b/bias" in str(info.value) and "a/bias" in str(info.value)


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resuming_with_another_number_of_ps_continues_exactly(tmp_path: Path, before: int, after: int) -> None:
    rule = Adam(lr=0.01)  # slots and the rule's step must carry over for this to match
    with running_ps(before) as ps:
        full = train_threads(
            ps.cluster(2),
            ps.transport,
            SPEC,
            rule,
            40,
            by_step,
            sync="sync",
            by_global_step=True,
            checkpoint_at=15,
            checkpoint_dir=tmp_path,
        )
    saved = checkpoint.load(full["checkpoint"])
    assert saved.global_step == 15 and saved.rule_step == 15 and set(saved.slots) == {"m", "v"}
    with running_ps(after) as ps:
        resumed = train_threads(
            ps.cluster(2), ps.transport, SPEC, rule, 40, by_step, sync="sync", by_global_step=True, resume=saved
        )
    assert resumed["local_steps"] == {0: 25, 1: 25}
    for name, value in full["params"].items():
        np.testing.assert_allclose(resumed["params"][name], value, atol=1e-5, rtol=0)


def test_an_async_checkpoint_is_a_consistent_cut_while_others_push(tmp_path: Path) -> None:
    with running_ps(2) as ps:
        result = train_threads(
            ps.cluster(2),
            ps.transport,
            SPEC,
            SGD(lr=0.1, momentum=0.9),
            300,
            by_step,
            checkpoint_at=100,
            checkpoint_dir=tmp_path,
        )
    saved = checkpoint.load(result["checkpoint"])
    # Both shards stood at one version when read (the client refuses otherwise), and the
    # momentum rule had applied exactly that many updates on each of them.
    assert saved.global_step >= 100 and saved.rule_step == saved.global_step
    assert result["stats"][0]["version"] == result["stats"][1]["version"] == 300


def test_resuming_with_another_optimizer_says_which_one_to_use(tmp_path: Path) -> None:
    with running_ps(1) as ps:
        result = train_threads(
            ps.cluster(1), ps.transport, SPEC, Adam(lr=0.01), 10, by_step, checkpoint_at=5, checkpoint_dir=tmp_path
        )
    saved = checkpoint.load(result["checkpoint"])
    with running_ps(1) as ps, pytest.raises(PsdkError, match="optimizer=adam"):
        train_threads(ps.cluster(1), ps.transport, SPEC, SGD(lr=0.1), 10, by_step, resume=saved)
