"""What a ps binds is separate from the address others reach it by, and it binds only what it is told."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psdk.errors import ConfigError
from psdk.ps.main import bind_address
from psdk.transport.zeromq import endpoint

from .conftest import REPO, free_port
from .jobs import env, psdk, wait_for

SERVICE = "myjob-ps-0.default.svc"  # a Kubernetes service name: it reaches the ps but is no address of its own


@pytest.mark.parametrize(
    "bind, advertised, expected",
    [
        (None, "10.0.0.5:2222", "10.0.0.5:2222"),  # by default: exactly its own ps_hosts entry
        ("", "10.0.0.5:2222", "10.0.0.5:2222"),
        ("eth0", f"{SERVICE}:2222", "eth0:2222"),  # no port: the entry's port
        ("0.0.0.0", f"{SERVICE}:2222", "0.0.0.0:2222"),  # every interface, only when asked
        ("10.1.2.3:7000", f"{SERVICE}:2222", "10.1.2.3:7000"),
        ("[::1]", "[::2]:5", "[::1]:5"),
        ("inproc://ps0", "h:1", "inproc://ps0"),
    ],
)
def test_the_bind_address(bind: str | None, advertised: str, expected: str) -> None:
    assert bind_address(bind, advertised) == expected


def test_a_bind_without_a_port_needs_one_to_borrow() -> None:
    with pytest.raises(ConfigError, match=r"ps\.bind.*has no port"):
        bind_address("eth0", "inproc://ps0")


def test_port_0_means_any_port_never_any_interface() -> None:
    assert endpoint("10.0.0.5:0") == "tcp://10.0.0.5:*"
    assert endpoint("127.0.0.1:2222") == "tcp://127.0.0.1:2222"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, fragments",
    [
        ([], [f"cannot bind {SERVICE}:", "not an address of this host", "Kubernetes service", "Set ps.bind"]),
        (
            ["ps.bind=no-such-interface0"],
            ["cannot bind no-such-interface0:", "ps.bind must be an address of this host"],
        ),
    ],
)
def test_an_address_that_cannot_be_bound_says_to_set_ps_bind(
    tmp_path: Path, extra: list[str], fragments: list[str]
) -> None:
    result = psdk(
        "ps",
        f"ps_hosts={SERVICE}:{free_port()}",
        "worker_hosts=a",
        "transport.secure=false",
        *extra,
        out=tmp_path,
        timeout=60,
    )
    text = result.stdout + result.stderr
    assert result.returncode != 0
    for fragment in [*fragments, "ps.bind=eth0", "ps 0"]:
        assert fragment in text, text
    assert "(addr=" not in text, text  # the system's reason alone: the address is named once, before it
    assert "Traceback" not in text


@pytest.mark.slow
def test_a_ps_reached_by_a_service_name_binds_the_interface_it_is_told(tmp_path: Path) -> None:
    port = free_port()
    announce = tmp_path / "ps0.json"
    ps = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psdk",
            "ps",
            f"ps_hosts={SERVICE}:{port}",
            "worker_hosts=a",
            "transport.secure=false",
            "ps.bind=lo",
            f"ps.announce_file={announce}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=REPO,
    )
    try:
        wait_for(announce.exists, ps, timeout=60)
        assert json.loads(announce.read_text())["address"] == f"127.0.0.1:{port}"
    finally:
        ps.kill()
        output = ps.communicate(timeout=30)[0]
    assert f"binding lo:{port}; the others reach it at {SERVICE}:{port}" in output
