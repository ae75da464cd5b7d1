"""Small models and sample inputs for ``tpcore check``, for every modality.

:func:`small_config` shrinks a config and every sub-config it nests (text, vision and audio
towers, encoder and decoder) to two layers of ``heads x 16`` features, with head counts that
every checked world size divides; special token ids move into the small vocabulary.
:func:`sample_inputs` builds a batch for what a model's ``forward`` accepts: token ids with a
padded row, pixel values, audio features or waveforms, decoder ids, and for vision-language
models image tokens matching the image features.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["VOCAB", "UnshrinkableConfig", "sample_inputs", "small_config", "special_token_ids"]

HEAD_DIM = 16
LAYERS = 2
#: the small vocabulary; its top ``RESERVED_IDS`` ids hold the special tokens, sample text is drawn below
VOCAB = 128
RESERVED_IDS = 16
#: ids below this are left where they are (pad/bos/eos 0, 1, 2 in most configs)
LOW_IDS = 3
POSITIONS = 128
IMAGE_SIZE, PATCH_SIZE = 32, 8
#: image regions per row for the models that read detected regions beside the text (LXMERT, VisualBERT)
REGIONS = 4
#: Whisper-like encoders take ``2 * max_source_positions`` feature frames
AUDIO_POSITIONS = 16
#: the M-RoPE sections Qwen2-VL's rotary embedding takes where its config names none
MROPE_SECTION = (16, 24, 24)
_IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")
#: config fields some default configs leave ``None`` although the model reads them as numbers (CTC heads: vocab_size)
_UNSET_IN_DEFAULTS = {"head_dim", "num_experts_per_tok", "vocab_size"}
#: config fields that follow from others and are recomputed when a sub-config is rebuilt
_DERIVED = {"layer_types", "head_dim", "transformers_version", "model_type", "architectures"}


class UnshrinkableConfig(ValueError):
    """The config cannot be rebuilt small: its own validation refuses the shrunk values."""


def small_sizes(world_sizes: Sequence[int]) -> dict[str, int]:
    """Config fields and their small values: ``2k`` heads and ``k`` grouped KV heads of 16
    features, ``k = lcm(2, *world_sizes)``, so every world size divides both."""
    kv_heads = math.lcm(2, *world_sizes)
    heads = 2 * kv_heads
    hidden = heads * HEAD_DIM
    sizes = dict.fromkeys(("num_hidden_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"), LAYERS)
    sizes |= dict.fromkeys(("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads"), heads)
    sizes |= dict.fromkeys(("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "d_ff"), 2 * hidden)
    sizes |= dict.fromkeys(("conv_dim", "conv_channels"), hidden)  # speech front ends
    sizes |= dict.fromkeys(("true_hidden_size", "intra_bottleneck_size"), hidden)  # MobileBERT's bottleneck
    sizes |= {"attention_head_size": HEAD_DIM, "axial_pos_embds_dim": hidden // 2}  # Reformer: 2 factors sum to hidden
    sizes |= {
        "hidden_size": hidden,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_DIM,
        "d_kv": HEAD_DIM,
        "d_head": HEAD_DIM,
    }
    sizes |= {"rotary_dim": HEAD_DIM // 2}  # GPT-J / CodeGen: rotary features per head
    sizes |= {"out_hidden_size": hidden}  # Qwen2.5-VL: the vision merger's output, the text width
    # SAM: the vision neck's channels are the prompt encoder's and mask decoder's width
    sizes |= {"output_channels": hidden, "iou_head_hidden_dim": hidden, "mlp_dim": 2 * hidden}
    sizes |= {"num_pos_feats": hidden // 2}  # its positional embedding: sines and cosines of this many
    sizes |= {"vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "max_target_positions": POSITIONS}
    sizes |= {"max_source_positions": AUDIO_POSITIONS, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}
    # mixture of experts: 8 experts of the hidden width, 2 per token (DeepSeek: in 2 groups, 1 chosen)
    sizes |= dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 8)
    sizes |= dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), hidden)
    sizes |= {"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
    # multi-head latent attention: latent ranks and per-head widths (the rotary part is its head_dim)
    sizes |= {"q_lora_rank": hidden // 2, "kv_lora_rank": 2 * HEAD_DIM}
    sizes |= dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM)
    return sizes


def small_config(config, world_sizes: Sequence[int] = (2,)):
    """``config`` rebuilt small (see :func:`small_sizes`), its sub-configs alike, special token
    ids inside the small vocabulary. Only fields the config has are set; a field holding a
    tuple (``image_size=(224, 224)``) gets the small value in every place; multi-head attention
    stays multi-head (``num_key_value_heads = num_attention_heads``). A config whose own validation
    refuses the shrunk values raises :class:`UnshrinkableConfig` naming it and the reason."""
    try:
        small = _shrunk(config, small_sizes(world_sizes))
    except Exception as error:  # a config's validators raise their own types (huggingface_hub's strict dataclasses)
        reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
        raise UnshrinkableConfig(f"cannot shrink {type(config).__name__}: {reason}") from error
    _move_special_ids(small)
    return small


def _shrunk(config, sizes: dict[str, int]):
    defaults = type(config)()
    kwargs = {
        key: value
        for key, value in config.to_dict().items()
        if key not in _DERIVED and key not in _sub_config_names(config) and value != getattr(defaults, key, None)
    }
    for name, value in sizes.items():
        if isinstance(getattr(type(config), name, None), property):
            continue  # derived from other fields (Falcon's head_dim)
        current = getattr(config, name, None)
        if isinstance(current, (list, tuple)) and all(isinstance(item, int) for item in current):
            kwargs[name] = type(current)([value] * len(current))
        elif isinstance(current, int) and not isinstance(current, bool):
            kwargs[name] = value
        elif name in _UNSET_IN_DEFAULTS and current is None and name in vars(config):
            kwargs[name] = value  # left unset by the default config, which some models read as is
    if "image_size" in kwargs and "patch_size" not in kwargs:
        del kwargs["image_size"]  # a patch grid needs both
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if "num_key_value_heads" in kwargs and (kv_heads is None or kv_heads == heads):
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", kv_heads)
    _state_space_heads(config, kwargs, sizes)
    _multimodal_rope(config, kwargs, sizes["head_dim"] // 2)
    if _has_int(config, "embed_dim") and _has_int(config, "num_heads"):  # Qwen2-VL's vision width (not Swin's list)
        kwargs["embed_dim"] = sizes["hidden_size"]
    for name in _sub_config_names(config):
        kwargs[name] = _shrunk(getattr(config, name), sizes)
    return type(config)(**kwargs)


def _multimodal_rope(config, kwargs: dict, rotary_pairs: int) -> None:
    """Qwen2-VL's M-RoPE (a config that names ``mrope_section`` among its rope keys): the rotary pairs of
    time, height and width scaled to sum to the small head's ``head_dim / 2`` pairs."""
    rope = kwargs.get("rope_parameters", getattr(config, "rope_parameters", None))
    if not isinstance(rope, dict) or "mrope_section" not in getattr(config, "ignore_keys_at_rope_validation", ()):
        return
    sections = rope.get("mrope_section") or MROPE_SECTION
    scaled = [max(1, section * rotary_pairs // sum(sections)) for section in sections]
    scaled[0] += rotary_pairs - sum(scaled)
    kwargs["rope_parameters"] = {**rope, "mrope_section": scaled}


def _state_space_heads(config, kwargs: dict, sizes: dict[str, int]) -> None:
    """Mamba2: ``num_heads * head_dim == expand * hidden_size`` and ``n_groups`` (of B and C) dividing the heads,
    as many groups as the grouped KV heads (so every world size divides them)."""
    if not all(_has_int(config, name) for name in ("num_heads", "expand", "head_dim", "n_groups")):
        return
    kwargs["num_heads"] = config.expand * kwargs.get("hidden_size", config.hidden_size) // sizes["head_dim"]
    kwargs["n_groups"] = sizes["num_key_value_heads"]


def _sub_config_names(config) -> list[str]:
    """Names of the nested configs (``text_config``, ``vision_config``, ``encoder``, ...)."""
    import transformers

    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig  # renamed in 5.x
    names = getattr(config, "sub_configs", None) or {}
    return [name for name in names if isinstance(getattr(config, name, None), base)]


def _configs(config) -> Iterator:
    """``config`` and every config nested in it."""
    yield config
    for name in _sub_config_names(config):
        yield from _configs(getattr(config, name))


def _special_id_fields(config) -> Iterator[tuple[Any, str, Any]]:
    for each in _configs(config):
        for name, value in vars(each).items():
            if name.endswith(("_token_id", "_token_index", "_token_ids")) and _ids(value):
                yield each, name, value


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return []


def special_token_ids(config) -> set[int]:
    """Every special token id (``pad``/``bos``/``eos``/``decoder_start``/``image``...) of
    ``config`` and its sub-configs."""
    return {i for _, _, value in _special_id_fields(config) for i in _ids(value)}


def _move_special_ids(config) -> None:
    """Give each distinct special id from ``LOW_IDS`` up its own id among the top ``RESERVED_IDS``
    of :data:`VOCAB` (equal ids stay equal, so ``pad == eos`` configs keep their meaning)."""
    moved = sorted(i for i in special_token_ids(config) if i >= LOW_IDS)
    if len(moved) > RESERVED_IDS:
        raise ValueError(f"{type(config).__name__} has {len(moved)} special token ids, more than {RESERVED_IDS}")
    new_id = {old: VOCAB - 1 - index for index, old in enumerate(moved)}
    for owner, name, value in list(_special_id_fields(config)):
        if isinstance(value, int):
            setattr(owner, name, new_id.get(value, value))
        else:
            setattr(owner, name, type(value)(new_id.get(i, i) for i in value))


# --- inputs -------------------------------------------------------------------------------------


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch for ``model.forward``, built from its config and the arguments it accepts.

    - ``pixel_values``: ``(batch, num_channels, H, W)`` at the (vision) config's ``image_size``;
    - ``input_features``: ``(batch, num_mel_bins, 2 * max_source_positions)`` (Whisper-like) or
      ``(batch, frames, features)`` (``input_feat_per_channel * input_channels``,
      ``feature_projection_input_dim`` or ``feature_size``,
      row 0 padded in its second half, with ``attention_mask`` when accepted);
    - ``input_values``: waveforms ``(batch, samples)``, ``samples`` a multiple of the conv strides
      (``2 * seq`` frames, and the context of an x-vector head's time-delay layers), row 0 zero in
      its second half, with ``attention_mask`` when accepted;
    - ``input_ids`` ``(batch, seq)`` drawn clear of every special id, row 0 right-padded with the
      pad id in its second half, with ``attention_mask`` when accepted; with ``pixel_values`` and an
      ``image_token_id``/``image_token_index``, each row starts with one image token per image feature;
    - ``decoder_input_ids`` ``(batch, 4)`` where accepted (encoder-decoder models, BLIP's answer
      decoder), except encoder-decoder sequence classifiers
      (BART's pools the decoder state at each row's last eos token: their rows end in eos, and the
      decoder reads the input ids shifted right);
    - ``visual_feats`` and ``visual_pos`` (LXMERT) or ``visual_embeds`` (VisualBERT): ``REGIONS``
      region features per row.
    """
    accepted = forward_parameters(model)
    generator = torch.Generator().manual_seed(seed)
    inputs: dict[str, torch.Tensor] = {}
    for build in (_pixels, _audio_features, _waveforms, _text, _decoder_text, _image_regions):
        inputs |= build(model, accepted, inputs, batch, seq, generator)
    if not inputs:
        raise ValueError(
            f"cannot build inputs for {type(model).__name__}: its forward takes none of "
            "input_ids, pixel_values, input_features, input_values"
        )
    return inputs


def forward_parameters(model: nn.Module) -> set[str]:
    """Names of the arguments ``model.forward`` takes by name."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in kinds}


def _pixels(model, accepted, inputs, batch, seq, generator) -> dict:
    if "pixel_values" not in accepted:
        return {}
    vision = getattr(model.config, "vision_config", None) or model.config
    if "spatial_shapes" in accepted:
        return _patches(vision, batch, generator)
    if "image_grid_thw" in accepted:
        return _grid_patches(vision, batch, generator)
    if "pixel_attention_mask" in accepted:  # Idefics3, SmolVLM: (batch, images, channels, H, W)
        height, width = _pair(getattr(vision, "image_size", IMAGE_SIZE))
        channels = getattr(vision, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, 1, channels, height, width, generator=generator)}
    height, width = _pair(getattr(vision, "image_size", IMAGE_SIZE))
    channels = getattr(vision, "num_channels", 3)
    return {"pixel_values": torch.randn(batch, channels, height, width, generator=generator)}


def _patches(vision, batch, generator) -> dict:
    """SigLIP2's patchified images of any aspect ratio: ``pixel_values (batch, P, channels * patch^2)`` of a
    ``4 x 4`` grid of ``P = 16`` patches, row 0 a ``2 x 4`` image padded to them (``pixel_attention_mask``)."""
    grid, channels = 4, getattr(vision, "num_channels", 3)
    patches = torch.randn(batch, grid * grid, channels * vision.patch_size**2, generator=generator)
    shapes = torch.tensor([[grid, grid]] * batch)
    shapes[0, 0] = grid // 2
    mask = torch.ones(batch, grid * grid, dtype=torch.long)
    mask[0, grid * grid // 2 :] = 0
    return {"pixel_values": patches * mask[..., None], "pixel_attention_mask": mask, "spatial_shapes": shapes}


def _grid_patches(vision, batch, generator) -> dict:
    """Qwen2-VL's and Qwen2.5-VL's flattened patches: one image per row of a ``1 x 4 x 4`` grid (``t x h x w``,
    ``h`` and ``w`` multiples of the ``spatial_merge_size``), ``pixel_values (batch * 16, channels * t_patch *
    patch^2)`` and ``image_grid_thw (batch, 3)``."""
    grid = 2 * getattr(vision, "spatial_merge_size", 2)
    channels = getattr(vision, "in_channels", 0) or getattr(vision, "num_channels", 3)
    features = channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size**2
    return {
        "pixel_values": torch.randn(batch * grid * grid, features, generator=generator),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * batch),
    }


def _audio_features(model, accepted, inputs, batch, seq, generator) -> dict:
    if "input_features" not in accepted:
        return {}
    config = model.config
    if getattr(config, "num_mel_bins", None) and getattr(config, "max_source_positions", None):
        shape = (batch, config.num_mel_bins, 2 * config.max_source_positions)
    elif getattr(config, "input_feat_per_channel", None):
        shape = (batch, 4 * seq, config.input_feat_per_channel * getattr(config, "input_channels", 1))
    elif getattr(config, "feature_projection_input_dim", None):  # w2v-BERT: stacked frames
        shape = (batch, 4 * seq, config.feature_projection_input_dim)
    elif getattr(config, "feature_size", None):
        shape = (batch, 4 * seq, config.feature_size)
    else:
        raise ValueError(f"{type(config).__name__} names no audio feature size (num_mel_bins, feature_size, ...)")
    features = torch.randn(*shape, generator=generator)
    if "attention_mask" not in accepted or getattr(config, "num_mel_bins", None):  # Whisper's encoder takes no mask
        return {"input_features": features}
    mask = torch.ones(shape[:2], dtype=torch.long)
    mask[0, shape[1] // 2 :] = 0  # row 0's frames padded on the right
    return {"input_features": features * mask[..., None], "attention_mask": mask}


def _waveforms(model, accepted, inputs, batch, seq, generator) -> dict:
    if "input_values" not in accepted:
        return {}
    config = model.config
    hop = math.prod(getattr(config, "conv_stride", None) or (160,))
    frames = 2 * seq
    if hasattr(model, "tdnn"):  # an x-vector head: its time-delay layers consume this much context
        frames += sum(
            (kernel - 1) * dilation for kernel, dilation in zip(config.tdnn_kernel, config.tdnn_dilation, strict=True)
        )
    values = torch.randn(batch, frames * hop, generator=generator)
    if "attention_mask" not in accepted:
        return {"input_values": values}
    mask = torch.ones_like(values, dtype=torch.long)
    mask[0, values.shape[1] // 2 :] = 0  # row 0 is half silence: padded on the right
    return {"input_values": values * mask, "attention_mask": mask}


def _text(model, accepted, inputs, batch, seq, generator) -> dict:
    if "input_ids" not in accepted:
        return {}
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    ids = _token_ids(config, text, (batch, seq), generator)
    image_token = next((getattr(config, n) for n in _IMAGE_TOKEN_FIELDS if _has_int(config, n)), None)
    if image_token is not None and "pixel_values" in inputs:
        images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw") if name in inputs}
        per_row = _image_feature_count(model, images) // batch
        ids = torch.cat([torch.full((batch, per_row), image_token), ids], dim=1)
    mask = torch.ones_like(ids)
    mask[0, ids.shape[1] - seq // 2 :] = 0  # right padding on row 0, image tokens kept
    pad = text.pad_token_id if _has_int(text, "pad_token_id") else 0
    result = {"input_ids": torch.where(mask.bool(), ids, pad)}
    if "mm_token_type_ids" in accepted and image_token is not None and "pixel_values" in inputs:
        result["mm_token_type_ids"] = (result["input_ids"] == image_token).long()  # Qwen2-VL's M-RoPE: 1 at images
    if "attention_mask" in accepted:
        result["attention_mask"] = mask
    return result


def _decoder_text(model, accepted, inputs, batch, seq, generator) -> dict:
    if "decoder_input_ids" not in accepted:  # encoder-decoders, and decoders of answers (BLIP's)
        return {}
    if _pools_at_eos(model) and "input_ids" in inputs:
        ids, mask = inputs["input_ids"].clone(), inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
        ids[torch.arange(len(ids)), mask.sum(1) - 1] = model.config.eos_token_id
        return {"input_ids": ids}
    decoder = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
    return {"decoder_input_ids": _token_ids(model.config, decoder or model.config, (batch, 4), generator)}


def _image_regions(model, accepted, inputs, batch, seq, generator) -> dict:
    """Features of detected image regions beside the text: LXMERT's (with their boxes), VisualBERT's."""
    config = model.config
    if "visual_feats" in accepted and getattr(config, "visual_feat_dim", None):
        features = torch.randn(batch, REGIONS, config.visual_feat_dim, generator=generator)
        return {
            "visual_feats": features,
            "visual_pos": torch.rand(batch, REGIONS, config.visual_pos_dim, generator=generator),
        }
    if "visual_embeds" in accepted and getattr(config, "visual_embedding_dim", None):
        return {"visual_embeds": torch.randn(batch, REGIONS, config.visual_embedding_dim, generator=generator)}
    return {}


def _pools_at_eos(model) -> bool:
    """An encoder-decoder sequence classifier, which classifies the decoder state at the eos tokens."""
    return type(model).__name__.endswith("ForSequenceClassification") and _has_int(model.config, "eos_token_id")


def _token_ids(config, text, shape, generator) -> torch.Tensor:
    """Ids below ``min(vocab, VOCAB - RESERVED_IDS)``, from ``LOW_IDS`` up, none of them special."""
    top = min(getattr(text, "vocab_size", None) or VOCAB, VOCAB - RESERVED_IDS)
    special = special_token_ids(config)
    allowed = torch.tensor([i for i in range(LOW_IDS, top) if i not in special])
    return allowed[torch.randint(len(allowed), shape, generator=generator)]


def _image_feature_count(model, images: dict[str, torch.Tensor]) -> int:
    """How many image features (so image tokens) the model makes of ``images`` (``pixel_values`` and, where
    there are, the image grids), all images together."""
    with torch.inference_mode():
        features = model.get_image_features(**images)
    features = getattr(features, "pooler_output", features)  # transformers >= 5.x returns an output object
    if isinstance(features, torch.Tensor):
        return features.shape[:-1].numel()
    return sum(feature.shape[:-1].numel() for feature in features)


def _has_int(config, name: str) -> bool:
    value = getattr(config, name, None)
    return isinstance(value, int) and not isinstance(value, bool)


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]
