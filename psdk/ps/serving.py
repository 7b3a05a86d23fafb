"""A ps task from your own script: TensorFlow 1.x's ``tf.train.Server(...).join()``.

::

    cluster = psdk.ClusterSpec({"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2", "10.0.0.3"]})
    if job_name == "ps":
        server = psdk.serve(cluster, task_index=0, keys="keys")
        server.join()           # until the chief ends the job
    else:
        with psdk.connect(cluster, task_index, steps=1000, keys="keys") as session:
            ...

It is the ps of ``python -m psdk ps``, on the same code path
(:func:`psdk.ps.main.start_ps`): the config is composed from psdk's config
tree with the same overrides (``overrides=["ps.idle_timeout_s=120"]``), so a
mistyped key gets the same did-you-mean error, and the ps serves in a thread
of this process. It binds when :func:`serve` returns, so a taken address is
refused there, not later.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from psdk.errors import ConfigError, PsdkError
from psdk.protocol.cluster import ClusterSpec
from psdk.ps.main import PsTask, start_ps
from psdk.runtime.logs import TaskFilter, set_task_label, task_label

log = logging.getLogger(__name__)

SET_BY_ARGUMENTS = {
    "job_name": "it is always ps here",
    "task_index": "give it as task_index=",
    "ps_hosts": "give the cluster as the first argument",
    "worker_hosts": "give the cluster as the first argument",
    "ps_hosts_from": "give the cluster as the first argument",
    "transport.keys_dir": "give it as keys=",
    "transport.secure": "give it as secure=",
}
"""Keys a ps of ``python -m psdk ps`` takes on its command line that :func:`serve` takes as arguments."""

JOIN_POLL_S = 0.2
"""How often :meth:`PsServer.join` looks up: a Ctrl-C in the main thread is seen this soon."""


class PsServer:
    """A ps task serving in a thread of this process, until the chief ends the job or :meth:`stop`."""

    def __init__(self, task: PsTask, task_index: int):
        self.task_index = task_index
        self.address = task.address
        """The address bound, with the port the system picked for a ``:0`` one."""
        self._task = task
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.exit_code: int | None = None
        """None while it serves; then 0 once the chief shut the job down (or :meth:`stop`), else 1."""
        self._thread = threading.Thread(target=self._run, name=f"psdk-ps-{task_index}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.exit_code = self._task.run(self._stop)
            if self._stop.is_set():
                log.info("ps %d: stopped (PsServer.stop)", self.task_index)
        except BaseException as exc:  # handed to join(): the ps's own errors are its log's and its exit code's
            self._error, self.exit_code = exc, 1

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End serving now (within a tenth of a second), whatever the job's state; :meth:`join` then returns."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Block until the ps ends: True once it has, False if ``timeout`` seconds passed first.

        The chief's shutdown at the job's end (or :meth:`stop`) ends it
        cleanly; any other end (the chief aborted the job or vanished, a
        transport failure) raises a :class:`~psdk.errors.PsdkError` saying
        why. A Ctrl-C while waiting stops the ps, then interrupts as usual.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self._thread.is_alive():
                left = JOIN_POLL_S if deadline is None else min(JOIN_POLL_S, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._thread.join(left)
        except KeyboardInterrupt:
            self.stop()
            self._thread.join(timeout=5)
            raise
        if self._error is not None:
            raise PsdkError(f"ps {self.task_index} failed: {self._error!r}") from self._error
        if self.exit_code:
            failure = self._task.server.failure or "see its log"
            raise PsdkError(f"ps {self.task_index} ended with exit code {self.exit_code}: {failure}")
        return True

    def __enter__(self) -> PsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._thread.join(timeout=10)


def serve(
    cluster: ClusterSpec | Mapping[str, Any],
    task_index: int = 0,
    *,
    keys: Path | str | None = None,
    secure: bool = True,
    overrides: Sequence[str] | Mapping[str, Any] = (),
) -> PsServer:
    """Start ps task ``task_index`` of ``cluster`` in this process; :meth:`PsServer.join` waits for the job's end.

    ``keys``: the job's key folder (``python -m psdk keys keys_dir=DIR
    workers=N``), as ``transport.keys_dir`` for ``python -m psdk ps``; the
    workers pass the same folder to :func:`psdk.connect`. ``secure=False``
    (``transport.secure=false``) turns CURVE off, where every host and user
    is trusted. ``overrides``: any other key of ``python -m psdk ps``, as
    ``["ps.idle_timeout_s=120", "ps.bind=0.0.0.0"]`` or as a mapping
    ``{"ps.idle_timeout_s": 120}``. A mistake (a key that does not exist, a
    value of the wrong type, a task index out of range, an address taken)
    raises a :class:`~psdk.errors.ConfigError` or
    :class:`~psdk.errors.BindError` here. When the script has configured no
    logging, the ps logs to the console as ``python -m psdk ps`` does.
    """
    spec = cluster if isinstance(cluster, ClusterSpec) else _cluster(cluster)
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ConfigError("task_index", f"must be a whole number, got {task_index!r}")
    spec.check_task("ps", task_index)
    if keys is None and secure:
        raise ConfigError(
            "keys",
            "psdk.serve needs the job's keys: keys=DIR, a folder made by `python -m psdk keys keys_dir=DIR "
            "workers=N`, which the workers pass to psdk.connect(keys=DIR) too; or secure=False on every task, "
            "where every host and user is trusted",
        )
    cfg = _composed(_override_list(overrides))
    cfg.task_index = task_index
    cfg.ps_hosts = spec.as_dict()["ps"]
    cfg.worker_hosts = spec.as_dict()["worker"]
    cfg.transport.secure = bool(secure)
    cfg.transport.keys_dir = str(Path(keys)) if keys is not None else None
    _log_to_console(f"ps {task_index}")
    return PsServer(start_ps(cfg), task_index)


def _cluster(cluster: object) -> ClusterSpec:
    if not isinstance(cluster, Mapping):
        raise ConfigError(
            "cluster", f"must be a psdk.ClusterSpec or a dict of ps and worker hosts, got {type(cluster).__name__}"
        )
    return ClusterSpec(cluster)


def _override_list(overrides: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """``key=value`` strings, as on ``python -m psdk ps``'s command line; refused where an argument says it."""
    if isinstance(overrides, str):
        raise ConfigError("overrides", f"must be a list of key=value strings, got the string {overrides!r}")
    if isinstance(overrides, Mapping):
        texts = [f"{key}={_value(value)}" for key, value in overrides.items()]
    else:
        texts = [str(text) for text in overrides]
    for text in texts:
        key = text.split("=", 1)[0].lstrip("+~")
        if "=" not in text:
            raise ConfigError(key, f"{text!r} is no override: write key=value, e.g. ps.idle_timeout_s=120")
        if key in SET_BY_ARGUMENTS:
            raise ConfigError(key, f"is an argument of psdk.serve, not an override: {SET_BY_ARGUMENTS[key]}")
    return texts


