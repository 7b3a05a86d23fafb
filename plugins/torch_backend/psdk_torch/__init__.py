"""PyTorch backend for psdk. Importing this package does not import torch.

One module per concern, as every psdk backend plugin is laid out:
:mod:`~psdk_torch.plugin` registers (and imports no torch),
:mod:`~psdk_torch.backend` is the thin :class:`~psdk.plugins.backend.Backend` (the bridge),
:mod:`~psdk_torch.mnist` is MNIST's trainer on it,
:mod:`~psdk_torch.models`, :mod:`~psdk_torch.optimizers` and
:mod:`~psdk_torch.placement` do the work.
"""
