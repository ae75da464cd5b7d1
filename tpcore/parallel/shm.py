"""Shared-memory collectives for the CPU ranks of one host: an all-reduce in microseconds, not gloo's
loopback TCP round trips (tenths of a millisecond), which dominate a decode step's time on CPU.

The ranks of a gloo group that all run on one host map one shared segment::

    flags  int64 [2, N]             flags[p, r] = k: rank r has written step k (parity p = k % 2)
    slots  bytes [2, N, capacity]   slots[p, r]: rank r's tensor of the step with parity p

Step ``k`` on rank ``r``: copy the tensor into ``slots[p, r]``, publish ``flags[p, r] = k``, wait
until every rank has published ``k``, then read: an all-reduce sums ``slots[p, 0..N-1]`` in rank
order (the same bits on every rank), an all-gather concatenates them. A tensor larger than a slot
goes through in slot-sized chunks, one step each. Two parities make this safe:
a rank writes parity ``p`` again only at step ``k + 2``, after every rank has published ``k + 1``,
which each does only after it finished reading step ``k``.

The segment is a file in ``/dev/shm``, its memory reserved when it is created (no room: gloo is
used instead), and unlinked as soon as every rank has mapped it, so nothing is left behind, however
the ranks end. A wait spins briefly, then yields the core (ranks may
outnumber cores) and gives up after the group's timeout. Tensors not on the CPU go through the
group's backend; ``TPCORE_SHM=0`` turns the fast path off.
"""

from __future__ import annotations

import datetime
import math
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from tpcore.parallel.memfd import gathered_empty

__all__ = ["ShmCollectives", "attach", "for_group"]

SLOT_BYTES = 4 * 2**20
SHM_DIR = Path("/dev/shm")
SPIN_CHECKS = 2000
TIMEOUT = datetime.timedelta(minutes=5)

_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
#: acquiring and releasing a lock is a full memory barrier on every CPU torch runs on
_FENCE = threading.Lock()


