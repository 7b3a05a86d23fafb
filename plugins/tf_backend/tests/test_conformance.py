"""psdk's conformance suites, run against the TensorFlow bridge and psdk's MNIST trainer on TensorFlow."""

from __future__ import annotations

from typing import Any

import keras

from psdk.testing import BridgeConformance, TrainerConformance


class TestTfBridgeConformance(BridgeConformance):
    backend_name = "tf"

    def refused_optimizers(self, model: Any) -> dict[str, Any]:
        staircase = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)
        return {
            "keras.optimizers.AdamW": keras.optimizers.AdamW(),
            "keras.optimizers.Nadam": keras.optimizers.Nadam(),
            "amsgrad": keras.optimizers.Adam(amsgrad=True),
            "weight_decay": keras.optimizers.SGD(weight_decay=0.01),  # decoupled in Keras, L2 on the ps
            "clipnorm": keras.optimizers.SGD(clipnorm=1.0),
            "global_clipnorm": keras.optimizers.Adam(global_clipnorm=1.0),
            "use_ema": keras.optimizers.SGD(use_ema=True),
            "staircase": keras.optimizers.SGD(staircase),
        }


class TestTfMnistTrainerConformance(TrainerConformance):
    backend_name = "tf"


class TestTfCtrTrainerConformance(TrainerConformance):
    """The ctr trainer through a worker's path: rows written before each batch, row gradients summed per id."""

    backend_name = "tf"
    workload = "ctr"
