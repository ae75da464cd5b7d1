"""Looking at processes from tests: is a pid gone, which children does this process have, where do they listen."""

from __future__ import annotations

import contextlib
import ipaddress
import os


def gone(pid: int) -> bool:
    """The process ended (a zombie counts as ended: nobody may be left to reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def children(pid: int | None = None) -> set[int]:
    """The running processes that ``pid`` started: its children, where the CPU ranks' zygote
    (:mod:`tpcore.ranks.zygote`, kept for the next pools) stands for the ranks it forked. Of this process's own
    (``pid`` ``None``) only tpcore's count: ranks and zygotes, not what libraries start in the background meanwhile
    (torch's compile workers)."""
    found = set()
    for child in _direct_children(os.getpid() if pid is None else pid):
        if is_zygote(child):
            found |= _direct_children(child)
        elif pid is not None or _runs_tpcore(child):
            found.add(child)
    return found


def _runs_tpcore(pid: int) -> bool:
    """A rank started as a fresh interpreter (its command imports tpcore's worker), or another tpcore command."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return b"tpcore" in cmdline.read()
    return False


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def is_zygote(pid: int) -> bool:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return b"# tpcore rank zygote" in cmdline.read()
    return False


def _direct_children(parent: int) -> set[int]:
    own = str(parent)
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == own and fields[0] != "Z":
                found.add(int(entry))
    return found


def listening_sockets() -> dict[int, tuple[str, int]]:
    """``{socket inode: (address, port)}`` of every listening TCP socket in this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    address, port = fields[1].rsplit(":", 1)
                    found[int(fields[9])] = (_address(address), int(port, 16))
    return found


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order) in the usual notation."""
    raw = bytes.fromhex(hex_address)
    host_order = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host_order))


def socket_inodes(pid: int | str) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def listening_of(pids) -> dict[int, tuple[str, int]]:
    """``{inode: (address, port)}`` of the listening TCP sockets that ``pids`` hold."""
    listening = listening_sockets()
    return {inode: listening[inode] for pid in pids for inode in socket_inodes(pid) if inode in listening}


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (getattr(ip, "ipv4_mapped", None) is not None and ip.ipv4_mapped.is_loopback)
