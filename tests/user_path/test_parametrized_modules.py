"""Modules that torch pickles only through ``state_dict()`` (parametrizations: the weight norm of Wav2Vec2's,
Hubert's and WavLM's positional convolution) travel to the ranks: through ``tpcore.parallelize`` of the model
object and of its saved directory, the split model equals the unsplit one."""

from __future__ import annotations

import pytest
import torch
import transformers

import tpcore
from tpcore.testing import compare_outputs

SIZES = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "conv_dim": (16, 16),
    "conv_stride": (5, 2),
    "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 4,
}


def build(family: str) -> torch.nn.Module:
    config = getattr(transformers, f"{family}Config")(**SIZES)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}Model")(config).eval()


@pytest.mark.parametrize(
    "family",
    ["Wav2Vec2", pytest.param("Hubert", marks=pytest.mark.slow), pytest.param("WavLM", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("source", ["object", "directory"])
def test_a_weight_normed_model_travels_and_equals_the_unsplit_one(family, source, tmp_path):
    reference = build(family)
    assert torch.nn.utils.parametrize.is_parametrized(reference.encoder.pos_conv_embed.conv)
    if source == "directory":
        reference.save_pretrained(tmp_path)
    model = tpcore.parallelize(build(family) if source == "object" else str(tmp_path), num_gpus=2)
    try:
        waveforms = torch.randn(2, 400, generator=torch.Generator().manual_seed(1))
        compare_outputs(reference(waveforms).last_hidden_state, model(waveforms).last_hidden_state)
    finally:
        model.deparallelize()
