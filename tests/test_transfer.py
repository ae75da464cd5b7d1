"""Inputs and outputs between devices and processes: containers keep their types, named tuples included,
KV caches are not sent back, and the caller learns which device its inputs were on."""

from __future__ import annotations

import collections

import pytest
import rank_helpers
import torch
from transformers import DynamicCache

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
