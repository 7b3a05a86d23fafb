"""Full and read-only disks: one line naming the file and the fix, never a traceback (docs/recovery.md).

Every disk here is real: a tmpfs of a few MiB fills up (ENOSPC), and one
remounted read-only refuses writes (EROFS) even to root, who ignores mode
bits. Mounting needs root (or CAP_SYS_ADMIN): without it these tests skip,
saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from psdk.client import checkpoint
from psdk.report.metrics import MetricsLog
from psdk.runtime.disks import WriteError

from .jobs import FAST_FLAGS, env, psdk

pytestmark = pytest.mark.timeout(60)

TWO_CHECKPOINTS = "800k"
"""A checkpoint of the job below (784-100-10 MLP, plain SGD: no slots) takes about 320 KB: two fit, not three."""
JOB = ("backend=numpy", "model=mlp", "model.hidden=[100]", "optimizer=sgd", "checkpoint.every_seconds=0")


def _mount(folder: Path, *options: str) -> None:
    done = subprocess.run(["mount", *options, folder], capture_output=True, text=True, timeout=20, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip() or done.returncode}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (resize it with :func:`resize`), unmounted whatever the test did."""
    folder = tmp_path / "disk"
    folder.mkdir()
    _mount(folder, "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], capture_output=True, timeout=20, check=False)


def resize(folder: Path, size: str) -> None:
    _mount(folder, "-o", f"remount,size={size}")


def read_only(folder: Path) -> None:
    _mount(folder, "-o", "remount,ro")


def a_checkpoint(step: int, floats: int = 150_000) -> checkpoint.Checkpoint:
    rng = np.random.default_rng(step)
    return checkpoint.Checkpoint(step, {"w": rng.standard_normal(floats).astype(np.float32)})


def test_a_checkpoint_the_disk_refuses_leaves_no_file_and_every_older_one_intact(tmpfs: Path) -> None:
    written = []
    with pytest.raises(WriteError) as refused:
        for step in range(1, 20):  # 600 KB each: the 2 MiB disk is full by the fourth
            written.append(checkpoint.save(a_checkpoint(step), checkpoint.path_for(tmpfs, step, "run")))
    message = str(refused.value)
    assert len(written) == 3
    assert f"cannot write {tmpfs}/ckpt-run-4.npz: No space left on device (ENOSPC); free space on {tmpfs}" in message
    assert message.endswith("or set checkpoint.dir=<a folder on another file system>")
    assert sorted(p.name for p in tmpfs.iterdir()) == sorted(p.name for p in written)  # no partial, no temporary
    for path in written:
        assert checkpoint.load(path).global_step == checkpoint.step_of(path)

    read_only(tmpfs)
    with pytest.raises(WriteError, match=rf"Read-only file system \(EROFS\); {tmpfs} is mounted read-only: set "
                       r"checkpoint.dir=<a writable folder>$"):  # fmt: skip
        checkpoint.save(a_checkpoint(1, 10), checkpoint.path_for(tmpfs, 1, "other"))


SKIPPED = re.compile(
    r"checkpoint not written \(training goes on; the next is tried when due\): "
    r"cannot write \S+/ckpt-[^ ]+-(\d+)\.npz: No space left on device"
)
"""The chief's warning for a periodic checkpoint the disk refused; the group is its global step."""


@pytest.mark.parametrize("final", [False, True])
def test_periodic_checkpoints_that_do_not_fit_are_skipped_and_training_goes_on(
    tmp_path: Path, tmpfs: Path, final: bool
) -> None:
    resize(tmpfs, TWO_CHECKPOINTS)
    out = tmp_path / "run"
    result = psdk(
        "run", *JOB, "train.steps=400", "checkpoint.every_steps=40", "checkpoint.keep=2", f"checkpoint.final={final}",
        f"checkpoint.dir={tmpfs}", *FAST_FLAGS, out=out, timeout=50,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    skipped = [int(step) for step in SKIPPED.findall(output)]
    assert len(set(skipped)) >= 2, output[-3000:]  # each due checkpoint tried again, each refused
    kept = sorted(tmpfs.iterdir())
    assert len(kept) == 2, kept  # nothing pruned after a failed write, no partial file
    assert all((checkpoint.step_of(p) or 0) < min(skipped) for p in kept)  # the good older ones stay ...
    for path in kept:
        checkpoint.load(path)  # ... whole
    assert (out / "summary.json").is_file() and (out / "params.npz").is_file(), output[-3000:]
    if not final:
        assert result.returncode == 0, output[-3000:]
        return
    # The final checkpoint is a result: the others are written, then the run fails with one line saying why.
    assert result.returncode == 1
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert re.search(r"worker 0 ERROR cannot write \S+/ckpt-\S+-400\.npz: No space left on device \(ENOSPC\); "
                     rf"free space on {tmpfs} \(.* free\) or set checkpoint.dir=", errors[0]), errors  # fmt: skip
    assert len(errors) == 2 and "the chief (worker 0) exited with code 2 (cannot write" in errors[1], errors


def test_a_result_that_cannot_be_written_at_the_end_fails_the_run_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "params.npz").mkdir(parents=True)  # something in the way of the final weights
    result = psdk("run", *JOB, "train.steps=200", *FAST_FLAGS, out=out, timeout=50)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert errors[0].endswith(
        f"worker 0 ERROR cannot write {out}/params.npz: Is a directory (EISDIR); {out}/params.npz is a folder where "
        "a file must be: move it or set hydra.run.dir=<a writable folder>"
    ), errors
    assert len(errors) == 2 and "launcher ERROR the chief (worker 0) exited with code 2" in errors[1], errors
    assert not list(out.glob(".params.npz*"))  # no partial file left behind


def test_points_a_full_disk_refuses_are_counted_and_training_goes_on(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    filler = tmpfs / "filler"
    log = MetricsLog(tmpfs / "metrics.jsonl")
    point = {"task": "worker0", "global_step": 0, "loss": 0.5, "note": "x" * 300}
    with filler.open("wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * (2 * 1024 * 1024))
    os.truncate(filler, filler.stat().st_size - 4096)  # one page left: a dozen points, then one cut short
    for step in range(100):
        log.write({**point, "global_step": step})  # never raises: the disk fills within a few points
    assert log.dropped > 0
    refusals = [r.getMessage() for r in caplog.records if "points not written" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].endswith("or set hydra.run.dir=<a folder on another file system>")
    assert f"cannot write {tmpfs}/metrics.jsonl: No space left on device (ENOSPC); free space on {tmpfs}" in refusals[0]
    filler.unlink()  # space again: the next point goes in, on a line of its own
    log.write({**point, "global_step": 1000})
    log.close()
    assert any("is written again" in r.getMessage() for r in caplog.records)
    lines = (tmpfs / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["global_step"] == 1000
    whole = [json.loads(line)["global_step"] for line in lines[:-1] if line.endswith("}")]
    assert whole == list(range(len(whole))) and len(whole) >= 5  # the points that fitted, whole
    assert len(lines) - 1 - len(whole) == 1  # and the one cut short, on a line of its own


def refused_before_any_task(result: subprocess.CompletedProcess[str]) -> str:
    """The one line of a run refused for its folders: exit 2, nothing started, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and "starting ps" not in output, output
    lines = [line for line in output.splitlines() if "cannot" in line]
    assert len(lines) == 1, output
    return lines[0]


def test_a_read_only_run_folder_is_refused_before_any_task_starts(tmp_path: Path, tmpfs: Path) -> None:
    read_only(tmpfs)
    line = refused_before_any_task(psdk("run", "backend=numpy", out=tmpfs / "run"))
    assert line == (
        f"psdk: error: cannot create the folder {tmpfs}/run: Read-only file system (EROFS); {tmpfs} is mounted "
        "read-only: set hydra.run.dir=<a writable folder>"
    )
    # The default folder (outputs/<date>/<time> under the current one), and a multirun's.
    for args, key in ((["run", "backend=numpy"], "hydra.run.dir"), (["run", "-m", "seed=1,2"], "hydra.sweep.dir")):
        result = subprocess.run(
            [sys.executable, "-m", "psdk", *args], capture_output=True, text=True, timeout=50, env=env(), cwd=tmpfs
        )
        assert refused_before_any_task(result).endswith(f"is mounted read-only: set {key}=<a writable folder>")
    # A command outside Hydra, the same.
    line = refused_before_any_task(psdk("keys", f"keys_dir={tmpfs}/keys"))
    assert line == f"psdk: error: cannot write {tmpfs}/keys: Read-only file system (EROFS); {tmpfs} is mounted " + (
        "read-only: set keys_dir=<a writable folder>"
    )
    # A checkpoint folder that could never be written is refused before training, not found out at its end.
    line = refused_before_any_task(psdk("run", "backend=numpy", f"checkpoint.dir={tmpfs}/ck", out=tmp_path / "run"))
    assert line.endswith(f"cannot create the folder {tmpfs}/ck: Read-only file system (EROFS); {tmpfs} is mounted "
                         "read-only: set checkpoint.dir=<a writable folder>")  # fmt: skip


def test_a_file_in_the_way_of_the_run_folder_is_refused_before_any_task_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "results"
    blocker.write_text("not a folder")
    line = refused_before_any_task(psdk("run", "backend=numpy", out=blocker / "run"))
    assert line == (
        f"psdk: error: cannot create the folder {blocker}/run: Not a directory (ENOTDIR); {blocker} is a file where "
        "a folder must be: move it or set hydra.run.dir=<a writable folder>"
    )
