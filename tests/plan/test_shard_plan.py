"""The shard plan: built and validated once, applied to any copy of the model, the same cut everywhere.

Single-process: every rank's shard is built here with an explicit rank, no process group.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tp_bert.policies import BertPolicy
from tp_gpt.policies import GPT2Policy
from transformers import AlbertConfig, AlbertModel, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel
from transformers.models.albert.modeling_albert import AlbertLayer

from tpcore import Layer, Policy, ShardingError, TensorReplacer, divide, share
from tpcore.authoring.policy import IfHeld
from tpcore.configs import config_of
from tpcore.cut.shares import resolve
from tpcore.cut.split import Split
from tpcore.load.skeleton import named_tensors, weightless_copy
from tpcore.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from tpcore.plan import apply_plan, log_plan, plan_for, replicated_warning, report


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def bert(**overrides) -> BertModel:
    options = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=48)
    options.update(overrides)
    return randomize(BertModel(BertConfig(max_position_embeddings=16, **options)))


def gpt2(vocab_size: int = 61) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=24, n_layer=2, n_head=6)
    return randomize(GPT2LMHeadModel(config))


def state(model: torch.nn.Module) -> dict:
    return {name: tensor.clone() for name, tensor in named_tensors(model).items()}


@pytest.mark.parametrize("world", [2, 3])
def test_building_a_plan_changes_nothing_and_applying_it_cuts_what_share_cuts(world):
    model = gpt2()
    before = state(model)
    classes = [type(module) for module in model.modules()]
    plan = plan_for(model, [GPT2Policy], world)
    assert [type(module) for module in model.modules()] == classes
    assert all(torch.equal(before[name], tensor) for name, tensor in named_tensors(model).items())
    for rank in range(world):
        shard = apply_plan(plan, copy.deepcopy(model), rank)
        for name, tensor in named_tensors(shard).items():
            expected = plan.shard(name, before[name], rank)
            assert tensor.shape == plan.shard_shape(name)
            assert torch.equal(tensor, expected), name


def test_the_plan_applies_to_a_meta_skeleton_with_the_shapes_of_the_real_shard():
    model = gpt2()
    plan = plan_for(model, [GPT2Policy], 3)
    skeleton = apply_plan(plan, weightless_copy(model), 1)
    real = apply_plan(plan, copy.deepcopy(model), 1)
    assert {n: t.shape for n, t in named_tensors(skeleton).items()} == {
        n: t.shape for n, t in named_tensors(real).items()
    }
    assert [type(m) for m in skeleton.modules()] == [type(m) for m in real.modules()]
    assert all(t.device.type == "meta" for t in skeleton.parameters())


def test_the_seed_api_and_the_plan_give_the_same_shard():
    model = bert()
    by_replacer = copy.deepcopy(model)
    TensorReplacer(by_replacer, None, False, 2, [BertPolicy], rank=1).replace_modules()
    by_plan = apply_plan(plan_for(model, [BertPolicy], 2), copy.deepcopy(model), 1)
    for (name, a), (_, b) in zip(named_tensors(by_replacer).items(), named_tensors(by_plan).items(), strict=True):
        assert torch.equal(a, b), name
    assert type(by_plan.encoder.layer[0].output.dense) is RowParallelLinear
    assert type(by_plan.embeddings.word_embeddings) is VocabParallelEmbedding
    assert by_plan.encoder.layer[0].attention.self.num_attention_heads == 3


def test_a_plan_refuses_a_model_it_was_not_built_for():
    plan = plan_for(bert(), [BertPolicy], 2)
    with pytest.raises(ValueError, match="this plan of BertModel cuts"):
        apply_plan(plan, bert(hidden_size=12, num_attention_heads=6), 0)


class NoHeadsPolicy(BertPolicy):
    """Names no heads on its projections (cut as plain features) and rewrites head counts with ``//``."""

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            "attention.self.num_attention_heads": config.num_attention_heads // world_size,
            "attention.self.all_head_size": config.hidden_size // world_size,
        }

    @staticmethod
    def attn_qkv():
        return [
            Layer(weight=f"attention.self.{n}.weight", bias=f"attention.self.{n}.bias")
            for n in ("query", "key", "value")
        ]

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.output.dense.weight", bias="attention.output.dense.bias")]


class MarkedOnlyPolicy(BertPolicy):
    """Rewrites ``attention.self.tag`` only in the layers that hold an ``attention.self.marker`` module."""

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            **BertPolicy.replace_arguments(config, world_size),
            "attention.self.tag": IfHeld("cut", "attention.self.marker"),
        }


