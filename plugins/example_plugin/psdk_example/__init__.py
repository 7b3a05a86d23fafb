"""An example psdk plugin: an update rule (:class:`~psdk_example.lion.Lion`) and a model (``resmlp``).

Import :mod:`psdk_example.plugin` to register them; nothing here imports a
framework until a backend builds the model.
"""
