"""Composite models: each layer's policy reads the config of its own sub-model (text, vision, ...).

LLaVA nests a Llama language model (``text_config``) and a CLIP vision tower (``vision_config``);
CLIP nests two towers of different widths. A policy must see the tower's config, the tp-plan
fallback must read each sub-model's own plan, and the split model must still equal the whole one.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

import tpcore
from tpcore import Layer, Policy, TensorReplacer, divide
from tpcore.configs import config_of, module_configs, sub_models
from tpcore.select.auto import AutoPolicy, sub_model_coverage
from tpcore.select.plugins import PolicyEntry, reset_plugins
from tpcore.select.tp_plan import TpPlanError, derive_policies, sub_model_plans
from tpcore.testing import ModelSpec, check_equivalence, tiny_llama_config
from tpcore.tools.cli import main

IMAGE_TOKEN = 63
IMAGE_FEATURES = 4  # (8 / 4) ** 2 patches of the tiny vision tower; its CLS feature is dropped


def llava_config() -> transformers.LlavaConfig:
    text = tiny_llama_config(vocab_size=64, hidden_size=32, intermediate_size=64)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4
    )
    return transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN)


def llava() -> transformers.LlavaForConditionalGeneration:
    return ModelSpec(transformers.LlavaForConditionalGeneration, llava_config(), seed=3).build()


def llava_inputs() -> dict:
    """Two prompts with one image each (its tokens at different places), the first one left-padded."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, IMAGE_TOKEN, (2, 10), generator=generator)
    ids[0, 3 : 3 + IMAGE_FEATURES] = IMAGE_TOKEN
    ids[1, 1 : 1 + IMAGE_FEATURES] = IMAGE_TOKEN
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :2] = 0
    ids[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(2, 3, 8, 8, generator=generator)}


def clip_config() -> transformers.CLIPConfig:
    """Towers of different widths: text 2 heads of 16, vision 4 heads of 16."""
    text = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, vocab_size=64)
    vision = dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, image_size=8, patch_size=4
    )
    return transformers.CLIPConfig(text_config=text, vision_config=vision)


def clip() -> transformers.CLIPModel:
    return ModelSpec(transformers.CLIPModel, clip_config(), seed=5).build()


def clip_inputs() -> dict:
    generator = torch.Generator().manual_seed(6)
    return {
        "input_ids": torch.randint(1, 64, (2, 7), generator=generator),
        "pixel_values": torch.randn(3, 3, 8, 8, generator=generator),
    }


def layer_names(model: nn.Module, tower: str) -> list[str]:
    """The CLIP encoder layers inside ``tower`` (transformers versions nest them differently)."""
    kind = transformers.models.clip.modeling_clip.CLIPEncoderLayer
    return [n for n, m in model.named_modules() if isinstance(m, kind) and n.startswith(f"{tower}.")]


def _linear(path: str) -> Layer:
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias")