def test_a_value_if_held_is_set_only_in_the_layer_instances_holding_its_module():
    model = bert()
    for layer in model.encoder.layer:
        layer.attention.self.tag = "whole"
    model.encoder.layer[1].attention.self.marker = torch.nn.Identity()
    plan = plan_for(model, [MarkedOnlyPolicy], 2)
    assert {path: value for path, value in plan.attributes.items() if path.endswith(".tag")} == {
        "encoder.layer.1.attention.self.tag": "cut"
    }
    assert plan.attributes["encoder.layer.0.attention.self.num_attention_heads"] == 3  # the others as before
    shard = apply_plan(plan, copy.deepcopy(model), 0)
    assert [layer.attention.self.tag for layer in shard.encoder.layer] == ["whole", "cut"]


class GroupsIfHeldPolicy(BertPolicy):
    """Rewrites ``attention.self.groups`` where the layer has that attribute (a layer of another version)."""

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            **BertPolicy.replace_arguments(config, world_size),
            "attention.self.groups": IfHeld(1, "attention.self.groups"),
        }


def test_a_value_if_held_is_set_only_in_the_layer_instances_holding_its_attribute():
    model = bert()
    model.encoder.layer[0].attention.self.groups = 2
    plan = plan_for(model, [GroupsIfHeldPolicy], 2)  # layer 1 lacks the attribute: no error, left alone
    assert {path: value for path, value in plan.attributes.items() if path.endswith(".groups")} == {
        "encoder.layer.0.attention.self.groups": 1
    }
    shard = apply_plan(plan, copy.deepcopy(model), 0)
    assert shard.encoder.layer[0].attention.self.groups == 1
    assert not hasattr(shard.encoder.layer[1].attention.self, "groups")


def test_heads_that_do_not_stay_whole_are_refused_before_anything_changes():
    model = bert()  # 6 heads of width 4; 24 features cut in 4 are 6 each: one and a half heads
    before = state(model)
    with pytest.raises(
        ShardingError, match=r"BertModel over 4 ranks.*query.*1.5 heads of width 4.*heads must stay whole"
    ):
        TensorReplacer(model, None, False, 4, [NoHeadsPolicy], rank=0).validate()
    assert all(torch.equal(before[name], tensor) for name, tensor in named_tensors(model).items())
    plan_for(model, [NoHeadsPolicy], 3)  # 6 heads over 3 ranks: whole heads, accepted
    plan_for(model, [BertPolicy], 4)  # the policy that names the heads deals them: 2, 2, 1, 1


class BrokenPolicy(BertPolicy):
    @staticmethod
    def replace_arguments(config, world_size):
        return {"attention.self.num_attention_heads": config.heads_that_do_not_exist}


def test_an_exception_from_a_policy_keeps_its_type_and_names_model_policy_and_layer():
    with pytest.raises(AttributeError) as caught:
        plan_for(bert(), [BrokenPolicy], 2)
    (note,) = caught.value.__notes__
    assert "BertModel over 2 ranks" in note and "encoder.layer.0" in note and "BrokenPolicy" in note


def test_one_tensor_cut_two_ways_is_refused():
    class CutsTheEmbedding(Policy):
        layer_class = GPT2LMHeadModel

        @staticmethod
        def attn_qkv():
            return [Layer(weight="transformer.wte.weight"), Layer(weight="lm_head.weight", reversed=True)]

    with pytest.raises(ShardingError, match="lm_head.weight.*is cut as"):
        plan_for(gpt2(62), [CutsTheEmbedding], 2, vocab_parallel=False)


def test_the_report_says_what_is_cut_how_and_the_bytes_per_rank():
    model = gpt2()
    text = report(plan_for(model, [GPT2Policy], 2))
    assert text.startswith("GPT2LMHeadModel over 2 ranks:")
    assert "transformer.h.*.attn.c_attn.weight" in text and "x2" in text
    assert "vocabulary rows" in text and "replicated" in text
    whole = sum(t.numel() * t.element_size() for t in named_tensors(model).values())
    assert whole < 2**20 and f"of {whole / 2**10:.1f} KiB" in text  # sizes under a MiB in KiB
    plan = plan_for(model, [GPT2Policy], 2)
    share, replicated = plan.bytes_per_rank(0) / whole, plan.replicated_bytes / 2**10
    assert text.endswith(f" ({share:.0%}; {replicated:.1f} KiB replicated on every rank)")


# -- what stays whole, and why ----------------------------------------------------------------------


class NormalizedEmbedding(torch.nn.Embedding):
    """An embedding whose forward normalizes the rows it looks up: not a lookup times one scale."""

    def forward(self, ids):
        return torch.nn.functional.normalize(super().forward(ids), dim=-1)


