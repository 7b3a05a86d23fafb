"""psdk's plugin hooks. Plugins implement them with ``@psdk.hookimpl``.

Hooks only *register* things: backends, update rules, models and datasets, as
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
