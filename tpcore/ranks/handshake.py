"""Admitting ranks to the caller-rank control channel: the caller's listening socket and the HMAC handshake.

A rank connects (:func:`connect`) to a socket in a directory only the caller's user can enter, answers a random
challenge with ``HMAC-SHA256(key, challenge | rank)`` for the key it was started with, and is
then a :class:`~multiprocessing.connection.Connection` (the messages on it: :mod:`tpcore.ranks.wire`).
Connections that do not answer correctly within :data:`HANDSHAKE_TIMEOUT_S` are dropped while the caller
keeps waiting for its ranks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import selectors
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

__all__ = ["ControlListener", "connect"]

#: how long a new connection has to answer the challenge before it is dropped
HANDSHAKE_TIMEOUT_S = 10.0
CHALLENGE_BYTES = 32
_RANK_BYTES = 4
_REPLY_BYTES = hashlib.sha256().digest_size + _RANK_BYTES


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
