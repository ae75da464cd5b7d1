"""Half precision: a rank's model is cast as ``from_pretrained(dtype=...)`` loads it, by both entry
points; ``fp16=`` and ``dtype=`` that contradict are refused by both; row-parallel partial sums of
more than two ranks are summed in fp32 and rounded once.

The reference is transformers itself: the same random-init model saved and loaded back with
``from_pretrained(dtype=...)``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import rank_helpers
import torch
import transformers

import tpcore
from tpcore.load import precision
from tpcore.load.precision import cast_model, resolve_dtype
from tpcore.testing import HALF_PRECISION_RTOL, ModelSpec, check_equivalence, compare_outputs, tiny_gpt2, tiny_llama

VOCAB = 64


def t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


#: tiny_llama and tiny_gpt2 as wide as the T5: 32 features, VOCAB tokens
llama = functools.partial(
    tiny_llama, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64
)
gpt2 = functools.partial(tiny_gpt2, vocab_size=VOCAB, n_embd=32, n_head=4, n_positions=64)


MODELS = {"t5": t5, "llama": llama, "gpt2": gpt2}


def inputs_for(name: str) -> dict:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    return {"input_ids": ids}


def dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Every parameter's and buffer's dtype (non-persistent buffers too), by name."""
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """``loaded(name, dtype)``: the model saved once, loaded back by transformers in ``dtype``."""
    saved = {}

    def load(name: str, dtype: torch.dtype) -> torch.nn.Module:
        if name not in saved:
            saved[name] = tmp_path_factory.mktemp(name)
            MODELS[name]().save_pretrained(saved[name])
        model_class = type(MODELS[name]())
        return model_class.from_pretrained(saved[name], dtype=dtype).eval()

    return load


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_cast_gives_every_tensor_the_dtype_and_value_from_pretrained_gives(loaded, name, dtype):
    reference = loaded(name, dtype)
    cast = cast_model(MODELS[name](), dtype)
    assert dtypes(cast) == dtypes(reference)
    expected = dict(reference.state_dict())
    for key, tensor in cast.state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_what_stays_in_fp32(loaded):
    """The cases that make the cast differ from ``model.to(dtype)`` (transformers keeps T5's ``wo`` in
    fp32 for fp16 only; ``_keep_in_fp32_modules_strict`` would for bf16 too)."""
    wo = "decoder.block.0.layer.2.DenseReluDense.wo.weight"
    assert dtypes(cast_model(t5(), torch.float16))[wo] == torch.float32
    assert dtypes(cast_model(t5(), torch.bfloat16))[wo] == torch.bfloat16
    rotary = dtypes(cast_model(llama(), torch.bfloat16))
    assert rotary["model.rotary_emb.inv_freq"] == torch.float32
    assert rotary["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16


def test_tied_weights_stay_tied():
    model = cast_model(gpt2(), torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_strict_fp32_modules_stay_fp32_in_bf16_too(monkeypatch):
    model = llama()
    monkeypatch.setattr(model, "_keep_in_fp32_modules_strict", ["mlp.gate_proj"], raising=False)
    cast = dtypes(cast_model(model, torch.bfloat16))
    assert cast["model.layers.1.mlp.gate_proj.weight"] == torch.float32
    assert cast["model.layers.1.mlp.up_proj.weight"] == torch.bfloat16


@pytest.mark.parametrize(("name", "dtype"), [("t5", torch.float16), ("llama", torch.bfloat16), ("gpt2", torch.float16)])
def test_the_dtypes_the_cast_would_give_are_told_without_casting(name, dtype):
    """``cast_dtypes`` (what a plan counts for ranks that cast) names each tensor the cast changes, by its first
    name, with the dtype it gets; the model is left as it was."""
    model = MODELS[name]()
    told = precision.cast_dtypes(model, dtype)
    assert set(dtypes(model).values()) == {torch.float32}
    cast = dtypes(cast_model(model, dtype))
    assert told == {key: value for key, value in cast.items() if key in told}
    assert {key for key, value in cast.items() if value != torch.float32} <= set(told)


@pytest.mark.parametrize(
    ("kept", "expected"),
    [
        (True, {"weight": torch.float32, "scale": torch.float32, "bias": torch.float32}),
        (("scale",), {"weight": torch.bfloat16, "scale": torch.float32, "bias": torch.bfloat16}),
        (False, {"weight": torch.bfloat16, "scale": torch.bfloat16, "bias": torch.bfloat16}),
    ],
)
def test_a_quantized_layer_keeps_the_dtypes_of_the_tensors_it_names(kept, expected):
    """``keeps_stored_dtypes``: every tensor of the module (``True``), those it names, or none."""
    layer = torch.nn.Linear(4, 3)
    layer.scale = torch.nn.Parameter(torch.ones(3))
    layer.keeps_stored_dtypes = kept
    cast_model(torch.nn.Sequential(layer), torch.bfloat16)
    assert {name: tensor.dtype for name, tensor in layer.named_parameters()} == expected


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [("t5", torch.float16), ("llama", torch.bfloat16)])
def test_parallelize_casts_the_ranks_models_as_from_pretrained(loaded, name, dtype):
    """On the ranks: T5's ``wo`` stays fp32 in fp16, Llama's rotary ``inv_freq`` in bf16; outputs match the
    unsplit model transformers loads in that dtype."""
    reference = loaded(name, dtype)
    inputs = inputs_for(name)
    with torch.inference_mode():
        expected = reference(**inputs).logits
    model = MODELS[name]()
    tpcore.parallelize(model, num_gpus=2, backend="gloo", dtype=dtype)
    try:
        for rank_dtypes in model._tpcore_handle.pool.run(rank_helpers.tensor_dtypes):
            assert rank_dtypes == dtypes(reference)
        compare_outputs(expected, model(**inputs).logits, rtol=HALF_PRECISION_RTOL[dtype])
    finally:
        model.deparallelize()


def test_the_engine_casts_as_from_pretrained(loaded, monkeypatch):
    monkeypatch.setattr(precision, "fast_cpu_half_dtype", lambda: torch.float16)
    reference = loaded("t5", torch.float16)
    model = tpcore.ParallelEngine(1, "gloo").parallelize(t5(), fp16=True)
    assert dtypes(model) == dtypes(reference)


def test_the_engine_refuses_fp16_with_another_dtype_as_parallelize_does():
    with pytest.raises(ValueError) as by_parallelize:
        tpcore.parallelize(gpt2(), num_gpus=1, backend="gloo", fp16=True, dtype=torch.bfloat16)
    model = gpt2()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as by_engine:
        tpcore.ParallelEngine(1, "gloo", dtype=torch.bfloat16).parallelize(model, fp16=True)
    assert str(by_engine.value) == str(by_parallelize.value) == "fp16=True contradicts dtype=torch.bfloat16"
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())  # refused before any change
    assert tpcore.ParallelEngine(1, "gloo", dtype=torch.float16).parallelize(gpt2(), fp16=True).dtype == torch.float16


