"""A BERT-family model split over 1-4 gloo ranks gives the unsplit model's outputs.

Every architecture tp-bert claims is listed in ``ARCHITECTURES`` with every head transformers
ships for it. ``test_every_head`` runs each head once at world sizes 1-4; the hypothesis property
draws random small configs, world sizes, batches and padding masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpcore.testing import ModelSpec, check_equivalence


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

    def make_config(self, hidden, heads, layers, intermediate, vocab, **overrides):
        values = dict(zip(self.names, (hidden, heads, layers, intermediate, vocab)))
        return getattr(transformers, self.config)(**values, **self.extra, **overrides)


ROBERTA_HEADS = ("Model", "ForMaskedLM", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
                 "ForQuestionAnswering", "ForMultipleChoice")
ARCHITECTURES = {
    "Bert": Architecture("BertConfig", ("Model", "ForMaskedLM", "ForPreTraining", "ForNextSentencePrediction",
                                        "LMHeadModel", "ForSequenceClassification", "ForTokenClassification",
                                        "ForQuestionAnswering", "ForMultipleChoice")),
    "Roberta": Architecture("RobertaConfig", ROBERTA_HEADS),
    "XLMRoberta": Architecture("XLMRobertaConfig", ROBERTA_HEADS),
    "Camembert": Architecture("CamembertConfig", ROBERTA_HEADS),
    "Electra": Architecture("ElectraConfig", ("Model", "ForMaskedLM", "ForPreTraining", "ForCausalLM",
                                              "ForSequenceClassification", "ForTokenClassification",
                                              "ForQuestionAnswering", "ForMultipleChoice"), extra={"embedding_size": 24}),
    "DistilBert": Architecture("DistilBertConfig", ("Model", "ForMaskedLM", "ForSequenceClassification",
                                                    "ForTokenClassification", "ForQuestionAnswering",
                                                    "ForMultipleChoice"),
                               names=("dim", "n_heads", "n_layers", "hidden_dim", "vocab_size")),
}
VOCAB = 64
CASES = [(arch, head) for arch, spec in ARCHITECTURES.items() for head in spec.heads]


def model_spec(arch: str, head: str, hidden: int, heads: int, layers: int, intermediate: int, seed: int) -> ModelSpec:
    architecture = ARCHITECTURES[arch]
    overrides = {"num_labels": 2 if head == "ForQuestionAnswering" else 3}
    if head in ("ForCausalLM", "LMHeadModel"):
        overrides["is_decoder"] = True
    config = architecture.make_config(hidden, heads, layers, intermediate, VOCAB, **overrides)
    return ModelSpec(getattr(transformers, arch + head), config, seed)


def make_inputs(head: str, lengths: list[int], seq: int, seed: int, choices: int = 2) -> dict:
    """Token ids with right padding: row ``i`` has ``lengths[i]`` real tokens."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=generator)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    if head == "ForMultipleChoice":
        ids, mask = (t[:, None, :].expand(batch, choices, seq).contiguous() for t in (ids, mask))
    return {"input_ids": ids, "attention_mask": mask, "output_hidden_states": True}


@pytest.mark.parametrize(("arch", "head"), CASES, ids=[a + h for a, h in CASES])
def test_every_head(rank_pools, arch, head):
    """12 heads split over 1, 2, 3 and 4 ranks; batch of 3 with padding."""
    spec = model_spec(arch, head, hidden=48, heads=12, layers=2, intermediate=96, seed=1)
    inputs = make_inputs(head, lengths=[7, 3, 5], seq=7, seed=2)
    report = check_equivalence(spec, inputs, world_sizes=(1, 2, 3, 4), pools=rank_pools)
    assert sorted(report) == [1, 2, 3, 4]
    assert all("hidden_states.0" in diffs for diffs in report.values())


@st.composite
def cases(draw):
    arch, head = draw(st.sampled_from(CASES))
    world_size = draw(st.sampled_from([1, 2, 3, 4]))
    heads = world_size * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    intermediate = world_size * draw(st.integers(1, 24))
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    layers = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**16))
    return arch, head, world_size, heads, head_dim, intermediate, layers, lengths, seq, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_configs_match_unsplit(rank_pools, case):
    arch, head, world_size, heads, head_dim, intermediate, layers, lengths, seq, seed = case
    spec = model_spec(arch, head, heads * head_dim, heads, layers, intermediate, seed)
    inputs = make_inputs(head, lengths, seq, seed + 1)
    report = check_equivalence(spec, inputs, world_sizes=(world_size,), pools=rank_pools)
    assert report[world_size]
