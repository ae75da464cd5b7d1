"""tpcore.parallel.memfd and the wire's shared-memory frames, within one process (a socket pair stands for a rank).

What crosses is a descriptor: the receiver maps the sender's segment copy-on-write, a tensor made in a
segment travels with no copy, and every segment is gone once its last tensor is.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import weakref
from multiprocessing.connection import Connection

import pytest
import torch

from tpcore.parallel import comm, memfd
from tpcore.ranks import wire

pytestmark = pytest.mark.skipif(not memfd.AVAILABLE, reason="no memfd on this system: tensors use the socket")


@pytest.fixture
def pair():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ends = Connection(left.detach()), Connection(right.detach())
    yield ends
    for end in ends:
        end.close()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_segments_hold_buffers_at_aligned_offsets_and_map_copy_on_write():
    first, second = torch.arange(10, dtype=torch.int16), torch.randn(33)
    fd, offsets = memfd.write([wire.byte_view(first), wire.byte_view(second)])
    try:
        assert offsets == [0, memfd.ALIGNMENT]
        mapped, again = memfd.map_private(fd), memfd.map_private(fd)
    finally:
        os.close(fd)
    second_back = mapped[offsets[1] : offsets[1] + 33 * 4].view(torch.float32)
    assert torch.equal(mapped[:20].view(torch.int16), first) and torch.equal(second_back, second)
    second_back.zero_()  # writable, and changes this mapping only
    assert torch.equal(again[offsets[1] : offsets[1] + 33 * 4].view(torch.float32), second)


def test_a_tensor_made_in_a_segment_is_found_by_its_views_and_releases_its_descriptor():
    before = open_fds()
    tensor = memfd.empty((4, 512), torch.float32)
    segment = memfd.segment_of(tensor[1:])  # a contiguous view: same segment, its own offset
    assert segment is not None and segment.nbytes == 4 * 512 * 4 and segment.offset == 512 * 4
    assert memfd.segment_of(tensor.T) is None and memfd.segment_of(torch.empty(4, 512)) is None
    assert open_fds() > before
    view = tensor[2]
    del tensor
    gc.collect()
    assert memfd.segment_of(view) is not None  # a view keeps the segment
    del view
    gc.collect()
    assert open_fds() == before


def test_gathered_outputs_go_to_segments_only_inside_the_context_and_only_when_large():
    small, large = torch.ones(2, 8), torch.ones(memfd.GATHERED_MIN_BYTES // 4, 1)
    assert memfd.segment_of(memfd.gathered_empty(large, -1, 2)) is None
    with memfd.gathered_outputs_shared():
        shared = memfd.gathered_empty(large, -1, 2)
        assert shared.shape == (large.shape[0], 2) and memfd.segment_of(shared) is not None
        assert memfd.segment_of(memfd.gathered_empty(small, 0, 2)) is None
        assert comm.all_gather(large, None) is large  # no group: nothing gathered, nothing allocated


def test_a_message_moves_big_tensors_through_shared_memory_and_small_ones_through_the_socket(pair):
    sender, receiver = pair
    in_segment = memfd.empty((600, 700), torch.float32)
    in_segment.copy_(torch.randn(600, 700))
    message = {
        "logits": in_segment,
        "big": torch.randn(512, 1024),
        "frame": torch.randn(100, 200),
        "small": torch.arange(3),
    }
    before = open_fds()
    with wire.encode(message) as encoded:
        places = pickle.loads(encoded.frames[0])[1]
        assert sorted(place[0] for place in places) == ["fd", "fd", "frame"]
        assert len(encoded.fds) == 2 and len(open_fds() - before) == 1  # one segment copied, one passed as it was
        encoded.send(sender)
    assert open_fds() == before  # the copy's descriptor is closed once sent
    received = wire.recv(receiver)
    for name, tensor in message.items():
        assert torch.equal(received[name], tensor), name
    assert open_fds() == before  # the receiver keeps mappings, not descriptors
    received["logits"].add_(1)  # copy-on-write: the sender's tensor is untouched
    assert not torch.equal(received["logits"], in_segment)


def test_a_sent_message_s_tensors_are_freed_with_it_without_a_garbage_collection(pair):
    """Nothing of the sender's keeps a message's tensors once it is sent (its pickler in a reference cycle, through
    a ``buffer_callback`` bound to itself, held each until the next collection): nor the receiver's once dropped."""
    sender, receiver = pair
    message = {"shared": torch.randn(512, 1024), "frame": torch.randn(100, 200), "small": torch.arange(3)}
    watched = [weakref.ref(tensor) for tensor in message.values()]
    gc.disable()
    try:
        wire.send(sender, message)
        del message
        assert [ref() for ref in watched] == [None, None, None]
        received = wire.recv(receiver)
        watched = [weakref.ref(tensor) for tensor in received.values()]
        del received
        assert [ref() for ref in watched] == [None, None, None]
    finally:
        gc.enable()


