"""Joining a world from torchrun's variables: a gloo world over several nodes is refused, before anything
is joined, where gloo's sockets would listen on loopback, naming the interface to set."""

from __future__ import annotations

import os
import socket

import pytest

from tpcore.ranks import distributed
from tpcore.ranks.distributed import check_gloo_reaches_nodes, gloo_address, interface_of, route_interface

LOOPBACK = interface_of("127.0.0.1")
STREAM = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")


class Joined(Exception):
    """Raised in place of joining a process group: the checks before it passed."""


def resolving_to(monkeypatch, *addresses: str) -> None:
    """The host name resolves to ``addresses`` (none: it does not resolve)."""

    def getaddrinfo(host, port, *args, **kwargs):
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(*STREAM, (address, 0)) for address in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def node_of_two(monkeypatch):
    """Rank 2 of a 4-rank world, 2 ranks per node, joining from torchrun's variables; joining raises ``Joined``."""
    world = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**world, "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)

    def join(*args, **kwargs):
        raise Joined

    monkeypatch.setattr(distributed, "init_process_group", join)


def test_gloo_listens_on_the_first_address_of_the_host_name_this_host_can_bind(monkeypatch):
    resolving_to(monkeypatch, "192.0.2.1", "127.0.0.1")  # 192.0.2.1 (TEST-NET-1) is no address of this host
    assert gloo_address() == "127.0.0.1"


def test_gloo_falls_back_to_loopback_where_the_host_name_does_not_resolve(monkeypatch):
    resolving_to(monkeypatch)
    assert gloo_address() == "127.0.0.1"


def test_the_route_to_a_loopback_address_or_name_is_the_loopback_interface():
    assert LOOPBACK is not None
    assert route_interface("127.0.0.1") == route_interface("localhost") == LOOPBACK


def test_a_name_that_does_not_resolve_has_no_route(monkeypatch):
    resolving_to(monkeypatch)
    assert route_interface("node-7") is None


def test_a_world_over_nodes_with_gloo_on_loopback_is_refused_naming_the_interface_before_joining(
    node_of_two, monkeypatch
):
    resolving_to(monkeypatch)
    monkeypatch.setattr(distributed, "route_interface", lambda host: "eth7" if host == "127.0.0.1" else None)
    with pytest.raises(
        RuntimeError, match=r"rank 2 of a gloo world of 4 ranks, 2 on this node: gloo would listen on 127\.0\.0\.1"
    ) as refused:
        distributed.tensor_parallel_group(2, "gloo")
    assert "Set GLOO_SOCKET_IFNAME to eth7 here, the interface that routes to MASTER_ADDR 127.0.0.1" in str(
        refused.value
    )


def test_where_the_route_to_the_master_is_loopback_the_refusal_says_how_to_find_the_interface(node_of_two, monkeypatch):
    resolving_to(monkeypatch, "127.0.1.1")  # Debian's line for the host's own name
    with pytest.raises(RuntimeError, match=r"ip route get <another node>") as refused:
        distributed.tensor_parallel_group(4, "gloo")
    assert "gloo would listen on 127.0.1.1" in str(refused.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("GLOO_SOCKET_IFNAME", "eth7"), ("LOCAL_WORLD_SIZE", "4")],
    ids=["the user chose an interface", "one node"],
)
def test_gloo_on_loopback_is_joined_where_the_user_chose_an_interface_or_all_ranks_are_here(
    node_of_two, monkeypatch, setting, value
):
    resolving_to(monkeypatch)
    monkeypatch.setenv(setting, value)
    with pytest.raises(Joined):
        distributed.tensor_parallel_group(2, "gloo")


def test_a_world_over_nodes_is_joined_where_the_host_name_resolves_off_loopback(node_of_two, monkeypatch):
    monkeypatch.setattr(distributed, "gloo_address", lambda: "10.0.0.5")
    with pytest.raises(Joined):
        distributed.tensor_parallel_group(2, "gloo")


def test_nccl_worlds_are_not_checked_for_gloo(node_of_two, monkeypatch):
    resolving_to(monkeypatch)
    with pytest.raises(Joined):
        distributed.tensor_parallel_group(2, "nccl")


def test_the_check_reads_the_environment_and_writes_none_of_it(node_of_two, monkeypatch):
    resolving_to(monkeypatch)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME"):
        check_gloo_reaches_nodes(2, 4, 2, "127.0.0.1")
    assert dict(os.environ) == before
