"""Checkpoints as transformers saves them: legacy key names (ViT) and per-expert tensors that load merged
into fused ones (Mixtral, Qwen2-MoE) are read as ``from_pretrained`` reads them, each rank reading only
the pieces of the stored tensors that its slice covers."""

from __future__ import annotations

import pytest
import rank_helpers
import torch
from process_probes import children
from rank_helpers import ViTLayerPolicy
from safetensors import safe_open
from safetensors.torch import save_file
from tp_gpt.policies import LlamaPolicy
from transformers import (
    Dinov2Config,
    Dinov2Model,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import tpcore
from tpcore.compat.parallelformers import shard
from tpcore.cut.split import Split
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.skeleton import empty_model, install_tensors, named_tensors
from tpcore.testing import compare_outputs

VIT = ViTConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=8
)
MIXTRAL = MixtralConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
QWEN2_MOE = Qwen2MoeConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip
EXPERTS = 4
MODELS = {"mixtral": (MixtralForCausalLM, MIXTRAL), "qwen2_moe": (Qwen2MoeForCausalLM, QWEN2_MOE)}


def saved(tmp_path_factory, model_class, config, seed=0):
    torch.manual_seed(seed)
    directory = tmp_path_factory.mktemp(config.model_type)
    model_class(config).save_pretrained(directory)
    return directory


def stored_keys(directory) -> set[str]:
    with safe_open(directory / "model.safetensors", framework="pt") as file:
        return set(file.keys())


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    return saved(tmp_path_factory, ViTForImageClassification, VIT)


@pytest.fixture(scope="module", params=list(MODELS))
def moe_dir(request, tmp_path_factory):
    return saved(tmp_path_factory, *MODELS[request.param])


def reference(directory):
    """The model from_pretrained loads from ``directory``, and its tensors by name."""
    model = empty_model(Checkpoint(directory).config())
    model = type(model).from_pretrained(directory).eval()
    return model, named_tensors(model)


def expected(tensor: torch.Tensor, split: Split | None, rank: int, world_size: int) -> torch.Tensor:
    return tensor if split is None else shard(tensor, split.dim, rank, world_size, split.n_fused, split.heads)


class Spy:
    """Wraps a safetensors file of a checkpoint: records which part of which stored tensor is read."""

    def __init__(self, handle, log: list):
        self.handle, self.log = handle, log

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def read(self, key, dim=None, start=0, stop=0, view=None):
        self.log.append((key, "whole" if dim is None else (slice(None),) * dim + (slice(start, stop),)))
        return self.handle.read(key, dim, start, stop, view)


@pytest.fixture
def read_log(monkeypatch) -> list:
    """Every read of a stored tensor through a checkpoint: ``(key, index or "whole")``."""
    log: list = []
    handle = Checkpoint._handle
    monkeypatch.setattr(Checkpoint, "_handle", lambda self, *args: Spy(handle(self, *args), log))
    return log


# -- the key layouts transformers writes ---------------------------------------------------------


def test_save_pretrained_writes_legacy_names_that_the_model_does_not_have(vit_dir, moe_dir):
    """What the rest of this file is about (transformers 5.17 to 5.24): the files' keys are not the model's."""
    vit = stored_keys(vit_dir)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in vit
    assert "vit.layers.0.attention.q_proj.weight" not in vit
    moe = stored_keys(moe_dir)
    assert not any(key.endswith("experts.gate_up_proj") for key in moe)
    assert sum(".experts.0." in key for key in moe) == 3 * 2  # gate, up and down of expert 0, in each layer


# -- reading: equal to from_pretrained's tensors, cut ---------------------------------------------

VIT_SPLITS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "fc1": 0, "o_proj.weight": 1, "fc2.weight": 1}


def vit_split(name: str) -> Split | None:
    return next((Split(0 if name.endswith("bias") else dim) for part, dim in VIT_SPLITS.items() if part in name), None)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_vit_saved_under_legacy_names_reads_as_from_pretrained_loads_it(vit_dir, world_size):
    _, tensors = reference(vit_dir)
    checkpoint = Checkpoint(vit_dir)
    model = empty_model(checkpoint.config())
    reads = checkpoint.reads(model, {name: vit_split(name) for name in named_tensors(model)})
    assert {read.name for read in reads} == set(tensors)
    assert sum(read.split is not None for read in reads) == 2 * 10  # per layer: q, k, v, fc1 and biases, o, fc2
    for rank in range(world_size):
        for read in reads:
            want = expected(tensors[read.name], read.split, rank, world_size)
            assert torch.equal(checkpoint.read_tensor(read, rank, world_size), want), read.name


def expert_split(name: str) -> Split | None:
    if name.endswith("experts.gate_up_proj"):  # (E, 2I, H): each rank holds its rows of gate and of up
        return Split(dim=1, n_fused=2)
    if name.endswith("experts.down_proj"):  # (E, H, I)
        return Split(dim=2)
    return None


