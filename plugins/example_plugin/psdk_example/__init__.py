"""An example psdk plugin: an update rule (:class:`~psdk_example.lion.Lion`), models (``resmlp``,
``regressor``) and a workload (``sines``, :mod:`psdk_example.sines`).

Import :mod:`psdk_example.plugin` to register them; nothing here imports a
framework until a backend builds a model or a worker trains the workload.
"""
