"""CPU ranks keep their float32 linear weights as the transpose of a contiguous ``[in, out]`` tensor
(:mod:`tpcore.parallel.cpu_layout`): the same shapes, values, ties and outputs, a layout the CPU's GEMM reads as it
lies. The split models of every equivalence test run with it; here the layout itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcore.load.checkpoint import Checkpoint
from tpcore.load.skeleton import empty_model
from tpcore.parallel.cpu_layout import lay_out, linear_weight_names, transpose_linear_weights
from tpcore.testing import random_weights, tiny_llama


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_linear_weights_are_transposed_in_place_keeping_shapes_values_and_ties(tied):
    model = random_weights(tiny_llama(tie_word_embeddings=tied), seed=1)
    before = _weights(model)
    parameters = dict(model.named_parameters())
    linears = [m for m in model.modules() if type(m) is nn.Linear]

    assert transpose_linear_weights(model) == len(linears)

    assert dict(model.named_parameters()).keys() == parameters.keys()
    for name, parameter in model.named_parameters():
        assert parameter is parameters[name]  # the same Parameter objects: ties and references hold
    for name, tensor in model.state_dict().items():
        assert tensor.shape == before[name].shape and torch.equal(tensor, before[name]), name
    for linear in linears:
        out_features, _ = linear.weight.shape
        assert linear.weight.stride() == (1, out_features) and linear.weight.t().is_contiguous()
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert transpose_linear_weights(model) == 0  # laid out already


def test_outputs_and_greedy_tokens_equal_the_row_major_model():
    """Logits within float rounding of the row-major weights' (a GEMM that sums in another order), the same greedy
    tokens; the embedding's lookup through a tied, transposed table gives the same rows."""
    reference = random_weights(tiny_llama(tie_word_embeddings=True), seed=2)
    laid_out = random_weights(tiny_llama(tie_word_embeddings=True), seed=2)
    transpose_linear_weights(laid_out)
    ids = torch.randint(1, 100, (8, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(laid_out.model.embed_tokens(ids), reference.model.embed_tokens(ids))
        torch.testing.assert_close(laid_out(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        tokens = laid_out.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=8, do_sample=False))


def test_other_weights_and_layers_with_a_forward_of_their_own_are_left_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8).bfloat16(), Scaled(8, 8), nn.Linear(8, 1), nn.Embedding(5, 8))
    weights = [module.weight for module in model]
    assert transpose_linear_weights(model) == 0
    assert all(weight.is_contiguous() for weight in weights)


@pytest.mark.parametrize("tied", [True, False])
def test_a_checkpoint_read_with_the_layout_lays_out_each_linear_weight_as_it_is_read(tmp_path, tied):
    """``Checkpoint.load_into(lay_out=, laid_out=linear_weight_names(...))``: each linear weight arrives laid out
    with the values saved, the other tensors row-major, and the pass after the load finds none left to lay out
    (a tied head comes with its embedding: read once under one of its names, laid out by that pass if not then)."""
    reference = random_weights(tiny_llama(tie_word_embeddings=tied), seed=3)
    reference.save_pretrained(tmp_path)
    checkpoint = Checkpoint(tmp_path)
    model = empty_model(checkpoint.config())
    names = linear_weight_names(model)
    assert names == {f"{name}.weight" for name, module in model.named_modules() if type(module) is nn.Linear}
    checkpoint.load_into(model, checkpoint.reads(model, {}), 0, 1, lay_out=lay_out, laid_out=names)
    saved = dict(reference.named_parameters())
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, saved[name]), name
        if name in names and not (tied and name == "lm_head.weight"):
            assert tensor.stride() == (1, tensor.shape[0]), name
        elif tensor.dim() == 2 and name not in names:
            assert tensor.is_contiguous(), name
    left = int(tied and model.lm_head.weight.is_contiguous())  # a tied head read under its embedding's name
    assert transpose_linear_weights(model) == left
