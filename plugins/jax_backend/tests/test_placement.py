"""psdk's device string and threads to JAX's setup, decided without a GPU; the rest in fresh processes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from psdk_jax.placement import MEM_FRACTION, PREALLOCATE, choose, memory_env, thread_cpus

from psdk import plugins
from psdk.errors import ConfigError
from psdk.launch.placement import visible_gpus

pytestmark = pytest.mark.timeout(120)


def test_the_cpu_sets_no_allocator_variable() -> None:
    assert memory_env("cpu", None, {}) == {}
    assert memory_env("cpu", 0.5, {}) == {}


def test_a_gpu_grows_on_demand_unless_given_a_fraction_which_is_then_a_cap() -> None:
    assert memory_env("cuda:0", None, {}) == {PREALLOCATE: "false"}
    assert memory_env("cuda:1", 0.25, {}) == {MEM_FRACTION: "0.25"}


def test_a_variable_the_user_set_is_kept() -> None:
    assert memory_env("cuda:0", None, {PREALLOCATE: "true"}) == {}
    assert memory_env("cuda:0", 0.5, {MEM_FRACTION: "0.9"}) == {}


def test_bad_devices_and_fractions_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^placement.device: .*'tpu:0'"):
        memory_env("tpu:0", None, {})
    with pytest.raises(ConfigError, match=r"^placement\.gpu_memory_fraction: must be in \(0, 1\], got 1.5"):
        memory_env("cuda:0", 1.5, {})


def test_xla_starts_on_as_many_cpus_as_threads_asked_for() -> None:
    assert thread_cpus(1, {2, 3, 5}) == {2}
    assert thread_cpus(2, {2, 3, 5}) == {2, 3}
    assert thread_cpus(None, {0, 1}) is None and thread_cpus(0, {0, 1}) is None
    assert thread_cpus(4, {0, 1}) is None  # as many as it may use: nothing to narrow


def test_cuda_n_is_the_nth_gpu_jax_sees() -> None:
    assert choose("cuda:1", ["gpu0", "gpu1"], "cpu0") == ("cuda:1", "gpu1")
    assert choose("cuda", ["gpu0"], "cpu0") == ("cuda:0", "gpu0")
    assert choose("cpu", ["gpu0"], "cpu0") == ("cpu", "cpu0")


@pytest.mark.parametrize("device, gpus", [("cuda:0", []), ("cuda:2", ["gpu0", "gpu1"])])
def test_a_missing_gpu_falls_back_to_the_cpu_and_says_why(
    device: str, gpus: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert choose(device, gpus, "cpu0") == ("cpu", "cpu0")
    assert "jax" in caplog.text and device in caplog.text


def test_setup_on_a_machine_without_a_gpu_trains_on_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    if visible_gpus():
        pytest.skip("this machine has a GPU")
    backend = plugins.load_backend("jax")
    with caplog.at_level(logging.WARNING):
        backend.setup("cuda:0", threads=1)
    assert backend.device == "cpu" and "falls back to the CPU" in caplog.text
    import jax  # the backend imported it already

    assert backend.jax_device.platform == "cpu"  # type: ignore[attr-defined]
    assert jax.config.jax_default_device == backend.jax_device  # type: ignore[attr-defined]


def _fresh(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_setup_gives_xla_one_cpu_thread_pins_nothing_and_dispatches_in_line() -> None:
    code = (
        "import json, os\n"
        "from psdk import plugins\n"
        "before = sorted(os.sched_getaffinity(0))\n"
        "backend = plugins.load_backend('jax')\n"
        "backend.setup('cpu', threads=1)\n"
        "import jax, jax.numpy as jnp\n"
        "jax.jit(lambda a: a @ a)(jnp.ones((300, 300))).block_until_ready()\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks]\n"
        "masks = {str(sorted(os.sched_getaffinity(int(t)))) for t in tasks}\n"
        "print(json.dumps({'eigen': sum('XLAEigen' in n for n in names), 'masks': sorted(masks),\n"
        "                  'before': str(before), 'async': jax.config.values['jax_cpu_enable_async_dispatch']}))\n"
    )
    result = _fresh(code)
    if len(json.loads(str(result["before"]))) < 2:
        pytest.skip("this process may run on one CPU only: nothing to narrow")
    assert result["eigen"] == 1  # XLA's intra-op pool (jaxlib 0.10 names its threads tf_XLAEigen)
    assert result["masks"] == [result["before"]]  # every thread, XLA's too, may run on every CPU it could
    assert result["async"] is False  # a step runs on the training thread


def test_the_compilation_cache_option_fills_the_folder(tmp_path: pytest.TempPathFactory) -> None:
    code = (
        "import json, os, numpy as np\n"
        "from psdk import plugins\n"
        "from psdk.plugins.batches import Batch\n"
        "from psdk.plugins.models import ModelSpec, init_weights\n"
        "from psdk_jax.mnist import JaxClassifier\n"
        f"backend = plugins.load_backend('jax', options={{'compilation_cache_dir': {str(tmp_path)!r}}})\n"
        "backend.setup('cpu', threads=1)\n"
        "spec = ModelSpec(hidden=(8,), input_dim=5, num_classes=3)\n"
        "model = backend.build_model(spec, init_weights(spec, 0))\n"
        "batch = Batch({'image': np.ones((4, 5), np.float32)}, np.zeros(4, np.int64))\n"
        "JaxClassifier(backend).forward_backward(model, batch)\n"
        f"print(json.dumps({{'files': len(os.listdir({str(tmp_path)!r}))}}))\n"
    )
    assert int(str(_fresh(code)["files"])) >= 2  # the weight load and the training step, at least
