"""The conformance suites: a framework bridge, and a workload's trainer on one, each held to the numpy reference.

A framework plugin provides two things, and its tests check each apart:

* a **bridge** (its :class:`~psdk.plugins.backend.Backend`): variables,
  weights, gradients, devices, optimizers. :class:`BridgeConformance`::

    # plugins/mybackend/tests/test_conformance.py
    from psdk.testing import BridgeConformance, TrainerConformance

    class TestMyBridge(BridgeConformance):
        backend_name = "mybackend"

* a **trainer** for a workload on that framework (psdk's MNIST, through
  ``psdk_register_trainers``; see :mod:`psdk.plugins.trainer`).
  :class:`TrainerConformance`::

    class TestMyMnistTrainer(TrainerConformance):
        backend_name = "mybackend"   # the trainer for this backend's framework
        workload = "mnist"           # the default

pytest runs every check against the installed plugins of those names, found
through the ``psdk`` entry points as a job finds them. The reference is the
``numpy`` bridge (:class:`psdk.plugins.backends.numpy_backend.NumpyBackend`)
and the workload's trainer on it (MNIST's is
:class:`psdk.workloads.mnist.trainers.NumpyClassifier`): same weights
(:func:`~psdk.plugins.models.init_weights`), same batches, so any difference
is the plugin's. Tolerances are class attributes a subclass may loosen, with
a comment saying why. :class:`BackendConformance` is both suites at once, for
a backend and psdk's MNIST trainer on its framework.

The bridge suite needs a backward pass to read gradients back, and gets it
from the trainer of :attr:`BridgeConformance.trainer_workload` (MNIST) for
the bridge's framework. psdk's click-through workload is one line more
(``workload = "ctr"``): its models have a table, so each batch's rows are
written with ``write_rows`` before the step, as a worker writes the rows it
pulled, and the row gradients ``read_row_gradients`` gives are summed per id
and compared with :class:`~psdk.workloads.ctr.trainers.NumpyDlrm`'s::

    class TestMyCtrTrainer(TrainerConformance):
        backend_name = "mybackend"
        workload = "ctr"

Another workload tested with :class:`TrainerConformance` names its models
(:attr:`TrainerConformance.models`, specs whose ``variables()`` and
``init_weights(seed)`` every framework shares, and ``tables()`` if it has
tables) and overrides :meth:`TrainerConformance.make_batch`; its numpy
trainer, if it registers one, is the reference (:attr:`TrainerConformance.reference_backend`).

A bridge subclass may also say more:

* :meth:`BridgeConformance.refused_optimizers`: framework optimizers the ps
  must refuse (``torch.optim.SGD(..., dampening=0.5)``), each under the
  option its error must name;
* :attr:`BridgeConformance.inspectable_optimizers` ``= False`` for a
  framework whose optimizers cannot be read (optax's are closures): an
  optimizer the backend did not make must then be refused with a message
  that shows ``rule=``, the way to state the ps rule instead.

The suites build models on a backend fresh from :func:`psdk.plugins.load_backend`,
without :meth:`~psdk.plugins.backend.Backend.setup` (only the placement checks call it):
a backend must build, train and predict on its default device as it is made.
"""

from __future__ import annotations

from typing import ClassVar

from psdk.testing.bridge_conformance import BridgeConformance
from psdk.testing.suite import KNOWN_FRAMEWORKS, load_trainer, mnist_batch, random_batch
from psdk.testing.trainer_conformance import TrainerConformance

__all__ = [
    "KNOWN_FRAMEWORKS",
    "BackendConformance",
    "BridgeConformance",
    "TrainerConformance",
    "load_trainer",
    "mnist_batch",
    "random_batch",
]


class BackendConformance(BridgeConformance, TrainerConformance):
    """Both suites for a backend and psdk's MNIST trainer on its framework: a plugin's one-line test.

    The same as a :class:`BridgeConformance` and a :class:`TrainerConformance`
    (``workload = "mnist"``) subclass side by side; write those two to say
    more of either (a refused optimizer, a tolerance).
    """

    trainer_workload: ClassVar[str] = "mnist"
    workload: ClassVar[str] = "mnist"