def expert_reads(checkpoint, model):
    return checkpoint.reads(model, {name: expert_split(name) for name in named_tensors(model)})


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_reads_only_its_pieces_of_each_experts_stored_tensors(moe_dir, world_size, read_log):
    _, tensors = reference(moe_dir)
    checkpoint = Checkpoint(moe_dir)
    model = empty_model(checkpoint.config())
    reads = [read for read in expert_reads(checkpoint, model) if read.split is not None]
    assert len(reads) == 2 * 2 and all(read.sources.converted is None for read in reads)  # read lazily
    for rank in range(world_size):
        for read in reads:
            read_log.clear()
            got = checkpoint.read_tensor(read, rank, world_size)
            assert torch.equal(got, expected(tensors[read.name], read.split, rank, world_size)), read.name
            # gate_up_proj: rows [r*I/N, (r+1)*I/N) of each expert's gate and up; down_proj: those columns
            keys = read.sources.all_keys
            assert len(keys) == EXPERTS * (2 if read.split.n_fused == 2 else 1)
            size = tensors[read.name].shape[read.split.dim] // read.split.n_fused
            piece = slice(rank * size // world_size, (rank + 1) * size // world_size)
            index = (piece,) if read.split.n_fused == 2 else (slice(None), piece)
            assert sorted(read_log) == sorted((key, index) for key in keys)


def test_load_into_fills_split_expert_tensors_and_a_whole_model_equals_from_pretrained(moe_dir):
    reference_model, tensors = reference(moe_dir)
    checkpoint = Checkpoint(moe_dir)
    model = empty_model(checkpoint.config())
    reads = expert_reads(checkpoint, model)
    for rank in range(2):
        skeleton = empty_model(checkpoint.config())
        shares = {read.name: expected(tensors[read.name], read.split, rank, 2) for read in reads}
        install_tensors(
            skeleton, {name: share.to("meta") for name, share in shares.items() if share.is_floating_point()}
        )
        Checkpoint(moe_dir).load_into(skeleton, reads, rank, 2)
        for name, tensor in named_tensors(skeleton).items():
            assert torch.equal(tensor, shares.get(name, tensors[name])), name
    whole = empty_model(checkpoint.config())
    Checkpoint(moe_dir).load_into(whole, checkpoint.reads(whole, {}), 0, 1)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        compare_outputs(reference_model(input_ids=ids), whole(input_ids=ids))


def test_an_operation_not_read_lazily_reads_its_sources_whole_and_cuts_them(tmp_path_factory, read_log):
    """DINOv2's SwiGLU ``weights_in`` is chunked into gate and up (transformers' ``Chunk``): the fallback."""
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=8, use_swiglu_ffn=True
    )
    directory = saved(tmp_path_factory, Dinov2Model, config)
    assert "encoder.layer.0.mlp.weights_in.weight" in stored_keys(directory)
    _, tensors = reference(directory)
    if "encoder.layer.0.mlp.gate_proj.weight" not in tensors:
        pytest.skip("this transformers keeps DINOv2's weights_in as saved: nothing is converted")
    checkpoint = Checkpoint(directory)
    model = empty_model(checkpoint.config())
    splits = {name: Split(0) if ".mlp.gate_proj." in name or ".mlp.up_proj." in name else None for name in tensors}
    reads = {read.name: read for read in checkpoint.reads(model, splits)}
    assert set(reads) == set(tensors)
    for name in ("encoder.layer.0.mlp.gate_proj.weight", "encoder.layer.0.mlp.up_proj.bias"):
        assert reads[name].sources.converted is not None
        for rank in range(2):
            read_log.clear()
            assert torch.equal(checkpoint.read_tensor(reads[name], rank, 2), shard(tensors[name], 0, rank, 2)), name
            assert read_log == [(reads[name].sources.keys[0][0], "whole")]


# -- errors in the caller, before any rank loads ---------------------------------------------------


def test_an_expert_missing_from_a_merged_tensor_fails_before_any_rank_loads(tmp_path, spawned):
    torch.manual_seed(0)
    MixtralForCausalLM(MIXTRAL).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as file:
        kept = {key: file.get_tensor(key) for key in file.keys() if ".layers.1.block_sparse_moe.experts.3." not in key}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    kids = children()
    with pytest.raises(ValueError, match=r"MixtralForCausalLM's 'model\.layers\.1\.mlp\.experts\.\w+' the shape \(3, "):
        tpcore.parallelize(tmp_path, num_gpus=2, custom_policies=[MixtralAttention])
    assert len(spawned) == 2 and children() <= kids  # the ranks were starting (the model is built meanwhile): gone


# -- end to end: parallelize(directory) ---------------------------------------------------------------


class MixtralAttention(LlamaPolicy):
    """Mixtral's attention split as Llama's; the experts stay replicated (their split is another policy's)."""

    layer_class = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"

    @staticmethod
    def mlp_in():
        return []

    @staticmethod
    def mlp_out():
        return []


@pytest.mark.slow  # a world of its own; the engine tests above read the legacy names in the quick suite
def test_parallelize_a_saved_vit_equals_from_pretrained(vit_dir, rank_pools):
    reference_model, _ = reference(vit_dir)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference_model(pixel_values=pixels)
    model = tpcore.parallelize(vit_dir, num_gpus=2, backend="gloo", custom_policies=[ViTLayerPolicy])
    try:
        compare_outputs(want, model(pixel_values=pixels))
    finally:
        model.deparallelize()
    ranks = rank_pools.get(2).run(
        rank_helpers.engine_logits_from_checkpoint, str(vit_dir), [ViTLayerPolicy], {"pixel_values": pixels}
    )
    for logits in ranks:  # ParallelEngine(2).parallelize(directory) on each rank
        compare_outputs(want.logits, logits)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_parallelize_a_saved_moe_model_equals_from_pretrained(tmp_path_factory):
    """Mixtral from its per-expert files: attention split over the ranks, the merged experts replicated."""
    directory = saved(tmp_path_factory, MixtralForCausalLM, MIXTRAL)
    reference_model, _ = reference(directory)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference_model(input_ids=ids)
    model = tpcore.parallelize(directory, num_gpus=2, backend="gloo", custom_policies=[MixtralAttention])
    try:
        compare_outputs(want, model(input_ids=ids))
    finally:
        model.deparallelize()
