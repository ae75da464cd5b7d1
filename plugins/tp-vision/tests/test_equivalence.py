"""Image encoders and vision-language models split over 1-4 gloo ranks give the unsplit outputs and tokens.

Every model runs every head transformers ships for it: the first head over 1-4 ranks (ViT, Swin,
CLIP and BLIP in the quick suite), the others (slow) over 2 and 3. Vision blocks have 6 heads and
text blocks 4, so 3 and 4 ranks deal them unevenly (6 over 4: 2, 2, 1, 1; 4 over 3: 2, 1, 1), and
each tower reads its own count; Swin's two stages have 4 and 6 heads of their own widths. Inputs are
batches of 3 images (and, for the text sides, token rows with padding). BLIP captioning and LLaVA
``generate()`` run through the engine (greedy and 4 beams), from ``save_pretrained`` directories
each rank reading its slices, and LLaVA through ``tpcore.parallelize()``; ``tpcore
check`` runs each class from its default config; a hypothesis property draws random uneven sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import HALF_PRECISION_RTOL, ModelSpec, SavedModelSpec, check_equivalence, seeds
from tpcore.testing.samples import forward_parameters, sample_inputs
from tpcore.tools.check import run_check

VISION_HEADS, TEXT_HEADS, HEAD_DIM = 6, 4, 8
VOCAB, PAD, IMAGE_TOKEN = 64, 0, 63
IMAGE_SIZE = 32


def vit_like(config_class, heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40, **options):
    """A ViT-style config: ``heads`` heads of ``head_dim`` features over 32 x 32 images in 8 x 8 patches."""
    sizes = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_hidden_layers": layers}
    sizes |= {"intermediate_size": ffn, "image_size": IMAGE_SIZE, "patch_size": 8, "num_labels": 3}
    return config_class(**sizes, **options)


def text_tower(heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40) -> dict:
    sizes = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_hidden_layers": layers}
    return sizes | {"intermediate_size": ffn, "vocab_size": VOCAB, "max_position_embeddings": 32, "pad_token_id": PAD}


def vision_tower(heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40) -> dict:
    sizes = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_hidden_layers": layers}
    return sizes | {"intermediate_size": ffn, "image_size": IMAGE_SIZE, "patch_size": 8}


def two_towers(config_class, heads: int, text_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40):
    """CLIP, SigLIP, BLIP: a vision tower of ``heads`` heads and a text tower of ``text_heads``."""
    text = text_tower(text_heads, head_dim, layers, ffn)
    if config_class is transformers.BlipConfig:  # BLIP's answer decoder reads the text encoder: one width
        width = heads * head_dim if heads * head_dim % text_heads == 0 else math.lcm(heads, text_heads) * 2
        text |= {"hidden_size": width, "encoder_hidden_size": width, "bos_token_id": 1, "sep_token_id": 2}
        text |= {"eos_token_id": 2}
    if config_class is transformers.SiglipConfig:  # its text head projects to the image embeddings' width
        text["projection_size"] = heads * head_dim
    vision = vision_tower(heads, head_dim, layers, ffn)
    if config_class is transformers.BlipConfig:
        vision["hidden_size"] = text["hidden_size"]
    return config_class(text_config=text, vision_config=vision, projection_dim=16, num_labels=3)


def swin(heads: int, text_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40):
    """Two stages of ``layers`` blocks: ``text_heads`` heads at the first width, ``heads`` at the
    second (twice as wide); 32 x 32 images in 4 x 4 patches, windows of 4 x 4."""
    embed = text_heads * head_dim
    if (2 * embed) % heads:  # the second stage's heads must divide its width too
        embed = math.lcm(text_heads, heads) * 2
    sizes = {"embed_dim": embed, "num_heads": [text_heads, heads], "depths": [layers, layers], "window_size": 4}
    sizes |= {"image_size": IMAGE_SIZE, "patch_size": 4, "mlp_ratio": ffn / embed, "num_labels": 3}
    return transformers.SwinConfig(**sizes, out_features=["stage1", "stage2"], encoder_stride=16)


def detr(heads: int, text_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40, masks: bool = False):
    """Encoder blocks of ``heads`` heads, decoder blocks of ``text_heads``, 5 object queries, a
    2-stage ResNet backbone (transformers' own: no timm). ``masks``: a width the segmentation head's
    convolutions take (``hidden + heads`` a multiple of 8)."""
    hidden = heads * head_dim
    if hidden % text_heads or masks:  # the decoder's heads must divide it too
        unit = math.lcm(heads, text_heads)
        widths = range(-(-hidden // unit) * unit, 64 * unit, unit)
        hidden = next(m for m in widths if not masks or _mask_head_takes(m, heads))
    stages = 4 if masks else 2  # the mask head fuses the features of stages 1-3
    features = [f"stage{i}" for i in range(1, stages + 1)] if masks else [f"stage{stages}"]
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 16][:stages], depths=[1] * stages, out_features=features
    )
    sizes = {"d_model": hidden, "encoder_attention_heads": heads, "decoder_attention_heads": text_heads}
    sizes |= {"encoder_layers": layers, "decoder_layers": layers, "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn}
    sizes |= {"num_queries": 5, "num_labels": 3, "use_timm_backbone": False, "use_pretrained_backbone": False}
    return transformers.DetrConfig(backbone_config=backbone, **sizes)


def llava(heads: int, text_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40):
    """A Llama language model of ``text_heads`` heads (half as many key/value heads) and a CLIP vision
    tower of ``heads``, each image 16 features (its CLS feature dropped) and so 16 image tokens."""
    text = text_tower(text_heads, head_dim, layers, ffn) | {"num_key_value_heads": max(1, text_heads // 2)}
    text["max_position_embeddings"] = 64
    vision = vision_tower(heads, head_dim, layers, ffn) | {"patch_size": 8}
    return transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**text),
        vision_config=transformers.CLIPVisionConfig(**vision),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )


@dataclass(frozen=True)
class Family:
    name: str
    prefix: str
    heads: tuple[str, ...]
    #: (vision or encoder heads, text or decoder or first-stage heads, head_dim=, layers=, ffn=) -> config
    config: Callable[..., Any]

    def model_class(self, head: str) -> type:
        return getattr(transformers, self.prefix + head)


def _vit_like(config_class, **options):
    return lambda heads, text_heads, **sizes: vit_like(config_class, heads, **sizes, **options)


def beit(heads, text_heads, layers: int = 2, **sizes):
    """Relative position bias in every block; 4 feature maps for segmentation and the backbone (so 3+ blocks)."""
    options = {"use_relative_position_bias": True, "out_indices": [0, 1, 2, 3]}
    return vit_like(transformers.BeitConfig, heads, layers=max(layers, 3), **sizes, **options)


def _mask_head_takes(hidden: int, heads: int) -> bool:
    """DETR's mask head convolves ``hidden + heads`` channels, then ``hidden / 2, 4, 8, 16`` in groups of 8."""
    return (hidden + heads) % 8 == 0 and all((hidden // d) % 8 == 0 for d in (2, 4, 8, 16))


def detr_masks(heads, text_heads, **sizes):
    """DETR for segmentation: 8 heads of 16 features in the encoder and the decoder (3 ranks: 3, 3, 2),
    the widths its mask head takes."""
    return detr(8, 8, **(sizes | {"head_dim": 16}), masks=True)


def _two_towers(config_class):
    return lambda heads, text_heads, **sizes: two_towers(config_class, heads, text_heads, **sizes)


FAMILIES = {
    family.name: family
    for family in (
        Family(
            "ViT",
            "ViT",
            ("ForImageClassification", "Model", "ForMaskedImageModeling"),
            _vit_like(transformers.ViTConfig),
        ),
        Family(
            "DeiT",
            "DeiT",
            ("ForImageClassificationWithTeacher", "Model", "ForImageClassification", "ForMaskedImageModeling"),
            _vit_like(transformers.DeiTConfig),
        ),
        Family(
            "BEiT",
            "Beit",
            ("ForImageClassification", "Model", "ForMaskedImageModeling", "ForSemanticSegmentation", "Backbone"),
            beit,
        ),
        Family(
            "BEiT-shared-bias",
            "Beit",
            ("Model",),
            _vit_like(transformers.BeitConfig, use_shared_relative_position_bias=True, use_mask_token=True),
        ),
        Family(
            "DINOv2", "Dinov2", ("ForImageClassification", "Model", "Backbone"), _vit_like(transformers.Dinov2Config)
        ),
        Family("DINOv2-SwiGLU", "Dinov2", ("Model",), _vit_like(transformers.Dinov2Config, use_swiglu_ffn=True)),
        Family("Swin", "Swin", ("ForImageClassification", "Model", "ForMaskedImageModeling", "Backbone"), swin),
        Family(
            "CLIP",
            "CLIP",
            (
                "Model",
                "TextModel",
                "VisionModel",
                "TextModelWithProjection",
                "VisionModelWithProjection",
                "ForImageClassification",
            ),
            _two_towers(transformers.CLIPConfig),
        ),
        Family(
            "SigLIP",
            "Siglip",
            ("Model", "TextModel", "VisionModel", "ForImageClassification"),
            _two_towers(transformers.SiglipConfig),
        ),
        Family(
            "BLIP",
            "Blip",
            (
                "ForConditionalGeneration",
                "Model",
                "ForQuestionAnswering",
                "ForImageTextRetrieval",
                "VisionModel",
                "TextModel",
            ),
            _two_towers(transformers.BlipConfig),
        ),
        Family("DETR", "Detr", ("ForObjectDetection", "Model"), detr),
        Family("DETR-segmentation", "Detr", ("ForSegmentation",), detr_masks),
        Family("LLaVA", "Llava", ("ForConditionalGeneration", "Model"), llava),
    )
}
CASES = [(family, head) for family in FAMILIES for head in FAMILIES[family].heads]


def model_config(family: str, head: str, heads: int = VISION_HEADS, text_heads: int = TEXT_HEADS, **sizes):
    """The family's config, or the tower's own where ``head`` is one tower (``CLIPTextModel``)."""
    config = FAMILIES[family].config(heads, text_heads, **sizes)
    config_class = FAMILIES[family].model_class(head).config_class
    if isinstance(config, config_class):
        return config
    return next(
        sub for sub in (getattr(config, "text_config", None), config.vision_config) if isinstance(sub, config_class)
    )


def model_spec(family: str, head: str, seed: int = 1, **sizes) -> ModelSpec:
    return ModelSpec(FAMILIES[family].model_class(head), model_config(family, head, **sizes), seed)


def head_inputs(spec: ModelSpec, batch: int = 3, seq: int = 7, seed: int = 2) -> dict:
    """What the head takes (:func:`tpcore.testing.samples.sample_inputs`: images, token rows with padding, one
    image token per image feature), every hidden state asked for where the head returns them."""
    model = spec.build()
    inputs = sample_inputs(model, batch=batch, seq=seq, seed=seed)
    if "output_hidden_states" in forward_parameters(model):
        inputs["output_hidden_states"] = True
    return inputs


#: the families whose first head runs in the quick suite: the plain layout, per-stage heads, two
#: towers of their own counts, a packed qkv beside a BERT-like decoder
QUICK = ("ViT", "Swin", "CLIP", "BLIP")


def every_head_cases():
    for family, head in CASES:
        if head == FAMILIES[family].heads[0]:
            marks = [] if family in QUICK else [pytest.mark.slow]
            yield pytest.param(family, head, (1, 2, 3, 4), id=f"{family}-{head}", marks=marks)
        else:
            yield pytest.param(family, head, (2, 3), id=f"{family}-{head}", marks=pytest.mark.slow)


@pytest.mark.parametrize(("family", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, family, head, world_sizes):
    """Every output (logits, embeddings, boxes, hidden states of every block) over each world size."""
    spec = model_spec(family, head)
    report = check_equivalence(spec, head_inputs(spec), world_sizes=world_sizes, pools=rank_pools)
    assert sorted(report) == list(world_sizes) and all(report.values())


# -- generation: BLIP captions, LLaVA answers ---------------------------------------------------------

GENERATORS = {"BLIP": "ForConditionalGeneration", "LLaVA": "ForConditionalGeneration"}


def generate_inputs(spec: ModelSpec, num_beams: int, seed: int = 4) -> dict:
    """Images (BLIP: unprompted captions) and prompts (LLaVA: the image tokens and a padded prompt),
    16 new tokens."""
    inputs = head_inputs(spec, batch=2, seq=5, seed=seed)
    inputs.pop("output_hidden_states", None)
    if spec.model_class is transformers.BlipForConditionalGeneration:  # captions from the BOS token alone
        inputs = {"pixel_values": inputs["pixel_values"]}
    options = {"max_new_tokens": 16, "min_new_tokens": 16, "num_beams": num_beams, "do_sample": False}
    return inputs | options


def _generation_cases():
    for family in GENERATORS:
        for num_beams, name in ((1, "greedy"), (4, "beam")):
            quick = num_beams == 1
            yield pytest.param(family, num_beams, id=f"{family}-{name}", marks=[] if quick else [pytest.mark.slow])


@pytest.mark.parametrize(("family", "num_beams"), list(_generation_cases()))
def test_generate_tokens_match(rank_pools, family, num_beams):
    """16 new tokens for a batch of 2 images, identical to the unsplit model's on every rank, over 2 and 4 ranks."""
    spec = model_spec(family, GENERATORS[family], seed=3)
    inputs = generate_inputs(spec, num_beams)
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


# -- saved directories ---------------------------------------------------------------------------------

SAVED = [("ViT", "ForImageClassification"), ("Swin", "ForImageClassification"), ("CLIP", "Model")]
SAVED += [("DETR", "ForObjectDetection"), ("BLIP", "ForConditionalGeneration"), ("LLaVA", "ForConditionalGeneration")]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "head"), SAVED, ids=[family for family, _ in SAVED])
def test_a_saved_directory_loads_each_rank_reading_its_slices(rank_pools, tmp_path, family, head):
    """``save_pretrained`` (ViT under its legacy key names), then each of 3 ranks reads only its slices
    (``ParallelEngine.parallelize(path)``): the outputs (captions and answers: 4-beam tokens) of
    ``from_pretrained``'s unsplit model."""
    built = model_spec(family, head, seed=5)
    built.build().save_pretrained(tmp_path)
    spec = SavedModelSpec(str(tmp_path), built.model_class)
    if family in GENERATORS:
        report = check_equivalence(
            spec, generate_inputs(built, 4, seed=6), world_sizes=(3,), pools=rank_pools, method="generate", rtol=0
        )
        assert all(diff == 0 for diff in report[3].values())
    else:
        report = check_equivalence(spec, head_inputs(built, seed=6), world_sizes=(3,), pools=rank_pools)
        assert report[3]


@pytest.mark.slow  # a world of its own
def test_llava_through_parallelize_from_a_saved_directory(tmp_path):
    """The one-liner over 2 ranks from a ``save_pretrained`` directory: the LLaVA model (tp-gpt splits its
    language model, tp-vision its CLIP tower) generates the unsplit model's greedy and beam tokens."""
    spec = model_spec("LLaVA", GENERATORS["LLaVA"], seed=7)
    reference = spec.build()
    reference.save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        for num_beams in (1, 4):
            inputs = generate_inputs(spec, num_beams=num_beams, seed=8)
            assert torch.equal(served.generate(**inputs), reference.generate(**inputs))
    finally:
        served.deparallelize()


# -- what is split and how (pure) -----------------------------------------------------------------------


def test_each_swin_stage_is_split_by_its_own_heads_and_width():
    """Stage 1: 4 heads of 6 features (width 24); stage 2: 6 heads of the doubled width 48: over 4 ranks
    1 head each, then 2, 2, 1, 1; each block's relative position bias table keeps its ranks' heads."""
    model = model_spec("Swin", "Model").build()
    plan = tpcore.TensorReplacer(model, None, False, 4, rank=0).split_plan()
    first, second = "encoder.layers.0.blocks.0.attention", "encoder.layers.1.blocks.1.attention"
    assert plan.attributes[f"{first}.num_attention_heads"] == 1
    assert plan.attributes[f"{second}.num_attention_heads"] == tpcore.PerRank((2, 2, 1, 1))
    assert plan.shard_shape(f"{first}.q_proj.weight", 3) == (6, 24)
    assert plan.shard_shape(f"{second}.q_proj.weight", 0) == (16, 48)
    assert plan.shard_shape(f"{second}.relative_position_bias.relative_position_bias_table", 3) == (49, 1)
    assert "encoder.layers.0.downsample.reduction.weight" not in plan.splits  # patch merging stays whole


def test_two_towers_read_their_own_head_counts_and_blip_splits_its_packed_qkv():
    """CLIP's vision tower (6 heads) and text tower (4) over 4 ranks, the text tower's token embedding over
    the vocabulary; BLIP's ``qkv`` ``[q | k | v]`` is cut in each of its three parts, a rank keeping its
    heads of each."""
    plan = tpcore.TensorReplacer(model_spec("CLIP", "Model").build(), None, False, 4, rank=0).split_plan()
    assert plan.attributes["vision_model.encoder.layers.0.self_attn.num_heads"] == tpcore.PerRank((2, 2, 1, 1))
    assert plan.attributes["text_model.encoder.layers.0.self_attn.num_heads"] == 1
    assert plan.vocab == {"text_model.embeddings.token_embedding": VOCAB}  # the text tower's own input embedding
    blip = tpcore.TensorReplacer(model_spec("BLIP", "Model").build(), None, False, 4, rank=3).split_plan()
    assert blip.shard_shape("vision_model.encoder.layers.0.self_attn.qkv.weight", 3) == (3 * HEAD_DIM, 48)
    assert blip.attributes["vision_model.encoder.layers.0.self_attn.embed_dim"] == tpcore.PerRank((16, 16, 8, 8))


def test_more_ranks_than_heads_are_refused_naming_the_tensor():
    with pytest.raises(tpcore.ShardingError, match=r"ViTModel over 7 ranks.*heads are fewer"):
        tpcore.TensorReplacer(model_spec("ViT", "Model").build(), None, False, 7, rank=0).validate()


# -- tpcore check from default configs; random sizes ---------------------------------------------------

#: not from their default configs: Swin's, shrunk, has 4 stages over a 4 x 4 patch grid, which its unsplit
#: forward cannot run; DETR's backbone needs timm; BEiT's segmenter needs 4 ``out_indices``, which it has not
DEFAULT_CONFIG_CASES = [
    name
    for name in dict.fromkeys(FAMILIES[family].prefix + head for family, head in CASES)
    if not name.startswith(("Swin", "Detr")) and name != "BeitForSemanticSegmentation"
]


@pytest.mark.slow
@pytest.mark.parametrize("name", DEFAULT_CONFIG_CASES)
def test_tpcore_check_passes_from_the_default_config(rank_pools, capsys, name):
    """``tpcore check CLASS`` on the default config shrunk (pixel inputs, text for the two towers)."""
    assert run_check(name, (2, 3), pools=rank_pools) == 0, capsys.readouterr().out


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    world_size=st.integers(2, 4),
    heads=st.integers(1, 3),
    text_heads=st.integers(1, 3),
    uneven=st.integers(0, 3),
    head_dim=st.sampled_from([4, 8]),
    layers=st.integers(1, 2),
    ffn=st.integers(9, 40),
    seed=seeds(),
)
def test_random_configs_match_unsplit(
    rank_pools, case, world_size, heads, text_heads, uneven, head_dim, layers, ffn, seed
):
    """Random head counts (``heads`` per rank, plus ``uneven`` more: 2-4 ranks dealing them unevenly),
    head widths, depths and MLP widths (MLP features dealt unevenly too)."""
    family, head = case
    spec = model_spec(
        family,
        head,
        seed,
        heads=heads * world_size + uneven % world_size,
        text_heads=text_heads * world_size,
        head_dim=head_dim,
        layers=layers,
        ffn=ffn,
    )
    report = check_equivalence(spec, head_inputs(spec, seed=seed % 97), world_sizes=(world_size,), pools=rank_pools)
    assert report[world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", ["ViT", "Swin", "CLIP", "BLIP", "DETR", "LLaVA"])
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, family, world_size, dtype):
    """Every output on CUDA with NCCL in half precision; world sizes beyond the GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    spec = model_spec(family, FAMILIES[family].heads[0])
    report = check_equivalence(
        spec,
        head_inputs(spec),
        world_sizes=(world_size,),
        pools=nccl_rank_pools,
        rtol=HALF_PRECISION_RTOL[dtype],
        dtype=dtype,
    )
    assert report[world_size]
