"""The MNIST workload: the MNIST job (:mod:`.job`), its evaluation (:mod:`.evaluate`), its data (:mod:`.data`).

Registered in :mod:`psdk.plugins.builtins` through the same hook as a
plugin's workload; ``workload=mnist`` is the default.
"""
