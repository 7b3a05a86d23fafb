"""psdk's plugin hooks. Plugins implement them with ``@psdk.hookimpl``.

Hooks only *register* things: backends, update rules, models, datasets and workloads, as
small records (or, for rules, the numpy-only rule classes themselves); the
behaviour lives in what the records point to (see :class:`psdk.plugins.backend.Backend`).
psdk's own built-ins register through these same hooks. A plugin is found
through the ``psdk`` entry-point group::

    [project.entry-points.psdk]
    mybackend = "psdk_mybackend.plugin"

and its module must be cheap to import: no framework, no sockets, no prints.
Always call hooks with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from psdk.errors import PluginError
from psdk.plugins.metrics import MetricSpec

if TYPE_CHECKING:
    from psdk.ps.rules import UpdateRule

hookspec = pluggy.HookspecMarker("psdk")
hookimpl = pluggy.HookimplMarker("psdk")


@dataclass(frozen=True)
class BackendRecord:
    """A backend a plugin provides: its whole identity, declared once.

    ``target`` is ``"package.module:ClassName"`` of a :class:`psdk.plugins.backend.Backend`
    subclass, imported only when the backend is used, so listing backends never
    imports a framework. ``framework`` is the framework's top-level module,
    checked for (never imported) before a job starts. ``modules`` names other
    top-level modules whose objects belong to this backend, for frameworks split
    across packages: TensorFlow's optimizers live in ``keras``, JAX's in
    ``optax``. Never list the plugin's own package there: it is imported to
    register the plugin, so nothing is learnt from its being loaded.

    ``aliases`` are other names ``backend=`` accepts (``pytorch`` for ``torch``);
    ``install`` tells a user whose environment lacks the framework how to get it;
    ``options`` are the plugin's own settings with their defaults, which a job
    overrides as ``backend_options.<name>.<key>=...`` and the backend reads from
    :attr:`psdk.plugins.backend.Backend.options`.
    """

    name: str
    target: str
    framework: str
    description: str = ""
    modules: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    install: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)


@hookspec
def psdk_register_backends() -> list[BackendRecord]:  # type: ignore[empty-body]
    """Backends this plugin provides.

    Example::

        @psdk.hookimpl
        def psdk_register_backends():
            return [BackendRecord("torch", "psdk_torch.backend:TorchBackend", "torch")]
    """


@dataclass(frozen=True)
class ModelRecord:
    """A model a plugin provides (``model=<name>`` in a job).

    ``target`` is ``"package.module:Class"`` of the model's spec: a frozen
    dataclass whose fields are the job's ``model.*`` keys, with ``name``,
    ``input_dim`` and ``num_classes`` among them, and the methods
    ``variables()`` (canonical names and shapes, in order) and
    ``init_weights(seed)`` (numpy), so every backend starts from the same
    weights. It must import no framework. ``builders`` maps a backend's name
    to ``"package.module:function"``, called as ``function(backend, spec,
    weights)`` to build the model on that backend; a model without builders is
    one every backend builds itself (psdk's dense stacks). A mixed job needs a
    builder for every backend in it.
    """

    name: str
    target: str
    builders: Mapping[str, str] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset a plugin provides (``data.name=<name>``).

    ``target`` is ``"package.module:function"``, called as ``function(data)``
    with the job's ``data`` config node (``dir``, ``cache_dir``, ...) and
    returning a :class:`psdk.data.mnist.Mnist`: flat uint8 images (0-255,
    which psdk scales to [0, 1]) and int labels for training and test, which
    psdk splits between the workers.
    """

    name: str
    target: str
    description: str = ""


@hookspec
def psdk_register_rules() -> list[type[UpdateRule]]:  # type: ignore[empty-body]
    """Update rules (subclasses of :class:`psdk.ps.rules.UpdateRule`) this plugin provides to the ps.

    A rule's ``name`` is what ``optimizer=<name>`` selects; its dataclass
    fields are its hyper-parameters (the job's ``optimizer.*`` keys) and its
    ``slot_names()`` the per-parameter buffers the ps keeps and checkpoints.
    """


@hookspec
def psdk_register_models() -> list[ModelRecord]:  # type: ignore[empty-body]
    """Models this plugin provides (see :class:`ModelRecord`)."""


@hookspec
def psdk_register_datasets() -> list[DatasetRecord]:  # type: ignore[empty-body]
    """Datasets this plugin provides (see :class:`DatasetRecord`)."""


@dataclass(frozen=True)
class WorkloadRecord:
    """A workload a plugin provides (``workload=<name>``): what a job trains, and how each command runs it.

    A workload is the job around the parameter server: its data, its models,
    its training loop, its evaluation. The CLI and the launchers run the one
    chosen through these entries, each ``"package.module:function"``,
    imported only when used (as model builders are):

    - ``worker``: ``function(cfg)``, one worker task of the job
      (``python -m psdk worker``, and every worker ``run`` starts);
    - ``evaluate``: ``function(cfg)``, returning a dict with the metrics of
      the saved parameters ``cfg.weights`` (``python -m psdk evaluate``,
      which the launcher runs for each backend the chief does not use);
    - ``prepare``: ``function(cfg)``, called once by the launcher before any
      task starts (a download, say), returning overrides for every task
      (``["data.dir=/where/it/went"]``); ``""`` when nothing is prepared;
    - ``data``: ``function(cfg)``, ``python -m psdk data``: fetch and check
      the data, print where it is, return an exit status; ``""`` when the
      workload has no data to check.

    ``trainers`` maps a framework (a backend record's ``framework``) to what
    trains the workload on it, ``"package.module:Name"``; the key ``"*"``
    stands for every framework, for a trainer written on the
    :class:`psdk.plugins.backend.Backend` contract alone. ``options`` are the
    workload's own config keys with their defaults, the ``workload.*`` keys
    a job overrides (``workload.<key>=...``). ``metrics`` are the
    :class:`~psdk.plugins.metrics.MetricSpec` s the workload reports, which
    progress lines, ``summary.json``, curves, TensorBoard, comparisons and
    ``report.target`` show (its ``primary`` one is what a target judges).
    """

    name: str
    description: str
    trainers: Mapping[str, str]
    worker: str
    evaluate: str
    prepare: str = ""
    data: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    metrics: tuple[MetricSpec, ...] = ()

    def __post_init__(self) -> None:
        """Refuse metrics no report could read: a name twice, two primaries, something not a MetricSpec."""
        metrics = tuple(self.metrics)
        object.__setattr__(self, "metrics", metrics)  # a list given is kept as the tuple a frozen record holds
        names = [getattr(m, "name", None) for m in metrics]
        problem = (
            "lists something that is not a psdk.MetricSpec"
            if not all(isinstance(m, MetricSpec) for m in metrics)
            else "declares a metric twice"
            if len(set(names)) != len(names)
            else "marks more than one metric primary"
            if sum(m.primary for m in metrics) > 1
            else None
        )
        if problem is not None:
            raise PluginError(f"workload {self.name!r} {problem}: metrics={list(metrics)!r}")

    def trainer(self, framework: str) -> str | None:
        """The trainer's target for ``framework`` (its own, else the one for every framework), None if none."""
        return self.trainers.get(framework, self.trainers.get("*"))


@hookspec
def psdk_register_workloads() -> list[WorkloadRecord]:  # type: ignore[empty-body]
    """Workloads this plugin provides (see :class:`WorkloadRecord`)."""
