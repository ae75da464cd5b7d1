"""A BERT-family model split over 1-4 gloo ranks gives the unsplit model's outputs.

Every architecture tp-bert claims is listed in ``ARCHITECTURES`` with every head transformers
ships for it. ``test_every_head`` runs each architecture's first head at world sizes 1-4 (the quick
core) and every other head over 2 and 3 ranks (an even split and a padded vocabulary; the heads
themselves are replicated); the hypothesis property draws random small configs, world sizes 2-4,
batches and padding masks from the strategies in ``tpcore.testing``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import (
    HALF_PRECISION_RTOL,
    ModelSpec,
    SavedModelSpec,
    check_equivalence,
    padded_batch,
    padded_batches,
    seeds,
    split_sizes,
    with_choices,
)
from tpcore.tools.check import run_check


@dataclass(frozen=True)
class Architecture:
    config: str
    heads: tuple[str, ...]
    #: config keyword for (hidden, heads, layers, intermediate, vocab)
    names: tuple[str, str, str, str, str] = (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
    )
    extra: dict = field(default_factory=dict)
    #: (head, inputs) -> the inputs with what else the architecture takes (VisualBERT's image regions)
    more_inputs: Callable[[str, dict], dict] | None = None
    #: the model classes' prefix, where the name is a variant's (``EsmRotary``: ``Esm``)
    prefix: str | None = None
    #: sizes -> config keywords that follow from them (MobileBERT's bottleneck width)
    derived: Callable[[dict], dict] | None = None

    def make_config(self, hidden, heads, layers, intermediate, vocab, **overrides):
        values = dict(zip(self.names, (hidden, heads, layers, intermediate, vocab), strict=True))
        values |= self.derived(values) if self.derived else {}
        return getattr(transformers, self.config)(**values, **self.extra, **overrides)


BERT_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
ROBERTA_HEADS = (*BERT_HEADS, "ForCausalLM", "ForMultipleChoice")
PRETRAINING_HEADS = ("ForPreTraining", "ForNextSentencePrediction")
DISTILBERT_NAMES = ("dim", "n_heads", "n_layers", "hidden_dim", "vocab_size")
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

VISUAL_FEATURES, REGIONS = 16, 4
DEBERTA_V3 = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 8}


def image_regions(head: str, inputs: dict) -> dict:
    """VisualBERT's inputs: ``REGIONS`` seeded region features per row (per choice) after the tokens,
    the last region of row 0 masked; the alignment head also maps each position to a region."""
    rows = inputs["input_ids"].shape[:-1]  # (batch,) or (batch, choices)
    generator = torch.Generator().manual_seed(9)
    mask = torch.ones(*rows, REGIONS, dtype=torch.long)
    mask[0, ..., -1] = 0
    regions = {"visual_embeds": torch.randn(*rows, REGIONS, VISUAL_FEATURES, generator=generator)}
    regions["visual_attention_mask"] = mask
    if head == "ForRegionToPhraseAlignment":
        positions = inputs["input_ids"].shape[-1] + REGIONS
        regions["region_to_phrase_position"] = torch.randint(0, REGIONS, (*rows, positions), generator=generator)
    return inputs | regions


def global_tokens(head: str, inputs: dict) -> dict:
    """Longformer's global attention on each row's first token (sliding windows of 4 elsewhere)."""
    mask = torch.zeros_like(inputs["input_ids"])
    mask[..., 0] = 1
    return inputs | {"global_attention_mask": mask}


def detected_regions(head: str, inputs: dict) -> dict:
    """LXMERT's inputs: ``REGIONS`` region features and boxes per row, the last region of row 0 masked."""
    rows = inputs["input_ids"].shape[0]
    generator = torch.Generator().manual_seed(10)
    mask = torch.ones(rows, REGIONS, dtype=torch.long)
    mask[0, -1] = 0
    regions = {"visual_feats": torch.randn(rows, REGIONS, VISUAL_FEATURES, generator=generator)}
    regions |= {"visual_pos": torch.rand(rows, REGIONS, 4, generator=generator), "visual_attention_mask": mask}
    return inputs | regions


