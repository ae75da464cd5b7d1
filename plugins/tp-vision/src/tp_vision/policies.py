"""Policies for image encoders and vision-language models (transformers 5.x).

Every model here is a stack of transformer blocks (:class:`tpcore.BlockPolicy`): each
attention's query, key and value projections column parallel and its output projection row
parallel, heads dealt whole (6 heads over 4 ranks as 2, 2, 1, 1); the MLP's input projection
column parallel, its output projection row parallel. The patch embedding (a convolution), the
position embeddings, the class tokens, the norms and the task heads stay whole. What differs:

- ViT, DeiT, BEiT, DINOv2: ``attention.{q,k,v,o}_proj``, ``mlp.fc1``/``mlp.fc2`` (DINOv2's SwiGLU
  MLP: ``gate_proj``/``up_proj``, ``down_proj``). BEiT's relative position bias tables
  ``(entries, heads)``, one per block or one the blocks share, are split by heads
  (:class:`BeitRelativePositionBiasPolicy`). DINOv2 as transformers 5.17 lays it out
  (``attention.attention.{query,key,value}``, ``attention.output.dense``, SwiGLU ``weights_in``
  packing gate and up) is split too.
- Swin: each stage has its own width and head count; a block is split by its own
  (:meth:`SwinLayerPolicy.layer_config`), its relative position bias table by heads. The patch
  merging between stages stays whole.
- CLIP and SigLIP: text and vision towers of their own configs (``self_attn``, ``mlp``), so a LLaVA
  model's CLIP or SigLIP tower is split here and its language model by tp-gpt. SigLIP's attention
  pooling head (``torch.nn.MultiheadAttention``, one per model) stays whole.
- BLIP: the vision encoder packs ``qkv`` (``[q | k | v]``) and reshapes to the input's width
  (:func:`local_heads_blip_attention`); the text side is BERT-like, with cross-attention in the
  decoder.
- DETR: encoder and decoder blocks of ``encoder_attention_heads`` / ``decoder_attention_heads``;
  the convolutional backbone, the query embeddings, the box heads and the segmentation head's
  attention map stay whole.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
from torch import nn

from tpcore import (
    PER_HEAD,
    Attention,
    BertLayoutPolicy,
    BlockPolicy,
    DecoderBlockPolicy,
    EncoderBlockPolicy,
    Layer,
    Policy,
    linear,
    subclassing,
    transformers_class,
)


class ViTStyleLayerPolicy(BlockPolicy):
    """A ViT block: ``attention.{q,k,v,o}_proj``, ``mlp.fc1``/``mlp.fc2``."""

    attentions = (Attention("attention", output="o_proj", counts=("num_attention_heads",)),)
    mlp_inputs = ("mlp.fc1",)
    mlp_outputs = ("mlp.fc2",)


class ViTLayerPolicy(ViTStyleLayerPolicy):
    layer_class = transformers_class("vit", "ViTLayer")


class DeiTLayerPolicy(ViTStyleLayerPolicy):
    layer_class = transformers_class("deit", "DeiTLayer")


class BeitLayerPolicy(ViTStyleLayerPolicy):
    layer_class = transformers_class("beit", "BeitLayer")


class BeitRelativePositionBiasPolicy(Policy):
    """BEiT's relative position bias, ``(entries, heads)``: in each block's attention, or one that
    the encoder gives every block (``use_shared_relative_position_bias``); a rank keeps its heads'
    columns."""

    layer_class = transformers_class("beit", "BeitRelativePositionBias")

    @staticmethod
    def layers():
        return [Layer(weight="relative_position_bias_table", style=PER_HEAD, dim=-1, heads="num_attention_heads")]


class Dinov2LayerPolicy(BlockPolicy):
    """DINOv2's block, in the layout of recent transformers or of 5.17 (``attention.attention``,
    ``attention.output.dense``), with either MLP (``fc1``/``fc2`` or SwiGLU)."""

    layer_class = transformers_class("dinov2", "Dinov2Layer")
    attentions = (
        Attention("attention", output="o_proj", counts=("num_attention_heads",), optional=True),
        Attention(
            "attention",
            projections=("attention.query", "attention.key", "attention.value"),
            output="output.dense",
            counts=("attention.num_attention_heads",),
            widths=("attention.all_head_size",),
            optional=True,
        ),
    )

    @classmethod
    def mlp_in(cls):
        swiglu = [linear("mlp.gate_proj", optional=True), linear("mlp.up_proj", optional=True)]
        return [linear("mlp.fc1", optional=True), *swiglu, linear("mlp.weights_in", optional=True, n_fused=2)]

    @classmethod
    def mlp_out(cls):
        return [linear(f"mlp.{name}", optional=True) for name in ("fc2", "down_proj", "weights_out")]


class SwinLayerPolicy(ViTStyleLayerPolicy):
    """A Swin block: the ViT layout at its stage's width and head count, and the relative position
    bias table of its window, ``(entries, heads)``, split by heads."""

    layer_class = transformers_class("swin", "SwinLayer")

    @classmethod
    def layer_config(cls, config, layer):
        """The config with this block's stage width and head count (``config.num_heads`` lists
        every stage's)."""
        own = copy.copy(config)
        own.hidden_size = layer.attention.q_proj.in_features
        own.num_attention_heads = layer.attention.num_attention_heads
        return own

    @classmethod
    def layers(cls):
        table = "attention.relative_position_bias.relative_position_bias_table"
        return [*super().layers(), Layer(weight=table, style=PER_HEAD, dim=-1, heads=cls.heads)]


