"""Process-group management: backend choice, rendezvous stores that listen on one address, clean destroy.

No global side effects beyond torch.distributed's own state: environment variables such as
``CUDA_VISIBLE_DEVICES`` and ``MASTER_PORT`` are read, never written.

torch's ``TCPStore`` server binds every interface (``::``) whatever address it is given. The stores
tpcore makes itself (the one behind ``parallelize()``, and rank 0's when :func:`tensor_parallel_group`
joins a world from ``MASTER_ADDR``/``MASTER_PORT`` without torchrun) are handed a socket already
bound to the rendezvous address, so they listen there alone: loopback by default.

gloo's own sockets listen where the host name resolves unless ``GLOO_SOCKET_IFNAME`` names an interface:
torch's ``init_process_group`` and ``new_group`` (2.6 to 2.13) ignore ``pg_options`` for gloo. A host
whose name does not resolve, or resolves to loopback (Debian's ``127.0.1.1``), would listen on loopback,
where no other node reaches it: :func:`tensor_parallel_group` refuses to join such a world, naming the
interface to set.
"""

from __future__ import annotations

import atexit
import datetime
import fcntl
import inspect
import ipaddress
import os
import socket
import struct
import time

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEVICE_TYPES",
    "LAUNCHER_VARIABLES",
    "bind_device",
    "check_gloo_reaches_nodes",
    "check_placement",
    "default_backend",
    "destroy_process_group",
    "device_for",
    "device_type",
    "free_port",
    "gloo_address",
    "init_process_group",
    "interface_of",
    "listening_store",
    "rendezvous_store",
    "route_interface",
    "tensor_parallel_group",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound and released by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


#: what ranks compute on: ``device=`` of RankPool, parallelize() and ParallelEngine (``None``: by the backend)
DEVICE_TYPES = ("cuda", "cpu")


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend(world_size: int) -> str:
    """``"nccl"`` when NCCL is there and this node sees a CUDA device for each of its ``world_size``
    ranks, else ``"gloo"`` (CPU ranks, or gloo ranks that share the GPUs with ``device="cuda"``)."""
    if dist.is_nccl_available() and _visible_gpus() >= world_size:
        return "nccl"
    return "gloo"


def device_type(backend: str, device: str | None = None) -> str:
    """What ranks of ``backend`` compute on: ``device``, or ``None`` for CUDA with NCCL and the CPU otherwise."""
    if device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if device not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES} or None, got {device!r}")
    return device


def check_placement(backend: str, local_ranks: int, device: str | None = None) -> str:
    """Refuse, before any rank starts, ``local_ranks`` ranks of ``backend`` on ``device`` that could not
    run on this node; return the device type they use.

    NCCL binds one CUDA device per rank and fails at the first collective, after loading, when two
    ranks share one; so NCCL ranks beyond the visible devices are refused here. gloo ranks may
    share the GPUs (rank ``r`` on ``cuda:(r % devices)``).
    """
    kind = device_type(backend, device)
    if backend == "nccl" and kind != "cuda":
        raise ValueError(f"backend 'nccl' moves CUDA tensors only; device={device!r} needs backend='gloo'")
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("backend 'nccl': this torch build has no NCCL; use backend='gloo'")
    gpus = _visible_gpus()
    if kind == "cuda" and gpus == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        note = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise RuntimeError(f"device 'cuda' (backend {backend!r}): no CUDA device is visible{note}")
    if backend == "nccl" and local_ranks > gpus:
        raise RuntimeError(f"{local_ranks} NCCL ranks on this node need one CUDA device each: {_too_few_gpus(gpus)}")
    return kind


def _too_few_gpus(gpus: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
    return (
        f"{gpus} {'is' if gpus == 1 else 'are'} visible ({note}), and NCCL cannot share a device between ranks. "
        "Use fewer ranks, or backend='gloo' (with device='cuda' gloo ranks share the GPUs)"
    )


def device_for(backend: str, local_rank: int, device: str | None = None) -> torch.device:
    """This rank's device: for NCCL ``cuda:<local_rank>`` (of the visible devices, one per rank), for
    gloo the CPU, or with ``device="cuda"`` ``cuda:(local_rank % devices)``."""
    if device_type(backend, device) == "cpu":
        return torch.device("cpu")
    count = _visible_gpus()
    if count == 0:
        raise RuntimeError(f"backend {backend!r} on device 'cuda': no CUDA device is visible")
    if backend == "nccl":
        if local_rank >= count:
            raise RuntimeError(f"NCCL local rank {local_rank} has no CUDA device of its own: {_too_few_gpus(count)}")
        return torch.device("cuda", local_rank)
    return torch.device("cuda", local_rank % count)


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (before any group exists); nothing for the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


#: what a launcher (torchrun, SLURM scripts) sets for its own ranks; a worker pool's ranks get their own world
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
)
# torch's libuv store server takes a listening socket from 2.8 on (pytorch/pytorch#150215); before, its older one
_LIBUV_TAKES_SOCKET = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 8)
# init_process_group(device_id=) binds a group to its device (and NCCL connects eagerly); torch 2.3 on
_INIT_TAKES_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters


