"""Shard-on-load: ranks read their own slices of a saved checkpoint (safetensors, single or sharded,
or pickle files opened with ``weights_only``), and the caller never holds the weights."""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import re
import shutil

import pytest
import rank_helpers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from output_probes import bar_states, on_terminal
from process_probes import children
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import BertConfig, BertForMaskedLM, GPT2LMHeadModel, GPT2Model

import tpcore
from tpcore.compat.parallelformers import shard
from tpcore.cut.split import Split
from tpcore.load.checkpoint import Checkpoint
from tpcore.testing import compare_outputs, tiny_gpt2

#: tiny_gpt2 with its special ids inside the vocabulary: ``gpt2(seed=0, model_class=GPT2LMHeadModel)``
gpt2 = functools.partial(tiny_gpt2, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A small GPT-2 saved with ``save_pretrained`` (safetensors, one file), for the module."""
    directory = tmp_path_factory.mktemp("gpt2")
    gpt2().save_pretrained(directory)
    return directory


def ids(batch: int = 2, seq: int = 7, vocab: int = 101, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# -- reading slices ------------------------------------------------------------------------------


def write(directory, tensors: dict[str, torch.Tensor], layout: str) -> None:
    """Save ``tensors`` as one safetensors file, two with an index, or one pickle file."""
    if layout == "single":
        save_file(tensors, directory / "model.safetensors")
    elif layout == "sharded":
        names = sorted(tensors)
        halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for file, keys in halves.items():
            save_file({key: tensors[key] for key in keys}, directory / file)
        weight_map = {key: file for file, keys in halves.items() for key in keys}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")


splits = st.one_of(
    st.builds(lambda dim, n_fused: Split(dim, n_fused), st.integers(0, 1), st.sampled_from([1, 3])),
    st.builds(lambda dim: Split(dim, pad=True), st.integers(0, 1)),
    st.just(Split(0, heads=1)),
)


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from(["single", "sharded", "pickle"]),
    split=splits,
    world_size=st.integers(1, 4),
    odd=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_a_slice_read_from_the_files_equals_the_slice_cut_from_the_tensor(
    tmp_path_factory, layout, split, world_size, odd, seed
):
    directory = tmp_path_factory.mktemp("ckpt")
    size = 12 * split.n_fused * (split.heads or 1) + (odd if split.pad else 0)
    shape = [size, 5] if split.dim == 0 else [5, size]
    generator = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(shape, generator=generator), "b": torch.randn(3, generator=generator)}
    write(directory, tensors, layout)
    checkpoint = Checkpoint(directory)
    assert set(checkpoint.files) == {"w", "b"}
    for rank in range(world_size):
        expected = shard(tensors["w"], split.dim, rank, world_size, split.n_fused, split.heads, split.pad)
        assert torch.equal(checkpoint.read("w", split, rank, world_size), expected)
    assert torch.equal(checkpoint.read("b", None, 0, world_size), tensors["b"])


@pytest.mark.parametrize("layout", ["single", "sharded", "pickle"])
def test_reading_onto_the_cpu_by_name_gives_the_same_tensors_in_memory_of_their_own(tmp_path, layout):
    generator = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(13, 6, generator=generator), "b": torch.randn(6, generator=generator).half()}
    write(tmp_path, tensors, layout)
    checkpoint = Checkpoint(tmp_path)
    for key, split in [("w", None), ("w", Split(0, pad=True)), ("w", Split(1, n_fused=3)), ("b", Split(0))]:
        for rank in range(2):
            expected = checkpoint.read(key, split, rank, 2)
            for device in ("cpu", torch.device("cpu")):
                for dtype in (None, torch.float16, torch.float64):
                    got = checkpoint.read(key, split, rank, 2, device, dtype)
                    assert torch.equal(got, expected) and got.dtype == tensors[key].dtype and got.is_contiguous()
                    got.add_(1)  # not a view of the file, nor of another read
                    assert torch.equal(checkpoint.read(key, split, rank, 2), expected)


@pytest.mark.parametrize("layout", ["single", "pickle"])
def test_a_gpu_rank_reads_a_tensor_that_its_cast_would_shrink_to_the_cpu(tmp_path, layout):
    from tpcore.load.checkpoint import _shrinks

    write(tmp_path, {"w": torch.ones(4, 2), "b": torch.ones(2).half()}, layout)
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.stored_dtype("w") == torch.float32
    got = checkpoint.read("w", Split(0), 1, 2, device="cuda:1", dtype=torch.float16)  # no CUDA touched: staged
    assert got.device.type == "cpu" and torch.equal(got, torch.ones(2, 2))
    assert _shrinks(torch.float32, torch.float16) and _shrinks(torch.float64, torch.bfloat16)
    same_or_wider = [(torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.float32, torch.float32)]
    no_cast = [(torch.int64, torch.float16), (torch.float32, None), (None, torch.float16)]
    assert not any(_shrinks(stored, dtype) for stored, dtype in same_or_wider + no_cast)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickle_checkpoint_with_code_in_it_is_refused(tmp_path):
    with open(tmp_path / "pytorch_model.bin", "wb") as file:
        pickle.dump({"w": Payload()}, file, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        Checkpoint(tmp_path)


def test_a_directory_without_weights_or_a_missing_one_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        tpcore.parallelize(tmp_path / "nowhere", num_gpus=2)
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        Checkpoint(tmp_path)


# -- parallelize() and the engine from a checkpoint ----------------------------------------------


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_parallelize_from_a_checkpoint_equals_the_unsplit_model_and_the_caller_holds_no_weights(gpt2_dir, caplog):
    """... and shows a bar over the bytes every rank read, each rank logging what it read."""
    reference = gpt2()
    inputs = ids()
    with torch.inference_mode():
        expected = reference(input_ids=inputs)
        tokens = reference.generate(inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    caplog.set_level(logging.INFO, logger="tpcore")
    with on_terminal() as screen:
        model = tpcore.parallelize(gpt2_dir, num_gpus=2, backend="gloo")
    try:
        plan = model._tpcore_handle.plan
        read = [plan.bytes_per_rank(rank) for rank in (0, 1)]  # fp32 stored, fp32 built: the bytes the ranks read
        final = bar_states(screen.getvalue(), "tpcore: 2 ranks loaded")[-1]
        shown = tqdm.format_sizeof(sum(read), divisor=1024)
        assert final.startswith("tpcore: 2 ranks loaded: 100%|") and f"| {shown}/{shown} [" in final
        assert len(bar_states(screen.getvalue(), "tpcore: 2 ranks loading")) >= 1
        for rank in (0, 1):
            (line,) = [r.getMessage() for r in caplog.records if r.name == "tpcore.parallelize" and r.rank == rank]
            assert line.startswith(f"rank {rank}: read {read[rank] / 2**10:.1f} KiB in ")
        # served, its class is a subclass of its own of the same name (device and dtype: the ranks')
        assert isinstance(model, GPT2LMHeadModel) and type(model).__name__ == "GPT2LMHeadModel"
        assert model.config.n_layer == 2 and model.device == torch.device("cpu")
        assert {p.device.type for p in model.parameters()} == {"meta"}
        compare_outputs(expected, model(input_ids=inputs))
        assert torch.equal(model.generate(inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False), tokens)
        shares = model.memory_allocated()
        assert len(shares) == 2 and all(
            v < 0.6 * 4 * sum(p.numel() for p in reference.parameters()) for v in shares.values()
        )
    finally:
        assert type(model.deparallelize()) is GPT2LMHeadModel  # its own class back, its weights gathered


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3])
def test_a_sharded_safetensors_bert_loads_split_over_the_ranks(tmp_path, world_size):
    """10 heads dealt 4, 3 and 3 over 3 ranks, each rank reading its own uneven slices (even splits read
    the same way: the GPT-2 checkpoints of the tests above load over 2 ranks)."""
    config = BertConfig(
        vocab_size=97, hidden_size=40, num_hidden_layers=2, num_attention_heads=10, intermediate_size=95
    )
    torch.manual_seed(2)
    reference = BertForMaskedLM(config).eval()
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    inputs = {"input_ids": ids(vocab=97), "attention_mask": mask}
    with torch.inference_mode():
        expected = reference(**inputs)
    model = tpcore.parallelize(tmp_path, num_gpus=world_size, backend="gloo")
    try:
        compare_outputs(expected, model(**inputs))
    finally:
        model.deparallelize()


@pytest.mark.slow
def test_a_base_model_checkpoint_fills_a_model_with_a_head_through_the_prefix(tmp_path):
    base = gpt2(seed=4, model_class=GPT2Model)
    base.save_pretrained(tmp_path)
    reference = gpt2(seed=None)  # the RNG as the base left it
    reference.transformer.load_state_dict(base.state_dict())  # the head is tied to the base's embeddings
    inputs = ids()
    with torch.inference_mode():
        expected = reference(input_ids=inputs).logits
    model = tpcore.parallelize(tmp_path, num_gpus=2, backend="gloo", model_class=GPT2LMHeadModel)
    try:
        compare_outputs(expected, model(input_ids=inputs).logits)
    finally:
        model.deparallelize()


def test_errors_found_while_the_ranks_start_stop_them_before_they_are_raised(tmp_path, gpt2_dir, spawned):
    """From a checkpoint the ranks start while the caller builds the model: what the model shows wrong then
    (weights the files lack, sizes that do not split) stops them before it is raised."""
    tensors = {k: v for k, v in gpt2().state_dict().items() if not k.startswith("transformer.h.1.mlp")}
    save_file({k: v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((gpt2_dir / "config.json").read_text())
    kids = children()
    with pytest.raises(KeyError, match=r"lacks 4 parameters of GPT2LMHeadModel: transformer\.h\.1\.mlp"):
        tpcore.parallelize(tmp_path, num_gpus=2)
    assert len(spawned) == 2 and children() <= kids
    with pytest.raises(tpcore.ShardingError, match="GPT2LMHeadModel over 13 ranks.*12 heads are fewer than the ranks"):
        tpcore.parallelize(gpt2_dir, num_gpus=13)
    assert len(spawned) == 2 + 13 and children() <= kids


# -- damaged checkpoints fail in the caller, before any rank starts --------------------------------


@pytest.fixture(scope="module")
def gpt2_shards(tmp_path_factory):
    """GPT-2 saved in four safetensors shards, and the same shards as pickle files."""
    directory = tmp_path_factory.mktemp("gpt2-shards")
    gpt2().save_pretrained(directory, max_shard_size="100KB")
    pickled = tmp_path_factory.mktemp("gpt2-pickle-shards")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        torch.save(load_file(directory / name), pickled / name.replace(".safetensors", ".bin"))
    index["weight_map"] = {key: name.replace(".safetensors", ".bin") for key, name in index["weight_map"].items()}
    (pickled / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    shutil.copy(directory / "config.json", pickled)
    return {"sharded": directory, "pickle": pickled}


SHARD = "model-00002-of-00004.safetensors"


def tensors_in(file) -> int:
    index = next(file.parent.glob("*.index.json"))
    return list(json.loads(index.read_text())["weight_map"].values()).count(file.name)


def header_of(file) -> tuple[dict, bytes]:
    """A safetensors file's header and the bytes after it."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def missing_file(directory, name=SHARD):
    count = tensors_in(directory / name)
    (directory / name).unlink()
    return (
        FileNotFoundError,
        rf"{name} is missing from the checkpoint in '{re.escape(str(directory))}': the index maps {count} tensors",
    )


def truncated(directory, name=SHARD):
    file = directory / name
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    return (
        ValueError,
        rf"{name} is truncated: tensor '[\w.]+' ends at byte \d+ but the file has {len(data) - 100} bytes",
    )


def garbage_header(directory):
    file = directory / SHARD
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32
    file.write_bytes(bytes(data))
    return ValueError, f"{SHARD} is not a safetensors file: its header is not valid JSON"


def garbage_header_length(directory):
    file = directory / SHARD
    file.write_bytes(b"\x00\x01" * 4 + file.read_bytes()[8:])
    return ValueError, rf"{SHARD} is truncated or not a safetensors file: its header ends at byte \d+ but the file has"


def shape_not_matching_its_bytes(directory):
    file = directory / SHARD
    header, data = header_of(file)
    key = next(key for key in header if key != "__metadata__")
    header[key]["shape"][0] += 1
    encoded = json.dumps(header).encode()
    file.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    return ValueError, rf"{SHARD} is corrupt: tensor '{key}' of dtype F32 and shape \[.*\] needs \d+ bytes"


def index_naming_a_key_the_file_lacks(directory):
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = next(key for key, name in index["weight_map"].items() if name != SHARD)
    index["weight_map"][key] = SHARD
    index_file.write_text(json.dumps(index))
    return ValueError, rf"{SHARD} lacks 1 of the tensors the index maps to it: {key}"


def index_not_json(directory):
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {')
    return ValueError, "model.safetensors.index.json in .* is not valid JSON"


def index_without_weight_map(directory):
    (directory / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return ValueError, "model.safetensors.index.json in .* has no 'weight_map'"


def truncated_pickle(directory):
    name = SHARD.replace(".safetensors", ".bin")
    file = directory / name
    file.write_bytes(file.read_bytes()[:-100])
    return ValueError, rf"{re.escape(name)} in 'damaged' cannot be read as a weights file: PytorchStreamReader"


DAMAGES = {
    "sharded-missing-shard": ("sharded", missing_file),
    "sharded-truncated-shard": ("sharded", truncated),
    "sharded-garbage-header": ("sharded", garbage_header),
    "sharded-garbage-header-length": ("sharded", garbage_header_length),
    "sharded-shape-not-matching-its-bytes": ("sharded", shape_not_matching_its_bytes),
    "sharded-index-naming-a-key-the-file-lacks": ("sharded", index_naming_a_key_the_file_lacks),
    "sharded-index-not-json": ("sharded", index_not_json),
    "sharded-index-without-weight-map": ("sharded", index_without_weight_map),
    "single-truncated": ("single", lambda directory: truncated(directory, "model.safetensors")),
    "pickle-missing-shard": (
        "pickle",
        lambda directory: missing_file(directory, SHARD.replace(".safetensors", ".bin")),
    ),
    "pickle-truncated-shard": ("pickle", truncated_pickle),
}


def damaged(source, damage, tmp_path):
    """A copy of a saved GPT-2 with ``damage`` done to it, and the error it must fail with."""
    directory = tmp_path / "damaged"
    shutil.copytree(source, directory)
    return directory, *damage(directory)


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_checkpoint_fails_naming_the_file_before_any_rank_starts(
    case, gpt2_dir, gpt2_shards, tmp_path, no_process_starts
):
    kind, damage = DAMAGES[case]
    directory, error, match = damaged(gpt2_dir if kind == "single" else gpt2_shards[kind], damage, tmp_path)
    with pytest.raises(error, match=match):
        tpcore.parallelize(directory, num_gpus=2)


def test_the_engine_fails_on_a_missing_shard_before_joining_a_process_group(
    gpt2_shards, tmp_path, monkeypatch, no_process_starts
):
    directory, error, match = damaged(gpt2_shards["sharded"], missing_file, tmp_path)
    monkeypatch.setattr("tpcore.engine.tensor_parallel_group", lambda *a: pytest.fail("joined a process group"))
    with pytest.raises(error, match=match):
        tpcore.ParallelEngine(2).parallelize(directory)


def test_the_spmd_engine_shows_rank_0s_reads_on_a_bar(gpt2_dir):
    with on_terminal() as screen:
        model = tpcore.ParallelEngine(1, "gloo").parallelize(gpt2_dir)
    shown = tqdm.format_sizeof(sum(t.numel() * t.element_size() for t in [*model.parameters()]), divisor=1024)
    final = bar_states(screen.getvalue(), "tpcore: rank 0 of 1 loaded")[-1]
    assert final.startswith("tpcore: rank 0 of 1 loaded: 100%|") and f"| {shown}/" in final


def test_the_spmd_engine_warns_on_rank_0_alone_when_much_stays_whole(rank_pools, gpt2_dir, caplog):
    rank_pools.get(2).run(rank_helpers.engine_from_checkpoint, str(gpt2_dir), ids(), vocab_parallel=False)
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (warning.name, warning.rank) == ("tpcore.plan", 0)
    lines = warning.getMessage().splitlines()
    assert re.fullmatch(
        r"rank 0: GPT2LMHeadModel over 2 ranks: .* of its .* \(\d+%\) stays whole on every rank; the largest:", lines[0]
    )
    assert lines[1] == "    transformer.wte (Embedding, 18.9 KiB) is replicated: vocab_parallel=False"


def test_the_spmd_engine_reads_its_own_slices_from_a_checkpoint(rank_pools, gpt2_dir):
    inputs = ids()
    with torch.inference_mode():
        expected = gpt2()(input_ids=inputs).logits
    full = sum(p.numel() for p in gpt2().parameters())
    for logits, devices, held in rank_pools.get(2).run(rank_helpers.engine_from_checkpoint, str(gpt2_dir), inputs):
        compare_outputs(expected, logits)
        assert devices == {"cpu"} and held < 0.55 * full


def test_a_checkpoint_that_ships_code_is_refused_without_running_it_or_prompting(
    gpt2_dir, tmp_path, monkeypatch, no_process_starts
):
    """``auto_map`` to a config class of the checkpoint's own: refused before any rank starts, its code never
    imported (it would leave a file behind), and no "run the custom code? [y/N]" prompt on a terminal."""
    directory = tmp_path / "ships-code"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((gpt2_dir / "model.safetensors").read_bytes())
    config = json.loads((gpt2_dir / "config.json").read_text())
    config.update(model_type="shipped", auto_map={"AutoConfig": "configuration_shipped.ShippedConfig"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_shipped.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('CODE_RAN').touch()\n"
        "from transformers import PretrainedConfig\n"
        "class ShippedConfig(PretrainedConfig):\n    model_type = 'shipped'\n"
    )
    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("prompted on the terminal"))
    with pytest.raises(ValueError, match="tpcore never runs a checkpoint's code"):
        tpcore.parallelize(directory, num_gpus=2)
    assert not (directory / "CODE_RAN").exists()
