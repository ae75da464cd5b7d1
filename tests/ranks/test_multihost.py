"""Multi-host: ``torchrun --nnodes 2`` over two hosts made here, split models equal to the unsplit one.

Each host is a network namespace with its own host name (a UTS namespace) and its own ``/etc/hosts`` (a
mount namespace); the two are joined by a veth pair on a private subnet, their only path to each other, so
gloo between hosts goes over TCP on that pair. ``/dev/shm`` is common to both, as it never is between
real hosts: shared-memory collectives must come from the group's ranks reporting one host name, and only
then. The hosts files are Debian's (a host's own name on ``127.0.1.1``), where gloo, left alone, listens
on loopback: the ranks are launched as docs/multi-host.md shows, c10d rendezvous at the first host and
``GLOO_SOCKET_IFNAME`` naming each host's interface, and without it tpcore refuses, naming that interface.

Skipped, with the reason, where the namespaces cannot be made (not root, no ``ip`` or ``unshare``, no
``CAP_NET_ADMIN``). Everything made here (namespaces, their veth pair, their processes) is removed after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tpcore.ranks.distributed import LAUNCHER_VARIABLES
from tpcore.testing import DEFAULT_RTOL

pytestmark = pytest.mark.slow  # two torchrun agents and four ranks

RANK_SCRIPT = Path(__file__).with_name("multihost_rank.py")
SUBNET = "10.77.0"
RENDEZVOUS_PORT = 29400  # each host has its own ports: no other program can hold it
COMMAND_TIMEOUT_S = 30
REFUSAL_TIMEOUT_S = 120  # one rank's start (joined by mistake, it would wait for the store for minutes)
WORLD_TIMEOUT_S = 600  # the whole two-host run (20 to 40 s on 2 cores)
EXIT_TIMEOUT_S = 15
#: an 8-head Llama with 4 key/value heads: dealt over 2 ranks, replicated in pairs over 4
CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclasses.dataclass(frozen=True)
class Host:
    """One of the two hosts: a network namespace, the veth end in it and its address, a host name."""

    name: str
    namespace: str
    interface: str
    address: str
    hosts_file: Path

    def command(self, *argv: str) -> list[str]:
        """``argv`` run on this host: in its network namespace, under its host name and hosts file."""
        setup = f'mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts && hostname {self.name} && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--mount", "sh", "-c", setup, "sh", *argv]


def missing_tools() -> str | None:
    """Why namespaces cannot be made here before trying, or ``None``."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} command" if missing else None


