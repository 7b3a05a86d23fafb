"""psdk's plugin hooks. Plugins implement them with ``@psdk.hookimpl``.

Hooks only *register* things, as small records; the behaviour lives in the
classes the records point to (see :class:`psdk.backend.Backend`). A plugin is
found through the ``psdk`` entry-point group::

    [project.entry-points.psdk]
    mybackend = "psdk_mybackend.plugin"

and its module must be cheap to import: no framework, no sockets, no prints.
Always call hooks with keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

hookspec = pluggy.HookspecMarker("psdk")
hookimpl = pluggy.HookimplMarker("psdk")


@dataclass(frozen=True)
class BackendRecord:
    """A backend a plugin provides.

    ``target`` is ``"package.module:ClassName"`` of a :class:`psdk.backend.Backend`
    subclass, imported only when the backend is used, so listing backends never
    imports a framework. ``modules`` names other top-level modules whose objects
    belong to this backend, for frameworks split across packages: TensorFlow's
    optimizers live in ``keras``, so the TensorFlow backend lists it, and
    ``DistributedOptimizer(keras.optimizers.SGD(...), ...)`` finds that backend.
    """

    name: str
    target: str
    framework: str
    description: str = ""
    modules: tuple[str, ...] = ()


@hookspec
def psdk_register_backends() -> list[BackendRecord]:  # type: ignore[empty-body]
    """Backends this plugin provides.

    Example::

        @psdk.hookimpl
        def psdk_register_backends():
            return [BackendRecord("torch", "psdk_torch.backend:TorchBackend", "torch")]
    """
