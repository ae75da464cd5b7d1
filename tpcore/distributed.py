"""Process-group management: backend choice, loopback rendezvous on a free port, clean destroy.

No global side effects beyond torch.distributed's own state: environment variables such as
``CUDA_VISIBLE_DEVICES`` and ``MASTER_PORT`` are read, never written.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import os
import socket
import time

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "check_port_free",
    "default_backend",
    "destroy_process_group",
    "device_for",
    "free_port",
    "init_process_group",
    "tensor_parallel_group",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound and released by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError(EADDRINUSE)`` if something listens on ``port`` already (another world's rendezvous)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store binds
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            message = (
                f"master_port {port} is in use on {host} (another parallelized model, or some other process, "
                "listens there): pass another master_port, or None to let tpcore pick a free one"
            )
            raise OSError(errno.EADDRINUSE, message) from None


def default_backend() -> str:
    """``"nccl"`` when CUDA devices and NCCL are there, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` (of the visible devices) for NCCL, else the CPU."""
    if backend == "nccl":
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("backend 'nccl' needs CUDA devices, and none is visible")
        return torch.device("cuda", local_rank % count)
    return torch.device("cpu")


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Join a world of ``world_size`` ranks through a TCP rendezvous at ``master_addr:master_port``."""
    if master_port is None:
        raise ValueError("init_process_group needs the master_port that rank 0 listens on")
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def tensor_parallel_group(num_gpus: int, backend: str | None = None) -> dist.ProcessGroup | None:
    """The tensor-parallel group of ``num_gpus`` ranks this process belongs to.

    Reuses an initialized world (``torchrun`` or a worker pool); otherwise joins one from the
    ``env://`` variables torchrun sets (and leaves it at exit). A world of ``k * num_gpus`` ranks is cut into ``k``
    groups of consecutive ranks. With ``num_gpus == 1`` and no world, returns ``None``.
    """
    if not dist.is_initialized():
        if num_gpus == 1 and "WORLD_SIZE" not in os.environ:
            return None
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                f"num_gpus={num_gpus} needs a process group: launch with torchrun "
                f"(torchrun --nproc-per-node {num_gpus} script.py), or use tpcore.parallelize()"
            )
        dist.init_process_group(backend or default_backend(), timeout=DEFAULT_TIMEOUT)
        atexit.register(destroy_process_group)  # we created it, so we tear it down at exit
    world_size = dist.get_world_size()
    if world_size == num_gpus:
        return dist.group.WORLD
    if world_size % num_gpus:
        raise ValueError(f"a world of {world_size} ranks cannot hold tensor-parallel groups of {num_gpus}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, num_gpus):  # every rank must create every group
        group = dist.new_group(list(range(start, start + num_gpus)))
        if start <= rank < start + num_gpus:
            mine = group
    return mine


def destroy_process_group(settle_s: float = 0.1) -> None:
    """Leave the world, if this process joined one; call it last thing in an SPMD script.

    gloo's worker threads release a finished collective a moment after the caller has its result, and that release
    needs the GIL when the tensors have Python objects. If the interpreter is already shutting down by then, the
    thread cannot take the GIL and the process aborts (``terminate called without an active exception``) although
    all work is done. Waiting ``settle_s`` seconds after the destroy lets the threads finish while the interpreter
    is alive.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(settle_s)
