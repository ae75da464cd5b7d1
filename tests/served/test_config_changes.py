"""CallerConfig: what the caller changed on a served model's config since the last call, and nothing else."""

from __future__ import annotations

import transformers

from tpcore.served.config_changes import CallerConfig


def composite_config() -> transformers.PretrainedConfig:
    text = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    vision = transformers.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    return transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict())


def test_nothing_changed_gives_nothing_and_each_change_is_given_once():
    config = composite_config()
    watch = CallerConfig(config)
    assert watch.write() == {}
    config.output_hidden_states = True
    config.text_config.rms_norm_eps = 1e-3
    assert watch.write() == {"": {"output_hidden_states": True}, "text_config": {"rms_norm_eps": 1e-3}}
    assert watch.write() == {}


def test_a_container_changed_in_place_is_a_change():
    config = composite_config()
    watch = CallerConfig(config)
    config.text_config.architectures = ["LlamaForCausalLM"]
    assert watch.write() == {"text_config": {"architectures": ["LlamaForCausalLM"]}}
    config.text_config.architectures.append("LlamaModel")
    assert watch.write() == {"text_config": {"architectures": ["LlamaForCausalLM", "LlamaModel"]}}
    assert watch.write() == {}


def test_a_replaced_sub_config_is_compared_on_its_own_path():
    config = composite_config()
    watch = CallerConfig(config)
    replaced = transformers.LlamaConfig(**config.text_config.to_dict())
    replaced.rms_norm_eps = 0.5
    config.text_config = replaced
    assert watch.write() == {"text_config": {"rms_norm_eps": 0.5}}
    assert watch.write() == {}


def test_a_deleted_attribute_or_a_nan_does_not_read_as_a_change_on_every_call():
    config = composite_config()
    config.scale = float("nan")
    config.extra = 1
    watch = CallerConfig(config)
    del config.extra
    assert watch.write() == {}
    config.scale = float("nan")  # another NaN object: a change, given once
    changes = watch.write()
    assert list(changes) == [""] and list(changes[""]) == ["scale"]
    assert watch.write() == {}
