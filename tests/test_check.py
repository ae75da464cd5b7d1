"""``tpcore check`` and the equivalence checker's failure reports."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn
from tp_bert.policies import BertPolicy

from tpcore import Layer
from tpcore.cli import main
from tpcore.testing import EquivalenceError, ModelSpec, check_equivalence


def test_check_a_class_covered_by_a_tp_plan_passes(capsys):
    assert main(["check", "Qwen3ForCausalLM", "--world-sizes", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "policy Qwen3DecoderLayer (tp plan of qwen3) from the config tp plan" in out
    assert "1 ranks: PASS" in out and "2 ranks: PASS" in out and out.rstrip().endswith("PASS")


def test_check_a_saved_model_directory_names_the_plugin(tmp_path, capsys):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--world-sizes", "2", "3"]) == 1
    out = capsys.readouterr().out
    assert "policy BertPolicy from tp-bert" in out
    assert "2 ranks: PASS" in out
    assert "3 ranks: REFUSED cannot split BertForMaskedLM over 3 ranks" in out


def test_check_an_uncovered_model_explains_and_fails(capsys):
    assert main(["check", "MixtralForCausalLM"]) == 2
    assert "'moe_tp_experts', which tpcore does not follow" in capsys.readouterr().out


def test_check_rejects_what_is_neither_a_directory_nor_a_class():
    with pytest.raises(SystemExit, match="neither a saved model directory nor a transformers model class"):
        main(["check", "NoSuchModel"])


class ForgetsTheAllReduce(BertPolicy):
    """Broken on purpose: the attention output stays a plain Linear, so its partial sums are never added."""

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.output.dense.weight", bias="attention.output.dense.bias", replace=nn.Linear)]


def test_a_broken_policy_fails_naming_output_world_size_rank_and_amount(rank_pools):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    spec = ModelSpec(transformers.BertModel, config, seed=0)
    inputs = {"input_ids": torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))}
    expected = r"BertModel split over 2 ranks, rank 0: last_hidden_state: max abs diff"
    with pytest.raises(EquivalenceError, match=expected):
        check_equivalence(spec, inputs, world_sizes=(2,), policies=[ForgetsTheAllReduce], pools=rank_pools)


def test_check_model_draws_inputs_and_passes_for_a_good_policy(tp_check):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    tp_check(transformers.BertForMaskedLM, config, world_sizes=(2, 4), max_examples=5)


def test_check_model_finds_a_broken_policy(tp_check):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
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
    assert q_proj["per_rank"] == [q_proj["shape"][0] // 2, q_proj["shape"][1]] and q_proj["cut"] == "cut dim 0"
    assert main(["plugins", "--model", "LlamaForCausalLM", "--world-size", "3"]) == 2  # 4 heads over 3 ranks
    assert "cannot split LlamaForCausalLM over 3 ranks" in capsys.readouterr().out
    assert main(["plugins", "--model", "MixtralForCausalLM"]) == 2