# -- what fp16=True means where -------------------------------------------------------------------


@pytest.mark.parametrize("fast", [torch.float16, torch.bfloat16, None])
def test_fp16_true_is_float16_on_cuda_and_a_cpu_s_fast_half_dtype_elsewhere_said_so(monkeypatch, caplog, fast):
    monkeypatch.setattr(precision, "fast_cpu_half_dtype", lambda: fast)
    assert resolve_dtype(True, None, "cuda") == torch.float16 and not caplog.records
    assert resolve_dtype(True, None, "cpu") == fast
    assert [record.levelname for record in caplog.records] == ([] if fast == torch.float16 else ["WARNING"])
    if fast == torch.bfloat16:
        assert "fp16=True: the CPU ranks run in bfloat16" in caplog.text
    if fast is None:
        assert "fp16=True: the CPU ranks keep the model's dtype" in caplog.text
    assert resolve_dtype(False, None, "cpu") is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_given_dtype_is_taken_as_given_on_any_machine(monkeypatch, dtype):
    monkeypatch.setattr(precision, "fast_cpu_half_dtype", lambda: None)
    assert resolve_dtype(False, dtype, "cpu") == dtype
    if dtype == torch.float16:
        assert resolve_dtype(True, dtype, "cpu") == torch.float16


@pytest.mark.parametrize(
    ("amx_fp16", "avx512_bf16", "amx_tile", "expected"),
    [
        (True, True, True, torch.float16),  # Granite Rapids: float16 tiles
        (False, True, True, torch.bfloat16),  # Sapphire Rapids: bfloat16 tiles and instructions
        (False, True, False, torch.bfloat16),  # Zen 4/5, Cooper Lake: AVX512-BF16
        (False, False, False, None),  # AVX2, AVX-512 without BF16
    ],
)
def test_a_cpu_s_fast_half_dtype_follows_its_units(monkeypatch, amx_fp16, avx512_bf16, amx_tile, expected):
    for probe, present in [
        ("_is_amx_fp16_supported", amx_fp16),
        ("_is_avx512_bf16_supported", avx512_bf16),
        ("_is_amx_tile_supported", amx_tile),
    ]:
        monkeypatch.setattr(torch.cpu, probe, lambda present=present: present, raising=False)
    assert precision.fast_cpu_half_dtype() == expected


