"""Equivalence checking: run a model split over gloo ranks and compare it with the unsplit model.

For policy authors and for tpcore's own tests::

    from tpcore.testing import ModelSpec, PoolCache, check_equivalence

    spec = ModelSpec(BertForMaskedLM, BertConfig(hidden_size=64, num_attention_heads=4, ...), seed=0)
    with PoolCache() as pools:
        check_equivalence(spec, {"input_ids": ids, "attention_mask": mask}, world_sizes=(2, 4), pools=pools)

Every rank builds the same seeded model, parallelizes it and runs the inputs; every output tensor
of every rank must be within ``rtol * max|reference|`` of the unsplit model's, and with more than
one rank each rank must hold fewer parameters than the whole model (a policy that matched
nothing would otherwise pass trivially).

Hypothesis strategies for a plugin's property tests (they need hypothesis, the ``test`` extra):
:func:`split_sizes` draws config sizes that split over a drawn world size (evenly, or with
``uneven=True`` mostly not), :func:`padded_batches` draws padded batches of token ids,
:func:`sample_batches` batches of any modality (images, waveforms, audio features) built from a
model's config, :func:`seeds` the init seed::

    @given(sizes=split_sizes(), inputs=padded_batches(vocab_size=64), seed=seeds())
    def test_my_family(rank_pools, sizes, inputs, seed):
        config = MyConfig(hidden_size=sizes.hidden, num_heads=sizes.heads, num_layers=sizes.layers, ...)
        check_equivalence(ModelSpec(MyModel, config, seed), inputs, (sizes.world_size,), pools=rank_pools)

Tiny random-init models for tests (:mod:`tpcore.testing.tiny_models`): :func:`tiny_llama`, :func:`tiny_gpt2` and
:func:`tiny_bert` (and their ``*_config``), seeded, any config field overridden by keyword (:func:`seeded_model` for
any other class and config); :func:`word_tokenizer` for their vocabularies; :func:`random_weights` for weights with
no zero bias.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpcore.load.precision import cast_model
from tpcore.ranks.process import RankContext, RankPool, WorkerError, reraise
from tpcore.ranks.transfer import to_cpu, to_device
from tpcore.testing.tiny_models import (
    random_weights,
    seeded_model,
    tiny_bert,
    tiny_bert_config,
    tiny_gpt2,
    tiny_gpt2_config,
    tiny_llama,
    tiny_llama_config,
    tiny_seq2seq,
    word_tokenizer,
)

__all__ = [
    "DEFAULT_RTOL",
    "HALF_PRECISION_RTOL",
    "MEDIA_INPUTS",
    "check_model",
    "EquivalenceError",
    "ModelSpec",
    "PoolCache",
    "SavedModelSpec",
    "SCALE_FLOOR",
    "SplitSizes",
    "check_equivalence",
    "compare_outputs",
    "flatten_outputs",
    "padded_batch",
    "padded_batches",
    "sample_batches",
    "seeds",
    "sharded_forward",
    "split_sizes",
    "random_weights",
    "seeded_model",
    "tiny_bert",
    "tiny_bert_config",
    "tiny_gpt2",
    "tiny_gpt2_config",
    "tiny_llama",
    "tiny_llama_config",
    "tiny_seq2seq",
    "with_choices",
    "word_tokenizer",
]

#: fp32 tolerance relative to the reference output's scale: max|a - b| <= rtol * max|a|.
DEFAULT_RTOL = 1e-5

#: fp16/bf16 tolerances relative to the output scale, for a split and an unsplit run in the same
#: dtype (only the order of the reductions differs).
HALF_PRECISION_RTOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


#: The least scale an output is compared at. An output whose values all fall below it (two start/end
#: logits that happen to nearly cancel) carries the fp32 round-off of its O(1) inputs, which the split
#: sums in another order, far above ``rtol`` of its own size; a wrong split changes it by about its size.
SCALE_FLOOR = 1e-3


class EquivalenceError(AssertionError):
    """A split model's output differs from the unsplit model's beyond the tolerance."""


@dataclass(frozen=True)
class ModelSpec:
    """A model every process can rebuild identically: class, config and init seed. ``bias_std``: every
    parameter named ``*bias*`` drawn from ``N(0, bias_std^2)`` after the model's own init, where a model
    starts its biases at zero (a zero bias would hide a split that adds it on every rank)."""

    model_class: type[nn.Module]
    config: Any
    seed: int = 0
    bias_std: float = 0.0

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = self.model_class(self.config).eval()
        if self.bias_std:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "bias" in name.rpartition(".")[2]:
                        parameter.normal_(0.0, self.bias_std)
        return model


@dataclass(frozen=True)
class SavedModelSpec:
    """A model saved in a directory (``save_pretrained``): the reference loads it with
    ``from_pretrained``, each rank reads only its own slices of the files (``ParallelEngine.parallelize(path)``)."""

    path: str
    model_class: Any  # a transformers model class, or an auto class

    def build(self) -> nn.Module:
        from transformers.utils import logging

        logging.disable_progress_bar()
        return self.model_class.from_pretrained(self.path).eval()


def sharded_forward(
    context: RankContext, spec: ModelSpec, inputs: dict, policies=None, dtype=None, method="forward", seed=None
) -> tuple[Any, int]:
    """On one rank: build ``spec`` (or, for a :class:`SavedModelSpec`, read this rank's slices of its
    files), parallelize it over the pool's group (in ``dtype``), run ``model.<method>(**inputs)``;
    return the CPU outputs and the parameter elements the rank holds."""
    from tpcore.engine import ParallelEngine

    device = context.device.type  # gloo ranks may compute on CUDA
    engine = ParallelEngine(
        context.world_size, context.backend, policies, dtype=dtype, device=device, process_group=context.tp_group
    )
    if isinstance(spec, SavedModelSpec):
        model = engine.parallelize(spec.path, model_class=spec.model_class)
    else:
        model = engine.parallelize(spec.build())
    return run_on(model, inputs, context.device, method, seed), parameter_count(model)


def run_on(model: nn.Module, inputs: dict, device, method: str = "forward", seed: int | None = None) -> Any:
    """``model.<method>(**inputs)`` with the tensors moved to ``device`` and the RNG seeded with
    ``seed``; outputs come back on the CPU."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        return to_cpu(getattr(model, method)(**to_device(inputs, device)))