# -- two towers: CLIP, SigLIP -------------------------------------------------------------------------


class CLIPEncoderLayerPolicy(BlockPolicy):
    """A block of CLIP's text or vision tower (each tower's own config) and of LLaVA's CLIP tower."""

    layer_class = transformers_class("clip", "CLIPEncoderLayer")
    mlp_inputs = ("mlp.fc1",)
    mlp_outputs = ("mlp.fc2",)


class SiglipEncoderLayerPolicy(CLIPEncoderLayerPolicy):
    layer_class = transformers_class("siglip", "SiglipEncoderLayer")


class Siglip2EncoderLayerPolicy(CLIPEncoderLayerPolicy):
    """SigLIP2's blocks, as SigLIP's; its vision tower reads patches of any aspect ratio (its inputs differ,
    not its blocks)."""

    layer_class = transformers_class("siglip2", "Siglip2EncoderLayer")


# -- the vision towers of vision-language models ------------------------------------------------------------


class Idefics3EncoderLayerPolicy(CLIPEncoderLayerPolicy):
    """A block of Idefics3's SigLIP-like vision tower (its language model is tp-gpt's or its tp plan's)."""

    layer_class = transformers_class("idefics3", "Idefics3EncoderLayer")


class SmolVLMEncoderLayerPolicy(CLIPEncoderLayerPolicy):
    """A block of SmolVLM's vision tower: Idefics3's."""

    layer_class = transformers_class("smolvlm", "SmolVLMEncoderLayer")


class Qwen2VLVisionBlockPolicy(BlockPolicy):
    """A block of Qwen2-VL's vision tower over the flattened patches of every image: ``attn.qkv`` packs
    ``[q | k | v]`` of ``num_heads`` heads of ``embed_dim / num_heads`` features, ``attn.proj`` row parallel;
    the MLP ``fc1``/``fc2``. The patch embedding and the patch merger into the text width stay whole."""

    layer_class = transformers_class("qwen2_vl", "Qwen2VLVisionBlock")
    heads = "num_heads"
    attentions = (Attention("attn", projections=("qkv",), output="proj", counts=("num_heads",), packed=3),)
    mlp_inputs: ClassVar[tuple[str, ...]] = ("mlp.fc1",)
    mlp_outputs = ("mlp.fc2",)


class Qwen2_5_VLVisionBlockPolicy(Qwen2VLVisionBlockPolicy):
    """Qwen2.5-VL's vision block: Qwen2-VL's attention, a gated MLP (``gate_proj``, ``up_proj`` -> ``down_proj``)."""

    layer_class = transformers_class("qwen2_5_vl", "Qwen2_5_VLVisionBlock")
    mlp_inputs = ("mlp.gate_proj", "mlp.up_proj")
    mlp_outputs = ("mlp.down_proj",)


class Qwen2VLPatchMergerPolicy(BlockPolicy):
    """Qwen2-VL's patch merger into the text width: its MLP (``mlp.0`` column, ``mlp.2`` row) over each group of
    ``spatial_merge_size^2`` patches (its ``hidden_size``, the width it views its input as, stays whole)."""

    layer_class = transformers_class("qwen2_vl", "PatchMerger")
    attentions = ()
    mlp_inputs = ("mlp.0",)
    mlp_outputs = ("mlp.2",)


class Qwen2_5_VLPatchMergerPolicy(Qwen2VLPatchMergerPolicy):
    layer_class = transformers_class("qwen2_5_vl", "Qwen2_5_VLPatchMerger")


# -- BLIP ------------------------------------------------------------------------------------------------


