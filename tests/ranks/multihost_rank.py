"""One rank of the two-host world of tests/ranks/test_multihost.py, run by torchrun on each host:
``multihost_rank.py CHECKPOINT RESULTS``.

It splits the saved model over the whole world (4 ranks, a group across both hosts) from the model object,
then over groups of 2 (consecutive ranks: one group per host) from the checkpoint directory, compares each
with the unsplit model, and writes what it saw to ``RESULTS/rank<r>.json``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import tpcore
from tpcore import destroy_process_group
from tpcore.parallel import shm
from tpcore.testing import SCALE_FLOOR

NEW_TOKENS = 8


def batch() -> dict[str, torch.Tensor]:
    """Two rows, the second left-padded (as generate() wants a decoder's padding)."""
    input_ids = torch.tensor([[5, 17, 42, 8, 63, 21], [0, 0, 33, 9, 71, 4]])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}


def run(model) -> tuple[torch.Tensor, list]:
    """The model's logits for the batch, and its greedy continuation."""
    with torch.inference_mode():
        logits = model(**batch()).logits
        tokens = model.generate(
            **batch(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return logits, tokens.tolist()


def split_run(model, group, reference: tuple[torch.Tensor, list]) -> dict:
    """Run a split model; where its group's ranks live, whether they share memory, and how it compares."""
    logits, tokens = run(model)
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    expected_logits, expected_tokens = reference
    return {
        "group_ranks": dist.get_process_group_ranks(group),
        "group_hosts": hosts,
        "shared_memory": shm.for_group(group) is not None,
        "max_diff": (logits.double() - expected_logits.double()).abs().max().item(),
        "scale": max(expected_logits.double().abs().max().item(), SCALE_FLOOR),
        "tokens": tokens,
        "reference_tokens": expected_tokens,
    }


def main(checkpoint: str, results: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    reference = run(model)
    across = tpcore.ParallelEngine(num_gpus=4, backend="gloo")
    whole_world = split_run(across.parallelize(model), across.tp_group, reference)
    per_host = tpcore.ParallelEngine(num_gpus=2, backend="gloo")
    host_groups = split_run(per_host.parallelize(checkpoint), per_host.tp_group, reference)
    rank = dist.get_rank()
    report = {"rank": rank, "host": socket.gethostname(), "tp4 from the model": whole_world}
    report["tp2 from the checkpoint"] = host_groups
    Path(results, f"rank{rank}.json").write_text(json.dumps(report))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
