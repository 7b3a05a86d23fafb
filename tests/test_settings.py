"""Every setting checked before launch: each numeric key has a range, and what must fit the job is checked.

The twelve overrides of issue 31 that hung, crashed or failed only after
the tasks had started are run as a user runs them (``python -m psdk run``,
in a subprocess with a timeout): each must exit 2 with one line naming the
key and what it must be, no traceback, and no task started. The rest needs
only the composed config.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from psdk.config import capacity, config_dir, prepare_hydra
from psdk.config.build import model_spec, update_rule
from psdk.config.options import options_from
from psdk.config.ranges import RANGES, SEED_MAX, THREADS_MAX, check_ranges, check_value, numeric_leaves
from psdk.config.readers import refuse_ignored
from psdk.errors import USAGE_EXIT, ConfigError
from psdk.plugins.models import ModelSpec
from psdk.protocol.sharding import largest_message_bytes, shard_sizes
from psdk.workloads.mnist.checks import check_shape, known_shape

from .conftest import free_port
from .jobs import psdk

pytestmark = pytest.mark.timeout(120)

CONF = config_dir()
OWN_GROUPS = ("launcher", "model", "optimizer", "sync", "topology", "experiment")


@pytest.fixture
def hydra_context() -> Iterator[None]:
    prepare_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def composed(*overrides: str) -> DictConfig:
    """The config as a task sees it (no Hydra run here to name its folder: nothing is written)."""
    return compose("config", overrides=["output_dir=.", *overrides])


def every_option() -> list[str]:
    """One override per option of psdk's own config groups (conf/<group>/<option>.yaml)."""
    return [f"{g}={p.stem}" for g in OWN_GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


# ------------------------------------------------------------------ the table
def test_every_numeric_key_of_the_config_tree_has_a_declared_range(hydra_context: None) -> None:
    """Walks the composed config of every group option: a numeric key added without a range fails here."""
    seen: set[str] = set()
    for choice in ["seed=0", *every_option()]:
        for key, _, typed in numeric_leaves(composed(choice)):
            if key.startswith("backend_options."):
                continue  # the plugins' own options: generic bounds (finite, int64)
            assert typed or key in RANGES, f"{key} ({choice}) is numeric but has no schema type"
            assert key in RANGES, f"{key} ({choice}) is a numeric setting with no range in psdk.config.ranges.RANGES"
            seen.add(key)
    # launcher.num_cpus is Any-typed (null, or Ray's CPU count): the walk meets it only once it is a number.
    stale = set(RANGES) - seen - {"launcher.num_cpus"}
    assert not stale, f"ranges for keys the config does not have: {sorted(stale)}"


def test_the_shipped_config_is_within_every_range(hydra_context: None) -> None:
    for choice in every_option():
        check_ranges(composed(choice))


@pytest.mark.parametrize(
    "key, good, bad",
    [
        ("seed", [0, SEED_MAX], [-1, SEED_MAX + 1]),
        ("train.threads", [1, THREADS_MAX], [0, THREADS_MAX + 1, 100000]),
        ("train.steps", [1, 2**63 - 1], [0, 2**63, 10**20]),
        ("optimizer.lr", [1e-9, 3.4e38], [0.0, -0.1, 1e39, math.inf, math.nan]),
        ("launcher.ready_timeout_s", [0.001, 30 * 24 * 3600.0], [0, 0.0, 1e9]),
        ("model.hidden", [1, 2**31 - 1], [0, 2**31]),
        ("placement.compute_nice", [0, 19], [-1, 20]),
        ("backend_options.jax.some_plugin_knob", [-5, 2**63 - 1, 1e300], [2**63, math.inf, math.nan]),
    ],
)
def test_a_value_outside_its_range_is_refused_naming_the_key_and_the_range(
    key: str, good: list[float], bad: list[float]
) -> None:
    for value in good:
        check_value(key, value)
    for value in bad:
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: must be a .*(number|finite)") as info:
            check_value(key, value)
        if key in RANGES:
            assert RANGES[key].interval in str(info.value)


def test_an_integer_key_takes_no_fraction() -> None:
    with pytest.raises(ConfigError, match=r"train\.steps: must be a whole number in \[1, "):
        check_value("train.steps", 2.5)
    check_value("train.epochs", 2.5)


def test_an_out_of_range_value_given_through_an_interpolation_is_named_by_its_own_key(hydra_context: None) -> None:
    """optimizer.decay_steps is ${train.steps} in the default recipe: the key the user gave is named."""
    cfg = composed("train.steps=100000000000000000000")
    with pytest.raises(ConfigError, match=r"^train\.steps: must be a whole number in \[1, 9223372036854775807\]"):
        check_ranges(cfg)


# ------------------------------------------------------------- against the job
def test_the_message_limit_is_the_ps_own_formula_for_the_largest_shard(hydra_context: None) -> None:
    cfg = composed("optimizer=adam", "topology.num_ps=2")
    spec, rule = model_spec(cfg), update_rule(cfg)
    need = max(largest_message_bytes(size, len(rule.slot_names())) for size in shard_sizes(spec.variables(), 2))
    assert need == 3 * 4 * max(shard_sizes(spec.variables(), 2)) + (1 << 16)  # weights, m and v; a header
    capacity.check_message_limit(composed("optimizer=adam", "topology.num_ps=2", f"transport.max_message_bytes={need}"),
                                 options_from(cfg), 2)  # fmt: skip
    low = composed("optimizer=adam", "topology.num_ps=2", f"transport.max_message_bytes={need - 1}")
    with pytest.raises(ConfigError, match=rf"transport\.max_message_bytes: is {need - 1:,} .* must be in \[{need}, "):
        capacity.check_message_limit(low, options_from(low), 2)


def test_a_model_larger_than_this_host_can_hold_is_refused_naming_its_size(hydra_context: None) -> None:
    available = capacity.available_memory()
    if available is None:
        pytest.skip("this host does not say how much memory is available (no /proc/meminfo)")
    width = int(math.sqrt(available / 4)) + 1  # one such kernel alone is more than the host has
    cfg = composed(f"model.hidden=[{width},{width}]")
    with pytest.raises(ConfigError, match=r"model\.hidden: makes model mlp [\d,]+ parameters .* must be a model of at"):
        capacity.check_memory(cfg, [0], 2, 1)
    capacity.check_memory(composed(), [0], 2, 1)


def test_a_model_that_does_not_fit_the_data_set_is_refused_from_its_known_shape(hydra_context: None) -> None:
    with pytest.raises(ConfigError, match=r"model\.input_dim: is 5, but the mnist images have 784 pixels; must be 784"):
        capacity.check_data_fits(composed("model.input_dim=5"))
    with pytest.raises(ConfigError, match=r"model\.num_classes: is 3, .* up to 9; must be at least 10"):
        capacity.check_data_fits(composed("model.num_classes=3"))
    capacity.check_data_fits(composed())


def test_an_idx_folder_is_measured_from_its_header_and_labels(tmp_path: Path) -> None:
    """``data.name=idx``: the launcher reads the images' header and the labels, never the images."""
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 50), ("t10k", 20)):
        for kind, array in (("images", rng.integers(0, 255, (n, 6, 5))), ("labels", rng.integers(0, 7, n))):
            header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            (tmp_path / f"{prefix}-{kind}-idx{array.ndim}-ubyte.gz").write_bytes(
                gzip.compress(header + array.astype(np.uint8).tobytes())
            )
    top = int(
        max(np.frombuffer(gzip.decompress(p.read_bytes())[8:], np.uint8).max() for p in tmp_path.glob("*labels*"))
    )
    data = {"name": "idx", "dir": str(tmp_path)}
    assert known_shape(data) == (30, top + 1)
    check_shape((30, top + 1), ModelSpec(input_dim=30, num_classes=top + 1), "idx")
    with pytest.raises(ConfigError, match=r"model\.input_dim: is 784, but the idx images have 30 pixels; must be 30"):
        check_shape((30, top + 1), ModelSpec(), "idx")


