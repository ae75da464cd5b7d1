"""Kept tensors (tpcore.served.kept_tensors), large tensors sent again unchanged: the caller's bookkeeping alone."""

from __future__ import annotations

import gc

import torch

from tpcore.served.kept_tensors import KEEP_BYTES, CallerKeptTensors, Kept, RankKeptTensors


def large() -> torch.Tensor:
    return torch.randn(KEEP_BYTES // 4 + 1)


def test_a_large_tensor_is_kept_from_its_second_send_and_referenced_from_its_third():
    caller, rank = CallerKeptTensors(), RankKeptTensors()
    tensor, small = large(), torch.randn(8)
    sends = [caller.write({"x": tensor, "small": small}) for _ in range(3)]
    assert sends[0]["x"] is tensor and all(send["small"] is small for send in sends)
    assert isinstance(sends[1]["x"], Kept) and sends[1]["x"].tensor is tensor
    assert sends[2]["x"] == Kept(sends[1]["x"].id)
    for send in sends:
        assert torch.equal(rank.resolve(send)["x"], tensor)
    assert list(rank.tensors) == [sends[1]["x"].id] and caller.take_freed() == ()


def test_a_tensor_written_into_or_dropped_is_sent_again_and_its_copy_freed():
    caller = CallerKeptTensors()
    tensor = large()
    caller.write(tensor)
    kept_id = caller.write(tensor).id
    tensor.add_(1)  # the ranks' copy is stale now
    assert caller.write(tensor) is tensor and caller.take_freed() == (kept_id,)
    again = caller.write(tensor)
    assert again.tensor is tensor and again.id != kept_id
    again_id = again.id
    del tensor, again  # a Kept that asks to keep holds the tensor: the call's, until it is sent
    gc.collect()
    assert caller.take_freed() == (again_id,)


def test_after_a_failed_call_every_kept_tensor_is_freed_and_sends_start_over():
    caller = CallerKeptTensors()
    tensor = large()
    caller.write(tensor)
    kept = caller.write(tensor)
    caller.reset()
    assert caller.take_freed() == (kept.id,)
    assert caller.write(tensor) is tensor
