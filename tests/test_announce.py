"""How `run` starts workers together with the ps: addresses told through files, waited for with a bound."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest

import psdk
from psdk.errors import PsdkError
from psdk.launch import announce
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.ps.rules import SGD

from .conftest import running_ps
from .helpers import FAST
from .jobs import FAST_FLAGS
from .jobs import psdk as psdk_command

pytestmark = pytest.mark.timeout(60)


def test_a_worker_waits_for_every_ps_to_announce_its_address(tmp_path: Path) -> None:
    announced = threading.Event()

    def announce_later() -> None:
        announced.wait(10)
        announce.announce(announce.file_for(tmp_path, 1), "tcp://127.0.0.1:2223")

    threading.Thread(target=announce_later, daemon=True).start()
    announce.announce(announce.file_for(tmp_path, 0), "tcp://127.0.0.1:2222")
    polls = []

    def still_worth_it() -> None:
        polls.append(1)
        announced.set()  # ps 1 announces only once the reader has waited for it

    assert announce.wait_for(tmp_path, 2, 10.0, still_worth_it) == ["127.0.0.1:2222", "127.0.0.1:2223"]
    assert polls  # it did wait


def test_waiting_for_a_ps_that_never_announces_ends_with_a_clear_error(tmp_path: Path) -> None:
    announce.announce(announce.file_for(tmp_path, 0), "tcp://127.0.0.1:2222")
    with pytest.raises(PsdkError, match=rf"ps 1 did not announce an address in {tmp_path} within 0 s"):
        announce.wait_for(tmp_path, 2, 0.2)


def test_a_launcher_stops_waiting_when_its_ps_died(tmp_path: Path) -> None:
    def dead() -> None:
        raise RuntimeError("ps 0 exited with code 1")

    with pytest.raises(RuntimeError, match="ps 0 exited"):
        announce.wait_for(tmp_path, 1, 30.0, dead)


# ------------------------------------------------------------------ DistributedOptimizer(rule=...)
SPEC = ModelSpec(hidden=(8,), input_dim=16, num_classes=4)


def test_a_rule_named_directly_is_the_one_the_ps_runs() -> None:
    with running_ps(1) as ps:
        backend = NumpyBackend()
        model = backend.build_model(SPEC, init_weights(SPEC, 0))
        rule = SGD(lr=0.125, momentum=0.5)
        with psdk.connect(ps.cluster(1), 0, steps=1, options=FAST, transport=ps.transport) as session:
            optimizer = psdk.DistributedOptimizer(None, model, session, backend=backend, rule=rule)
            optimizer.broadcast_parameters()
            assert optimizer.rule == rule
            assert ps.servers[0].store.rule == rule
            with pytest.raises(PsdkError, match="a framework optimizer or a rule=, not both"):
                psdk.DistributedOptimizer(rule, model, session, backend=backend, rule=rule)
            with pytest.raises(PsdkError, match=r"needs a framework optimizer, or the ps's rule: rule=psdk\.rules"):
                psdk.DistributedOptimizer(None, model, session)
            found = psdk.DistributedOptimizer(model=model, session=session, rule=psdk.rules.SGD(lr=0.125))
            assert found.backend.name == "numpy"  # no backend=: the one that owns the model


def test_a_second_launcher_in_the_same_run_folder_is_refused_before_it_starts_anything(tmp_path: Path) -> None:
    """Two runs started in the same second share a folder: the second one fails, it never mixes with the first."""
    (tmp_path / "tasks").mkdir()
    with (tmp_path / "tasks" / "launcher.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running launcher holds it
        result = psdk_command("run", "backend=numpy", *FAST_FLAGS, out=tmp_path, timeout=60)
    assert result.returncode != 0
    assert f"another launcher is running a job in {tmp_path}" in result.stderr + result.stdout
    assert not list((tmp_path / "tasks").glob("*.pid")) and not (tmp_path / "keys").exists()
