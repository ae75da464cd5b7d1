"""Vocab-parallel input embeddings and LM heads: which modules are split, and that the split model
still equals the unsplit one (tied weights tied, odd vocabularies padded, logits gathered or not)."""

from __future__ import annotations

import copy

import pytest
import rank_helpers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tpcore import TensorReplacer
from tpcore.parallel.layers import VocabParallelEmbedding, VocabParallelLMHead
from tpcore.testing import ModelSpec, check_equivalence, parameter_count, tiny_gpt2_config


def gpt2_spec(vocab: int, seed: int = 0, tie: bool = True) -> ModelSpec:
    config = tiny_gpt2_config(vocab_size=vocab, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    return ModelSpec(GPT2LMHeadModel, config, seed)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_an_odd_vocabulary_is_padded_to_equal_rows_and_the_tied_head_shares_them(world_size):
    vocab = 101
    for rank in range(world_size):
        model = gpt2_spec(vocab).build()
        TensorReplacer(model, None, False, world_size, rank=rank).replace_modules()
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        rows = -(-vocab // world_size)
        assert type(embedding) is VocabParallelEmbedding and type(head) is VocabParallelLMHead
        assert embedding.weight is head.weight and embedding.weight.shape == (rows, 48)
        assert (embedding.vocab_start, head.vocab_start, head.vocab_size) == (rank * rows, rank * rows, vocab)
        assert (embedding.num_embeddings, head.out_features) == (rows, rows)
        assert model.transformer.wpe.weight.shape == (32, 48)  # position embeddings stay whole


def test_untied_embeddings_are_each_split():
    model = gpt2_spec(50, tie=False).build()
    TensorReplacer(model, None, False, 2, rank=1).replace_modules()
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    assert model.get_input_embeddings().weight.shape == model.get_output_embeddings().weight.shape == (25, 48)


def test_a_table_tied_into_several_embeddings_and_the_head_is_split_in_all_of_them():
    """One table held by the input embedding, a second embedding and the head (BART's ``shared``,
    ``encoder.embed_tokens``, ``decoder.embed_tokens``, ``lm_head``): all are cut by the same rows."""
    model = gpt2_spec(50).build()
    model.transformer.second = nn.Embedding(50, 48)
    model.transformer.second.weight = model.transformer.wte.weight
    TensorReplacer(model, None, False, 2, rank=1).replace_modules()
    second, head = model.transformer.second, model.lm_head
    assert type(second) is VocabParallelEmbedding and second.weight is model.transformer.wte.weight is head.weight
    assert second.weight.shape == (25, 48) and (second.vocab_start, second.vocab_size) == (25, 50)


class ShiftedEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) + 1.0


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_embeddings_that_do_more_than_a_lookup_or_are_read_elsewhere_stay_whole():
    model = gpt2_spec(50, tie=False).build()
    model.transformer.wte.__class__ = ShiftedEmbedding  # its forward is more than a lookup times a scale
    model.extra = nn.Module()
    model.extra.weight = model.lm_head.weight  # a module of no vocabulary-parallel kind reads the head's weight
    assert TensorReplacer(model, None, False, 2, rank=0).vocab_modules() == []
    TensorReplacer(model, None, False, 2, rank=0).replace_modules()
    assert model.lm_head.weight.shape == (50, 48) and type(model.lm_head) is nn.Linear


def test_an_embedding_whose_forward_is_the_lookup_times_a_scale_is_split_and_keeps_its_scale():
    model = gpt2_spec(50, tie=False).build()
    model.transformer.wte.__class__ = ScaledEmbedding
    ids = torch.tensor([[0, 7, 24, 25, 49]])
    whole = model.transformer.wte(ids)
    parts = []
    for rank in range(2):
        shard = copy.deepcopy(model)
        TensorReplacer(shard, None, False, 2, rank=rank).replace_modules()  # no group: each rank's masked rows
        embedding = shard.transformer.wte
        assert isinstance(embedding, ScaledEmbedding) and isinstance(embedding, VocabParallelEmbedding)
        assert embedding.weight.shape == (25, 48)
        parts.append(embedding(ids))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=0)


