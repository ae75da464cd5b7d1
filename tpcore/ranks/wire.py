"""The caller-rank control channel: an authenticated Unix socket, and the message framing on it.

A rank connects to a socket in a directory only the caller's user can enter, answers a random
challenge with ``HMAC-SHA256(key, challenge | rank)`` for the key it was started with, and is
then a :class:`~multiprocessing.connection.Connection`. Connections that do not answer correctly
within :data:`HANDSHAKE_TIMEOUT_S` are dropped while the caller keeps waiting for its ranks.

A message is framed as the pickled message (cloudpickle: code from ``__main__`` travels by value)
and where its out-of-band buffers are, then each raw frame. Plain CPU tensors travel as their bytes
(pickle protocol 5), never through torch's own serialization (about 0.1 ms a tensor however small):
small ones inside the pickle, large ones out of band with no copy into it; from a megabyte on they
travel in shared memory (:mod:`tpcore.parallel.memfd`), the receiver mapping what the sender wrote, and a
tensor the sender already holds in shared memory is not copied at all.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import secrets
import selectors
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tpcore.parallel import memfd

try:
    import cloudpickle
except ImportError:  # an offline machine without it: code from __main__ cannot travel, the rest works
    cloudpickle = pickle

__all__ = ["ControlListener", "Encoded", "byte_view", "connect", "encode", "picklable", "recv", "send"]

#: how long a new connection has to answer the challenge before it is dropped
HANDSHAKE_TIMEOUT_S = 10.0
CHALLENGE_BYTES = 32
_RANK_BYTES = 4
_REPLY_BYTES = hashlib.sha256().digest_size + _RANK_BYTES
#: CPU tensors from this size on travel as raw frames beside the pickled message
RAW_TENSOR_BYTES = 64 * 2**10
#: ... and from this size on in shared memory (:mod:`tpcore.parallel.memfd`) where the system has it
SHARED_TENSOR_BYTES = 2**20
#: descriptors one ``SCM_RIGHTS`` message may carry (Linux's ``SCM_MAX_FD``)
_MAX_FDS_PER_MESSAGE = 253


# -- authentication ------------------------------------------------------------------------------


def _proof(key: bytes, challenge: bytes, rank_bytes: bytes) -> bytes:
    return hmac.new(key, challenge + rank_bytes, hashlib.sha256).digest()


class _Handshake:
    """A connection that has been sent its challenge and has until ``deadline`` to answer."""

    def __init__(self, challenge: bytes, deadline: float):
        self.challenge = challenge
        self.deadline = deadline
        self.reply = b""

    def rank(self, key: bytes) -> int | None:
        """The rank the full reply proves, or ``None`` if the proof is wrong."""
        proof, rank_bytes = self.reply[:-_RANK_BYTES], self.reply[-_RANK_BYTES:]
        if not hmac.compare_digest(proof, _proof(key, self.challenge, rank_bytes)):
            return None
        return int.from_bytes(rank_bytes, "big")


class ControlListener:
    """A listening Unix socket in a fresh directory of mode 0700 (only this user can connect).

    Only the process that made it removes the socket and its directory: a child forked meanwhile, closing its
    copy, leaves them to the parent."""

    def __init__(self):
        self._directory = Path(tempfile.mkdtemp(prefix="tpcore-"))
        self._owner_pid = os.getpid()
        self.address = str(self._directory / "control")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.bind(self.address)
            self._socket.listen(64)
        except BaseException:
            self.close()
            raise
        #: connections dropped because they did not authenticate in time
        self.dropped = 0

    def accept_ranks(
        self, key: bytes, world_size: int, deadline: float, check: Callable[[set[int]], None]
    ) -> list[Connection]:
        """One authenticated connection per rank, in rank order, before ``deadline`` (``time.monotonic``).

        ``check(connected_ranks)`` is called every tenth of a second and raises to give up (a rank
        that died before connecting). A connection with a wrong, late or duplicate answer is dropped.
        """
        admission = _Admission(self._socket, key, world_size)
        try:
            while len(admission.accepted) < world_size:
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(range(world_size)) - set(admission.accepted))
                    raise TimeoutError(f"start: ranks {missing} did not connect in time")
                check(set(admission.accepted))
                admission.handle(now, timeout=min(0.1, deadline - now))
        except BaseException:
            admission.close_accepted()
            raise
        finally:
            self.dropped += admission.finish()
        return admission.connections()

    def close(self) -> None:
        """Stop listening and remove the socket and its directory (in the process that made them). Idempotent."""
        self._socket.close()
        if os.getpid() == self._owner_pid:
            shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ControlListener:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Admission:
    """The connections of one start: those that have their challenge and have not answered it yet
    (:attr:`pending`), and the ranks proven so far (:attr:`accepted`)."""

    def __init__(self, listening: socket.socket, key: bytes, world_size: int):
        self._listening = listening
        self._key = key
        self._world_size = world_size
        self._selector = selectors.DefaultSelector()
        self._selector.register(listening, selectors.EVENT_READ)
        self.pending: dict[socket.socket, _Handshake] = {}
        self.accepted: dict[int, socket.socket] = {}
        self._dropped = 0

    def handle(self, now: float, timeout: float) -> None:
        """Drop the connections whose time to answer is up, then handle what arrives within ``timeout``
        seconds: a new connection gets its challenge, an answer is read and checked."""
        for peer in [peer for peer, state in self.pending.items() if now > state.deadline]:
            self._drop(peer)
        for selected, _ in self._selector.select(timeout=timeout):
            if selected.fileobj is self._listening:
                self._challenge(now)
            else:
                self._read_answer(selected.fileobj)

    def _challenge(self, now: float) -> None:
        peer, _ = self._listening.accept()
        peer.setblocking(False)
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            peer.send(challenge)  # a fresh socket's buffer always takes 32 bytes
        except OSError:
            peer.close()
            return
        self.pending[peer] = _Handshake(challenge, now + HANDSHAKE_TIMEOUT_S)
        self._selector.register(peer, selectors.EVENT_READ)

    def _read_answer(self, peer) -> None:
        """Read what ``peer`` sent of its answer; once whole, accept its rank or drop it."""
        state = self.pending[peer]
        try:
            data = peer.recv(_REPLY_BYTES - len(state.reply))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        state.reply += data
        if not data:
            self._drop(peer)
        elif len(state.reply) == _REPLY_BYTES:
            rank = state.rank(self._key)
            if rank is None or rank in self.accepted or not 0 <= rank < self._world_size:
                self._drop(peer)
            else:
                self._selector.unregister(peer)
                del self.pending[peer]
                self.accepted[rank] = peer

    def _drop(self, peer: socket.socket) -> None:
        self._selector.unregister(peer)
        self.pending.pop(peer)
        peer.close()
        self._dropped += 1

    def close_accepted(self) -> None:
        for peer in self.accepted.values():
            peer.close()

    def finish(self) -> int:
        """Drop the connections still pending and stop selecting; the number dropped in all."""
        for peer in list(self.pending):
            self._drop(peer)
        self._selector.close()
        return self._dropped

    def connections(self) -> list[Connection]:
        """The accepted connections in rank order, blocking, as :class:`~multiprocessing.connection.Connection`."""
        connections = []
        for rank in range(self._world_size):
            peer = self.accepted[rank]
            peer.setblocking(True)
            connections.append(Connection(peer.detach()))
        return connections


def connect(address: str, key: bytes, rank: int, timeout: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """A rank's side: connect to the caller's :class:`ControlListener` and prove ``key``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        challenge = b""
        while len(challenge) < CHALLENGE_BYTES:
            data = sock.recv(CHALLENGE_BYTES - len(challenge))
            if not data:
                raise ConnectionError("the caller closed the control socket during the handshake")
            challenge += data
        rank_bytes = rank.to_bytes(_RANK_BYTES, "big")
        sock.sendall(_proof(key, challenge, rank_bytes) + rank_bytes)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Connection(sock.detach())


