"""Single-process tests of :class:`tpcore.TensorReplacer`: every rank sliced with an explicit ``rank=``.

No process group: each rank's shard is built in this process from a copy of the same model, so the
shards can be compared with the whole model and a row-parallel all-reduce simulated by a sum.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tp_bert.policies import BertPolicy
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.pytorch_utils import Conv1D

from tpcore import Layer, Policy, ShardingError, TensorReplacer, divide
from tpcore.compat.parallelformers import shard
from tpcore.parallel.layers import RowParallelConv1D, RowParallelLinear
from tpcore.testing import random_weights

HEADS, HEAD_DIM, INTERMEDIATE = 12, 2, 48  # 12 heads and 48 MLP features divide over 1, 2, 3, 4 ranks
HIDDEN = HEADS * HEAD_DIM
WORLDS = [2, 3, 4]
ATOL, RTOL = 1e-6, 1.3e-6  # fp32: sums over shards add in another order than the whole matmul


def make_bert(**overrides) -> BertModel:
    options = dict(
        vocab_size=32,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=16,
        type_vocab_size=2,
    )
    options.update(overrides)
    return random_weights(BertModel(BertConfig(**options)).eval(), seed=1234)


def make_gpt2() -> GPT2Model:
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=HEADS, bos_token_id=0, eos_token_id=0
    )
    return random_weights(GPT2Model(config).eval(), seed=1234)


@pytest.fixture(scope="module")
def bert() -> BertModel:
    """A small BertModel, built once for the module."""
    return make_bert()


def split(model: nn.Module, world: int, rank: int, policies=(BertPolicy,)) -> nn.Module:
    shard = copy.deepcopy(model)
    result = TensorReplacer(shard, None, False, num_gpus=world, custom_policies=list(policies), rank=rank)
    assert result.replace_modules() is shard
    return shard


def all_ranks(model: nn.Module, world: int, policies=(BertPolicy,)) -> list[nn.Module]:
    return [split(model, world, rank, policies) for rank in range(world)]


# -- BERT: shards, sizes, classes ---------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_bert_weight_shards_concatenate_to_the_original(bert, world):
    shards = all_ranks(bert, world)
    for index, whole in enumerate(bert.encoder.layer):
        layers = [shard.encoder.layer[index] for shard in shards]
        for name in ("query", "key", "value"):
            for kind in ("weight", "bias"):
                pieces = [getattr(getattr(layer.attention.self, name), kind) for layer in layers]
                assert torch.equal(torch.cat(pieces, dim=0), getattr(getattr(whole.attention.self, name), kind))
        column = [layer.intermediate.dense for layer in layers]
        assert torch.equal(torch.cat([m.weight for m in column], dim=0), whole.intermediate.dense.weight)
        assert torch.equal(torch.cat([m.bias for m in column], dim=0), whole.intermediate.dense.bias)
        for path in ("attention.output.dense", "output.dense"):
            rows = [layer.get_submodule(path) for layer in layers]
            original = whole.get_submodule(path)
            assert torch.equal(torch.cat([m.weight for m in rows], dim=1), original.weight)
            for module in rows:  # a row-parallel bias is not sliced
                assert torch.equal(module.bias, original.bias)


@pytest.mark.parametrize("world", WORLDS)
def test_bert_parameters_outside_the_policy_are_untouched(bert, world):
    policy_paths = {
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    }
    original = bert.state_dict()
    for rank, piece in enumerate(all_ranks(bert, world)):
        state = piece.state_dict()
        assert state.keys() == original.keys()
        for key, value in state.items():
            if key.startswith("encoder.layer.") and key.split(".", 3)[3].rpartition(".")[0] in policy_paths:
                continue
            if key == "embeddings.word_embeddings.weight":  # split over the vocabulary, outside the policy
                assert torch.equal(value, shard(original[key], 0, rank, world, pad=True))
                continue
            assert torch.equal(value, original[key]), key


@pytest.mark.parametrize("world", WORLDS)
def test_bert_module_sizes_and_attributes_are_per_rank(bert, world):
    for rank in range(world):
        shard = split(bert, world, rank)
        for layer in shard.encoder.layer:
            attention = layer.attention.self
            assert attention.num_attention_heads == HEADS // world
            assert attention.all_head_size == HIDDEN // world
            assert attention.attention_head_size == HEAD_DIM
            for name in ("query", "key", "value"):
                module = getattr(attention, name)
                assert (module.out_features, module.in_features) == (HIDDEN // world, HIDDEN)
                assert module.weight.shape == (HIDDEN // world, HIDDEN)
                assert module.bias.shape == (HIDDEN // world,)
            out = layer.attention.output.dense
            assert (out.out_features, out.in_features) == (HIDDEN, HIDDEN // world)
            assert out.weight.shape == (HIDDEN, HIDDEN // world)
            assert out.bias.shape == (HIDDEN,)
            mlp_in = layer.intermediate.dense
            assert (mlp_in.out_features, mlp_in.in_features) == (INTERMEDIATE // world, HIDDEN)
            mlp_out = layer.output.dense
            assert (mlp_out.out_features, mlp_out.in_features) == (HIDDEN, INTERMEDIATE // world)
            assert mlp_out.weight.shape == (HIDDEN, INTERMEDIATE // world)


@pytest.mark.parametrize("world", WORLDS)
def test_bert_output_projections_become_row_parallel(bert, world):
    shard = split(bert, world, world - 1)
    state = shard.state_dict()
    for index, layer in enumerate(shard.encoder.layer):
        for path in ("attention.output.dense", "output.dense"):
            module = layer.get_submodule(path)
            assert type(module) is RowParallelLinear
            assert isinstance(module, nn.Linear)
            assert module.tp_group is None
            assert isinstance(module.weight, nn.Parameter)  # still where model code reads it
            assert state[f"encoder.layer.{index}.{path}.weight"].data_ptr() == module.weight.data_ptr()
            assert state[f"encoder.layer.{index}.{path}.bias"].shape == (HIDDEN,)
        for path in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
            assert type(layer.get_submodule(path)) is nn.Linear  # column parallel needs no new class
    assert type(bert.encoder.layer[0].output.dense) is nn.Linear  # the original model is not touched


def test_bert_parameters_keep_their_identity(bert):
    model = copy.deepcopy(bert)
    before = {name: id(param) for name, param in model.named_parameters()}
    TensorReplacer(model, None, False, num_gpus=2, custom_policies=[BertPolicy], rank=1).replace_modules()
    assert {name: id(param) for name, param in model.named_parameters()} == before


def test_world_of_one_is_a_no_op_on_values(bert):
    model = copy.deepcopy(bert)
    TensorReplacer(model, None, False, num_gpus=1, custom_policies=BertPolicy).replace_modules()
    for key, value in model.state_dict().items():
        assert torch.equal(value, bert.state_dict()[key])
    assert type(model.encoder.layer[0].output.dense) is RowParallelLinear
    ids = torch.tensor([[1, 5, 7, 2]])
    torch.testing.assert_close(model(ids).last_hidden_state, bert(ids).last_hidden_state, rtol=RTOL, atol=ATOL)


def test_auto_policy_is_used_without_custom_policies(bert, monkeypatch):
    from tpcore.select.plugins import reset_plugins

    monkeypatch.delenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TPCORE_PLUGINS", raising=False)
    reset_plugins()
    try:
        model = copy.deepcopy(bert)
        replacer = TensorReplacer(model, None, False, num_gpus=2, rank=0)
        assert replacer.auto_policy() == [BertPolicy]
        replacer.replace_modules()
        assert model.encoder.layer[1].attention.self.num_attention_heads == HEADS // 2
        assert model.encoder.layer[1].intermediate.dense.weight.shape == (INTERMEDIATE // 2, HIDDEN)
    finally:
        reset_plugins()


# -- BERT: single-process simulation of the all-reduce -------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_row_parallel_linear_partial_sums_equal_the_whole_layer(bert, world):
    whole = bert.encoder.layer[0].attention.output.dense
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(world))
    expected = whole(x)
    shards = [split(bert, world, rank).encoder.layer[0].attention.output.dense for rank in range(world)]
    inputs = x.chunk(world, dim=-1)

    partial_sum = sum(F.linear(x_r, module.weight) for x_r, module in zip(inputs, shards, strict=True))
    torch.testing.assert_close(partial_sum + shards[0].bias, expected, rtol=RTOL, atol=ATOL)

    # Without a process group (a world of one) the forward is the local partial sum plus the bias.
    for x_r, module in zip(inputs, shards, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(module(x_r), F.linear(x_r, module.weight) + module.bias, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLDS)
def test_bert_layer_simulated_over_all_ranks_matches_the_whole_layer(world):
    """Attention and MLP of one BertLayer, every rank's column outputs and row partial sums, in float64."""
    model = make_bert().double()
    whole = model.encoder.layer[0]
    layers = [shard.encoder.layer[0] for shard in all_ranks(model, world)]
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    with torch.no_grad():
        expected_attention = whole.attention(x)[0]
        expected = whole(x)  # BertLayer returns a tensor in transformers 5.x
        if isinstance(expected, tuple):  # older versions return (hidden_states, ...)
            expected = expected[0]

        partial = sum(F.linear(layer.attention.self(x)[0], layer.attention.output.dense.weight) for layer in layers)
        attention = whole.attention.output.LayerNorm(partial + whole.attention.output.dense.bias + x)
        torch.testing.assert_close(attention, expected_attention, rtol=0, atol=1e-12)

        partial = sum(F.linear(layer.intermediate(attention), layer.output.dense.weight) for layer in layers)
        out = whole.output.LayerNorm(partial + whole.output.dense.bias + attention)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)

        # each rank's context holds exactly its own heads of the whole context
        context = whole.attention.self(x)[0]
        per_rank = [layer.attention.self(x)[0] for layer in layers]
        torch.testing.assert_close(torch.cat(per_rank, dim=-1), context, rtol=0, atol=1e-12)


