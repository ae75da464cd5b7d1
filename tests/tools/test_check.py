"""``tpcore check`` and the equivalence checker's failure reports."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers
from rank_helpers import ViTLayerPolicy
from torch import nn
from tp_bert.policies import BertPolicy

from tpcore import Layer
from tpcore.ranks.process import WorkerError
from tpcore.testing import (
    DEFAULT_RTOL,
    SCALE_FLOOR,
    EquivalenceError,
    ModelSpec,
    check_equivalence,
    compare_outputs,
    flatten_outputs,
    parameter_count,
    tiny_bert_config,
)
from tpcore.testing.samples import (
    HEAD_DIM,
    IMAGE_SIZE,
    PATCH_SIZE,
    RESERVED_IDS,
    VOCAB,
    UnshrinkableConfig,
    _configs,
    sample_inputs,
    small_config,
    special_token_ids,
)
from tpcore.tools.check import resolve, run_check
from tpcore.tools.cli import main


def bert_config() -> transformers.BertConfig:
    """tiny_bert's config with 4 heads of 8 features and 64 tokens: 2 and 3 ranks split it, 5 do not."""
    return tiny_bert_config(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_check_a_class_covered_by_a_tp_plan_passes(rank_pools, capsys):
    assert run_check("Qwen3ForCausalLM", [1, 2], pools=rank_pools) == 0
    out = capsys.readouterr().out
    assert "policy Qwen3DecoderLayer (tp plan of qwen3) from config tp plan" in out
    assert "1 ranks: PASS" in out and "2 ranks: PASS" in out and out.rstrip().endswith("PASS")


def test_check_a_saved_model_directory_names_the_plugin(rank_pools, tmp_path, capsys):
    config = bert_config()
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path)
    assert run_check(str(tmp_path), [2, 3, 5], pools=rank_pools) == 1
    out = capsys.readouterr().out
    assert "policy BertPolicy from tp-bert" in out
    assert "2 ranks: PASS" in out and "3 ranks: PASS" in out  # 4 heads over 3 ranks: 2, 1, 1
    assert "5 ranks: REFUSED cannot split BertForMaskedLM over 5 ranks" in out and "fewer than the ranks" in out


def test_check_an_uncovered_model_explains_and_fails(spawned, capsys):
    """DiffLlama: its tp plan splits no block; a model with a tp plan gets no structural policy in its place."""
    assert main(["check", "DiffLlamaForCausalLM", "--world-sizes", "2", "4"]) == 2  # the command line, no rank started
    assert spawned == []
    assert "its tp plan splits no block" in capsys.readouterr().out


def test_check_rejects_what_is_neither_a_directory_nor_a_class():
    with pytest.raises(SystemExit, match="neither a saved model directory nor a transformers model class"):
        main(["check", "NoSuchModel"])


def test_a_config_that_cannot_be_shrunk_is_said_so_not_raised(monkeypatch, spawned, capsys):
    def refuses(config, world_sizes=(2,)):  # a config's own validation refusing the shrunk sizes
        raise UnshrinkableConfig("cannot shrink BertConfig: hidden_size must be 768")

    monkeypatch.setattr("tpcore.tools.check.small_config", refuses)
    assert main(["check", "BertModel"]) == 2
    assert main(["plugins", "--model", "BertModel"]) == 2
    out = capsys.readouterr().out
    assert "config: cannot shrink BertConfig: hidden_size must be 768 (nothing was split)" in out
    assert "pass a saved directory instead" in out and spawned == []


class PickyConfig(transformers.PretrainedConfig):
    """A config whose own validation refuses small widths."""

    def __init__(self, hidden_size=768, **kwargs):
        if hidden_size % 96:
            raise ValueError("hidden_size must be a multiple of 96")
        self.hidden_size = hidden_size
        super().__init__(**kwargs)


def test_a_config_validator_refusing_the_shrunk_sizes_raises_unshrinkable_config():
    with pytest.raises(UnshrinkableConfig, match="cannot shrink PickyConfig: hidden_size must be a multiple of 96"):
        small_config(PickyConfig())


