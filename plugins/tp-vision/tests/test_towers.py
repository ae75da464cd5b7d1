"""SAM, SigLIP2 and the vision towers of Qwen2-VL, Qwen2.5-VL, Idefics3 and SmolVLM split and equal to the
unsplit model, on the user's path: ``tpcore.parallelize(model)`` and ``tpcore.parallelize(directory)``
over 2 ranks and 3 (the shrunk configs' 12 heads over 3: 4 each; SAM's mask decoder and the VLMs' text
towers alike), and uneven over 3 ranks (shrunk for 2: 4 heads dealt 2, 1, 1), greedy ``generate()`` for the
VLMs, and ``tpcore check CLASS`` for every family.

Each model is ``tpcore check``'s: its class's default config shrunk by :func:`tpcore.testing.samples.small_config`
for world sizes 2 and 3, with the inputs :func:`~tpcore.testing.samples.sample_inputs` builds for it (SAM's
pixels; SigLIP2's patches of two aspect ratios, one padded; the Qwen VLs' flattened patches and image grids;
Idefics3's and SmolVLM's image stacks; image tokens matching the image features).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import tpcore
from tpcore.testing import check_equivalence, compare_outputs
from tpcore.testing.samples import sample_inputs
from tpcore.tools.check import resolve, run_check

WORLD_SIZES = (2, 3)
FAMILIES = {
    "SAM": "SamModel",
    "SigLIP2": "Siglip2Model",
    "Qwen2-VL": "Qwen2VLForConditionalGeneration",
    "Qwen2.5-VL": "Qwen2_5_VLForConditionalGeneration",
    "Idefics3": "Idefics3ForConditionalGeneration",
    "SmolVLM": "SmolVLMForConditionalGeneration",
}
GENERATORS = ("Qwen2-VL", "Qwen2.5-VL", "Idefics3", "SmolVLM")


@functools.cache
def reference(family: str) -> tuple[nn.Module, dict]:
    """The unsplit model of ``family`` and its inputs (built once: do not change them)."""
    model = resolve(FAMILIES[family], WORLD_SIZES).build().eval()
    return model, sample_inputs(model)


def served_matches(served: nn.Module, family: str) -> None:
    model, inputs = reference(family)
    with torch.inference_mode():
        expected, got = model(**inputs), served(**inputs)
    assert compare_outputs(expected, got)


def generates_alike(served: nn.Module, family: str) -> None:
    model, inputs = reference(family)
    options = {"max_new_tokens": 5, "do_sample": False}
    assert torch.equal(served.generate(**inputs, **options), model.generate(**inputs, **options))


def test_sam_through_parallelize_over_2_ranks():
    model, _ = reference("SAM")
    served = tpcore.parallelize(model, num_gpus=2, backend="gloo")
    try:
        served_matches(served, "SAM")
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world of its own (the directory matrix below has it too)
def test_qwen2_5_vl_from_a_directory_over_3_ranks_answers_and_generates(tmp_path):
    model, _ = reference("Qwen2.5-VL")
    model.save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=3, backend="gloo")
    try:
        served_matches(served, "Qwen2.5-VL")
        generates_alike(served, "Qwen2.5-VL")
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world per family
@pytest.mark.parametrize("family", list(FAMILIES))
def test_through_parallelize_of_the_object_over_2_ranks(family):
    served = tpcore.parallelize(reference(family)[0], num_gpus=2, backend="gloo")
    try:
        served_matches(served, family)
        if family in GENERATORS:
            generates_alike(served, family)
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world per family
@pytest.mark.parametrize("family", list(FAMILIES))
def test_through_parallelize_of_a_directory_over_3_ranks(tmp_path, family):
    reference(family)[0].save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=3, backend="gloo")
    try:
        served_matches(served, family)
        if family in GENERATORS:
            generates_alike(served, family)
    finally:
        served.deparallelize()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tpcore_check_passes(rank_pools, capsys, family):
    assert run_check(FAMILIES[family], WORLD_SIZES, pools=rank_pools) == 0, capsys.readouterr().out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_uneven_heads_over_3_ranks(rank_pools, family):
    """Each model shrunk for 2 ranks (4 heads a block) over 3 on the shared rank pools: heads dealt 2, 1, 1."""
    spec = resolve(FAMILIES[family], (2,))
    model = spec.build()
    assert check_equivalence(spec, sample_inputs(model), world_sizes=(3,), pools=rank_pools)[3]


# -- what is split (pure) ----------------------------------------------------------------------------------


def test_the_vision_towers_are_split_by_their_own_heads():
    """Over 3 ranks each tower keeps 4 of its 12 heads: SAM's packed ``qkv`` in each of its three parts and
    its mask decoder's attentions (the cross-attentions at half the width), Qwen2-VL's packed ``qkv``,
    Idefics3's q/k/v."""
    sam = tpcore.TensorReplacer(reference("SAM")[0], None, False, 3, rank=1).split_plan()
    width = 12 * 16
    assert sam.shard_shape("vision_encoder.layers.0.attn.qkv.weight", 1) == (3 * width // 3, width)
    assert sam.attributes["vision_encoder.layers.0.attn.num_attention_heads"] == 4
    assert sam.shard_shape("mask_decoder.transformer.layers.0.cross_attn_token_to_image.q_proj.weight", 1) == (
        width // 6,
        width,
    )
    assert "mask_decoder.transformer.final_attn_token_to_image.out_proj.weight" in sam.splits
    qwen = tpcore.TensorReplacer(reference("Qwen2-VL")[0], None, False, 3, rank=0).split_plan()
    assert qwen.shard_shape("model.visual.blocks.0.attn.qkv.weight", 0) == (3 * width // 3, width)
    assert qwen.attributes["model.visual.blocks.0.attn.num_heads"] == 4
    idefics = tpcore.TensorReplacer(reference("Idefics3")[0], None, False, 3, rank=2).split_plan()
    assert idefics.shard_shape("model.vision_model.encoder.layers.0.self_attn.q_proj.weight", 2) == (64, width)