def listening_store(host: str, port: int = 0, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """A ``TCPStore`` server that listens on ``host`` only; ``port`` 0 picks a free one (``store.port``).

    Raises ``OSError`` naming the address when ``host:port`` cannot be bound (in use, not an
    address of this machine).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port just freed (TIME_WAIT), never a listened one
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        hint = " (another world or program holds it; master_port=None picks a free one)" if port else ""
        message = f"cannot listen on {host}:{port} for the rendezvous: {error.strerror}{hint}"
        raise OSError(error.errno, message) from None
    fd = sock.detach()  # the store owns the socket from here on and closes it when it is deleted
    return dist.TCPStore(
        host, 0, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd, use_libuv=_LIBUV_TAKES_SOCKET
    )


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> dist.TCPStore:
    """The store of a world: rank 0 serves it on ``host:port`` alone, the other ranks connect to it."""
    if rank == 0:
        return listening_store(host, port, timeout)
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    store: dist.Store | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    device: torch.device | None = None,
) -> None:
    """Join a world of ``world_size`` ranks that meet in ``store`` (``None``: the ``env://`` variables).

    An NCCL group is bound to ``device`` (``device_id=``, where this torch has it); bind the process
    to it first (:func:`bind_device`).
    """
    options: dict = {"store": store, "rank": rank, "world_size": world_size} if store is not None else {}
    if backend == "nccl" and device is not None and device.type == "cuda" and _INIT_TAKES_DEVICE_ID:
        options["device_id"] = device
    dist.init_process_group(backend, timeout=timeout, **options)


def interface_of(address: str) -> str | None:
    """The name of the network interface that carries IPv4 ``address`` (any loopback address: the
    loopback interface), or ``None`` (unknown address, IPv6, no interface query on this system)."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    siocgifaddr = 0x8915  # Linux: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            carried = ipaddress.IPv4Address(reply[20:24])
            if carried == wanted or (wanted.is_loopback and carried.is_loopback):
                return name
    return None


def route_interface(host: str) -> str | None:
    """The interface this host sends to ``host`` (an IPv4 address or a name) through, or ``None``
    (a name that does not resolve, no route)."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))  # a datagram socket's connect picks the route and sends nothing
            source = sock.getsockname()[0]
    except OSError:
        return None
    return interface_of(source)


def gloo_address() -> str:
    """The address torch's gloo listens on where ``GLOO_SOCKET_IFNAME`` is unset: the first address the host
    name resolves to that this host can bind, else loopback (``127.0.0.1``)."""
    try:
        candidates = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, kind, protocol, _, address in candidates:
        try:
            with socket.socket(family, kind, protocol) as probe:
                probe.bind(address)
        except OSError:
            continue
        return str(address[0])
    return "127.0.0.1"


def check_gloo_reaches_nodes(rank: int, world_size: int, local_world_size: int, master_addr: str) -> None:
    """Refuse a gloo world over several nodes (``local_world_size < world_size``) whose sockets would listen
    on loopback here, naming the interface to set in ``GLOO_SOCKET_IFNAME``; nothing where that is set."""
    if local_world_size >= world_size or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    address = gloo_address()
    if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return
    interface = route_interface(master_addr)
    if interface is None or interface == interface_of("127.0.0.1"):
        hint = "the interface the nodes reach each other through (`ip route get <another node>` names it)"
    else:
        hint = f"{interface} here, the interface that routes to MASTER_ADDR {master_addr}"
    raise RuntimeError(
        f"rank {rank} of a gloo world of {world_size} ranks, {local_world_size} on this node: gloo would listen "
        f"on {address}, a loopback address no other node reaches (the host name {socket.gethostname()!r} "
        f"resolves to no other address this host can bind). Set GLOO_SOCKET_IFNAME to {hint} "
        "(GLOO_SOCKET_IFNAME=lo if every node runs on this machine)"
    )


def tensor_parallel_group(
    tp_size: int, backend: str | None = None, device: torch.device | None = None
) -> dist.ProcessGroup | None:
    """The tensor-parallel group of ``tp_size`` ranks this process belongs to.

    Reuses an initialized world (``torchrun`` or a worker pool); otherwise joins one from the
    ``env://`` variables torchrun sets (and leaves it at exit), bound to ``device``; a gloo world over several
    nodes only where gloo listens off loopback (:func:`check_gloo_reaches_nodes`). A world of ``k * tp_size``
    ranks is cut into ``k`` groups of consecutive ranks. With ``tp_size == 1`` and no world, returns ``None``.
    """
    if not dist.is_initialized():
        if tp_size == 1 and "WORLD_SIZE" not in os.environ:
            return None
        _join_world(tp_size, backend, device)
    world_size = dist.get_world_size()
    if world_size == tp_size:
        return dist.group.WORLD
    if world_size % tp_size:
        raise ValueError(f"a world of {world_size} ranks cannot hold tensor-parallel groups of {tp_size}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, tp_size):  # every rank must create every group
        group = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            mine = group
    return mine


def _join_world(tp_size: int, backend: str | None, device: torch.device | None) -> None:
    """Join the world the ``env://`` variables describe (torchrun's, or hand-set), and leave it at exit."""
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            f"a tensor-parallel group of {tp_size} ranks needs a process group: launch with torchrun "
            f"(torchrun --nproc-per-node {tp_size} script.py), or use tpcore.parallelize()"
        )
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", tp_size)))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "gloo":
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        check_gloo_reaches_nodes(rank, world_size, local_world_size, os.environ["MASTER_ADDR"])
    store = None  # torchrun's agent serves the store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = rendezvous_store(address, port, rank, world_size)
    init_process_group(backend, rank, world_size, store, device=device)
    atexit.register(destroy_process_group)  # we created it, so we tear it down at exit


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