def test_state_space_and_sam_configs_shrink_consistently():
    mamba2 = small_config(transformers.Mamba2Config(), (2, 3))
    assert mamba2.num_heads * mamba2.head_dim == mamba2.expand * mamba2.hidden_size
    assert mamba2.num_heads % mamba2.n_groups == 0 and mamba2.n_groups % 6 == 0
    sam = small_config(transformers.SamConfig())
    width = sam.mask_decoder_config.hidden_size
    assert sam.vision_config.output_channels == width == sam.prompt_encoder_config.hidden_size


def test_an_unsplit_failure_of_the_shrunk_model_is_not_a_split_failure(monkeypatch, spawned, capsys):
    class FailsUnsplit(nn.Module):
        config = transformers.BertConfig()

        def forward(self, input_ids):
            raise RuntimeError("the size of tensor a (256) must match the size of tensor b (64)")

    monkeypatch.setattr("tpcore.tools.check.resolve", lambda model, world_sizes: ModelSpec(FailsUnsplit, None))
    monkeypatch.setattr(ModelSpec, "build", lambda self: FailsUnsplit())
    assert run_check("Anything", [2], policies=[BertPolicy]) == 2
    out = capsys.readouterr().out
    assert "unsplit model: fails on its own inputs before any split (its config, not the split)" in out
    assert "ranks:" not in out and spawned == []


class ForgetsTheAllReduce(BertPolicy):
    """Broken on purpose: the attention output stays a plain Linear, so its partial sums are never added."""

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.output.dense.weight", bias="attention.output.dense.bias", replace=nn.Linear)]


def test_a_broken_policy_fails_naming_output_world_size_rank_and_amount(rank_pools):
    config = bert_config()
    spec = ModelSpec(transformers.BertModel, config, seed=0)
    inputs = {"input_ids": torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))}
    expected = r"BertModel split over 2 ranks, rank 0: last_hidden_state: max abs diff"
    with pytest.raises(EquivalenceError, match=expected):
        check_equivalence(spec, inputs, world_sizes=(2,), policies=[ForgetsTheAllReduce], pools=rank_pools)


def test_outputs_are_compared_at_their_scale_and_tiny_ones_at_the_floor():
    """A pair of logits that nearly cancel (scale 1.9e-4) keeps the round-off of its O(1) inputs (6.5e-9,
    seen from Qwen2's QA head over 4 ranks); a split that loses or doubles a term moves it by its own size."""
    tiny = {"end_logits": torch.tensor([1.885e-4, -0.7e-4])}
    assert compare_outputs(tiny, {"end_logits": tiny["end_logits"] + 6.5e-9})["end_logits"] > 0
    for wrong in (tiny["end_logits"] * 0, tiny["end_logits"] * 2, tiny["end_logits"] + 2e-6):
        with pytest.raises(EquivalenceError, match="end_logits: max abs diff"):
            compare_outputs(tiny, {"end_logits": wrong})
    with pytest.raises(EquivalenceError, match=r"x scale 2\.000e\+00"):
        compare_outputs({"logits": torch.tensor([2.0])}, {"logits": torch.tensor([2.0 + 4e-5])})
    assert SCALE_FLOOR * DEFAULT_RTOL < 2e-6  # outputs above the floor keep their relative tolerance


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_check_model_draws_inputs_and_passes_for_a_good_policy(tp_check):
    config = bert_config()
    tp_check(transformers.BertForMaskedLM, config, world_sizes=(2, 4), max_examples=5)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_check_model_finds_a_broken_policy(tp_check):
    config = bert_config()
    with pytest.raises(EquivalenceError, match="split over 2 ranks, rank 0"):
        tp_check(transformers.BertModel, config, policies=[ForgetsTheAllReduce], max_examples=5)