# -- errors are raised before anything is modified ----------------------------------------------


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {key: value.clone() for key, value in model.state_dict().items()},
        "classes": {name: type(module) for name, module in model.named_modules()},
        "sizes": {
            name: (module.in_features, module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
        },
        "heads": [
            (layer.attention.self.num_attention_heads, layer.attention.self.all_head_size)
            for layer in model.encoder.layer
        ],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert after["state"][key].shape == value.shape, key
        assert torch.equal(after["state"][key], value), key
    assert after["classes"] == before["classes"]
    assert after["sizes"] == before["sizes"]
    assert after["heads"] == before["heads"]


@pytest.mark.parametrize("world", [13, 16])
def test_more_ranks_than_heads_fail_before_any_change(bert, world):
    model = copy.deepcopy(bert)
    before = snapshot(model)
    replacer = TensorReplacer(model, None, False, num_gpus=world, custom_policies=[BertPolicy], rank=0)
    with pytest.raises(ShardingError) as info:
        replacer.replace_modules()
    message = str(info.value)
    assert "BertModel" in message
    assert f"over {world} ranks" in message
    assert "attention.output.dense.weight" in message
    assert f"its {HEADS} heads are fewer than the ranks" in message
    assert_unchanged(model, before)


@pytest.mark.parametrize("world", [5, 7, 8])
def test_a_world_size_not_dividing_the_heads_deals_them_whole(bert, world):
    model = copy.deepcopy(bert)
    TensorReplacer(model, None, False, num_gpus=world, custom_policies=[BertPolicy], rank=world - 1).replace_modules()
    attention = model.encoder.layer[0].attention.self
    heads = HEADS // world  # the last ranks hold one head less than the first HEADS % world
    assert attention.num_attention_heads == heads and attention.all_head_size == heads * HEAD_DIM
    assert (
        attention.query.weight.shape == (heads * HEAD_DIM, HIDDEN) and attention.query.out_features == heads * HEAD_DIM
    )


def test_a_tensor_too_small_to_split_fails_naming_the_tensor():
    model = make_bert(num_attention_heads=4, hidden_size=16, intermediate_size=3)
    before = snapshot(model)
    with pytest.raises(ShardingError) as info:
        TensorReplacer(model, None, False, num_gpus=4, custom_policies=[BertPolicy], rank=2).replace_modules()
    message = str(info.value)
    assert "BertModel" in message
    assert "over 4 ranks" in message
    assert "'encoder.layer.0.intermediate.dense.weight'" in message
    assert "(3, 16)" in message
    assert "size 3 is smaller than the 4 ranks" in message
    assert_unchanged(model, before)


def test_a_bad_last_layer_leaves_the_earlier_layers_untouched():
    model = make_bert()
    last = model.encoder.layer[1]
    last.intermediate.dense = nn.Linear(HIDDEN, 3)  # 3 features cannot split over 4 ranks
    last.output.dense = nn.Linear(3, HIDDEN)
    before = snapshot(model)
    with pytest.raises(ShardingError, match=r"'encoder\.layer\.1\.intermediate\.dense\.weight'"):
        TensorReplacer(model, None, False, num_gpus=4, custom_policies=[BertPolicy], rank=0).replace_modules()
    assert_unchanged(model, before)


class MissingModulePolicy(BertPolicy):
    @staticmethod
    def mlp_in():
        return [Layer(weight="intermediate.dens.weight", bias="intermediate.dens.bias")]


class MissingBiasPolicy(BertPolicy):
    @staticmethod
    def mlp_out():
        return [Layer(weight="output.dense.weight", bias="output.dense.beta")]


class MissingAttributePolicy(BertPolicy):
    @staticmethod
    def replace_arguments(config, world_size):
        return {"attention.self.n_heads": divide(config.num_attention_heads, world_size, "heads")}


class MissingReplacedModulePolicy(BertPolicy):
    @staticmethod
    def replace_modules():
        return {"attention.core": nn.Identity}


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        (MissingModulePolicy, "'intermediate.dens.weight'"),
        (MissingBiasPolicy, "'output.dense.beta'"),
        (MissingAttributePolicy, "'attention.self.n_heads'"),
        (MissingReplacedModulePolicy, "'attention.core'"),
    ],
)
def test_policy_naming_a_missing_path_fails_before_any_change(bert, policy, named):
    model = copy.deepcopy(bert)
    before = snapshot(model)
    with pytest.raises(ShardingError) as info:
        TensorReplacer(model, None, False, num_gpus=2, custom_policies=[policy], rank=0).replace_modules()
    message = str(info.value)
    assert named in message
    assert "BertModel" in message
    assert "encoder.layer.0" in message
    assert policy.__name__ in message
    assert_unchanged(model, before)