def test_only_addresses_of_this_host_can_be_bound() -> None:
    capacity.check_bindable("127.0.0.1", "topology.host")
    capacity.check_bindable("0.0.0.0", "topology.host")
    for host in ("8.8.8.8", "no-such-host.invalid"):
        with pytest.raises(ConfigError, match=r"topology\.host: .* must be an address of this host"):
            capacity.check_bindable(host, "topology.host")


def test_a_key_a_command_ignores_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"weights: `python -m psdk run` does not read it \(only `evaluate`\)"):
        refuse_ignored("run", ["weights=params.npz"])
    with pytest.raises(ConfigError, match=r"ps_hosts: `python -m psdk run` does not read it"):
        refuse_ignored("run", ["backend=numpy", "ps_hosts=h:1"])
    refuse_ignored("evaluate", ["weights=params.npz"])
    refuse_ignored("worker", ["ps_hosts=h:1", "task_index=1", "~weights"])


# ------------------------------------------------------------ the 12 commands
CASES = [
    ("transport.max_message_bytes=1", "transport.max_message_bytes", "must be in [701616, "),
    ("train.threads=100000", "train.threads", f"must be a whole number in [1, {THREADS_MAX}]"),
    ("seed=-1", "seed", "must be a whole number in [0, 4294967295]"),
    ("model.hidden=[100000,100000]", "model.hidden", "must be a model of at most"),
    ("optimizer.lr=1e39", "optimizer.lr", "must be a number in (0, 3.40282e+38]"),
    ("train.steps=1e20", "train.steps", "must be a whole number in [1, 9223372036854775807]"),
    ("model.input_dim=5", "model.input_dim", "must be 784"),
    ("ps.max_connections=1", "ps.max_connections", "must be null or in [4, 1048576]"),
    ("topology.host=8.8.8.8", "topology.host", "must be an address of this host"),
    ("launcher.ready_timeout_s=0", "launcher.ready_timeout_s", "must be a number in (0, 2.592e+06]"),
    ("train.steps=100000000000000000000", "train.steps", "must be a whole number in [1, 9223372036854775807]"),
    ("weights=PARAMS", "weights", "does not read it (only `evaluate`)"),
]