class CLIPLayerPolicy(Policy):
    """Test-only: a third party's policy for CLIP's encoder layer, shared by both towers."""

    layer_class = "transformers.models.clip.modeling_clip.CLIPEncoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            "self_attn.num_heads": divide(config.num_attention_heads, world_size, "num_attention_heads"),
            "self_attn.embed_dim": divide(config.hidden_size, world_size, "hidden_size"),
        }

    @staticmethod
    def attn_qkv():
        return [_linear(f"self_attn.{name}_proj") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("self_attn.out_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.fc1")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.fc2")]


def _plugins_under(monkeypatch, name: str, value: str):
    """The plugin registry reloaded with the environment switch ``name`` set to ``value``, then restored."""
    monkeypatch.setenv(name, value)
    reset_plugins()
    yield
    monkeypatch.delenv(name)
    reset_plugins()


@pytest.fixture
def no_plugins(monkeypatch):
    """Plugin autoload off (the tp-plan fallback alone)."""
    yield from _plugins_under(monkeypatch, "TPCORE_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture
def only_tp_gpt(monkeypatch):
    """tp-gpt the only plugin loaded (tp-vision would cover the CLIP tower)."""
    yield from _plugins_under(monkeypatch, "TPCORE_PLUGINS", "tp-gpt")


# -- which config a module belongs to (pure) -------------------------------------------------------


def test_config_of_llava_finds_the_text_and_vision_sub_configs():
    model = llava()
    top = model.config
    assert config_of(model, "model.language_model.layers.1") is top.text_config
    assert config_of(model, "model.language_model.layers.1.self_attn.q_proj") is top.text_config
    assert config_of(model, layer_names(model, "model.vision_tower")[0]) is top.vision_config
    assert config_of(model, "model.multi_modal_projector") is top
    assert config_of(model, "") is top
    assert top.text_config is not top and top.vision_config is not top
    configs = module_configs(model)
    assert all(configs[name] is config_of(model, name) for name, _ in model.named_modules())


def test_config_of_clip_gives_each_tower_its_config():
    model = clip()
    text, vision = layer_names(model, "text_model"), layer_names(model, "vision_model")
    assert len(text) == len(vision) == 2
    assert config_of(model, text[0]) is model.config.text_config
    assert config_of(model, f"{vision[1]}.mlp") is model.config.vision_config
    assert config_of(model, text[0]).num_attention_heads == 2
    assert config_of(model, vision[0]).num_attention_heads == 4


def test_config_of_encoder_decoders_is_the_halfs_own_config():
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    )
    # T5's stacks hold copies of the top-level config (flagged encoder / decoder)
    assert config_of(t5, "encoder.block.0") is t5.encoder.config and t5.encoder.config is not t5.config
    assert config_of(t5, "decoder.block.0.layer.0") is t5.decoder.config and t5.decoder.config.is_decoder
    sizes = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32, decoder_ffn_dim=32)
    heads = dict(encoder_attention_heads=2, decoder_attention_heads=4)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(**sizes, **heads))
    whisper = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(
            **sizes,
            **heads,
            num_mel_bins=8,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )
    for model in (bart, whisper):  # both halves share the top-level config: one object for the whole model
        assert config_of(model, "model.encoder.layers.0") is model.model.encoder.config is model.config
        assert config_of(model, "model.decoder.layers.0.self_attn") is model.model.decoder.config is model.config
    assert list(sub_models(t5)) == list(sub_models(bart)) == [""]  # copies of one config are one sub-model


def test_sub_models_are_where_a_config_of_another_class_begins():
    assert list(sub_models(llava())) == ["", "model.vision_tower", "model.language_model"]
    assert list(sub_models(clip())) == ["", "text_model", "vision_model"]


def test_config_of_a_model_without_a_transformers_config_is_its_config_attribute():
    model = nn.Sequential(nn.Linear(2, 2))
    assert config_of(model, "0") is None
    model.config = {"any": "object"}
    assert config_of(model, "0") is model.config


# -- the tp-plan fallback on composite models (pure) -------------------------------------------------


def test_llava_derives_the_language_models_policy_from_its_text_config_plan():
    model = llava()
    plans = {plan.name: plan for plan in sub_model_plans(model)}
    assert plans["model.language_model"].config is model.config.text_config
    assert list(plans["model.language_model"].rules) == ["model.language_model.layers"]
    assert "CLIPVisionModel's config (clip_vision_model) has no base_model_tp_plan" in plans["model.vision_tower"].whole
    assert plans[""].whole and not plans[""].rules  # LlavaConfig carries no plan of its own
    (policy,) = derive_policies(model)
    assert policy.policy_name() == "LlamaDecoderLayer (tp plan of llama)"


def test_a_derived_policy_reads_the_head_counts_of_the_config_it_is_given():
    (policy,) = derive_policies(llava())
    arguments = policy.replace_arguments(llava_config().text_config, 2)  # 4 heads, 2 KV heads
    assert arguments["self_attn.num_key_value_groups"] == 2
    wider = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=8, hidden_size=64)
    assert policy.replace_arguments(wider, 2)["self_attn.num_key_value_groups"] == 1
    assert policy.replace_arguments(llava_config(), 2) == {}  # a config without head counts