def test_plugins_command_shows_which_policy_applies_to_a_model(capsys, monkeypatch):
    assert main(["plugins", "--model", "LlamaForCausalLM"]) == 0
    out = capsys.readouterr().out
    assert "LlamaPolicy" in out and "(from tp-gpt" in out  # the plugin wins over Llama's tp plan
    assert "LlamaForCausalLM over 2 ranks:" in out and "model.layers.*.self_attn.q_proj.weight" in out
    assert "per rank" in out and "replicated" in out
    assert main(["plugins", "--model", "Qwen3ForCausalLM", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"] == "Qwen3ForCausalLM"
    assert shown["policies"][0]["from"] == "config tp plan"
    q_proj = shown["plan"]["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj["per_rank"] == [[q_proj["shape"][0] // 2, q_proj["shape"][1]]] * 2
    assert q_proj["cut"].startswith("cut dim 0, ") and " heads" in q_proj["cut"]
    assert main(["plugins", "--model", "LlamaForCausalLM", "--world-size", "3"]) == 0  # 4 heads: 2, 1, 1
    assert "LlamaForCausalLM over 3 ranks, shares by rank:" in capsys.readouterr().out
    assert main(["plugins", "--model", "LlamaForCausalLM", "--world-size", "5"]) == 2  # 4 heads, 5 ranks
    assert "cannot split LlamaForCausalLM over 5 ranks" in capsys.readouterr().out
    assert main(["plugins", "--model", "DiffLlamaForCausalLM"]) == 2


# --- tpcore check for every modality: small configs, inputs, rank exceptions -----------------------

#: one class per layout and modality; each is shrunk, given inputs and run unsplit (no process starts)
MODEL_CLASSES = [
    "BertForMaskedLM",
    "ModernBertModel",
    "RobertaModel",
    "DistilBertModel",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "FalconForCausalLM",
    "GPTBigCodeForCausalLM",
    "StableLmForCausalLM",
    "OpenAIGPTLMHeadModel",
    "CTRLLMHeadModel",
    "T5ForConditionalGeneration",
    "BartForConditionalGeneration",
    "ViTForImageClassification",
    "CLIPModel",
    "SiglipModel",
    "LlavaForConditionalGeneration",
    "WhisperForConditionalGeneration",
    "Speech2TextForConditionalGeneration",
    "Wav2Vec2Model",
]


@functools.cache
def small_model(name: str) -> nn.Module:
    """``tpcore check``'s model for a class name (built once per test session: do not change it)."""
    return resolve(name, (2,)).build()


@pytest.mark.parametrize("name", MODEL_CLASSES)
def test_every_modality_gets_a_small_model_and_inputs_it_runs_on(name):
    model = small_model(name)
    assert parameter_count(model) < 5_000_000
    inputs = sample_inputs(model)
    with torch.inference_mode():
        outputs = model(**inputs)
    assert flatten_outputs(outputs)
    for config in _configs(model.config):  # every special id is a row of its vocabulary
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int):
            assert all(i < vocab for i in special_token_ids(config)), type(config).__name__


def test_inputs_follow_what_forward_accepts():
    shapes = {name: {k: tuple(v.shape) for k, v in sample_inputs(small_model(name)).items()} for name in MODEL_CLASSES}
    assert shapes["ViTForImageClassification"] == {"pixel_values": (2, 3, 32, 32)}
    assert shapes["CLIPModel"] == {"pixel_values": (2, 3, 32, 32), "input_ids": (2, 8), "attention_mask": (2, 8)}
    assert shapes["WhisperForConditionalGeneration"] == {"input_features": (2, 80, 32), "decoder_input_ids": (2, 4)}
    assert shapes["Speech2TextForConditionalGeneration"]["input_features"] == (2, 32, 80)
    waveforms = (2, 16 * 320)  # 16 frames of its 320-sample hop
    assert shapes["Wav2Vec2Model"] == {"input_values": waveforms, "attention_mask": waveforms}
    assert shapes["T5ForConditionalGeneration"]["decoder_input_ids"] == (2, 4)
    assert shapes["Qwen3ForCausalLM"] == {"input_ids": (2, 8), "attention_mask": (2, 8)}


def test_whisper_features_follow_the_config():
    model = transformers.WhisperModel(
        transformers.WhisperConfig(
            vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=12,
            max_source_positions=10, max_target_positions=20, pad_token_id=1, decoder_start_token_id=2,
        )
    )  # fmt: skip
    inputs = sample_inputs(model, batch=3)
    assert tuple(inputs["input_features"].shape) == (3, 12, 20)
    assert set(inputs) == {"input_features", "decoder_input_ids"}
    with torch.inference_mode():
        model(**inputs)


def test_llava_is_built_small_with_one_image_token_per_image_feature():
    model = small_model("LlavaForConditionalGeneration")
    config = model.config
    assert parameter_count(model) < 5_000_000  # the default config is 7B
    assert config.text_config.hidden_size == 64 and config.vision_config.hidden_size == 64
    assert config.text_config.num_hidden_layers == config.vision_config.num_hidden_layers == 2
    assert config.image_token_id < config.text_config.vocab_size
    inputs = sample_inputs(model)
    features = (IMAGE_SIZE // PATCH_SIZE) ** 2  # per image: the patches ("default" strategy drops the CLS)
    assert ((inputs["input_ids"] == config.image_token_id).sum(dim=1) == features).all()
    assert inputs["input_ids"].shape == (2, features + 8)
    assert inputs["attention_mask"][0, :features].all() and not inputs["attention_mask"][0, -4:].any()


@pytest.mark.parametrize("world_sizes", [(2,), (2, 4), (3,), (1, 2, 3, 4)])
def test_shrunk_head_counts_divide_by_every_world_size(world_sizes):
    checked = 0
    for name in ("LlamaForCausalLM", "CLIPModel", "BartForConditionalGeneration", "T5Model"):
        for config in _configs(resolve(name, world_sizes).config):
            for field in ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads"):
                heads = getattr(config, field, None)
                if heads is None:
                    continue
                kv_heads = getattr(config, "num_key_value_heads", None) or heads
                assert config.hidden_size == heads * HEAD_DIM and heads % kv_heads == 0, (name, field)
                assert all(heads % n == 0 and kv_heads % n == 0 for n in world_sizes), (name, field, heads, kv_heads)
                checked += 1
            for field in ("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff"):
                assert all(getattr(config, field, 0) % n == 0 for n in world_sizes), (name, field)
    assert checked == 7  # Llama; CLIP's text and vision towers (its top level has none); BART three fields; T5


def test_grouped_kv_heads_stay_grouped_and_full_heads_stay_full():
    llama = transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=8)
    assert (small_config(llama).num_attention_heads, small_config(llama).num_key_value_heads) == (4, 2)
    bert_like = transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=32)
    assert small_config(bert_like).num_key_value_heads == 4


def test_composite_configs_shrink_every_sub_config_and_keep_their_own_settings():
    clip = small_config(transformers.CLIPConfig())
    assert clip.text_config.hidden_size == clip.vision_config.hidden_size == 64
    assert (clip.vision_config.image_size, clip.vision_config.patch_size) == (IMAGE_SIZE, PATCH_SIZE)
    assert clip.text_config.vocab_size == VOCAB and clip.text_config.max_position_embeddings <= 128
    llava = transformers.LlavaConfig()
    assert llava.vision_config.hidden_act == "quick_gelu"  # LLaVA's own vision tower setting...
    assert small_config(llava).vision_config.hidden_act == "quick_gelu"  # ...survives the shrink
    assert small_config(llava).vision_feature_layer == llava.vision_feature_layer


def test_fields_a_default_config_leaves_unset_or_too_wide_get_small_values():
    assert small_config(transformers.MinistralConfig()).head_dim == 16  # None by default, read as a number
    assert small_config(transformers.DeepseekV2Config()).num_experts_per_tok == 2  # None by default
    gptj = small_config(transformers.GPTJConfig())  # 64 rotary features of 16-wide heads by default
    assert gptj.rotary_dim == 8 < gptj.n_embd // gptj.n_head


def test_special_ids_move_into_the_vocabulary_keeping_equal_ids_equal():
    whisper = small_config(transformers.WhisperConfig())  # pad = bos = eos = 50256, decoder_start 50257
    assert whisper.vocab_size == VOCAB
    assert whisper.pad_token_id == whisper.bos_token_id == whisper.eos_token_id
    assert VOCAB - RESERVED_IDS <= whisper.eos_token_id != whisper.decoder_start_token_id < VOCAB
    modernbert = small_config(transformers.ModernBertConfig())  # pad 50283, bos = cls 50281, eos = sep 50282
    assert modernbert.bos_token_id == modernbert.cls_token_id and modernbert.eos_token_id == modernbert.sep_token_id
    ids = {modernbert.pad_token_id, modernbert.bos_token_id, modernbert.eos_token_id}
    assert len(ids) == 3 and all(VOCAB - RESERVED_IDS <= i < VOCAB for i in ids)
    assert small_config(transformers.BertConfig()).pad_token_id == 0  # low ids stay where they are


def test_sample_token_ids_avoid_every_special_id():
    model = small_model("ModernBertModel")
    inputs = sample_inputs(model, batch=3, seq=40)
    special = special_token_ids(model.config)
    real = inputs["input_ids"][inputs["attention_mask"].bool()]
    assert not any(int(i) in special for i in real)
    assert (inputs["input_ids"][0, 20:] == model.config.pad_token_id).all()  # padded with the pad id


def test_a_model_whose_forward_takes_no_known_input_is_refused_clearly():
    class Odd(nn.Module):
        config = transformers.BertConfig()

        def forward(self, something):
            return something

    with pytest.raises(ValueError, match="cannot build inputs for Odd: its forward takes none of input_ids"):
        sample_inputs(Odd())


# the same checks through ``tpcore check``, with ranks (one gloo world of 2, shared)


def _needs_the_vit_layout():
    from transformers.models.vit import modeling_vit

    if not hasattr(modeling_vit, "ViTLayer") or hasattr(modeling_vit, "ViTSelfAttention"):
        pytest.skip("ViTLayerPolicy is written for the q_proj/fc1 ViT layout of recent transformers")


def test_check_a_vision_model_sends_pixels_and_passes(rank_pools, capsys):
    _needs_the_vit_layout()
    assert run_check("ViTForImageClassification", [2], policies=[ViTLayerPolicy], pools=rank_pools) == 0
    out = capsys.readouterr().out
    assert "policy ViTLayerPolicy from custom_policies" in out
    assert "inputs: pixel_values (2, 3, 32, 32)" in out and "2 ranks: PASS" in out


def test_check_a_saved_vision_model_passes(rank_pools, tmp_path, capsys):
    _needs_the_vit_layout()
    small_model("ViTForImageClassification").save_pretrained(tmp_path)
    assert run_check(str(tmp_path), [2], policies=[ViTLayerPolicy], pools=rank_pools) == 0
    out = capsys.readouterr().out
    assert "inputs: pixel_values (2, 3, 32, 32)" in out and "2 ranks: PASS" in out


@pytest.mark.parametrize("name", ["ModernBertModel", "T5ForConditionalGeneration"])
def test_check_passes_where_the_vocabulary_was_shrunk_under_the_pad_id(name, rank_pools, capsys):
    assert run_check(name, [2], pools=rank_pools) == 0
    out = capsys.readouterr().out
    assert "2 ranks: PASS" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Phi3ForCausalLM", "Olmo2ForCausalLM"])
def test_check_passes_through_a_tp_plan_whose_gathers_tpcore_leaves_out(name, rank_pools, capsys):
    assert run_check(name, [2], pools=rank_pools) == 0
    assert "2 ranks: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["ResNetModel"])  # no plugin, no tp plan, no structural split
def test_check_a_model_no_policy_covers_says_so_before_any_rank_starts(name, spawned, capsys):
    assert run_check(name, [2]) == 2
    out = capsys.readouterr().out
    assert f"No installed tpcore policy covers {name}" in out and "inputs:" not in out
    assert spawned == []


class RaisesOnTheRanks(BertPolicy):
    """Broken on purpose: its per-rank attributes raise a KeyError once a process group exists (on the ranks)."""

    @staticmethod
    def replace_arguments(config, world_size):
        if torch.distributed.is_initialized():
            raise KeyError("no such head count on the ranks")
        return BertPolicy.replace_arguments(config, world_size)


def test_a_rank_exception_comes_out_as_its_own_type(rank_pools, capsys):
    config = bert_config()
    spec = ModelSpec(transformers.BertModel, config, seed=0)
    inputs = {"input_ids": torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))}
    with pytest.raises(KeyError, match="no such head count on the ranks") as raised:
        check_equivalence(spec, inputs, world_sizes=(2,), policies=[RaisesOnTheRanks], pools=rank_pools)
    assert isinstance(raised.value.__cause__, WorkerError)
    assert "replace_arguments" in raised.value.__cause__.remote_traceback  # the rank's traceback as the cause
    assert run_check("BertModel", [2], policies=[RaisesOnTheRanks], pools=rank_pools) == 1
    assert "2 ranks: ERROR KeyError: 'no such head count on the ranks'" in capsys.readouterr().out