class TableReader(torch.nn.Module):
    """A module that reads an embedding table of another module."""

    def __init__(self, table):
        super().__init__()
        self.weight = table


def test_a_plan_says_why_each_tensor_it_does_not_cut_stays_whole():
    plan = plan_for(gpt2(), [GPT2Policy], 2, vocab_parallel=False)
    assert set(plan.kept_whole) == set(plan.shapes) - set(plan.splits)
    assert plan.kept_whole["transformer.wte.weight"] == ("Embedding", "vocab_parallel=False")
    assert plan.kept_whole["transformer.wpe.weight"] == (
        "Embedding",
        "outside the layers the policies split (GPT2Block)",
    )
    assert plan.kept_whole["transformer.h.1.attn.c_proj.bias"] == ("Conv1D", "GPT2Policy does not cut it")
    assert "transformer.h.1.attn.c_attn.weight" not in plan.kept_whole


def test_much_replicated_is_one_warning_naming_the_largest_and_why(caplog):
    model = gpt2()
    plan = plan_for(model, [GPT2Policy], 2, vocab_parallel=False)
    log_plan(plan)
    (warning,) = [record for record in caplog.records if record.levelno == logging.WARNING]
    whole = sum(t.numel() * t.element_size() for t in named_tensors(model).values())
    replicated = whole - sum(t.numel() * t.element_size() for n, t in named_tensors(model).items() if n in plan.splits)
    assert warning.name == "tpcore.plan" and warning.getMessage().splitlines() == [
        f"GPT2LMHeadModel over 2 ranks: {replicated / 2**10:.1f} KiB of its {whole / 2**10:.1f} KiB "
        f"({replicated / whole:.0%}) stays whole on every rank; the largest:",
        "    transformer.wte (Embedding, 5.7 KiB) is replicated: vocab_parallel=False",
        "    transformer.wpe (Embedding, 1.5 KiB) is replicated: outside the layers the policies split (GPT2Block)",
        "    transformer.h.*.ln_1 (LayerNorm x2, 0.4 KiB) is replicated: GPT2Policy does not cut it",
    ]


def test_an_embedding_that_cannot_be_split_over_the_vocabulary_is_named_with_why():
    model = gpt2()
    model.transformer.wte.__class__ = NormalizedEmbedding  # tied to lm_head still
    plan = plan_for(model, [GPT2Policy], 2)
    assert "transformer.wte.weight" not in plan.splits and not plan.vocab  # the tied head stays whole with it
    assert replicated_warning(plan).splitlines()[1] == (
        "    transformer.wte (NormalizedEmbedding, 5.7 KiB) is replicated: the forward of NormalizedEmbedding "
        "is not a lookup times one scale, which is what splits over the vocabulary"
    )


def test_an_embedding_another_module_reads_is_named_with_its_reader():
    model = gpt2()
    model.reader = TableReader(model.transformer.wte.weight)
    plan = plan_for(model, [GPT2Policy], 2)
    assert replicated_warning(plan).splitlines()[1] == (
        "    transformer.wte (Embedding, 5.7 KiB) is replicated: reader (TableReader) reads its tensors too"
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_nothing_is_said_when_the_vocabulary_is_split_or_there_is_one_rank(caplog, world_size):
    plan = plan_for(gpt2(), [GPT2Policy], world_size, vocab_parallel=world_size == 2)
    log_plan(plan)
    assert replicated_warning(plan) is None
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


class AlbertLayerPolicy(Policy):
    layer_class = AlbertLayer

    @staticmethod
    def replace_arguments(config, world_size):
        heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
        return {
            "attention.num_attention_heads": heads,
            "attention.all_head_size": heads * config.hidden_size // config.num_attention_heads,
        }

    @staticmethod
    def attn_qkv():
        return [
            Layer(weight=f"attention.{name}.weight", bias=f"attention.{name}.bias")
            for name in ("query", "key", "value")
        ]

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.dense.weight", bias="attention.dense.bias")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="ffn.weight", bias="ffn.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="ffn_output.weight", bias="ffn_output.bias")]