# -- framing ---------------------------------------------------------------------------------------


def byte_view(tensor):
    """A writable/readable numpy view of a contiguous CPU tensor's bytes (any dtype, bf16 too).

    A tensor elsewhere (a GPU) has no such view: copy it to the CPU first, one tensor at a time.
    """
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"byte_view needs a CPU tensor, got one on {tensor.device}: send tensor.cpu()")
    flat = tensor.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element may keep its view's stride (a column of a split)
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


class _OutOfBand:
    """The out-of-band buffers of one message, in order (:attr:`buffers`), and for each the
    :class:`~tpcore.parallel.memfd.Segment` its tensor already lives in (it travels as that segment's descriptor,
    with no copy at all) or ``None`` (:attr:`segments`).

    Apart from the pickler, whose ``buffer_callback`` is :meth:`keep`: a callback bound to the pickler itself
    would make a reference cycle, and the pickler's memo would keep every object of the message (a call's
    inputs, a rank's outputs) alive until the next garbage collection."""

    def __init__(self):
        self.buffers: list[pickle.PickleBuffer] = []
        self.segments: list[memfd.Segment | None] = []
        #: the segment of each large tensor's buffer, from the pickler's reducer until ``keep`` files it
        self.segment_of_buffer: dict[int, tuple[pickle.PickleBuffer, memfd.Segment | None]] = {}

    def keep(self, buffer: pickle.PickleBuffer) -> bool:
        """``buffer_callback``: ``True`` pickles ``buffer`` in band (a small tensor's bytes, a small array)."""
        if buffer.raw().nbytes < RAW_TENSOR_BYTES:
            return True
        self.buffers.append(buffer)
        self.segments.append(self.segment_of_buffer.pop(id(buffer), (None, None))[1])
        return False


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with plain CPU tensors sent as their bytes: inside the pickle below
    :data:`RAW_TENSOR_BYTES`, out of band from there on (as raw frames or in shared memory: :attr:`out_of_band`).
    """

    def __init__(self, file):
        self.out_of_band = _OutOfBand()
        super().__init__(file, protocol=5, buffer_callback=self.out_of_band.keep)

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and _bytes_sendable(obj):
            data = obj.detach().contiguous()
            buffer = pickle.PickleBuffer(byte_view(data))
            if data.numel() * data.element_size() >= RAW_TENSOR_BYTES:
                self.out_of_band.segment_of_buffer[id(buffer)] = (buffer, memfd.segment_of(data))
            return _tensor_from_buffer, (buffer, data.dtype, tuple(data.shape))
        parent = getattr(super(), "reducer_override", None)  # plain pickle (no cloudpickle) has none
        return parent(obj) if parent is not None else NotImplemented


def _bytes_sendable(tensor) -> bool:
    """A tensor whose values are all in its bytes: on the CPU, dense, not empty, no autograd, no lazy bits."""
    import torch

    return (
        tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel() > 0
    )


def _tensor_from_buffer(buffer, dtype, shape):
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class Encoded:
    """A message ready to send, to one receiver or several: its frames, and the shared-memory segments
    its large tensors travel in (descriptors passed beside the frames). :meth:`close` once sent."""

    def __init__(self, frames: list, fds: list[int], owned: list[int]):
        #: the header (the pickled message and where each out-of-band buffer is), then the socket frames
        self.frames = frames
        self.fds = fds
        self._owned = owned  # of ``fds``, the segments made for this message

    def send(self, conn: Connection) -> None:
        conn.send_bytes(self.frames[0])
        if self.fds:
            _send_fds(conn, self.fds)
        for frame in self.frames[1:]:
            conn.send_bytes(frame)

    def close(self) -> None:
        """Close the segments made for this message (each receiver holds its own mapping)."""
        for fd in self._owned:
            os.close(fd)
        self._owned = []

    def __enter__(self) -> Encoded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode(message) -> Encoded:
    """``message`` as an :class:`Encoded`: out-of-band buffers from :data:`SHARED_TENSOR_BYTES` on go
    through shared memory (one segment for all that are copied, none for a tensor already in a
    segment), smaller ones follow the header as raw frames.

    The header is ``(pickled message, places, number of descriptors)``, a place per buffer:
    ``("frame", nbytes)``, ``("fd", descriptor index, offset, nbytes)`` (mapped by the receiver) or
    ``("copy", descriptor index, offset, nbytes)`` (a reused segment: copied out by the receiver).
    """
    stream = io.BytesIO()
    pickler = _Pickler(stream)
    pickler.dump(message)
    out_of_band = pickler.out_of_band
    raws = [buffer.raw() for buffer in out_of_band.buffers]
    places: list[tuple] = []
    frames, fds, copied = [], [], []
    for raw, segment in zip(raws, out_of_band.segments, strict=True):
        if segment is not None:
            if segment.fd not in fds:
                fds.append(segment.fd)
            kind = "copy" if segment.reused else "fd"  # the sender writes a reused segment again: copy it out
            places.append((kind, fds.index(segment.fd), segment.offset, raw.nbytes))
        elif memfd.AVAILABLE and raw.nbytes >= SHARED_TENSOR_BYTES:
            copied.append((len(places), raw))
            places.append(())  # filled in below, once the segment is written
        else:
            frames.append(raw)
            places.append(("frame", raw.nbytes))
    owned = []
    if copied:
        fd, offsets = memfd.write([raw for _, raw in copied])
        owned.append(fd)
        fds.append(fd)
        for (index, raw), offset in zip(copied, offsets, strict=True):
            places[index] = ("fd", len(fds) - 1, offset, raw.nbytes)
    header = pickle.dumps((stream.getvalue(), places, len(fds)), protocol=5)
    return Encoded([header, *frames], fds, owned)


def send(conn: Connection, message) -> None:
    with encode(message) as encoded:
        encoded.send(conn)


def recv(conn: Connection):
    payload, places, fd_count = pickle.loads(conn.recv_bytes())
    fds = _recv_fds(conn, fd_count) if fd_count else []
    try:
        mapped: dict[int, Any] = {}
        buffers: list[Any] = []
        for place in places:
            if place[0] == "frame":
                buffer = bytearray(place[1])
                conn.recv_bytes_into(buffer)
            elif place[0] == "copy":
                _, index, offset, nbytes = place
                buffer = memfd.copy_out(fds[index], offset, nbytes)
            else:
                _, index, offset, nbytes = place
                if index not in mapped:
                    mapped[index] = memfd.map_private(fds[index])
                buffer = mapped[index][offset : offset + nbytes].numpy()  # the mapping lives while a view does
            buffers.append(buffer)
    finally:
        for fd in fds:
            os.close(fd)
    return pickle.loads(payload, buffers=buffers)


def _send_fds(conn: Connection, fds: list[int]) -> None:
    """Pass ``fds`` over ``conn``'s Unix socket (``SCM_RIGHTS``), each batch carried by one byte."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=conn.fileno())
    try:
        for start in range(0, len(fds), _MAX_FDS_PER_MESSAGE):
            socket.send_fds(sock, [b"F"], fds[start : start + _MAX_FDS_PER_MESSAGE])
    finally:
        sock.detach()  # the connection keeps its descriptor


def _recv_fds(conn: Connection, count: int) -> list[int]:
    """The ``count`` descriptors :func:`_send_fds` passed, now open in this process."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=conn.fileno())
    fds: list[int] = []
    try:
        while len(fds) < count:
            data, received, flags, _ = socket.recv_fds(sock, 1, min(count - len(fds), _MAX_FDS_PER_MESSAGE))
            fds += received
            if not data or flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                reason = "the connection closed" if not data else "this process may not open more files"
                raise OSError(f"shared-memory segments of a message were lost: {reason}")
    finally:
        sock.detach()
    return fds


def picklable(obj) -> bool:
    """Whether ``obj`` survives a round trip through the wire's pickler."""
    try:
        pickle.loads(cloudpickle.dumps(obj))
    except Exception:
        return False
    return True