def _value(value: Any) -> str:
    """A Python value as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def _composed(overrides: list[str]) -> DictConfig:
    """psdk's config for a ps task with ``overrides``, checked and explained as on the command line."""
    from psdk.config import config_dir, prepare_hydra
    from psdk.config.check import OverrideChecker
    from psdk.config.ranges import check_ranges

    prepare_hydra()
    # No Hydra run here: the output folder would come from it. A ps writes nothing there.
    given = ["job_name=ps", "output_dir=.", *overrides]
    with _hydra_set_aside():
        cfg = OverrideChecker(config_dir()).composed(given)
    OmegaConf.set_struct(cfg, True)
    check_ranges(cfg)  # every numeric key in its range, as on the command line
    return cfg


@contextlib.contextmanager
def _hydra_set_aside() -> Iterator[None]:
    """A script that runs under ``@hydra.main`` keeps its Hydra: psdk composes its own config beside it."""
    from hydra.core.global_hydra import GlobalHydra

    held = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if held is not None:
            GlobalHydra.instance().initialize(held)


def _log_to_console(label: str) -> None:
    """psdk's log lines on stdout, as a task's, unless the script configured logging itself."""
    psdk_log = logging.getLogger("psdk")
    if logging.getLogger().handlers or psdk_log.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(task)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(TaskFilter())
    psdk_log.addHandler(handler)
    if psdk_log.level == logging.NOTSET:
        psdk_log.setLevel(logging.INFO)
    if task_label() == "psdk":
        set_task_label(label)