def test_a_layer_reached_through_several_paths_is_split_once():
    config = AlbertConfig(vocab_size=40, embedding_size=8, hidden_size=16, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    model = randomize(AlbertModel(config))
    shared = model.encoder.albert_layer_groups[0].albert_layers[0]
    model.encoder.albert_layer_groups[0].albert_layers.append(shared)  # a second path to the same layer
    shards = [apply_plan(plan_for(model, [AlbertLayerPolicy], 2), copy.deepcopy(model), r) for r in range(2)]
    for shard in shards:
        layer = shard.encoder.albert_layer_groups[0].albert_layers[0]
        assert layer.attention.query.weight.shape == (8, 16) and layer.ffn.weight.shape == (16, 16)
        assert shard.encoder.albert_layer_groups[0].albert_layers[1] is layer


def test_each_layer_reads_the_config_of_its_own_sub_model():
    model = bert()
    layer_name = "encoder.layer.1"
    assert config_of(model, layer_name) is model.config
    assert config_of(model, "") is model.config
    assert isinstance(plan_for(model, [BertPolicy], 2).splits["encoder.layer.1.attention.self.query.weight"], Split)


def test_a_per_head_parameter_left_whole_while_heads_are_cut_is_refused():
    from transformers import CohereConfig, CohereForCausalLM
    from transformers.models.cohere.modeling_cohere import CohereDecoderLayer

    class ForgetsTheNorms(Policy):
        layer_class = CohereDecoderLayer

        @staticmethod
        def attn_qkv():
            return [Layer(weight=f"self_attn.{name}_proj.weight", heads="num_key_value_heads") for name in "kv"] + [
                Layer(weight="self_attn.q_proj.weight")
            ]

        @staticmethod
        def attn_out():
            return [Layer(weight="self_attn.o_proj.weight")]

    config = CohereConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, use_qk_norm=True)  # fmt: skip
    model = CohereForCausalLM(config).eval()
    with pytest.raises(ShardingError, match=r"self_attn.q_norm.weight.*per-head parameter of shape \(4, 8\)"):
        plan_for(model, [ForgetsTheNorms], 2)
    plan = TensorReplacer(model, None, False, 2, rank=0).split_plan()  # its tp plan, with the norms following the heads
    assert plan.shard_shape("model.layers.0.self_attn.q_norm.weight") == (2, 8)


# -- blocks of one class with counts of their own (Policy.layer_config) ---------------------------


class StageBlock(torch.nn.Module):
    """Heads of ``head_dim`` features merged then projected back: ``o(q(x))``, row-parallel in ``o``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.q, self.o = torch.nn.Linear(width, width), torch.nn.Linear(width, width)


class Stages(torch.nn.Module):
    """Blocks of one class at widths and head counts of their own (Swin's stages)."""

    def __init__(self, stages: list[tuple[int, int]]):
        super().__init__()
        self.config = None  # no count of the model's own applies to every block
        self.blocks = torch.nn.ModuleList(StageBlock(width, heads) for width, heads in stages)


class StagePolicy(Policy):
    layer_class = StageBlock

    @classmethod
    def layer_config(cls, config, layer):
        return SimpleNamespace(hidden_size=layer.q.in_features, num_attention_heads=layer.num_heads)

    @staticmethod
    def replace_arguments(config, world_size):
        return {"num_heads": share(config.num_attention_heads, world_size, "num_attention_heads")}

    @staticmethod
    def attn_qkv():
        return [Layer("q.weight", "q.bias", heads="num_attention_heads")]

    @staticmethod
    def attn_out():
        return [Layer("o.weight", "o.bias", heads="num_attention_heads")]


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(1, 4),
    stages=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_blocks_of_one_class_are_each_cut_by_their_own_heads_and_their_pieces_sum_to_the_whole(world, stages, seed):
    """Each block's ``layer_config`` gives its own heads and width: every rank holds whole heads of that
    block (``share(heads_i, N)`` of ``head_dim_i`` rows), and the ranks' row-parallel partial sums
    ``o_r(q_r(x))`` add up to the whole block's ``o(q(x))``."""
    sizes = [(max(heads, world) * head_dim, max(heads, world)) for heads, head_dim in stages]
    model = Stages(sizes)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    plan = plan_for(model, [StagePolicy], world)
    for index, (width, heads) in enumerate(sizes):
        block, name = model.blocks[index], f"blocks.{index}"
        x = torch.randn(3, width, generator=generator)
        partial = torch.zeros(3, width)
        for rank in range(world):
            rows = plan.shard(f"{name}.q.weight", block.q.weight, rank)
            own_heads = resolve(plan.attributes[f"{name}.num_heads"], rank)
            assert rows.shape == (own_heads * (width // heads), width)
            q = x @ rows.T + plan.shard(f"{name}.q.bias", block.q.bias, rank)
            partial += q @ plan.shard(f"{name}.o.weight", block.o.weight, rank).T
        assert sum(resolve(plan.attributes[f"{name}.num_heads"], r) for r in range(world)) == heads
        expected = block.q(x) @ block.o.weight.T
        assert torch.allclose(partial, expected, atol=1e-4 * max(1.0, expected.abs().max().item()))
