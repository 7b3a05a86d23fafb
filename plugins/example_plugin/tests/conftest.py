"""The example plugin's tests take MNIST from psdk's pytest plugin (``psdk_mnist_dir``, from ``$PSDK_DATA_DIR``)."""