def parameter_count(model: nn.Module) -> int:
    """Elements held by the model's parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def flatten_outputs(value, prefix: str = "output") -> dict[str, torch.Tensor]:
    """Every tensor inside a model output, keyed by where it sits (``logits``, ``hidden_states.2``)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {}
    flat = {}
    for key, item in items:
        flat.update(flatten_outputs(item, key if prefix == "output" else f"{prefix}.{key}"))
    return flat


def compare_outputs(reference, candidate, rtol: float = DEFAULT_RTOL) -> dict[str, float]:
    """Max abs difference per output tensor; raise :class:`EquivalenceError` if any is off.

    A tensor passes when ``max|ref - got| <= rtol * max(max|ref|, SCALE_FLOOR)`` (``rtol=0``: identical).
    """
    expected, actual = flatten_outputs(reference), flatten_outputs(candidate)
    if expected.keys() != actual.keys():
        raise EquivalenceError(f"outputs differ in structure: {sorted(expected)} vs {sorted(actual)}")
    diffs, failures = {}, []
    for key, ref in expected.items():
        got = actual[key]
        if ref.shape != got.shape:
            raise EquivalenceError(f"{key}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        diff = (ref.double() - got.double()).abs().max().item() if ref.numel() else 0.0
        scale = max(ref.double().abs().max().item() if ref.numel() else 0.0, SCALE_FLOOR)
        diffs[key] = diff
        if not diff <= rtol * scale:  # also catches NaN
            failures.append(f"{key}: max abs diff {diff:.3e} > {rtol:g} x scale {scale:.3e}")
    if failures:
        raise EquivalenceError("; ".join(failures))
    return diffs


class PoolCache:
    """Long-lived :class:`RankPool` per world size; a pool that failed is replaced on next use."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, self.backend)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> PoolCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_equivalence(
    spec: ModelSpec,
    inputs: dict,
    world_sizes=(2,),
    *,
    policies=None,
    pools: PoolCache | None = None,
    rtol: float = DEFAULT_RTOL,
    dtype: torch.dtype | None = None,
    method: str = "forward",
    seed: int | None = None,
) -> dict[int, dict[str, float]]:
    """Compare ``spec`` split over each world size with the unsplit model, on every rank.

    ``method="generate"`` with ``rtol=0`` checks generated tokens for identity; ``seed`` seeds
    the RNG right before each run (sampling).

    The reference runs in this process in ``dtype`` on the pools' device type (``cuda:0`` for
    NCCL pools). Returns ``{world_size: {output name: max abs diff}}``; raises
    :class:`EquivalenceError` naming the world size, the rank and the output that differ. An
    exception raised on a rank is raised here as its own type, its ``__cause__`` the
    :class:`~tpcore.ranks.process.WorkerError` that holds the rank's traceback.
    """
    own_pools = pools is None
    pools = pools or PoolCache()
    device = torch.device("cuda", 0) if pools.backend == "nccl" else torch.device("cpu")
    model = spec.build()
    model = (cast_model(model, dtype) if dtype is not None else model).to(device)  # as the ranks cast it
    reference = run_on(model, inputs, device, method, seed)
    full_size = parameter_count(model)
    del model
    report = {}
    try:
        for world_size in world_sizes:
            try:
                results = pools.get(world_size).run(sharded_forward, spec, inputs, policies, dtype, method, seed)
            except WorkerError as error:  # a rank's exception, as its own type (the rank's traceback as cause)
                reraise(error)
            for rank, (outputs, size) in enumerate(results):
                where = f"{spec.model_class.__name__} split over {world_size} ranks, rank {rank}"
                if world_size > 1 and size >= full_size:
                    raise EquivalenceError(f"{where}: holds {size} parameters of {full_size}; nothing was split")
                try:
                    report[world_size] = compare_outputs(reference, outputs, rtol)
                except EquivalenceError as error:
                    raise EquivalenceError(f"{where}: {error}") from None
    finally:
        if own_pools:
            pools.close()
    return report


def check_model(
    model_class: type[nn.Module],
    config: Any,
    world_sizes=(2,),
    *,
    policies=None,
    pools: PoolCache | None = None,
    max_examples: int = 10,
    rtol: float = DEFAULT_RTOL,
) -> None:
    """The one-line check for policy authors: ``model_class(config)`` split over each world size
    equals the unsplit model for hypothesis-drawn batches: for a text model, sizes, token ids,
    right padding, and decoder ids for encoder-decoder models; for a model of images or audio
    (its forward takes ``pixel_values``, ``input_features`` or ``input_values``),
    :func:`sample_batches` built from its config. Raises :class:`EquivalenceError` on the first
    difference, naming the output, the world size, the rank and the amount."""
    from hypothesis import given, settings

    from tpcore.testing.samples import forward_parameters

    spec = ModelSpec(model_class, config)
    model = spec.build()
    if forward_parameters(model) & MEDIA_INPUTS:
        batches = sample_batches(model)
    else:
        vocab = min(int(getattr(config, "vocab_size", 64) or 64), 512)
        decoder = (1, 12) if getattr(config, "is_encoder_decoder", False) else None
        batches = padded_batches(vocab, batch=(1, 3), seq=(1, 12), decoder_seq=decoder)
    own_pools = pools is None
    pools = pools or PoolCache()

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(inputs=batches)
    def holds(inputs):
        check_equivalence(spec, inputs, world_sizes, policies=policies, pools=pools, rtol=rtol)

    try:
        holds()
    finally:
        if own_pools:
            pools.close()


# -- hypothesis strategies for property tests -----------------------------------------------------


@dataclass(frozen=True)
class SplitSizes:
    """Sizes of a small config that split evenly over ``world_size`` ranks (``hidden = heads * head_dim``)."""

    world_size: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    #: key/value heads: ``heads`` unless drawn with ``grouped_kv=True``
    kv_heads: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def split_sizes(
    world_sizes=(1, 2, 3, 4),
    *,
    heads_per_rank=(1, 3),
    head_dims=(2, 4, 8),
    intermediate_per_rank=(1, 24),
    layers=(1, 2),
    grouped_kv: bool = False,
    uneven: bool = False,
):
    """Strategy of :class:`SplitSizes`: a world size from ``world_sizes``, then heads and the MLP's
    intermediate size as multiples of it (``heads_per_rank``, ``intermediate_per_rank``: inclusive
    ranges per rank), a head size from ``head_dims`` and a layer count from ``layers``. With
    ``uneven``, heads and intermediate size are any count in those ranges times the world size, so
    mostly ones the ranks do not divide (dealt in whole heads, :mod:`tpcore.cut.shares`). With
    ``grouped_kv``, the key/value heads divide the heads; without ``uneven`` they also split over the
    ranks or are replicated evenly (they divide the world size or it divides them)."""
    from hypothesis import strategies as st

    def count(draw, world_size: int, per_rank: tuple[int, int]) -> int:
        low, high = per_rank
        return draw(st.integers(low * world_size, high * world_size) if uneven else st.integers(low, high)) * (
            1 if uneven else world_size
        )

    @st.composite
    def draw_sizes(draw) -> SplitSizes:
        world_size = draw(st.sampled_from(world_sizes))
        heads = count(draw, world_size, heads_per_rank)
        kv_heads = heads
        if grouped_kv:
            splittable = [
                d
                for d in range(1, heads + 1)
                if heads % d == 0 and (uneven or d % world_size == 0 or world_size % d == 0)
            ]
            kv_heads = draw(st.sampled_from(splittable))
        return SplitSizes(
            world_size=world_size,
            heads=heads,
            head_dim=draw(st.sampled_from(head_dims)),
            intermediate=count(draw, world_size, intermediate_per_rank),
            layers=draw(st.integers(*layers)),
            kv_heads=kv_heads,
        )

    return draw_sizes()


def padded_batch(
    lengths,
    seq: int,
    vocab_size: int,
    seed: int = 0,
    *,
    padding: str = "right",
    pad_token_id: int = 0,
    min_token_id: int = 3,
) -> dict:
    """``{"input_ids", "attention_mask"}``, both ``(len(lengths), seq)``: row ``i`` holds ``lengths[i]``
    real tokens, seeded random ids in ``[min_token_id, vocab_size)`` (below it: the special tokens),
    padded on the ``"right"`` (encoders) or the ``"left"`` (generation) with ``pad_token_id``."""
    if padding not in ("right", "left"):
        raise ValueError(f"padding must be 'right' or 'left', not {padding!r}")
    if vocab_size <= min_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no token id at or above min_token_id {min_token_id}")
    if not all(1 <= n <= seq for n in lengths):
        raise ValueError(f"every row needs 1 to seq={seq} real tokens, not {list(lengths)}")
    ids = torch.randint(min_token_id, vocab_size, (len(lengths), seq), generator=torch.Generator().manual_seed(seed))
    real, positions = torch.tensor(list(lengths))[:, None], torch.arange(seq)[None, :]
    mask = positions < real if padding == "right" else positions >= seq - real
    return {"input_ids": ids.masked_fill(~mask, pad_token_id), "attention_mask": mask.long()}


def padded_batches(vocab_size: int, *, batch=(1, 3), seq=(1, 9), decoder_seq=None, **options):
    """Strategy of :func:`padded_batch` inputs: ``batch`` rows of ``seq`` tokens (inclusive ranges),
    each row's real length and the ids' seed drawn; ``options`` go to :func:`padded_batch`.
    ``decoder_seq`` (an inclusive range) adds ``decoder_input_ids`` ``(batch, m)`` for encoder-decoders."""
    from hypothesis import strategies as st

    @st.composite
    def draw_batch(draw) -> dict:
        rows, length = draw(st.integers(*batch)), draw(st.integers(*seq))
        lengths = draw(st.lists(st.integers(1, length), min_size=rows, max_size=rows))
        inputs = padded_batch(lengths, length, vocab_size, draw(seeds()), **options)
        if decoder_seq is not None:
            decoder = draw(st.integers(*decoder_seq))
            inputs["decoder_input_ids"] = padded_batch([decoder] * rows, decoder, vocab_size, draw(seeds()))[
                "input_ids"
            ]
        return inputs

    return draw_batch()


#: the inputs of image and audio models, for which :func:`check_model` draws :func:`sample_batches`
MEDIA_INPUTS = frozenset({"pixel_values", "input_features", "input_values"})


def sample_batches(model: nn.Module, *, batch=(1, 3), seq=(2, 9)):
    """Strategy of :func:`tpcore.testing.samples.sample_inputs` batches for ``model``, any modality
    (images, waveforms or audio features with a padded row, token ids, decoder ids): ``batch`` rows
    and a length ``seq`` (inclusive ranges; audio takes ``2 * seq`` frames or more), from a drawn seed."""
    from hypothesis import strategies as st

    from tpcore.testing.samples import sample_inputs

    return st.builds(
        lambda rows, length, seed: sample_inputs(model, batch=rows, seq=length, seed=seed),
        st.integers(*batch),
        st.integers(*seq),
        seeds(),
    )


def seeds():
    """Strategy of model init seeds (:attr:`ModelSpec.seed`)."""
    from hypothesis import strategies as st

    return st.integers(0, 2**16)


def with_choices(inputs: dict, choices: int = 2) -> dict:
    """``inputs`` for a multiple-choice head: every ``(batch, seq)`` tensor repeated as ``(batch, choices, seq)``."""
    return {
        key: value[:, None].expand(-1, choices, -1).contiguous() if isinstance(value, torch.Tensor) else value
        for key, value in inputs.items()
    }
