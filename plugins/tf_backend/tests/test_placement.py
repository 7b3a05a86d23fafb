"""psdk's device string to TensorFlow's device setup, decided without a GPU (the plan is plain values)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from psdk_tf.backend import TfBackend
from psdk_tf.placement import CPU, Plan, physical_id, plan

from psdk.errors import ConfigError
from psdk.launch.placement import visible_gpus


def test_the_cpu_hides_every_gpu() -> None:
    assert plan("cpu", gpus_seen=2) == CPU and CPU.gpu is None and CPU.tf_device == "/CPU:0"


def test_cuda_n_keeps_only_gpu_n_visible_which_tensorflow_then_calls_gpu_0() -> None:
    assert plan("cuda:1", gpus_seen=2) == Plan("cuda:1", "/GPU:0", gpu=1, memory_growth=True)
    assert plan("cuda", gpus_seen=1).gpu == 0


@pytest.mark.parametrize("device, seen", [("cuda:0", 0), ("cuda:2", 2)])
def test_a_missing_gpu_falls_back_to_the_cpu_and_says_why(
    device: str, seen: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="psdk.plugins.backends.kit"):
        chosen = plan(device, gpus_seen=seen)
    assert chosen == CPU
    assert device in caplog.text and "TensorFlow" in caplog.text and "CPU" in caplog.text


def test_a_memory_fraction_becomes_a_limit_in_megabytes() -> None:
    chosen = plan("cuda:0", gpus_seen=1, memory_fraction=0.25, total_memory_mb=80000)
    assert (chosen.memory_limit_mb, chosen.memory_growth) == (20000, False)


def test_without_the_gpus_size_a_fraction_gives_way_to_growth_and_says_so() -> None:
    chosen = plan("cuda:0", gpus_seen=1, memory_fraction=0.25, total_memory_mb=None)
    assert chosen.memory_growth and chosen.memory_limit_mb is None
    assert "gpu_memory_fraction" in chosen.notes[0]


def test_growth_is_left_to_tensorflow_when_the_user_set_its_variable() -> None:
    assert not plan("cuda:0", gpus_seen=1, growth_left_to_tf=True).memory_growth


def test_bad_devices_and_fractions_name_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"^placement.device: .*'tpu:0'.*valid choices: cpu, cuda, cuda:N"):
        plan("tpu:0", gpus_seen=0)
    with pytest.raises(ConfigError, match=r"placement\.gpu_memory_fraction"):
        plan("cuda:0", gpus_seen=1, memory_fraction=1.5)


def test_nvidia_smi_is_asked_about_the_gpu_cuda_visible_devices_names() -> None:
    assert physical_id(1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == "5"
    assert physical_id(0, {"CUDA_VISIBLE_DEVICES": "GPU-8a1b"}) == "GPU-8a1b"
    assert physical_id(1, {}) == "1"


def test_setup_with_a_gpu_tensorflow_does_not_see_logs_the_fallback(
    backend: TfBackend, caplog: pytest.LogCaptureFixture
) -> None:
    missing = f"cuda:{len(visible_gpus())}"  # one past the last GPU: there is none on a CPU machine
    with caplog.at_level(logging.WARNING, logger="psdk.plugins.backends.kit"):
        backend.setup(missing, threads=1)
    assert backend.device == "cpu" and backend.plan.tf_device == "/CPU:0"
    assert missing in caplog.text and "CPU" in caplog.text


def test_setup_pins_tensorflows_threads_in_a_fresh_process() -> None:
    code = (
        "import tensorflow as tf\n"
        "from psdk_tf.backend import TfBackend\n"
        "TfBackend().setup('cpu', threads=1)\n"
        "t = tf.config.threading\n"
        "print(t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["1", "1"]
