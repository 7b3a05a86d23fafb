from __future__ import annotations

import pytest

from psdk.errors import ConfigError
from psdk.protocol.cluster import ClusterSpec, parse_hosts


@pytest.mark.parametrize(
    "value, expected",
    [
        (["h1:2222", "h2:2222"], ("h1:2222", "h2:2222")),
        ("h1:2222,h2:2222", ("h1:2222", "h2:2222")),
        ("h1:2222, h2:2222", ("h1:2222", "h2:2222")),
        ("localhost:2222", ("localhost:2222",)),
        ("tcp://10.0.0.1:5", ("10.0.0.1:5",)),
        ("[::1]:2222", ("[::1]:2222",)),
        ("inproc://ps0", ("inproc://ps0",)),
        (None, ()),
    ],
)
def test_host_lists_in_every_form_tf_users_write(value: object, expected: tuple[str, ...]) -> None:
    assert parse_hosts(value, "ps_hosts") == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("h1", "no port"),
        ("h1:99999", "bad port"),
        ("h1:abc", "bad port"),
        ("h1:2222,,h2:1", "empty"),
        ("bad host:1", "not host:port"),
        ("udp://h:1", "unknown scheme"),
        (42, "expected a list"),
    ],
)
def test_malformed_host_lists_name_the_key(value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hosts(value, "ps_hosts")
    assert "ps_hosts" in str(info.value) and fragment in str(info.value)


def test_workers_may_omit_ports_and_local_rank_counts_per_host() -> None:
    spec = ClusterSpec({"ps": "p:1", "worker": ["a", "b:7", "a:9", "b", "a"]})
    assert [spec.local_rank(i) for i in range(5)] == [0, 0, 1, 1, 2]
    assert spec.as_dict() == {"ps": ["p:1"], "worker": ["a", "b:7", "a:9", "b", "a"]}


def test_cluster_errors_name_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="ps_hosts"):
        ClusterSpec({"worker": ["a"]})
    with pytest.raises(ConfigError, match="evaluator"):
        ClusterSpec({"ps": ["p:1"], "worker": ["a"], "evaluator": ["e"]})
    spec = ClusterSpec({"ps": ["p:1"], "worker": ["a", "b"]})
    with pytest.raises(ConfigError, match=r"valid: 0\.\.1"):
        spec.check_task("worker", 2)
    with pytest.raises(ConfigError, match="job_name"):
        spec.check_task("chief", 0)