def test_many_segments_in_one_message_all_arrive(pair):
    sender, receiver = pair
    tensors = [memfd.empty((2**18,), torch.float32).fill_(i) for i in range(3)]
    wire._MAX_FDS_PER_MESSAGE, limit = 2, wire._MAX_FDS_PER_MESSAGE  # batches of two descriptors
    try:
        wire.send(sender, tensors)
    finally:
        wire._MAX_FDS_PER_MESSAGE = limit
    assert [tensor[0].item() for tensor in wire.recv(receiver)] == [0.0, 1.0, 2.0]


def test_a_one_element_view_with_a_stride_travels(pair):
    """A question-answering head splits its ``(batch, seq, 2)`` logits into two strided views; with one
    token each is one element whose view keeps a stride of 2, which a byte view cannot take as it is."""
    sender, receiver = pair
    start, end = torch.randn(1, 1, 2).split(1, dim=-1)
    message = {"start_logits": start.squeeze(-1), "end_logits": end.squeeze(-1)}
    assert message["start_logits"].stride() == (2, 2)
    with wire.encode(message) as encoded:
        encoded.send(sender)
    received = wire.recv(receiver)
    assert all(torch.equal(received[name], tensor) for name, tensor in message.items())


def test_a_reused_segment_comes_back_once_its_tensor_and_views_are_gone_and_is_written_again(pair):
    """The receiver copies a reused segment out as it reads the message and keeps it mapped: the segment's
    descriptor travels with the first message only, and the sender's next use of it leaves the received tensor
    as it was."""
    sender, receiver = pair
    tensor = memfd.empty((256, 128), torch.float32, reused=True).fill_(1.0)
    segment = memfd.segment_of(tensor)
    assert segment is not None and segment.reused and segment.nbytes == 2**17  # a power of two
    with wire.encode({"logits": tensor}) as encoded:
        assert [place[0] for place in pickle.loads(encoded.frames[0])[1]] == ["copy"]
        encoded.send(sender)
    received = wire.recv(receiver)["logits"]
    view = tensor[3:]
    del tensor
    gc.collect()
    assert memfd.segment_of(view).fd == segment.fd  # a view keeps the segment taken
    assert memfd.segment_of(memfd.empty((256, 128), torch.float32, reused=True)).fd != segment.fd
    del view
    gc.collect()
    again = memfd.empty((250, 128), torch.float32, reused=True).fill_(2.0)  # fits the same size class
    assert memfd.segment_of(again).fd == segment.fd
    sent_headers = []
    original_send_bytes = sender.send_bytes
    sender.send_bytes = lambda data: (sent_headers.append(bytes(data)), original_send_bytes(data))[1]
    wire.send(sender, again)
    del sender.send_bytes
    _, places, fd_count, _ = pickle.loads(sent_headers[0])
    assert [place[0] for place in places] == ["held"] and fd_count == 0  # named by its key, no descriptor
    assert torch.equal(wire.recv(receiver), again)
    assert torch.equal(received, torch.ones(256, 128))  # a copy: the segment's second use left it alone


def test_a_receiver_unmaps_a_reused_segment_once_its_sender_closes_it(pair, monkeypatch):
    """A sender that keeps no free segment (``KEPT_BYTES`` 0) closes a reused one once its tensor is gone; its
    next message tells the receiver, which drops its mapping, so no memory stays held for it."""
    monkeypatch.setattr(memfd, "KEPT_BYTES", 0)
    sender, receiver = pair
    tensor = memfd.empty((64, 256), torch.float32, reused=True).fill_(3.0)
    key = memfd.segment_of(tensor).key
    wire.send(sender, tensor)
    assert torch.equal(wire.recv(receiver), tensor) and key in wire._HELD[receiver]
    del tensor
    gc.collect()
    assert not memfd.reused_held(key)
    wire.send(sender, "next")
    assert wire.recv(receiver) == "next" and key not in wire._HELD[receiver]
    assert key not in wire._ANNOUNCED[sender]


def test_gathered_outputs_past_the_reused_size_get_a_segment_of_their_own(monkeypatch):
    monkeypatch.setattr(memfd, "REUSED_MAX_BYTES", 2**16)
    with memfd.gathered_outputs_shared():
        segment = memfd.segment_of(memfd.gathered_empty(torch.ones(2**14, 1), -1, 2))
    assert segment is not None and not segment.reused
