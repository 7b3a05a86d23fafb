"""PyTorch backend for psdk. Importing this package does not import torch."""