def test_vocab_parallel_off_keeps_the_embeddings_whole():
    model = gpt2_spec(50).build()
    TensorReplacer(model, None, False, 2, rank=0, vocab_parallel=False).replace_modules()
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.shape == (50, 48)


def test_an_id_outside_the_vocabulary_raises_and_the_check_reads_the_host_once_per_forward(monkeypatch):
    model = gpt2_spec(50).build()
    TensorReplacer(model, None, False, 2, rank=1).replace_modules()  # rows 25-49; no group: no collective
    embedding = model.get_input_embeddings()
    reads = []
    for name in ("item", "__bool__"):  # the ways a tensor's value reaches the host
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self))
    out = embedding(torch.tensor([[0, 24, 25, 49]]))
    assert len(reads) <= 1 and out.shape == (1, 4, 48)
    assert not out[0, :2].any() and torch.equal(out[0, 2:], embedding.weight[[0, 24]])  # ids held elsewhere: zeros
    monkeypatch.undo()
    for ids in ([0, 50], [-1, 3], [[7], [60]]):
        with pytest.raises(IndexError, match="index out of range"):
            embedding(torch.tensor(ids))
    assert embedding(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 48)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
@settings(max_examples=8, deadline=None)
@given(world_size=st.integers(1, 4), vocab=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_split_vocabularies_give_the_unsplit_logits(rank_pools, world_size, vocab, seed):
    spec = gpt2_spec(vocab, seed)
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))
    check_equivalence(spec, {"input_ids": ids}, (world_size,), pools=rank_pools)


@pytest.mark.parametrize("world_size", [2, 3])
def test_logits_stay_split_when_asked_and_every_rank_holds_its_columns(rank_pools, world_size):
    vocab = 37
    spec = gpt2_spec(vocab, seed=3)
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = spec.build()(input_ids=ids).logits
    results = rank_pools.get(world_size).run(rank_helpers.vocab_parallel_logits, spec, ids, False)
    rows = -(-vocab // world_size)
    for rank, result in enumerate(results):
        assert result["classes"] == ("VocabParallelEmbedding", "VocabParallelLMHead") and result["tied"]
        assert result["rows"] == rows and result["starts"] == (rank * rows, rank * rows)
        assert result["logits"].shape == (2, 5, rows)
    columns = torch.cat([result["logits"] for result in results], dim=-1)
    torch.testing.assert_close(columns[..., :vocab], expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert not columns[..., vocab:].any()  # the padding rows give zero logits


def test_a_rank_of_gpt2_holds_about_half_its_parameters(rank_pools):
    spec = gpt2_spec(1001, seed=1)
    full = parameter_count(spec.build())
    results = rank_pools.get(2).run(rank_helpers.vocab_parallel_logits, spec, torch.zeros(1, 3, dtype=torch.long))
    assert results[0]["rows"] == 501
    model = spec.build()
    TensorReplacer(model, None, False, 2, rank=0).replace_modules()
    held = parameter_count(model)
    replicated = sum(p.numel() for name, p in model.named_parameters() if "wpe" in name or "ln" in name)
    assert held == pytest.approx(full / 2 + replicated / 2, abs=2 * 2 * 48)  # biases of row layers stay whole


@pytest.mark.parametrize(
    ("spec", "layer"),
    [
        (gpt2_spec(50), "transformer.h.1"),
        (
            ModelSpec(
                LlamaForCausalLM,
                LlamaConfig(
                    vocab_size=50,
                    hidden_size=48,
                    intermediate_size=96,
                    num_hidden_layers=2,
                    num_attention_heads=12,
                    num_key_value_heads=4,
                ),
            ),
            "model.layers.1",
        ),
    ],
    ids=["GPT2", "Llama"],
)
def test_a_layer_costs_exactly_two_all_reduces_and_the_vocabulary_two_more_collectives(rank_pools, spec, layer):
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    for total, in_layer in rank_pools.get(2).run(rank_helpers.collectives_of_a_forward, spec, ids, layer):
        assert in_layer == {"all_reduce": 2}
        assert total == {"all_reduce": 2 * 2 + 1, "all_gather": 1}  # + the embedding's reduce, the head's gather
