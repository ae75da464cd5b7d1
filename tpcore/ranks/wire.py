"""The messages of the caller-rank control channel: how each is pickled, framed, sent and received.

The connections they travel on are those :mod:`tpcore.ranks.handshake` admitted. A message is framed as the pickled
message and where its out-of-band buffers are, then each raw frame. The C pickler pickles it; cloudpickle only a
message with code that must travel by value (from ``__main__``, local or dynamic), since its pickler costs twice as
much. Plain CPU tensors travel as their bytes (pickle protocol 5), never through torch's own serialization (about
0.1 ms a tensor however small): small ones inside the pickle, large ones out of band with no copy into it; from a
megabyte on they travel in shared memory (:mod:`tpcore.parallel.memfd`), the receiver mapping what the sender wrote,
and a tensor the sender already holds in shared memory is not copied at all. A transformers ``ModelOutput`` (every
reply of a served forward, an encoder's output in each decode step's inputs) travels as its class, items and
attributes and is rebuilt from them, not through its ``__init__``: unpickled its own way, a
``CausalLMOutputWithPast`` costs 70 us warm, several times that on caches a forward has just left cold.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import socket
import sys
import types
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy

from tpcore.parallel import memfd

try:
    import cloudpickle
except ImportError:  # an offline machine without it: code from __main__ cannot travel, the rest works
    cloudpickle = pickle

__all__ = ["Encoded", "byte_view", "encode", "picklable", "recv", "send"]

#: CPU tensors from this size on travel as raw frames beside the pickled message
RAW_TENSOR_BYTES = 64 * 2**10
#: ... and from this size on in shared memory (:mod:`tpcore.parallel.memfd`) where the system has it
SHARED_TENSOR_BYTES = 2**20
#: descriptors one ``SCM_RIGHTS`` message may carry (Linux's ``SCM_MAX_FD``)
_MAX_FDS_PER_MESSAGE = 253


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


class _ByValue(Exception):
    """A function or class that the receiver cannot import: the message needs cloudpickle."""


class _TensorBytes:
    """Mixed into a pickler: plain CPU tensors sent as their bytes (:func:`_reduce_tensor`), anything else to the
    pickler's :meth:`_reduce_other`."""

    def __init__(self, file, out_of_band: _OutOfBand):
        self.out_of_band = out_of_band
        super().__init__(file, protocol=5, buffer_callback=out_of_band.keep)  # type: ignore[call-arg]  # a pickler

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is not type and kind is not types.FunctionType:  # classes and functions: the other pickler's
            reduced = _reduce_tensor(obj, self.out_of_band) if kind is _tensor_class() else _reduce_model_output(obj)
            if reduced is not None:
                return reduced
        return self._reduce_other(obj)

    def _reduce_other(self, obj):
        return NotImplemented


