from __future__ import annotations

import numpy as np
import pytest

from psdk.errors import ConfigError
from psdk.protocol.sharding import assign_shards, flat_size, layout, views

VARS = [("a", (10, 10)), ("b", (10,)), ("c", (100, 10)), ("d", (5,)), ("e", (3, 3))]


def test_round_robin_deals_in_creation_order() -> None:
    assert assign_shards(VARS, 2) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert assign_shards(VARS, 1) == dict.fromkeys("abcde", 0)


def test_greedy_gives_each_variable_to_the_lightest_shard() -> None:
    placement = assign_shards(VARS, 2, "greedy")
    assert placement == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}


@pytest.mark.parametrize("strategy", ["round_robin", "greedy"])
def test_sharding_is_deterministic_and_puts_something_on_shard_0(strategy: str) -> None:
    assert assign_shards(VARS, 3, strategy) == assign_shards(VARS, 3, strategy)
    assert assign_shards(VARS, 3, strategy)["a"] == 0


def test_bad_sharding_input_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"topology\.sharding"):
        assign_shards(VARS, 2, "random")
    with pytest.raises(ConfigError, match=r"topology\.num_ps"):
        assign_shards(VARS, 0)
    with pytest.raises(ConfigError, match="unique"):
        assign_shards([("a", (1,)), ("a", (2,))], 2)


def test_views_share_one_flat_buffer() -> None:
    specs = layout(VARS)
    flat = np.zeros(flat_size(specs), np.float32)
    named = views(flat, specs)
    named["c"][...] = 1.0
    assert flat.sum() == 1000 and named["c"].shape == (100, 10)
    assert [s.offset for s in specs] == [0, 100, 110, 1110, 1115]