@subclassing("LocalHeads")
def local_heads_blip_attention(base: type) -> dict:
    """For BLIP's vision attention, which splits its packed ``qkv`` into heads of
    ``input width // num_heads`` features: a subclass whose forward splits it into the rank's
    ``num_heads`` heads of ``head_dim`` and merges them into ``embed_dim`` (the rank's width).
    Math as unsplit: ``softmax(q k^T * scale) v`` per head, then ``projection``."""

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = hidden_states.shape
        packed = self.qkv(hidden_states).reshape(batch, length, 3, self.num_heads, self.head_dim)
        query, key, value = packed.permute(2, 0, 3, 1, 4)  # each [batch, heads, length, head_dim]
        probs = self.dropout(nn.functional.softmax(query @ key.transpose(-1, -2) * self.scale, dim=-1))
        context = (probs @ value).permute(0, 2, 1, 3).reshape(batch, length, self.embed_dim)
        return self.projection(context), probs

    return {"forward": forward}


class BlipEncoderLayerPolicy(CLIPEncoderLayerPolicy):
    """A block of BLIP's vision encoder: packed ``qkv``, output ``projection``."""

    layer_class = transformers_class("blip", "BlipEncoderLayer")
    attentions = (Attention("self_attn", projections=("qkv",), output="projection", widths=("embed_dim",), packed=3),)

    @staticmethod
    def replace_modules():
        return {"self_attn": local_heads_blip_attention}


class BlipTextLayerPolicy(BertLayoutPolicy):
    """A block of BLIP's BERT-like text model; the decoder's blocks cross-attend to the image."""

    layer_class = transformers_class("blip", "BlipTextLayer", "blip_text")


# -- SAM ---------------------------------------------------------------------------------------------------


class SamVisionAttentionPolicy(BlockPolicy):
    """SAM's image encoder attention: ``qkv`` packs ``[q | k | v]`` (each cut by heads), ``proj`` row parallel.
    Its relative position tables ``rel_pos_h``/``rel_pos_w`` are ``(positions, head_dim)``, shared by every
    head: they stay whole."""

    layer_class = transformers_class("sam", "SamVisionAttention")
    attentions = (Attention("", projections=("qkv",), output="proj", counts=("num_attention_heads",), packed=3),)
    mlp_inputs = ()
    mlp_outputs = ()


class SamVisionSdpaAttentionPolicy(SamVisionAttentionPolicy):
    """The same attention under ``attn_implementation="sdpa"`` (transformers' default)."""

    layer_class = transformers_class("sam", "SamVisionSdpaAttention")


class SamAttentionPolicy(BlockPolicy):
    """An attention of SAM's two-way mask decoder (self, token-to-image, image-to-token, and the final one):
    ``{q,k,v}_proj`` into ``hidden / downsample`` features of the decoder's heads, ``out_proj`` back."""

    layer_class = transformers_class("sam", "SamAttention")
    attentions = (Attention("", counts=("num_attention_heads",)),)
    mlp_inputs = ()
    mlp_outputs = ()


class SamMLPBlockPolicy(BlockPolicy):
    """SAM's MLP, in the image encoder's blocks and the mask decoder's: ``lin1`` column, ``lin2`` row."""

    layer_class = transformers_class("sam", "SamMLPBlock")
    attentions = ()
    mlp_inputs = ("lin1",)
    mlp_outputs = ("lin2",)


# -- DETR --------------------------------------------------------------------------------------------------


class DetrEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("detr", "DetrEncoderLayer")
    attentions = (Attention("self_attn", output="o_proj", counts=()),)
    mlp_inputs = ("mlp.fc1",)
    mlp_outputs = ("mlp.fc2",)


class DetrDecoderLayerPolicy(DecoderBlockPolicy):
    """Self-attention over the object queries, cross-attention to the encoded image."""

    layer_class = transformers_class("detr", "DetrDecoderLayer")
    attentions = (
        Attention("self_attn", output="o_proj", counts=()),
        Attention("encoder_attn", output="o_proj", counts=()),
    )
    mlp_inputs = ("mlp.fc1",)
    mlp_outputs = ("mlp.fc2",)


POLICIES = (
    ViTLayerPolicy,
    DeiTLayerPolicy,
    BeitLayerPolicy,
    BeitRelativePositionBiasPolicy,
    Dinov2LayerPolicy,
    SwinLayerPolicy,
    CLIPEncoderLayerPolicy,
    SiglipEncoderLayerPolicy,
    Siglip2EncoderLayerPolicy,
    Idefics3EncoderLayerPolicy,
    SmolVLMEncoderLayerPolicy,
    Qwen2VLVisionBlockPolicy,
    Qwen2_5_VLVisionBlockPolicy,
    Qwen2VLPatchMergerPolicy,
    Qwen2_5_VLPatchMergerPolicy,
    BlipEncoderLayerPolicy,
    BlipTextLayerPolicy,
    SamVisionAttentionPolicy,
    SamVisionSdpaAttentionPolicy,
    SamAttentionPolicy,
    SamMLPBlockPolicy,
    DetrEncoderLayerPolicy,
    DetrDecoderLayerPolicy,
)