def setup_commands(hosts: list[Host]) -> list[list[str]]:
    """The namespaces, the veth pair made straight into them, addresses and links up, then a trial run on each."""
    first, second = hosts
    commands = [["ip", "netns", "add", host.namespace] for host in hosts]
    commands.append(
        ["ip", "link", "add", first.interface, "netns", first.namespace]
        + ["type", "veth", "peer", "name", second.interface, "netns", second.namespace]
    )
    for host in hosts:
        commands.append(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface])
        commands.append(["ip", "-n", host.namespace, "link", "set", host.interface, "up"])
        commands.append(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
    return commands + [host.command("true") for host in hosts]


def write_hosts_files(hosts: list[Host]) -> None:
    """Debian's hosts file on each host: its own name on 127.0.1.1, the other host's on its address."""
    for host in hosts:
        others = "".join(f"{other.address} {other.name}\n" for other in hosts if other is not host)
        host.hosts_file.write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n{others}")


def first_failure(commands: list[list[str]]) -> str | None:
    """Run ``commands`` in turn; the first that fails, with its error, or ``None``."""
    for command in commands:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"`{shlex.join(command)}` did not finish in {COMMAND_TIMEOUT_S} s"
        if done.returncode:
            return f"`{shlex.join(command)}` failed: {(done.stderr or done.stdout).strip()}"
    return None


def remove(hosts: list[Host]) -> None:
    """Kill what still runs in the namespaces (by pid: only what this module started runs there), delete them
    (and with them the veth pair)."""
    for host in hosts:
        listed = subprocess.run(
            ["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=COMMAND_TIMEOUT_S)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> list[Host]:
    """Two hosts, ``node0`` and ``node1``, joined by a veth pair (skipped where they cannot be made)."""
    reason = missing_tools()
    if reason:
        pytest.skip(f"cannot make network namespaces: {reason}")
    tag, directory = secrets.token_hex(3), tmp_path_factory.mktemp("hosts")
    hosts = [
        Host(f"node{i}", f"tpcore-{tag}-{i}", f"tpv{tag}{i}", f"{SUBNET}.{i + 1}", directory / f"hosts{i}")
        for i in range(2)
    ]
    write_hosts_files(hosts)
    try:
        failure = first_failure(setup_commands(hosts))
        if failure:
            pytest.skip(f"cannot make network namespaces: {failure}")
        yield hosts
    finally:
        remove(hosts)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A small random-init Llama saved with ``save_pretrained``."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).save_pretrained(directory)
    return directory


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's world or a chosen gloo interface, plus ``extra``."""
    dropped = {*LAUNCHER_VARIABLES, "GLOO_SOCKET_IFNAME"}
    return {**{name: value for name, value in os.environ.items() if name not in dropped}, **extra}


def torchrun(host: Host, rendezvous: Host, *script: str) -> list[str]:
    """The launch a cluster user types on each node: 2 nodes of 2 ranks, c10d rendezvous at ``rendezvous``."""
    return host.command(
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rendezvous.name}:{RENDEZVOUS_PORT}"),
        *("--rdzv-id", "tpcore-multihost"),
        *script,
    )


def run_world(hosts: list[Host], logs: Path, *script: str) -> list[int | None]:
    """torchrun on both hosts at once, each with ``GLOO_SOCKET_IFNAME`` naming its interface; their exit codes.

    Each agent's output goes to ``logs/<host>.log``. Agents still running at the deadline are stopped
    (SIGTERM, which stops their ranks, then SIGKILL) and get exit code ``None``.
    """
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    with contextlib.ExitStack() as stack:
        agents = []
        for host in hosts:
            log = stack.enter_context(open(logs / f"{host.name}.log", "w"))
            environment = clean_environment(GLOO_SOCKET_IFNAME=host.interface)
            command = torchrun(host, hosts[0], *script)
            agents.append(subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        try:
            return [agent.wait(timeout=max(0.0, deadline - time.monotonic())) for agent in agents]
        except subprocess.TimeoutExpired:
            return [stop(agent) for agent in agents]


def stop(agent: subprocess.Popen) -> int | None:
    """The agent's exit code if it ended, else ``None`` after stopping it."""
    if agent.poll() is not None:
        return agent.returncode
    agent.terminate()
    try:
        agent.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait(timeout=EXIT_TIMEOUT_S)
    return None


@pytest.fixture(scope="module")
def reports(two_hosts, llama_dir, tmp_path_factory) -> dict[int, dict]:
    """Every rank's report from one run of tests/ranks/multihost_rank.py over the two hosts, by rank."""
    results, logs = tmp_path_factory.mktemp("results"), tmp_path_factory.mktemp("logs")
    codes = run_world(two_hosts, logs, str(RANK_SCRIPT), str(llama_dir), str(results))
    output = "\n".join(f"--- {log.name}\n{log.read_text()[-6000:]}" for log in sorted(logs.iterdir()))
    assert codes == [0, 0], f"torchrun exit codes {codes} (None: stopped after {WORLD_TIMEOUT_S} s)\n{output}"
    found = {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in results.glob("*.json")}
    assert sorted(found) == [0, 1, 2, 3], output
    return found


def assert_equivalent(check: dict) -> None:
    """Logits within tpcore's fp32 tolerance of their scale, greedy tokens identical."""
    assert check["max_diff"] <= DEFAULT_RTOL * check["scale"], check
    assert len(check["reference_tokens"][0]) == 6 + 8
    assert check["tokens"] == check["reference_tokens"]


def test_a_host_whose_name_is_on_loopback_is_refused_naming_its_interface(two_hosts):
    """Without GLOO_SOCKET_IFNAME, gloo would listen on 127.0.1.1; the rank fails before joining, saying what to set."""
    first, second = two_hosts
    world = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": first.name}
    environment = clean_environment(**world, MASTER_PORT=str(RENDEZVOUS_PORT), TORCHELASTIC_USE_AGENT_STORE="True")
    join = "import tpcore; tpcore.ParallelEngine(num_gpus=2, backend='gloo').create_process_group()"
    command = second.command(sys.executable, "-c", join)
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert done.returncode == 1, done.stderr
    assert "gloo would listen on 127.0.1.1, a loopback address no other node reaches" in done.stderr
    expected = f"Set GLOO_SOCKET_IFNAME to {second.interface} here, the interface that routes to MASTER_ADDR node0"
    assert expected in done.stderr


def test_each_host_runs_two_ranks_of_the_world(reports):
    hosts = [reports[rank]["host"] for rank in range(4)]
    assert sorted(hosts) == ["node0", "node0", "node1", "node1"]
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3]  # torchrun numbers each node's ranks consecutively


def test_a_group_across_hosts_talks_over_tcp_only_and_matches_the_unsplit_model(reports):
    for rank, report in reports.items():
        check = report["tp4 from the model"]
        assert check["group_ranks"] == [0, 1, 2, 3]
        assert sorted(check["group_hosts"]) == ["node0", "node0", "node1", "node1"]
        assert check["shared_memory"] is False, f"rank {rank} got shared memory in a group over two hosts"
        assert_equivalent(check)


def test_groups_of_one_host_share_memory_and_match_the_unsplit_model_read_from_the_checkpoint(reports):
    for rank, report in reports.items():
        check = report["tp2 from the checkpoint"]
        assert check["group_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert check["group_hosts"] == [report["host"]] * 2
        assert check["shared_memory"] is True, f"rank {rank}: no shared memory in a group on one host"
        assert_equivalent(check)