def test_a_prefixed_plan_on_the_top_level_config_is_merged_with_the_sub_models(monkeypatch):
    text_plan = transformers.LlamaConfig.base_model_tp_plan
    prefixed = {f"language_model.{rule}": style for rule, style in text_plan.items()}
    monkeypatch.setattr(transformers.LlavaConfig, "base_model_tp_plan", prefixed)
    model = llava()
    plans = {plan.name: plan for plan in sub_model_plans(model)}
    assert plans[""].rules == plans["model.language_model"].rules  # the same blocks, found both ways
    (policy,) = derive_policies(model)
    columns = {spec.weight for spec in policy.layers() if spec.style is tpcore.COLUMN}
    assert columns >= {"self_attn.q_proj.weight", "mlp.up_proj.weight"}
    disagreeing = {**prefixed, "language_model.layers.*.mlp.down_proj": "colwise"}
    monkeypatch.setattr(transformers.LlavaConfig, "base_model_tp_plan", disagreeing)
    with pytest.raises(TpPlanError, match=r"split 'model.language_model.layers.0.mlp.down_proj' as 'colwise' and 'row"):
        derive_policies(llava())


def clip_tower_plans(monkeypatch):
    """Give both CLIP towers' configs a tp plan (they have none), relative to each tower's model."""
    model = clip()
    for config_class, tower in ((transformers.CLIPTextConfig, "text"), (transformers.CLIPVisionConfig, "vision")):
        first = layer_names(model, f"{tower}_model")[0]  # "<tower>_model[.<tower>_model].encoder.layers.0"
        blocks = first.removeprefix(f"{tower}_model.").rpartition(".")[0] + ".*"
        plan = {f"{blocks}.self_attn.{name}_proj": "colwise" for name in "qkv"}
        plan |= {f"{blocks}.self_attn.out_proj": "rowwise", f"{blocks}.mlp.fc1": "colwise"}
        monkeypatch.setattr(config_class, "base_model_tp_plan", {**plan, f"{blocks}.mlp.fc2": "rowwise"})


