"""Models no plugin covers work from their config's ``base_model_tp_plan``, equivalently."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.parallel.layers import ColumnSplitRMSNorm
from tpcore.plan import class_for
from tpcore.select.auto import AutoPolicy
from tpcore.select.plugins import reset_plugins
from tpcore.testing import ModelSpec, check_equivalence
from tpcore.testing.samples import small_config

SIZES = dict(
    vocab_size=64,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    head_dim=12,
    pad_token_id=0,
)
#: (config class, causal-LM class[, more config]): architectures outside tpcore's plugins, with a tp plan
DERIVED = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "Granite": ("GraniteConfig", "GraniteForCausalLM"),
    "Cohere": ("CohereConfig", "CohereForCausalLM"),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "OLMo": ("OlmoConfig", "OlmoForCausalLM"),
    "Helium": ("HeliumConfig", "HeliumForCausalLM"),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    # gathered outputs followed without the gather: packed q|k|v and gate|up (Phi-3), full-width q/k norms
    "Phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "GLM": ("GlmConfig", "GlmForCausalLM"),
}
QUICK = set(DERIVED) - {"OLMo2", "OLMoE", "GLM"}  # the newer ones are slow but Phi-3, the one quick case

#: the ones normalizing their whole q/k width: key/value heads replicated over the ranks must be equally so
FULL_WIDTH_NORMS = {"OLMo2", "OLMoE"}


def spec_for(config_class: str, model_class: str, more: dict | None = None, seed: int = 1, **sizes) -> ModelSpec:
    if not hasattr(transformers, model_class):  # newer than the oldest transformers tpcore supports
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    config = getattr(transformers, config_class)(**{**SIZES, **(more or {}), **sizes})
    config._experts_implementation = "eager"
    return ModelSpec(getattr(transformers, model_class), config, seed)


def batch() -> dict:
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a in QUICK else pytest.mark.slow) for a in DERIVED])
def test_a_model_with_a_tp_plan_splits_without_a_plugin(rank_pools, arch):
    """Logits at 2 ranks (KV heads split) and 4 ranks (replicated); 16 greedy tokens identical."""
    spec = spec_for(*DERIVED[arch])
    assert "tp plan" in AutoPolicy().get_policy(spec.build())[0].policy_name()
    report = check_equivalence(spec, batch(), world_sizes=(2, 4), pools=rank_pools)
    assert sorted(report) == [2, 4]
    tokens = {**batch(), "max_new_tokens": 16, "do_sample": False}
    check_equivalence(spec, tokens, world_sizes=(2,), pools=rank_pools, method="generate", rtol=0)


def test_a_plan_with_styles_tpcore_cannot_follow_is_refused_clearly():
    model = spec_for("Qwen3Config", "Qwen3ForCausalLM").build()
    model.config.base_model_tp_plan = {"layers.*.mlp.experts.zero": "moe_identity_expert"}
    with pytest.raises(tpcore.UnsupportedModelError, match=r"No policy could be derived: .*'moe_identity_expert'"):
        AutoPolicy().get_policy(model)


@pytest.mark.parametrize(
    ("config_class", "model_class", "why"),
    [
        # the plan cuts qkv_proj by columns, but the forward reshapes its output into 4 fixed blocks
        ("CodeGenConfig", "CodeGenForCausalLM", r"CodeGen.*does not follow its tp plan: .*mp_num"),
        # dt_proj is row-split, yet each local head reads its own gate from the whole output
        ("DogeConfig", "DogeForCausalLM", r"Doge.*does not follow its tp plan: its dt_proj"),
        # sliding-window layers double their key/value heads: the config's head counts are wrong for them
        (
            "MiMoV2FlashConfig",
            "MiMoV2FlashForCausalLM",
            r"layers.1.self_attn groups 1 query heads per key/value head, its config 2",
        ),
        # its plan names MLP linears its MoE blocks lack, and a split input without the gather before it
        (
            "MuseSparkTextConfig",
            "MuseSparkTextModel",
            r"rules of its tp plan that a split forward follows name no tensor of its blocks",
        ),
    ],
)
def test_a_plan_that_no_split_can_follow_is_refused_naming_why(config_class, model_class, why):
    if not hasattr(transformers, model_class):  # newer than the oldest transformers tpcore supports
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    model = getattr(transformers, model_class)(small_config(getattr(transformers, config_class)(), (2,)))
    with pytest.raises(tpcore.UnsupportedModelError, match=why):
        AutoPolicy().get_policy(model)


def test_a_full_width_q_norm_after_a_split_projection_must_be_an_rms_norm():
    """ESM C normalizes the whole q/k width with LayerNorms after projections its plan splits: refused
    before any rank starts (a column-split norm is an RMSNorm)."""
    if not hasattr(transformers, "EsmcModel"):
        pytest.skip(f"transformers {transformers.__version__} has no EsmcModel")
    model = transformers.EsmcModel(small_config(transformers.EsmcConfig(), (2,)))
    with pytest.raises(tpcore.ShardingError, match=r"self_attn.q_norm: no column-split norm for a EsmcLayerNorm"):
        tpcore.TensorReplacer(model, None, False, 2, rank=0).validate()


def test_gathered_outputs_are_split_by_their_parts_without_a_gather():
    """Phi-3's packed q|k|v is cut by its unequal parts and gate|up by its halves; OLMo 2's full-width q/k
    norms become column-split norms, and world sizes that would replicate its KV heads unequally are refused."""
    phi3 = tpcore.TensorReplacer(spec_for(*DERIVED["Phi3"]).build(), None, False, 3, rank=0).split_plan()
    width = SIZES["head_dim"]
    qkv = [phi3.shard_shape("model.layers.0.self_attn.qkv_proj.weight", rank)[0] // width for rank in range(3)]
    assert qkv == [1 + 1 + 1, 1 + 1 + 1, 2 + 1 + 1]  # query heads with their one key and one value head
    assert phi3.attributes["model.layers.0.self_attn.config"][2].num_attention_heads == 2
    assert phi3.shard_shape("model.layers.0.mlp.gate_up_proj.weight", 1)[0] == 2 * 21  # 64 = 22 + 21 + 21 per half
    olmo2 = spec_for(*DERIVED["OLMo2"]).build()
    plan = tpcore.TensorReplacer(olmo2, None, False, 4, rank=0).split_plan()
    q_norm = "model.layers.0.self_attn.q_norm"
    assert issubclass(class_for(olmo2.get_submodule(q_norm), plan.replacements[q_norm]), ColumnSplitRMSNorm)
    assert plan.shard_shape("model.layers.0.self_attn.k_norm.weight", 3) == (width,)
    with pytest.raises(tpcore.ShardingError, match=r"over 3 ranks its 2 key/value heads would be held by unequally"):
        tpcore.TensorReplacer(olmo2, None, False, 3, rank=0).validate()


def test_a_projection_with_one_feature_per_head_is_dealt_with_the_query_heads(rank_pools):
    """Laguna's output gate ``g_proj`` (hidden -> one value per query head) follows the query heads, 4 in 2
    key/value groups over 3 ranks: 1 + 1 + 2 heads, as q_proj's rows and o_proj's columns."""
    more = {
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    }
    spec = spec_for("LagunaConfig", "LagunaForCausalLM", more)
    plan = tpcore.TensorReplacer(spec.build(), None, False, 3, rank=0).split_plan()
    attention = "model.layers.0.self_attn"
    gates = [plan.shard_shape(f"{attention}.g_proj.weight", rank)[0] for rank in range(3)]
    queries = [plan.shard_shape(f"{attention}.q_proj.weight", rank)[0] // SIZES["head_dim"] for rank in range(3)]
    assert gates == queries == [1, 1, 2]
    assert sorted(check_equivalence(spec, batch(), world_sizes=(3,), pools=rank_pools)) == [3]


def test_a_hybrid_stack_rewrites_head_counts_only_in_the_blocks_holding_the_split_attention(rank_pools):
    """MiniMax alternates softmax and lightning attention in blocks of one class: the first's head counts
    are rewritten, the lightning attention (no rule names its modules) stays whole with its own."""
    spec = spec_for(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {"layer_types": ["full_attention", "linear_attention"], "num_local_experts": 2, "num_experts_per_tok": 1},
    )
    plan = tpcore.TensorReplacer(spec.build(), None, False, 2, rank=0).split_plan()
    rewritten = {path for path in plan.attributes if ".self_attn." in path}
    assert rewritten == {"model.layers.0.self_attn.num_key_value_groups"}
    assert (
        plan.shard_shape("model.layers.1.self_attn.qkv_proj.weight")
        == plan.shapes["model.layers.1.self_attn.qkv_proj.weight"]
    )
    assert sorted(check_equivalence(spec, batch(), world_sizes=(2,), pools=rank_pools)) == [2]


def test_a_plugin_policy_wins_over_the_derived_one(monkeypatch):
    model = spec_for("LlamaConfig", "LlamaForCausalLM").build()
    reset_plugins()
    try:
        assert AutoPolicy().get_policy(model)[0].__name__ == "LlamaPolicy"  # tp-gpt's
        monkeypatch.setenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
        reset_plugins()
        (derived,) = AutoPolicy().get_policy(model)
        assert derived.policy_name() == "LlamaDecoderLayer (tp plan of llama)"
    finally:
        monkeypatch.delenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD")
        reset_plugins()


def test_derived_heads_are_dealt_with_their_kv_heads_and_more_ranks_than_heads_are_refused():
    model = spec_for("Qwen3Config", "Qwen3ForCausalLM").build()  # 4 query heads, 2 KV heads
    plan = tpcore.TensorReplacer(model, None, False, 3, rank=0).split_plan()
    width = model.config.head_dim
    q_rows = [plan.shard_shape("model.layers.0.self_attn.q_proj.weight", rank)[0] // width for rank in range(3)]
    k_rows = [plan.shard_shape("model.layers.0.self_attn.k_proj.weight", rank)[0] // width for rank in range(3)]
    assert q_rows == [1, 1, 2] and k_rows == [1, 1, 1]  # KV head 0 shared by ranks 0 and 1, KV head 1 on rank 2
    assert plan.attributes["model.layers.0.self_attn.num_key_value_groups"] == tpcore.PerRank((1, 1, 2))
    with pytest.raises(tpcore.ShardingError, match=r"Qwen3ForCausalLM over 5 ranks.*o_proj.*heads are fewer than the"):
        tpcore.TensorReplacer(model, None, False, 5, rank=0).validate()


@st.composite
def derived_cases(draw):
    arch = draw(st.sampled_from(list(DERIVED)))
    world_size = draw(st.sampled_from([1, 2, 3, 4, 5]))
    heads = draw(st.integers(world_size, 2 * world_size))  # the ranks mostly do not divide them
    equal_copies = arch in FULL_WIDTH_NORMS  # KV heads fewer than the ranks must divide them
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    kv_heads = draw(st.sampled_from([d for d in divisors if not (equal_copies and d < world_size and world_size % d)]))
    head_dim = draw(st.sampled_from([4, 8]))
    intermediate = draw(st.integers(world_size, 16 * world_size))
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    return arch, world_size, heads, kv_heads, head_dim, intermediate, lengths, seq, draw(st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=derived_cases())
def test_random_configs_of_derived_architectures_match_unsplit(rank_pools, case):
    arch, world_size, heads, kv_heads, head_dim, intermediate, lengths, seq, seed = case
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": heads * head_dim,
        "intermediate_size": intermediate,
    }
    spec = spec_for(*DERIVED[arch], seed=seed, **sizes)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (len(lengths), seq), generator=generator)
    mask = (torch.arange(seq)[None, :] >= seq - torch.tensor(lengths)[:, None]).long()
    report = check_equivalence(
        spec, {"input_ids": ids * mask, "attention_mask": mask}, world_sizes=(world_size,), pools=rank_pools
    )
    assert report[world_size]
