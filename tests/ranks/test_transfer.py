"""Inputs and outputs between devices and processes: containers keep their types, named tuples included,
KV caches are not sent back, and the caller learns which device its inputs were on."""

from __future__ import annotations

import collections
import socket
from multiprocessing.connection import Connection

import pytest
import rank_helpers
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from tpcore.parallel import memfd
from tpcore.ranks import wire
from tpcore.ranks.transfer import first_device, to_cpu, to_device

Pair = collections.namedtuple("Pair", ["values", "extra"])


def test_a_named_tuple_of_tensors_is_moved_and_rebuilt_as_itself():
    pair = Pair(torch.arange(3.0), [torch.ones(2)])
    moved = to_device(pair, "meta")
    assert type(moved) is Pair and moved.values.device.type == "meta" and moved.extra[0].device.type == "meta"
    grad = torch.ones(2, requires_grad=True) * 2
    back = to_cpu(Pair(grad, {"cache": DynamicCache(), "x": grad}))
    assert type(back) is Pair and not back.values.requires_grad and torch.equal(back.values, grad.detach())
    assert set(back.extra) == {"x"} and not back.extra["x"].requires_grad  # the cache is dropped
    result = torch.max(torch.tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1)  # torch's own named tuples (no _fields)
    assert type(to_cpu(result)) is type(result) and torch.equal(to_cpu(result).indices, torch.tensor([1, 0]))
    assert type(to_device(result, "meta")) is type(result) and to_device(result, "meta").values.is_meta


def test_a_named_tuple_makes_the_round_trip_through_a_rank(rank_pools):
    pair = Pair(torch.ones(3, requires_grad=True) * 3, (DynamicCache(), torch.arange(4)))
    for back in rank_pools.get(2).run(rank_helpers.echo_through_device, pair):
        assert type(back) is Pair and torch.equal(back.values, torch.full((3,), 3.0))
        assert not back.values.requires_grad and back.extra[0] is None and torch.equal(back.extra[1], torch.arange(4))


@pytest.mark.parametrize(
    ("value", "device"),
    [
        (((), {"input_ids": torch.ones(1, device="meta"), "mask": torch.ones(1)}), "meta"),
        (((torch.ones(1), torch.ones(1, device="meta")), {}), "cpu"),
        (((None, [Pair(None, torch.ones(1, device="meta"))]), {}), "meta"),
        (((1, "text"), {"flag": True}), None),
    ],
)
def test_the_first_input_tensor_names_the_device_of_the_outputs(value, device):
    found = first_device(value)
    assert (found.type if found is not None else None) == device


def test_a_model_output_travels_as_itself_and_is_rebuilt_without_its_init(monkeypatch):
    """Through the wire a ModelOutput keeps its class, items in order, attributes (those left ``None`` too) and
    tensors, a nested one as well; the receiver does not run its ``__init__`` (a served reply's cost)."""
    logits = torch.randn(2, 3, 5)
    output = CausalLMOutputWithPast(logits=logits, hidden_states=(torch.ones(2), torch.zeros(2)))
    message = {"output": output, "encoder": BaseModelOutput(last_hidden_state=torch.arange(6.0).view(2, 3))}
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = Connection(left.detach()), Connection(right.detach())

    def refused(self):
        raise AssertionError("a ModelOutput was rebuilt through its __init__")

    try:
        wire.send(sender, message)
        monkeypatch.setattr(CausalLMOutputWithPast, "__post_init__", refused)
        monkeypatch.setattr(BaseModelOutput, "__post_init__", refused)
        back = wire.recv(receiver)
    finally:
        sender.close()
        receiver.close()
    got = back["output"]
    assert type(got) is CausalLMOutputWithPast and list(got.keys()) == ["logits", "hidden_states"]
    assert torch.equal(got.logits, logits) and got["logits"] is got.logits and got.loss is None
    assert [torch.equal(a, b) for a, b in zip(got.hidden_states, output.hidden_states, strict=True)] == [True, True]
    assert len(got.to_tuple()) == 2 and vars(got).keys() == vars(output).keys()
    encoder = back["encoder"]
    assert type(encoder) is BaseModelOutput and torch.equal(encoder[0], torch.arange(6.0).view(2, 3))


def test_a_tensor_from_another_device_lands_in_a_reused_segment_only_where_outputs_are_shared():
    large, small = torch.randn(64, 1024), torch.randn(4)  # 256 KiB: past the size of a shared output
    plain = memfd.cpu_copy(large)
    assert memfd.segment_of(plain) is None and torch.equal(plain, large)
    with memfd.gathered_outputs_shared():
        shared, kept_small = memfd.cpu_copy(large), memfd.cpu_copy(small)
    segment = memfd.segment_of(shared)
    assert memfd.AVAILABLE == (segment is not None and segment.reused)
    assert torch.equal(shared, large) and memfd.segment_of(kept_small) is None and torch.equal(kept_small, small)