class ShmCollectives:
    """All-reduce (sum) and all-gather of CPU tensors through shared memory, ``slot_bytes`` per step."""

    def __init__(self, path: Path, rank: int, world_size: int, slot_bytes: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        flag_bytes = 2 * world_size * 8
        segment = torch.from_file(str(path), shared=True, size=segment_bytes(world_size, slot_bytes), dtype=torch.uint8)
        self._flags = segment[:flag_bytes].view(torch.int64).view(2, world_size).numpy()
        self._slots = segment[flag_bytes:].view(2, world_size, slot_bytes)
        self._step = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` can go through shared memory (any CPU tensor: large ones go in chunks)."""
        return tensor.device.type == "cpu"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place: ``((t_0 + t_1) + t_2) + ...`` on every rank."""
        flat = tensor.reshape(-1)  # a view of a contiguous tensor, else a copy written back below
        for chunk in flat.split(self._chunk_elements(flat)):
            slots = self._exchange(chunk)
            torch.add(slots[0], slots[1], out=chunk)
            for other in slots[2:]:
                chunk.add_(other)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order.

        Seen as ``rows [outer, inner]`` (``outer``: the sizes before ``dim``), the result is
        ``[outer, N * inner]`` with rank ``r``'s rows in columns ``[r * inner, (r + 1) * inner)``;
        whole rows go through a step and land straight in the result.
        """
        dim = dim % tensor.dim()
        outer, inner = math.prod(tensor.shape[:dim]), math.prod(tensor.shape[dim:])
        rows = tensor.reshape(outer, inner)
        rows_per_step = self._chunk_elements(rows) // max(inner, 1)
        if rows_per_step == 0:  # one row is larger than a slot
            return self._all_gather_flat(tensor, dim)
        out = gathered_empty(tensor, dim, self.world_size)
        out_rows = out.view(outer, self.world_size * inner)
        for start in range(0, outer, rows_per_step):
            chunk = rows[start : start + rows_per_step]
            for rank, slot in enumerate(self._exchange(chunk)):
                out_rows[start : start + len(chunk), rank * inner : (rank + 1) * inner].copy_(slot)
        return out

    def _all_gather_flat(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        offset = 0
        for chunk in flat.split(self._chunk_elements(flat)):
            for part, slot in zip(parts, self._exchange(chunk), strict=True):
                part[offset : offset + chunk.numel()].copy_(slot)
            offset += chunk.numel()
        out = gathered_empty(tensor, dim, self.world_size)
        return torch.cat([part.view(tensor.shape) for part in parts], dim=dim, out=out)

    def _chunk_elements(self, flat: torch.Tensor) -> int:
        """Elements per step: a slot's worth (at least one, so that an empty tensor is one step)."""
        return max(1, self.slot_bytes // flat.element_size())

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``tensor``, wait for every rank's, and return views of all of them (rank order)."""
        self._step += 1
        step, parity = self._step, self._step % 2
        nbytes = tensor.numel() * tensor.element_size()

        def view(rank: int) -> torch.Tensor:
            return self._slots[parity, rank, :nbytes].view(tensor.dtype).view(tensor.shape)

        view(self.rank).copy_(tensor)
        with _FENCE:  # the data is visible before the flag
            self._flags[parity, self.rank] = step
        self._wait(self._flags[parity], step)
        with _FENCE:  # the flags are read before the data
            pass
        return [view(rank) for rank in range(self.world_size)]

    def _wait(self, flags, step: int) -> None:
        checks, started = 0, None
        while flags.min() < step:
            checks += 1
            if checks <= SPIN_CHECKS:
                continue
            _yield()  # ranks may outnumber cores: let the one we wait for run
            if checks % 1024 == 0:
                started = started or time.monotonic()
                if time.monotonic() - started > self.timeout_s:
                    waiting = [rank for rank in range(self.world_size) if flags[rank] < step]
                    raise TimeoutError(
                        f"rank {self.rank}: ranks {waiting} did not reach shared-memory step {step} "
                        f"within {self.timeout_s:g} s"
                    )


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    return 2 * world_size * 8 + 2 * world_size * slot_bytes


def for_group(group: dist.ProcessGroup | None) -> ShmCollectives | None:
    """The shared-memory collectives attached to ``group`` (``None``: the default group), if any."""
    if group is None:
        group = dist.group.WORLD
    try:
        return _BY_GROUP.get(group)
    except TypeError:  # not weak-referenceable: never attached
        return None


def attach(group: dist.ProcessGroup | None = None, slot_bytes: int = SLOT_BYTES) -> ShmCollectives | None:
    """Collective over ``group``: give it shared-memory collectives if it is a gloo group whose
    ranks all run on this host; returns them (or ``None``). Every rank of the group must call it."""
    if group is None:
        group = dist.group.WORLD
    existing = for_group(group)
    if existing is not None:
        return existing
    if os.environ.get("TPCORE_SHM", "1") == "0" or dist.get_backend(group) != "gloo":
        return None
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return None
    here = (socket.gethostname(), _boot_id())
    path = None
    if rank == 0:
        path = _create_segment(segment_bytes(world_size, slot_bytes))
    everyone: list = [None] * world_size
    try:
        dist.all_gather_object(everyone, (here, path), group=group)
        path = everyone[0][1]
        if path is None or any(other != here for other, _ in everyone):
            return None
        fast = ShmCollectives(path, rank, world_size, slot_bytes, TIMEOUT.total_seconds())
        dist.barrier(group=group)  # every rank has mapped the segment
    finally:
        if rank == 0 and path is not None:
            path.unlink(missing_ok=True)
    _BY_GROUP[group] = fast
    return fast


def _create_segment(size: int) -> Path | None:
    """A file of ``size`` bytes in /dev/shm with its memory reserved up front, or ``None`` if there is
    no room (a small /dev/shm, as in containers, would otherwise kill a rank with SIGBUS later)."""
    if not SHM_DIR.is_dir():
        return None
    path = SHM_DIR / f"tpcore-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        with open(path, "wb") as segment:
            os.posix_fallocate(segment.fileno(), 0, size)
    except (OSError, AttributeError):  # no room, or no posix_fallocate on this system
        path.unlink(missing_ok=True)
        return None
    return path


def _boot_id() -> str:
    """Distinguishes hosts (and containers) that share a host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