def test_a_torch_without_the_probes_has_no_fast_half_dtype(monkeypatch):
    for probe in ("_is_amx_fp16_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, probe, raising=False)
    assert precision.fast_cpu_half_dtype() is None


# -- row-parallel partial sums --------------------------------------------------------------------


def partials(world_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's partial sum: values of mixed scales, so that rounding every addition shows."""
    generator = torch.Generator().manual_seed(world_size)
    scales = torch.logspace(-2, 2, 64)
    return [(torch.randn(4, 64, generator=generator) * scales).to(dtype) for _ in range(world_size)]


def summed_in(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``((p_0 + p_1) + p_2) + ...`` in ``dtype``, rounded back to the parts' dtype."""
    total = parts[0].to(dtype)
    for part in parts[1:]:
        total = total + part.to(dtype)
    return total.to(parts[0].dtype)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world_size", [3, 4])
def test_half_precision_partial_sums_of_more_than_two_ranks_are_rounded_once(rank_pools, world_size, dtype):
    parts = partials(world_size, dtype)
    once, every_step = summed_in(parts, torch.float32), summed_in(parts, dtype)
    assert not torch.equal(once, every_step)  # the data tells the two apart
    for result in rank_pools.get(world_size).run(rank_helpers.reduce_partial_sums, parts):
        assert torch.equal(result, once)


def test_half_precision_partial_sums_of_two_ranks_travel_in_half_precision(rank_pools):
    """A sum of two halves is computed in fp32 and rounded once anyway: the same bits, half the bytes."""
    parts = partials(2, torch.bfloat16)
    assert torch.equal(summed_in(parts, torch.float32), summed_in(parts, torch.bfloat16))
    for result, sent in rank_pools.get(2).run(rank_helpers.reduce_partial_sums, parts, with_dtype_sent=True):
        assert torch.equal(result, summed_in(parts, torch.bfloat16)) and sent == [torch.bfloat16]


def test_the_equivalence_checker_casts_its_reference_as_the_ranks_cast_theirs(rank_pools):
    """One rank computes what this process computes, to the bit, only if both cast T5 alike (``wo`` in fp32)."""
    spec = ModelSpec(type(t5()), t5().config)
    check_equivalence(spec, inputs_for("t5"), world_sizes=(1,), pools=rank_pools, dtype=torch.float16, rtol=0)
