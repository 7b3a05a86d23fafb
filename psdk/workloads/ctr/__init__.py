"""The click-through (CTR) workload: a Criteo-shaped click log and a DLRM-style model on embedding tables.

Its data (:mod:`.data`: generated from a seed, or Criteo TSV files), its model
(:mod:`.model`), its numpy trainer (:mod:`.trainers`) and its record's entries
(:mod:`.workload`); registered in :mod:`psdk.plugins.builtins` beside MNIST.
"""
