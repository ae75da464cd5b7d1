"""Looking at processes from tests: is a pid gone, which children does this process have."""

from __future__ import annotations

import os


def gone(pid: int) -> bool:
    """The process ended (a zombie counts as ended: nobody may be left to reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def children() -> set[int]:
    own = str(os.getpid())
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