class _Pickler(_TensorBytes, pickle.Pickler):
    """The C pickler: half the cost of cloudpickle's for a served call or its reply. It raises :class:`_ByValue`
    at code that must travel by value (:func:`_travels_by_value`), and the message is pickled again by
    :class:`_CodePickler`."""

    def _reduce_other(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and _travels_by_value(obj):
            raise _ByValue(obj)
        return NotImplemented


def _tensor_class() -> type | None:
    """``torch.Tensor`` once torch is imported (a message of a process without torch holds no tensor)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


class _CodePickler(_TensorBytes, cloudpickle.Pickler):
    """cloudpickle: functions and classes of ``__main__``, local or dynamic ones travel by value."""

    def _reduce_other(self, obj):
        parent = getattr(cloudpickle.Pickler, "reducer_override", None)  # plain pickle (no cloudpickle) has none
        return parent(self, obj) if parent is not None else NotImplemented


def _reduce_tensor(obj, out_of_band: _OutOfBand) -> tuple | None:
    """A plain CPU tensor (of class ``torch.Tensor`` itself) as its bytes: inside the pickle below
    :data:`RAW_TENSOR_BYTES`, out of band from there on (as a raw frame, or in shared memory: ``out_of_band``);
    ``None`` if its bytes are not its values (torch's own pickling then sends it).

    Through numpy where it has the dtype: one ``Tensor.numpy()`` both checks the tensor (on the CPU, dense, no
    autograd, no lazy bits) and gives its bytes. Each call into torch costs microseconds when a forward has just
    left the caches cold, ten times its cost in a warm loop; this path makes three."""
    try:
        array = obj.numpy()
    except (TypeError, RuntimeError):  # bf16 and other dtypes numpy lacks, or a tensor whose bytes are not its values
        return _reduce_tensor_bytes(obj, out_of_band)
    if not array.flags.c_contiguous:
        array = numpy.ascontiguousarray(array)
    buffer = pickle.PickleBuffer(array)
    if array.nbytes >= RAW_TENSOR_BYTES:
        out_of_band.segment_of_buffer[id(buffer)] = (buffer, memfd.segment_of(obj))
    return _tensor_from_array, (buffer, array.dtype.str, array.shape)


def _reduce_tensor_bytes(obj, out_of_band: _OutOfBand) -> tuple | None:
    """:func:`_reduce_tensor` through the tensor's bytes (a dtype numpy lacks); ``None`` if they are not its values."""
    if not _bytes_sendable(obj):
        return None
    data = obj.detach().contiguous()
    buffer = pickle.PickleBuffer(byte_view(data))
    if data.numel() * data.element_size() >= RAW_TENSOR_BYTES:
        out_of_band.segment_of_buffer[id(buffer)] = (buffer, memfd.segment_of(data))
    return _tensor_from_buffer, (buffer, data.dtype, tuple(data.shape))


def _reduce_model_output(obj) -> tuple | None:
    """A transformers ``ModelOutput`` (an ``OrderedDict`` of its set fields, each also an attribute) as its class,
    items and attributes (:func:`_model_output` rebuilds it); ``None`` for anything else, or a subclass that
    pickles its own way."""
    generic = sys.modules.get("transformers.utils.generic")
    model_output = getattr(generic, "ModelOutput", None)
    if model_output is None or not isinstance(obj, model_output):
        return None
    if type(obj).__reduce__ is not model_output.__reduce__ or type(obj).__reduce_ex__ is not object.__reduce_ex__:
        return None
    return _model_output, (type(obj), tuple(obj.items()), vars(obj))


def _model_output(cls: type[collections.OrderedDict], items: tuple, attributes: dict):
    """The ``ModelOutput`` of class ``cls`` holding ``items`` and ``attributes``, as its ``__init__`` would leave it
    (set without it: no ``__post_init__`` walk over the fields, no ``__setitem__`` of its own)."""
    output = cls.__new__(cls)
    for key, value in items:
        collections.OrderedDict.__setitem__(output, key, value)
    output.__dict__.update(attributes)
    return output


def _travels_by_value(code) -> bool:
    """Whether cloudpickle would send a function or class by value: it lives in ``__main__``, in a module that
    is not imported, or in one registered to travel by value. (Local and replaced ones make plain pickle fail.)"""
    name = getattr(code, "__module__", None)
    if name is None or name == "__main__" or name not in sys.modules:
        return True
    registered = () if cloudpickle is pickle else cloudpickle.list_registry_pickle_by_value()
    return bool(registered) and any(name == module or name.startswith(module + ".") for module in registered)


def _pickled(message) -> tuple[bytes, _OutOfBand]:
    """``message`` pickled, and its out-of-band buffers: by the C pickler where it can, else by cloudpickle."""
    try:
        return _dump(_Pickler, message)
    except Exception:  # code to send by value, or what neither pickler takes (cloudpickle raises it again)
        return _dump(_CodePickler, message)


def _dump(pickler_class: type, message) -> tuple[bytes, _OutOfBand]:
    stream, out_of_band = io.BytesIO(), _OutOfBand()
    pickler_class(stream, out_of_band).dump(message)
    return stream.getvalue(), out_of_band


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


def _tensor_from_array(buffer, dtype: str, shape: tuple[int, ...]):
    import torch

    return torch.from_numpy(numpy.ndarray(shape, dtype, buffer))


class Encoded:
    """A message ready to send, to one receiver or several: the pickled message, where each out-of-band buffer
    is (``places``), the raw frames, and the shared-memory segments its large tensors travel in (descriptors
    passed beside the frames). :meth:`close` once sent.

    :attr:`frames` is the header for a receiver that holds none of the message's reused segments, then the raw
    frames; :meth:`send` names a reused segment that the receiver holds by its key, without its descriptor."""

    def __init__(self, payload: bytes, places: list[tuple], frames: list, fds: list[int], owned: list[int]):
        self.payload = payload
        self.places = places
        self.fds = fds
        self.frames = [pickle.dumps((payload, places, len(fds), []), protocol=5), *frames]
        self._owned = owned  # of ``fds``, the segments made for this message

    def send(self, conn: Connection) -> None:
        announced = _ANNOUNCED.get(conn) or set()
        released = [key for key in announced if not memfd.reused_held(key)]
        new_keys: list[tuple[int, int]] = []
        if not released and not any(place[0] == "copy" for place in self.places):
            header, fds = self.frames[0], self.fds  # the common message: the header made once for every receiver
        else:
            header, fds, new_keys = self._header_for(announced, released)
        conn.send_bytes(header)
        if fds:
            _send_fds(conn, fds)
        for frame in self.frames[1:]:
            conn.send_bytes(frame)
        if released or new_keys:
            _ANNOUNCED[conn] = (announced - set(released)) | set(new_keys)

    def _header_for(self, announced: set, released: list) -> tuple[bytes, list[int], list]:
        """The header for a receiver that holds the reused segments ``announced`` (less ``released``, which it
        is told to unmap), the descriptors it needs, and the keys of the reused segments it gets now."""
        held_fds = {self.fds[place[1]] for place in self.places if place[0] == "copy" and place[4] in announced}
        fds = [fd for fd in self.fds if fd not in held_fds]
        places, new_keys = [], []
        for place in self.places:
            if place[0] == "copy" and place[4] in announced:
                places.append(("held", place[4], place[2], place[3]))
            elif place[0] in ("copy", "fd"):
                places.append((place[0], fds.index(self.fds[place[1]]), *place[2:]))
                if place[0] == "copy":
                    new_keys.append(place[4])
            else:
                places.append(place)
        return pickle.dumps((self.payload, places, len(fds), released), protocol=5), fds, new_keys

    def close(self) -> None:
        """Close the segments made for this message (each receiver holds its own mapping)."""
        for fd in self._owned:
            os.close(fd)
        self._owned = []

    def __enter__(self) -> Encoded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: per connection, the reused segments sent on it with their descriptor, which its receiver keeps mapped
_ANNOUNCED: weakref.WeakKeyDictionary[Connection, set[tuple[int, int]]] = weakref.WeakKeyDictionary()
#: per connection, the receiver's mappings of the sender's reused segments, by key
_HELD: weakref.WeakKeyDictionary[Connection, dict[tuple[int, int], Any]] = weakref.WeakKeyDictionary()


def encode(message) -> Encoded:
    """``message`` as an :class:`Encoded`: out-of-band buffers from :data:`SHARED_TENSOR_BYTES` on go
    through shared memory (one segment for all that are copied, none for a tensor already in a
    segment), smaller ones follow the header as raw frames.

    The header is ``(pickled message, places, number of descriptors, released keys)``, a place per buffer:
    ``("frame", nbytes)``, ``("fd", descriptor index, offset, nbytes)`` (mapped by the receiver),
    ``("copy", descriptor index, offset, nbytes, key)`` (a reused segment: copied out by the receiver, which
    keeps it mapped under ``key``) or ``("held", key, offset, nbytes)`` (a reused segment the receiver has
    mapped); the released keys name reused segments the sender has closed, which the receiver unmaps.
    """
    payload, out_of_band = _pickled(message)
    raws = [buffer.raw() for buffer in out_of_band.buffers]
    places: list[tuple] = []
    frames, fds, copied = [], [], []
    for raw, segment in zip(raws, out_of_band.segments, strict=True):
        if segment is not None:
            if segment.fd not in fds:
                fds.append(segment.fd)
            if segment.key is not None:  # the sender writes a reused segment again: the receiver copies it out
                places.append(("copy", fds.index(segment.fd), segment.offset, raw.nbytes, segment.key))
            else:
                places.append(("fd", fds.index(segment.fd), segment.offset, raw.nbytes))
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
    return Encoded(payload, places, frames, fds, owned)


def send(conn: Connection, message) -> None:
    with encode(message) as encoded:
        encoded.send(conn)


def recv(conn: Connection):
    payload, places, fd_count, released = pickle.loads(conn.recv_bytes())
    held = _HELD.setdefault(conn, {})
    for key in released:
        held.pop(key, None)
    fds = _recv_fds(conn, fd_count) if fd_count else []
    try:
        mapped: dict[int, Any] = {}
        buffers: list[Any] = []
        for place in places:
            if place[0] == "frame":
                buffer = bytearray(place[1])
                conn.recv_bytes_into(buffer)
            elif place[0] == "copy":
                _, index, offset, nbytes, key = place
                held[key] = memfd.map_shared(fds[index])
                buffer = memfd.copy_out(held[key], offset, nbytes)
            elif place[0] == "held":
                _, key, offset, nbytes = place
                if key not in held:
                    raise OSError(f"a message names a shared-memory segment {key} this end does not hold")
                buffer = memfd.copy_out(held[key], offset, nbytes)
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