REFORMER_CHUNKS = {"lsh_attn_chunk_length": 4, "local_attn_chunk_length": 4, "max_position_embeddings": 64}
TOP_SPANS = {"start_n_top": 2, "end_n_top": 2}  # XLM's and XLNet's QA heads: the 2 best starts and ends
XLM_NAMES = ("emb_dim", "n_heads", "n_layers", "intermediate_size", "vocab_size")  # its FFN is 4 x emb_dim wide
XLNET_NAMES = ("d_model", "n_head", "n_layer", "d_inner", "vocab_size")
QA_SIMPLE_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnsweringSimple")
FUNNEL_NAMES = ("d_model", "n_head", "num_decoder_layers", "d_inner", "vocab_size")
LXMERT_NAMES = ("hidden_size", "num_attention_heads", "l_layers", "intermediate_size", "vocab_size")

ARCHITECTURES = {
    "Bert": Architecture("BertConfig", (*BERT_HEADS, "LMHeadModel", "ForMultipleChoice", *PRETRAINING_HEADS)),
    "Roberta": Architecture("RobertaConfig", ROBERTA_HEADS),
    "XLMRoberta": Architecture("XLMRobertaConfig", ROBERTA_HEADS),
    "Camembert": Architecture("CamembertConfig", ROBERTA_HEADS),
    "Electra": Architecture("ElectraConfig", (*ROBERTA_HEADS, "ForPreTraining"), extra={"embedding_size": 24}),
    "DistilBert": Architecture("DistilBertConfig", (*BERT_HEADS, "ForMultipleChoice"), names=DISTILBERT_NAMES),
    "Data2VecText": Architecture("Data2VecTextConfig", ROBERTA_HEADS),
    "Ernie": Architecture("ErnieConfig", (*ROBERTA_HEADS, *PRETRAINING_HEADS)),
    "RobertaPreLayerNorm": Architecture("RobertaPreLayerNormConfig", ROBERTA_HEADS),
    "XLMRobertaXL": Architecture("XLMRobertaXLConfig", ROBERTA_HEADS),
    "MegatronBert": Architecture("MegatronBertConfig", (*ROBERTA_HEADS, *PRETRAINING_HEADS)),
    "LayoutLM": Architecture("LayoutLMConfig", BERT_HEADS),
    "MarkupLM": Architecture("MarkupLMConfig", ("Model", *BERT_HEADS[2:]), extra={"max_depth": 8}),
    "Splinter": Architecture("SplinterConfig", ("Model", "ForQuestionAnswering"), extra={"question_token_id": 5}),
    "RemBert": Architecture(
        "RemBertConfig", ROBERTA_HEADS, extra={"input_embedding_size": 16, "output_embedding_size": 24}
    ),
    "BertGeneration": Architecture("BertGenerationConfig", ("Encoder", "Decoder")),
    "RoCBert": Architecture(
        "RoCBertConfig",
        (*ROBERTA_HEADS, "ForPreTraining"),
        extra={
            "shape_vocab_size": 16,
            "pronunciation_vocab_size": 16,
            "shape_embed_dim": 8,
            "pronunciation_embed_dim": 8,
        },
    ),
    "Xmod": Architecture("XmodConfig", ROBERTA_HEADS, extra={"default_language": "en_XX"}),
    "Esm": Architecture("EsmConfig", BERT_HEADS[:4], extra={"pad_token_id": 1}),
    "EsmRotary": Architecture(
        "EsmConfig", BERT_HEADS[:2], extra={"pad_token_id": 1, "position_embedding_type": "rotary"}, prefix="Esm"
    ),
    "BigBird": Architecture(  # blocks of 2 tokens, 1 random block: block sparse above 14 tokens
        "BigBirdConfig", (*ROBERTA_HEADS, "ForPreTraining"), extra={"block_size": 2, "num_random_blocks": 1}
    ),
    "ConvBert": Architecture(  # 12 heads, half of them attention heads, the rest span-based convolution
        "ConvBertConfig",
        (*BERT_HEADS, "ForMultipleChoice"),
        extra={"embedding_size": 24, "head_ratio": 2, "conv_kernel_size": 3},
    ),
    "Albert": Architecture(
        "AlbertConfig",
        (*BERT_HEADS, "ForMultipleChoice", "ForPreTraining"),
        extra={"embedding_size": 24, "num_hidden_groups": 1},
    ),
    "Deberta": Architecture(
        "DebertaConfig",
        BERT_HEADS,
        extra={"relative_attention": True, "pos_att_type": ["c2p", "p2c"], "max_relative_positions": 8},
    ),
    "DebertaV2": Architecture(  # as DeBERTa-v3 checkpoints: buckets, keys shared with the content
        "DebertaV2Config",
        (*BERT_HEADS, "ForMultipleChoice"),
        extra={**DEBERTA_V3, "share_att_key": True, "norm_rel_ebd": "layer_norm"},
    ),
    "DebertaV2Conv": Architecture(  # as DeBERTa-v2 xlarge: position projections of its own, a convolution
        "DebertaV2Config",
        BERT_HEADS[:2],
        extra={**DEBERTA_V3, "share_att_key": False, "conv_kernel_size": 3},
        prefix="DebertaV2",
    ),
    "RoFormer": Architecture("RoFormerConfig", ROBERTA_HEADS, extra={"embedding_size": 24}),
    "Tapas": Architecture("TapasConfig", ("Model", "ForMaskedLM", "ForSequenceClassification", "ForQuestionAnswering")),
    "VisualBert": Architecture(
        "VisualBertConfig",
        (
            "Model",
            "ForPreTraining",
            "ForQuestionAnswering",
            "ForVisualReasoning",
            "ForMultipleChoice",
            "ForRegionToPhraseAlignment",
        ),
        extra={"visual_embedding_dim": VISUAL_FEATURES},
        more_inputs=image_regions,
    ),
    "Longformer": Architecture(
        "LongformerConfig", (*BERT_HEADS, "ForMultipleChoice"), extra={"attention_window": 4}, more_inputs=global_tokens
    ),
    "Lxmert": Architecture(
        "LxmertConfig",
        ("Model", "ForPreTraining", "ForQuestionAnswering"),
        names=LXMERT_NAMES,
        extra={"x_layers": 1, "r_layers": 1, "visual_feat_dim": VISUAL_FEATURES, "num_qa_labels": 3}
        | {"num_object_labels": 5, "num_attr_labels": 4},
        more_inputs=detected_regions,
    ),
    "MobileBert": Architecture(
        "MobileBertConfig",
        (*BERT_HEADS, "ForMultipleChoice", *PRETRAINING_HEADS),
        extra={"num_feedforward_networks": 2},
        derived=lambda sizes: (
            dict.fromkeys(("true_hidden_size", "intra_bottleneck_size"), sizes["hidden_size"])
            | {"embedding_size": max(1, sizes["hidden_size"] // 3)}
        ),  # its LM head spans hidden - embedding features
    ),
    "Funnel": Architecture(  # two blocks, the sequence pooled between them, and the decoder
        "FunnelConfig",
        ("Model", "BaseModel", "ForMaskedLM", *BERT_HEADS[2:], "ForMultipleChoice", "ForPreTraining"),
        names=FUNNEL_NAMES,
        derived=lambda sizes: {
            "d_head": sizes["d_model"] // sizes["n_head"],
            "block_sizes": [sizes["num_decoder_layers"]] * 2,
        },
    ),
    "XLM": Architecture(
        "XLMConfig",
        ("Model", "WithLMHeadModel", *QA_SIMPLE_HEADS, "ForQuestionAnswering", "ForMultipleChoice"),
        names=XLM_NAMES,
        extra=TOP_SPANS,
    ),
    "XLNet": Architecture(
        "XLNetConfig",
        ("Model", "LMHeadModel", *QA_SIMPLE_HEADS, "ForQuestionAnswering", "ForMultipleChoice"),
        names=XLNET_NAMES,
        extra=TOP_SPANS,
        derived=lambda sizes: {"d_head": sizes["d_model"] // sizes["n_head"]},
    ),
    "IBert": Architecture("IBertConfig", (*BERT_HEADS, "ForMultipleChoice")),
    "Reformer": Architecture(  # chunks of 4 tokens: the LSH attention hashes (2 rounds into 2 buckets)
        "ReformerConfig",
        ("Model", "ForMaskedLM", "ModelWithLMHead", "ForSequenceClassification", "ForQuestionAnswering"),
        names=("hidden_size", "num_attention_heads", "num_hidden_layers", "feed_forward_size", "vocab_size"),
        extra={**REFORMER_CHUNKS, "num_buckets": 2, "num_hashes": 2, "hash_seed": 3, "axial_pos_embds": False},
        derived=lambda sizes: {
            "attention_head_size": sizes["hidden_size"] // sizes["num_attention_heads"],
            "attn_layers": ["local", "lsh"] * sizes["num_hidden_layers"],
        },
    ),
    "Luke": Architecture(
        "LukeConfig", (*BERT_HEADS, "ForMultipleChoice"), extra={"entity_vocab_size": 16, "entity_emb_size": 8}
    ),
    "MPNet": Architecture("MPNetConfig", (*BERT_HEADS, "ForMultipleChoice")),
    "NomicBert": Architecture("NomicBertConfig", BERT_HEADS[:4]),
    "EuroBert": Architecture("EuroBertConfig", BERT_HEADS[:4], extra={**SPECIAL_TOKENS, "mask_token_id": 3}),
    "ModernBert": Architecture(
        "ModernBertConfig",
        (*BERT_HEADS, "ForMultipleChoice"),
        extra={**SPECIAL_TOKENS, "cls_token_id": 1, "sep_token_id": 2, "local_attention": 4},
    ),
}
VOCAB = 64
CASES = [(arch, head) for arch, spec in ARCHITECTURES.items() for head in spec.heads]


def model_spec(arch: str, head: str, hidden: int, heads: int, layers: int, intermediate: int, seed: int) -> ModelSpec:
    architecture = ARCHITECTURES[arch]
    overrides = {"num_labels": 2 if head.startswith("ForQuestionAnswering") else 3}
    if head in ("ForCausalLM", "LMHeadModel", "Decoder", "ModelWithLMHead"):
        overrides["is_decoder"] = True
    config = architecture.make_config(hidden, heads, layers, intermediate, VOCAB, **overrides)
    return ModelSpec(getattr(transformers, (architecture.prefix or arch) + head), config, seed)


def make_inputs(arch: str, head: str, inputs: dict) -> dict:
    """``inputs`` (a :func:`tpcore.testing.padded_batch`) shaped for ``head``, with what else the
    architecture takes, and hidden states."""
    if head == "ForMultipleChoice":
        inputs = with_choices(inputs)
    more = ARCHITECTURES[arch].more_inputs
    return {**(more(head, inputs) if more else inputs), "output_hidden_states": True}


def every_head_cases():
    """``(arch, head, world sizes)``: the first head of each architecture over 1-4 ranks, the others
    (slow) over 2 and 3."""
    for arch, architecture in ARCHITECTURES.items():
        first, *others = architecture.heads
        yield pytest.param(arch, first, (1, 2, 3, 4), id=arch + first)
        for head in others:
            yield pytest.param(arch, head, (2, 3), id=arch + head, marks=pytest.mark.slow)


@pytest.mark.parametrize(("arch", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, arch, head, world_sizes):
    """12 heads split over each world size; batch of 3 with padding."""
    spec = model_spec(arch, head, hidden=48, heads=12, layers=2, intermediate=96, seed=1)
    inputs = make_inputs(arch, head, padded_batch([7, 3, 5], 7, VOCAB, seed=2))
    report = check_equivalence(spec, inputs, world_sizes=world_sizes, pools=rank_pools)
    assert sorted(report) == list(world_sizes)
    assert all(any(name.endswith("hidden_states.0") for name in diffs) for diffs in report.values())  # LXMERT: 2


CROSS_ATTENTION = [
    ("Bert", "LMHeadModel"),
    *((arch, "ForCausalLM") for arch in ("Roberta", "XLMRoberta", "Camembert", "Electra", "Data2VecText", "Ernie")),
    *((arch, "ForCausalLM") for arch in ("RobertaPreLayerNorm", "XLMRobertaXL", "RemBert", "RoCBert", "Xmod")),
    ("MegatronBert", "ForCausalLM"),
    ("BertGeneration", "Decoder"),
]


@pytest.mark.parametrize(
    ("arch", "head"),
    [
        pytest.param(*case, id="".join(case), marks=[pytest.mark.slow] if i else [])
        for i, case in enumerate(CROSS_ATTENTION)
    ],
)
def test_cross_attention_decoders(rank_pools, arch, head):
    """Decoders with cross-attention over encoder states: both attentions are split."""
    spec = model_spec(arch, head, hidden=48, heads=12, layers=2, intermediate=96, seed=3)
    spec.config.add_cross_attention = True
    inputs = make_inputs(arch, head, padded_batch([6, 2], 6, VOCAB, seed=4))
    # MegatronBert reshapes cross-attention keys with the decoder's length: keep both equal.
    encoder_length = 6
    inputs["encoder_hidden_states"] = torch.randn(2, encoder_length, 48, generator=torch.Generator().manual_seed(5))
    inputs["encoder_attention_mask"] = torch.tensor([[1] * encoder_length, [1] * 3 + [0] * (encoder_length - 3)])
    report = check_equivalence(spec, inputs, world_sizes=(2, 3, 4), pools=rank_pools)
    assert sorted(report) == [2, 3, 4]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    sizes=split_sizes(world_sizes=(2, 3, 4, 5), uneven=True),
    inputs=padded_batches(VOCAB, batch=(1, 3), seq=(1, 9)),
    seed=seeds(),
)
def test_random_configs_match_unsplit(rank_pools, case, sizes, inputs, seed):
    """Random configs over 2-5 ranks, head counts and sizes mostly not divided by them (world size 1 is
    ``test_every_head``'s)."""
    arch, head = case
    if arch == "ConvBert":  # half the heads attend, in heads of half the width: configs ConvBERT takes, split
        attention_heads = sizes.heads // 2
        assume(attention_heads >= sizes.world_size and sizes.hidden % (2 * attention_heads) == 0)
    assume(arch != "Funnel" or inputs["input_ids"].shape[-1] >= 3)  # shorter, its unsplit pooling fails
    assume(arch != "VisualBert" or int(inputs["attention_mask"].sum(-1).min()) >= 2)  # its QA head reads token -2
    spec = model_spec(arch, head, sizes.hidden, sizes.heads, sizes.layers, sizes.intermediate, seed)
    assume(inputs["input_ids"].shape[-1] >= getattr(spec.config, "start_n_top", 1))  # XLM's, XLNet's beam QA
    report = check_equivalence(spec, make_inputs(arch, head, inputs), world_sizes=(sizes.world_size,), pools=rank_pools)
    assert report[sizes.world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("arch", "head"), [(arch, spec.heads[1]) for arch, spec in ARCHITECTURES.items()])
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, arch, head, world_size, dtype):
    """The same property on CUDA with NCCL, in half precision; world sizes beyond the GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    spec = model_spec(arch, head, hidden=48, heads=12, layers=2, intermediate=96, seed=1)
    inputs = make_inputs(arch, head, padded_batch([7, 3, 5], 7, VOCAB, seed=2))
    report = check_equivalence(
        spec, inputs, world_sizes=(world_size,), pools=nccl_rank_pools, rtol=HALF_PRECISION_RTOL[dtype], dtype=dtype
    )
    assert report[world_size]


LUKE_ENTITY_HEADS = ["Model", "ForEntityClassification", "ForEntityPairClassification", "ForEntitySpanClassification"]


@pytest.mark.parametrize(
    "head", [LUKE_ENTITY_HEADS[0], *(pytest.param(h, marks=pytest.mark.slow) for h in LUKE_ENTITY_HEADS[1:])]
)
def test_luke_entity_aware_attention(rank_pools, head):
    """LUKE with entity inputs, so the word-to-entity, entity-to-word and entity-to-entity queries run."""
    spec = model_spec("Luke", head, hidden=48, heads=12, layers=2, intermediate=96, seed=6)
    spec.config.use_entity_aware_attention = True
    inputs = make_inputs("Luke", "Model", padded_batch([6, 4], 6, VOCAB, seed=7))
    entities = 2
    inputs["entity_ids"] = torch.tensor([[3, 5], [7, 2]])
    inputs["entity_attention_mask"] = torch.ones(2, entities, dtype=torch.long)
    inputs["entity_position_ids"] = torch.tensor([[[0, 1, -1], [3, -1, -1]], [[1, 2, 3], [0, -1, -1]]])
    if head == "ForEntitySpanClassification":
        inputs["entity_start_positions"] = torch.tensor([[0, 3], [1, 0]])
        inputs["entity_end_positions"] = torch.tensor([[1, 3], [3, 0]])
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools)
    assert any(name.startswith("entity_") or name == "logits" for name in report[4])


def test_deberta_talking_heads_are_refused_with_the_reason():
    """Talking heads project every head's scores onto every head: no rank holds what its heads need."""
    spec = model_spec("Deberta", "Model", hidden=48, heads=12, layers=1, intermediate=96, seed=0)
    spec.config.talking_head = True
    with pytest.raises(tpcore.ShardingError, match="talking_head=True mixes the scores of all heads"):
        tpcore.TensorReplacer(spec.build(), None, False, 2, rank=0).validate()


@pytest.mark.parametrize("head", ["Model", pytest.param("ForMaskedLM", marks=pytest.mark.slow)])
def test_bigbird_block_sparse_attention(rank_pools, head):
    """20 tokens in blocks of 2 (above the 14 below which BigBird switches to full attention): the
    block-sparse path, its global, sliding and random blocks, over 2-4 ranks."""
    spec = model_spec("BigBird", head, hidden=48, heads=12, layers=2, intermediate=96, seed=8)
    inputs = make_inputs("BigBird", head, padded_batch([20, 13], 20, VOCAB, seed=9))
    model = spec.build()
    with torch.inference_mode():
        model(**inputs)
    assert model.base_model.attention_type == "block_sparse"  # no switch to full attention (7 tokens would)
    report = check_equivalence(spec, inputs, world_sizes=(2, 3, 4), pools=rank_pools)
    assert sorted(report) == [2, 3, 4]


@pytest.mark.slow
def test_convbert_cross_attention(rank_pools):
    """A ConvBERT decoder's cross-attention (attention and span-based convolution heads) over 2-4 ranks;
    unpadded and over encoder states of the decoder's length, as transformers' ConvBERT needs (it adds
    the decoder's mask to the cross-attention scores; its convolution runs over the decoder's positions)."""
    spec = model_spec("ConvBert", "Model", hidden=48, heads=12, layers=2, intermediate=96, seed=11)
    spec.config.is_decoder = spec.config.add_cross_attention = True
    inputs = make_inputs("ConvBert", "Model", padded_batch([6, 6], 6, VOCAB, seed=12))
    inputs["encoder_hidden_states"] = torch.randn(2, 6, 48, generator=torch.Generator().manual_seed(13))
    report = check_equivalence(spec, inputs, world_sizes=(2, 3, 4), pools=rank_pools)
    assert sorted(report) == [2, 3, 4]


@pytest.mark.parametrize("head", ["ForMaskedLM", pytest.param("ForSequenceClassification", marks=pytest.mark.slow)])
def test_ibert_integer_mode(rank_pools, tmp_path, head):
    """I-BERT with ``quant_mode=True``: its activation ranges calibrated by training-mode forwards, saved,
    then each of 2-4 ranks reads its slices; integer GELU, softmax and layer norm on integer-valued
    activations give the unsplit outputs."""
    spec = model_spec("IBert", head, hidden=48, heads=12, layers=2, intermediate=96, seed=14)
    spec.config.quant_mode = True
    model = spec.build().train()
    inputs = make_inputs("IBert", head, padded_batch([7, 3, 5], 7, VOCAB, seed=15))
    with torch.no_grad():
        for seed in range(3):  # each quantizer keeps the running range of what it sees
            model(**make_inputs("IBert", head, padded_batch([7, 7], 7, VOCAB, seed=seed)))
    ranges = [buffer for name, buffer in model.named_buffers() if name.endswith("activation.x_max")]
    assert ranges and all(bool((upper > 0).all()) for upper in ranges)  # calibrated: integer mode is live
    model.eval().save_pretrained(tmp_path)
    saved = SavedModelSpec(str(tmp_path), spec.model_class)
    report = check_equivalence(saved, inputs, world_sizes=(2, 3, 4), pools=rank_pools)
    assert sorted(report) == [2, 3, 4]


def test_reformer_draws_each_heads_rotations_from_the_global_generator_as_unsplit(rank_pools):
    """Without ``hash_seed`` the LSH rotations come from the global generator, seeded before each run:
    every rank draws all heads' rotations (the unsplit count) and hashes with its own heads' over 2-4 ranks."""
    spec = model_spec("Reformer", "Model", hidden=48, heads=12, layers=2, intermediate=96, seed=16)
    spec.config.hash_seed = None
    inputs = make_inputs("Reformer", "Model", padded_batch([7, 3, 5], 7, VOCAB, seed=17))
    report = check_equivalence(spec, inputs, world_sizes=(2, 3, 4), pools=rank_pools, seed=18)
    assert sorted(report) == [2, 3, 4]
    model = spec.build()
    torch.manual_seed(18)
    first = model(**inputs).last_hidden_state
    torch.manual_seed(19)
    assert not torch.allclose(first, model(**inputs).last_hidden_state)  # the draws matter: the hashing runs


#: every architecture's first head, as ``tpcore check`` names it (variants of one class once), but two whose
#: default configs do not run unsplit: X-MOD's names no default language, ESM's no pad token
CHECKED_CLASSES = [
    name
    for name in dict.fromkeys((spec.prefix or arch) + spec.heads[0] for arch, spec in ARCHITECTURES.items())
    if name not in ("XmodModel", "EsmModel")
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED_CLASSES)
def test_tpcore_check_passes_from_the_default_config(rank_pools, capsys, name):
    """``tpcore check CLASS`` on the default config shrunk (MobileBERT's bottleneck, Reformer's axial
    position factors and XLNet's head width too; LXMERT's and VisualBERT's region features)."""
    assert run_check(name, (2, 3), pools=rank_pools) == 0, capsys.readouterr().out


def test_mobilebert_lm_head_is_split_over_the_vocabulary_with_the_embeddings():
    spec = model_spec("MobileBert", "ForMaskedLM", hidden=48, heads=12, layers=1, intermediate=96, seed=0)
    plan = tpcore.TensorReplacer(spec.build(), None, False, 4, rank=0).split_plan()
    assert plan.vocab == {"mobilebert.embeddings.word_embeddings": VOCAB, "cls.predictions.decoder": VOCAB}