def test_optional_missing_layers_are_skipped(bert):
    class OptionalPolicy(BertPolicy):
        @staticmethod
        def mlp_in():
            return [
                Layer(weight="intermediate.dense.weight", bias="intermediate.dense.bias"),
                Layer(weight="intermediate.gate.weight", ignore_checker=True),
            ]

    model = split(bert, 2, 0, policies=[OptionalPolicy])
    assert model.encoder.layer[0].intermediate.dense.out_features == INTERMEDIATE // 2


@pytest.mark.parametrize("layer_class", [GPT2Block, "transformers.models.gpt2.modeling_gpt2.GPT2Block"])
def test_policy_for_a_layer_class_the_model_lacks_fails_before_any_change(bert, layer_class):
    class ForeignPolicy(Policy):
        @staticmethod
        def mlp_in():
            return [Layer(weight="mlp.c_fc.weight", bias="mlp.c_fc.bias", reversed=True)]

    ForeignPolicy.layer_class = layer_class
    model = copy.deepcopy(bert)
    before = snapshot(model)
    with pytest.raises(ShardingError) as info:
        TensorReplacer(
            model, None, False, num_gpus=2, custom_policies=[BertPolicy, ForeignPolicy], rank=0
        ).replace_modules()
    message = str(info.value)
    assert "ForeignPolicy" in message
    assert "transformers.models.gpt2.modeling_gpt2.GPT2Block" in message
    assert "BertModel" in message
    assert_unchanged(model, before)


