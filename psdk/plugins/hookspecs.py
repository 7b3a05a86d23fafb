"""psdk's plugin hooks. Plugins implement them with ``@psdk.hookimpl``.

Hooks only *register* things: backends, update rules, models, datasets, workloads and trainers, as
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
    dataclass whose fields are the job's ``model.*`` keys, ``name`` among
    them (what else it holds is between it and its workload), and the methods
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
    returning what the workload that reads it expects: the MNIST workload's
    datasets return a :class:`psdk.data.mnist.Mnist` (flat uint8 images and
    int labels); a workload's ``shard`` entry splits it between the workers
    and its ``check`` entry refuses a model that does not fit it.
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


GENERIC_WORKER = "psdk.jobs.worker:run_worker"
"""psdk's training loop, every workload's ``worker`` unless it brings its own: shard, trainer, ps, score."""
GENERIC_EVALUATE = "psdk.jobs.evaluate:run_evaluate"
"""psdk's evaluation of saved parameters, every workload's ``evaluate`` unless it brings its own."""


@dataclass(frozen=True)
class WorkloadRecord:
    """A workload a plugin provides (``workload=<name>``): what a job trains, on which data, scored how.

    A workload owns its data, its models, its loss, its metrics and its
    evaluation; psdk's training loop (``worker``) and evaluation
    (``evaluate``) run any workload through these entries, each
    ``"package.module:function"`` imported only when used (as model builders are):

    - ``shard``: ``function(request)`` with a
      :class:`~psdk.plugins.batches.ShardRequest` (which worker of how many,
      the ``data`` group, the model spec, the workload's options, the seed),
      returning that worker's :class:`~psdk.plugins.batches.Shard` (its
      training batches, the validation and test sets);
    - ``score``: ``function(predictions, batch)``, the metrics (a dict by
      metric name) of a trainer's numpy predictions for a batch: computed
      here once, whichever framework predicted;
    - ``check``: ``function(cfg)``, called by the launcher before any task
      starts: refuse (:class:`~psdk.errors.ConfigError`) a model that does
      not fit the data; ``""`` when there is nothing to check;
    - ``train_size``: ``function(cfg)``, the training examples of the whole
      job, which turns ``train.epochs`` into steps; ``""`` when the
      workload counts no epochs (give ``train.steps``);
    - ``prepare``: ``function(cfg)``, called once by the launcher before any
      task starts (a download, say), returning overrides for every task
      (``["data.dir=/where/it/went"]``); ``""`` when nothing is prepared;
    - ``data``: ``function(cfg)``, ``python -m psdk data``: fetch and check
      the data, print where it is, return an exit status; ``""`` when the
      workload has no data to check;
    - ``worker`` and ``evaluate``: psdk's own loop and evaluation
      (:data:`GENERIC_WORKER`, :data:`GENERIC_EVALUATE`) unless the workload
      brings its own, ``function(cfg)``.

    ``trainers`` maps a framework (a backend record's ``framework``) to the
    :class:`~psdk.plugins.trainer.Trainer` that trains the workload on it,
    ``"package.module:Name"``; a framework plugin may add one for its
    framework with a :class:`TrainerRecord`. ``options`` are the workload's
    own config keys with their defaults (``workload.<key>=...``), handed to
    its trainers and entries. ``metrics`` are the
    :class:`~psdk.plugins.metrics.MetricSpec` s it reports, which progress
    lines, ``summary.json``, curves, TensorBoard, comparisons and
    ``report.target`` show (its ``primary`` one is what a target judges).
    """

    name: str
    description: str
    trainers: Mapping[str, str] = field(default_factory=dict)
    shard: str = ""
    score: str = ""
    check: str = ""
    train_size: str = ""
    prepare: str = ""
    data: str = ""
    worker: str = GENERIC_WORKER
    evaluate: str = GENERIC_EVALUATE
    options: Mapping[str, Any] = field(default_factory=dict)
    metrics: tuple[MetricSpec, ...] = ()

    def __post_init__(self) -> None:
        """Refuse a record no job could run, and metrics no report could read."""
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
        generic = [e for e in ("worker", "evaluate") if getattr(self, e) in (GENERIC_WORKER, GENERIC_EVALUATE)]
        missing = [entry for entry in ("shard", "score") if generic and not getattr(self, entry)]
        if missing:
            raise PluginError(
                f"workload {self.name!r} runs on psdk's {' and '.join(generic)} but names no "
                f"{' or '.join(missing)} entry: psdk's loop reads the data of its shard and scores through its score"
            )

    def trainer(self, framework: str) -> str | None:
        """The trainer's target for ``framework`` (its own, else the one for every framework), None if none."""
        return self.trainers.get(framework, self.trainers.get("*"))


@hookspec
def psdk_register_workloads() -> list[WorkloadRecord]:  # type: ignore[empty-body]
    """Workloads this plugin provides (see :class:`WorkloadRecord`)."""


@dataclass(frozen=True)
class TrainerRecord:
    """A trainer a plugin gives a workload it does not own, for one framework.

    How a framework plugin makes an existing workload (psdk's MNIST, or
    another plugin's) train on its framework, without the workload naming
    it: ``target`` is ``"package.module:Name"`` of a
    :class:`~psdk.plugins.trainer.Trainer`. A workload's own ``trainers``
    entry for the same framework wins.
    """

    workload: str
    framework: str
    target: str


@hookspec
def psdk_register_trainers() -> list[TrainerRecord]:  # type: ignore[empty-body]
    """Trainers this plugin gives other workloads (see :class:`TrainerRecord`)."""
