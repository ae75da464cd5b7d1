"""The user's two paths to a split model, for tests: ``parallelize(model)`` and ``parallelize(directory)``."""

from __future__ import annotations

import torch

import tpcore
from tpcore.testing import compare_outputs


def assert_equal_on_both_paths(model, inputs: dict, expected, directory, world_size: int = 2) -> None:
    """``model`` split over ``world_size`` ranks gives ``expected`` for ``inputs`` served from the object and
    from ``directory``, where it is saved first."""
    model.save_pretrained(directory)
    for source in (model, directory):
        served = tpcore.parallelize(source, num_gpus=world_size)
        try:
            with torch.inference_mode():
                compare_outputs(expected, served(**inputs))
        finally:
            served.deparallelize()