def per_rank_heads(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{tower: (num_heads, q_proj rows)}`` of the first layer of each CLIP tower."""
    layers = {tower: model.get_submodule(layer_names(model, f"{tower}_model")[0]) for tower in ("text", "vision")}
    return {
        tower: (layer.self_attn.num_heads, layer.self_attn.q_proj.weight.shape[0]) for tower, layer in layers.items()
    }


def test_derived_policy_shared_by_two_towers_gives_each_its_own_head_count(monkeypatch, no_plugins):
    clip_tower_plans(monkeypatch)
    (policy,) = AutoPolicy().get_policy(clip())
    assert policy.layer_class_name().endswith("CLIPEncoderLayer")
    for rank in (0, 1):
        model = TensorReplacer(clip(), None, num_gpus=2, rank=rank).replace_modules()
        assert per_rank_heads(model) == {"text": (1, 16), "vision": (2, 32)}


def test_a_composite_model_no_plan_covers_is_refused_naming_each_sub_model(no_plugins, monkeypatch):
    monkeypatch.setenv("TPCORE_STRUCTURAL", "0")  # nor its structure
    with pytest.raises(tpcore.UnsupportedModelError) as raised:
        AutoPolicy().get_policy(clip())
    message = str(raised.value)
    assert "No policy could be derived: CLIPModel's config (clip) has no base_model_tp_plan" in message
    assert "CLIPTextModel's config (clip_text_model) has no" in message
    assert "CLIPVisionModel's config (clip_vision_model) has no" in message


# -- plugins for some layer classes, tp plans for the rest (pure) ------------------------------------


def test_llava_with_tp_gpt_splits_the_language_model_and_keeps_the_vision_tower_whole(only_tp_gpt):
    model = llava()
    (policy,) = AutoPolicy().get_policy(model)
    assert policy.__name__ == "LlamaPolicy"  # tp-gpt's, not the derived one for the same class
    coverage = {part.name: part for part in sub_model_coverage(model, [policy])}
    assert coverage["model.language_model"].policies == (policy,)
    assert "no plugin policy covers its layers" in coverage["model.vision_tower"].whole
    assert TensorReplacer(model, None, num_gpus=2, rank=1).validate() == [policy]


def test_a_tower_no_plugin_covers_follows_its_own_tp_plan(monkeypatch, only_tp_gpt):
    clip_tower_plans(monkeypatch)  # CLIPVisionConfig now has a plan; tp-gpt covers the Llama layers
    policies = AutoPolicy().get_policy(llava())
    assert [p.policy_name() for p in policies] == ["LlamaPolicy", "CLIPEncoderLayer (tp plan of clip_vision_model)"]


def test_a_derived_policy_around_a_plugin_covered_layer_is_dropped(monkeypatch, no_plugins):
    class LlamaAttentionPolicy(Policy):  # a plugin's policy for a module inside the derived blocks
        layer_class = "transformers.models.llama.modeling_llama.LlamaAttention"

    entry = PolicyEntry(LlamaAttentionPolicy, "attention", "tp-attention", "1.0")
    monkeypatch.setattr(AutoPolicy, "entries_for", lambda self, model: [entry])
    assert AutoPolicy().get_policy(llava()) == [LlamaAttentionPolicy]


def test_plugins_command_lists_what_splits_each_sub_model_and_what_stays_whole(capsys, monkeypatch, only_tp_gpt):
    import tpcore.tools.check

    spec = ModelSpec(transformers.LlavaForConditionalGeneration, llava_config())
    monkeypatch.setattr(tpcore.tools.check, "resolve", lambda name: spec)
    assert main(["plugins", "--model", "LlavaForConditionalGeneration"]) == 0
    out = capsys.readouterr().out
    assert "LlamaPolicy" in out and "(from tp-gpt" in out
    assert "model.language_model     LlamaModel  split by LlamaPolicy" in out
    assert "model.vision_tower       CLIPVisionModel  stays whole: no plugin policy covers its layers" in out
    assert main(["plugins", "--model", "LlavaForConditionalGeneration", "--json"]) == 0
    shown = {row["name"]: row for row in json.loads(capsys.readouterr().out)["sub_models"]}
    assert shown["model.language_model"] == {
        "name": "model.language_model",
        "class": "LlamaModel",
        "policies": ["LlamaPolicy"],
        "whole": None,
    }
    assert "has no base_model_tp_plan" in shown["model.vision_tower"]["whole"]


# -- a policy gets its tower's config (pure), and the split models equal the whole ones (gloo ranks) --


def test_a_policy_shared_by_two_towers_gets_each_towers_config():
    for rank in (0, 1):
        model = TensorReplacer(clip(), None, num_gpus=2, custom_policies=[CLIPLayerPolicy], rank=rank)
        model = model.replace_modules()
        assert per_rank_heads(model) == {"text": (1, 16), "vision": (2, 32)}
        assert model.get_submodule(layer_names(model, "text_model")[1]).self_attn.embed_dim == 16
        assert model.get_submodule(layer_names(model, "vision_model")[1]).self_attn.embed_dim == 32


def test_llava_split_by_tp_gpt_equals_the_unsplit_model(rank_pools):
    reset_plugins()
    spec = ModelSpec(transformers.LlavaForConditionalGeneration, llava_config(), seed=3)
    report = check_equivalence(spec, llava_inputs(), world_sizes=(2,), pools=rank_pools)
    assert "logits" in report[2]  # every output compared; the image features' names vary by version


def test_clip_split_with_per_tower_head_counts_equals_the_unsplit_model(rank_pools):
    spec = ModelSpec(transformers.CLIPModel, clip_config(), seed=5)
    report = check_equivalence(spec, clip_inputs(), world_sizes=(2,), policies=[CLIPLayerPolicy], pools=rank_pools)
    assert {"logits_per_image", "text_embeds", "image_embeds"} <= set(report[2])