@pytest.mark.parametrize("bad", [int, object(), "BertPolicy", nn.Linear, None])
def test_custom_policies_must_be_policy_classes(bert, bad):
    model = copy.deepcopy(bert)
    before = snapshot(model)
    with pytest.raises(TypeError, match="custom_policies must be Policy subclasses"):
        TensorReplacer(model, None, False, num_gpus=2, custom_policies=[BertPolicy, bad], rank=0).replace_modules()
    assert_unchanged(model, before)


@pytest.mark.parametrize("bad", [BertPolicy(), "tp_bert.policies.BertPolicy"], ids=["instance", "string"])
def test_a_single_non_policy_custom_policies_value_gets_a_clear_error(bert, bad):
    model = copy.deepcopy(bert)
    message = r"custom_policies must be a Policy subclass or a list of them, got .*BertPolicy"
    with pytest.raises(TypeError, match=message):
        TensorReplacer(model, None, False, num_gpus=2, custom_policies=bad, rank=0).replace_modules()


def test_row_group_on_a_module_adding_a_bias_no_layer_names_fails_before_any_change():
    """A ``Linear`` subclass gets a row-parallel subclass of its own class, which all-reduces its output: a bias it
    adds inside its forward is then named as the Layer's bias (rank 0 alone holds it), else refused."""

    class MyLinear(nn.Linear):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 8)
            self.down = MyLinear(8, 4)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

    class BlockPolicy(Policy):
        layer_class = Block

        @staticmethod
        def mlp_in():
            return [Layer(weight="up.weight", bias="up.bias")]

        @staticmethod
        def mlp_out():
            return [Layer(weight="down.weight")]

    class ReplacingBlockPolicy(BlockPolicy):
        @staticmethod
        def mlp_out():
            return [Layer(weight="down.weight", bias="down.bias", replace=RowParallelLinear)]

    torch.manual_seed(0)
    model = Toy()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(
        ShardingError, match=r"Toy over 2 ranks: blocks\.0\.down\.bias: a .*MyLinear adds it inside its row-parallel"
    ):
        TensorReplacer(model, None, False, num_gpus=2, custom_policies=[BlockPolicy], rank=0).replace_modules()
    assert all(torch.equal(model.state_dict()[key], value) for key, value in state.items())
    assert type(model.blocks[0].up) is nn.Linear and model.blocks[0].up.out_features == 8

    TensorReplacer(model, None, False, num_gpus=2, custom_policies=[ReplacingBlockPolicy], rank=1).replace_modules()
    for block in model.blocks:
        assert type(block.down) is RowParallelLinear
        assert block.down.weight.shape == (4, 4) and block.down.in_features == 4
        assert block.up.weight.shape == (4, 4) and block.up.out_features == 4
    assert torch.equal(model.blocks[1].down.weight, state["blocks.1.down.weight"][:, 4:])
    assert torch.equal(model.blocks[1].up.bias, state["blocks.1.up.bias"][4:])

    class NamingBlockPolicy(BlockPolicy):
        @staticmethod
        def mlp_out():
            return [Layer(weight="down.weight", bias="down.bias")]

    named = Toy()
    TensorReplacer(named, None, False, num_gpus=2, custom_policies=[NamingBlockPolicy], rank=1).replace_modules()
    down = named.blocks[0].down
    assert type(down).__name__ == "RowParallelMyLinear" and down.bias.shape == (4,) and not down.bias.any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_gpus": 2}, "num_gpus=2 needs a process group"),
        ({"num_gpus": 2, "rank": 2}, "rank 2 is outside a world of 2"),
        ({"num_gpus": 3, "rank": -1}, "rank -1 is outside a world of 3"),
    ],
)
def test_bad_world_or_rank_raises(bert, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TensorReplacer(bert, None, False, custom_policies=[BertPolicy], **kwargs)


# -- GPT-2 Conv1D (reversed) with fused q|k|v, with a policy defined here -------------------------


class GPT2TestPolicy(Policy):
    layer_class = GPT2Block

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            "attn.num_heads": divide(config.n_head, world_size, "n_head"),
            "attn.split_size": divide(config.n_embd, world_size, "n_embd"),
            "attn.embed_dim": divide(config.n_embd, world_size, "n_embd"),
        }

    @staticmethod
    def attn_qkv():
        return [Layer(weight="attn.c_attn.weight", bias="attn.c_attn.bias", n_fused=3, reversed=True)]

    @staticmethod
    def attn_out():
        return [Layer(weight="attn.c_proj.weight", bias="attn.c_proj.bias", reversed=True)]

    @staticmethod
    def mlp_in():
        return [Layer(weight="mlp.c_fc.weight", bias="mlp.c_fc.bias", reversed=True)]

    @staticmethod
    def mlp_out():
        return [Layer(weight="mlp.c_proj.weight", bias="mlp.c_proj.bias", reversed=True)]