@pytest.mark.parametrize("override, key, valid", CASES, ids=[c[0] for c in CASES])
def test_a_bad_setting_is_refused_before_any_task_starts(tmp_path: Path, override: str, key: str, valid: str) -> None:
    params = tmp_path / "params.npz"
    params.write_bytes(b"not read")
    run = tmp_path / "run"
    result = psdk("run", override.replace("PARAMS", str(params)), "backend=numpy", out=run, timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode == USAGE_EXIT, text
    errors = [line for line in text.splitlines() if f"{key}: " in line and ("ERROR" in line or "error:" in line)]
    assert len(errors) == 1 and valid in errors[0], text
    assert "Traceback" not in text, text
    assert not (run / "tasks").exists(), "a task was started"


@pytest.mark.parametrize(
    "command, extra, key",
    [
        ("ps", ["transport.max_message_bytes=1"], "transport.max_message_bytes"),
        ("ps", ["seed=-1"], "seed"),
        ("worker", ["model.input_dim=5"], "model.input_dim"),
        ("task", ["job_name=ps", "weights=params.npz"], "weights"),
    ],
)
def test_a_task_started_by_hand_checks_its_settings_too(
    tmp_path: Path, command: str, extra: list[str], key: str
) -> None:
    hosts = [f"ps_hosts=127.0.0.1:{free_port()}", f"worker_hosts=127.0.0.1:{free_port()}", "transport.secure=false"]
    result = psdk(command, *hosts, *extra, "backend=numpy", out=tmp_path / "task", timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode == USAGE_EXIT, text
    assert f"{key}: " in text and "Traceback" not in text, text