@pytest.fixture(scope="module")
def gpt2() -> GPT2Model:
    """A small GPT2Model, built once for the module."""
    return make_gpt2()


@pytest.mark.parametrize("world", WORLDS)
def test_gpt2_conv1d_sizes_and_classes(gpt2, world):
    inner = 4 * HIDDEN
    for rank in range(world):
        shard = split(gpt2, world, rank, policies=[GPT2TestPolicy])
        for block in shard.h:
            c_attn, c_proj = block.attn.c_attn, block.attn.c_proj
            assert type(c_attn) is Conv1D
            assert c_attn.weight.shape == (HIDDEN, 3 * HIDDEN // world)
            assert (c_attn.nx, c_attn.nf) == (HIDDEN, 3 * HIDDEN // world)
            assert c_attn.bias.shape == (3 * HIDDEN // world,)
            assert type(c_proj) is RowParallelConv1D and isinstance(c_proj, Conv1D)
            assert c_proj.weight.shape == (HIDDEN // world, HIDDEN)
            assert (c_proj.nx, c_proj.nf) == (HIDDEN // world, HIDDEN)
            assert c_proj.bias.shape == (HIDDEN,)
            c_fc, mlp_proj = block.mlp.c_fc, block.mlp.c_proj
            assert type(c_fc) is Conv1D
            assert c_fc.weight.shape == (HIDDEN, inner // world)
            assert (c_fc.nx, c_fc.nf) == (HIDDEN, inner // world)
            assert c_fc.bias.shape == (inner // world,)
            assert type(mlp_proj) is RowParallelConv1D
            assert mlp_proj.weight.shape == (inner // world, HIDDEN)
            assert (mlp_proj.nx, mlp_proj.nf) == (inner // world, HIDDEN)
            assert block.attn.num_heads == HEADS // world
            assert block.attn.split_size == HIDDEN // world
            assert block.attn.head_dim == HEAD_DIM


@pytest.mark.parametrize("world", WORLDS)
def test_gpt2_shards_reassemble_with_q_k_v_grouped_per_rank(gpt2, world):
    shards = all_ranks(gpt2, world, policies=[GPT2TestPolicy])
    per = HIDDEN // world
    for index, whole in enumerate(gpt2.h):
        blocks = [shard.h[index] for shard in shards]
        for part in range(3):  # q, k, v
            columns = slice(part * HIDDEN, (part + 1) * HIDDEN)
            weight = torch.cat([b.attn.c_attn.weight[:, part * per : (part + 1) * per] for b in blocks], dim=1)
            bias = torch.cat([b.attn.c_attn.bias[part * per : (part + 1) * per] for b in blocks])
            assert torch.equal(weight, whole.attn.c_attn.weight[:, columns])
            assert torch.equal(bias, whole.attn.c_attn.bias[columns])
        assert torch.equal(torch.cat([b.attn.c_proj.weight for b in blocks], dim=0), whole.attn.c_proj.weight)
        assert torch.equal(torch.cat([b.mlp.c_fc.weight for b in blocks], dim=1), whole.mlp.c_fc.weight)
        assert torch.equal(torch.cat([b.mlp.c_fc.bias for b in blocks]), whole.mlp.c_fc.bias)
        assert torch.equal(torch.cat([b.mlp.c_proj.weight for b in blocks], dim=0), whole.mlp.c_proj.weight)
        for b in blocks:
            assert torch.equal(b.attn.c_proj.bias, whole.attn.c_proj.bias)
            assert torch.equal(b.mlp.c_proj.bias, whole.mlp.c_proj.bias)

    # Outputs: rank r's fused projection splits into its own heads of q, k and v.
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q, k, v = gpt2.h[0].attn.c_attn(x).split(HIDDEN, dim=-1)
        for rank, shard in enumerate(shards):
            q_r, k_r, v_r = shard.h[0].attn.c_attn(x).split(shard.h[0].attn.split_size, dim=-1)
            heads = slice(rank * per, (rank + 1) * per)
            torch.testing.assert_close(q_r, q[..., heads], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(k_r, k[..., heads], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(v_r, v[..., heads], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLDS)
def test_gpt2_row_parallel_conv1d_partial_sums_equal_the_whole(gpt2, world):
    whole = gpt2.h[1].mlp.c_proj
    inner = 4 * HIDDEN
    x = torch.randn(3, 4, inner, generator=torch.Generator().manual_seed(world))
    shards = [split(gpt2, world, rank, policies=[GPT2TestPolicy]).h[1].mlp.c_proj for rank in range(world)]
    with torch.no_grad():
        inputs = x.chunk(world, dim=-1)
        partial = sum(x_r @ module.weight for x_r, module in zip(inputs, shards, strict=True))
        torch.testing.assert_close(partial + whole.bias, whole(x), rtol=RTOL, atol=ATOL)
        for x_r, module in zip(inputs, shards, strict=True):  # world of one: local partial plus bias
            torch.testing.assert_close(module(x_r), x_r @ module.weight + module.bias, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLDS)
def test_gpt2_attention_and_mlp_simulated_over_all_ranks_match_the_whole(world):
    """Each rank's sliced attention/MLP returns partial + bias; the sum minus the extra biases is the whole."""
    model = make_gpt2().double()
    shards = all_ranks(model, world, policies=[GPT2TestPolicy])
    x = torch.randn(2, 6, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    whole = model.h[0]
    with torch.no_grad():
        attention = sum(shard.h[0].attn(x)[0] for shard in shards) - (world - 1) * whole.attn.c_proj.bias
        torch.testing.assert_close(attention, whole.attn(x)[0], rtol=0, atol=1e-12)
        mlp = sum(shard.h[0].mlp(x) for shard in shards) - (world - 1) * whole.mlp.c_proj.bias
        torch.testing.assert_close(mlp, whole.mlp(x), rtol=0, atol=1e-12)


def test_gpt2_heads_not_divisible_fails_before_any_change(gpt2):
    model = copy.deepcopy(gpt2)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ShardingError) as info:
        TensorReplacer(model, None, False, num_gpus=5, custom_policies=GPT2TestPolicy, rank=0).replace_modules()
    message = str(info.value)
    assert "GPT2Model over 5 ranks" in message
    assert "n_head = 12" in message
    assert all(torch.equal(model.state_dict()[key], value) for key, value in state.items())
    assert model.h[0].attn.num_heads == HEADS
    assert type(model.h[0].attn.c_proj) is Conv1D


def test_two_policies_for_one_layer_class_are_refused_before_any_change(bert):
    model = copy.deepcopy(bert)
    before = snapshot(model)

    class Again(BertPolicy):
        pass

    with pytest.raises(ShardingError, match=r"policies BertPolicy and Again both apply to .*BertLayer"):
        TensorReplacer(model, None, False, num_gpus=2, custom_policies=[BertPolicy, Again], rank=0).replace_modules()
    assert_unchanged(model, before)
