"""tpcore.load.safetensors_file: slices read with pread equal safetensors' own, and nothing stays mapped."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from tpcore.load import safetensors_file
from tpcore.load.safetensors_file import SafetensorsFile

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


def random_tensor(shape, dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100, 100, shape, dtype=dtype)


@st.composite
def slices(draw):
    """A tensor's shape and dtype, and a dim with a range ``[start, stop)`` of it (or ``None``: all)."""
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    dtype = draw(st.sampled_from(DTYPES))
    if not shape or draw(st.booleans()):
        return shape, dtype, None
    dim = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(0, shape[dim]))
    return shape, dtype, (dim, start, draw(st.integers(start, shape[dim])))


@settings(max_examples=150, deadline=None)
@given(cases=st.lists(slices(), min_size=1, max_size=4))
def test_a_slice_read_equals_safetensors_own_slice(tmp_path_factory, cases):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file({f"t{i}": random_tensor(shape, dtype) for i, (shape, dtype, _) in enumerate(cases)}, str(path))
    file = SafetensorsFile(path)
    with safe_open(path, framework="pt") as reference:
        for i, (shape, dtype, part) in enumerate(cases):
            key = f"t{i}"
            assert file.shape(key) == shape and file.dtype(key) == dtype
            if part is None:
                got, want = file.read(key), reference.get_tensor(key)
            else:
                dim, start, stop = part
                got = file.read(key, dim, start, stop)
                want = reference.get_slice(key)[(slice(None),) * dim + (slice(start, stop),)]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (key, part)
            assert got.is_contiguous()
    file.close()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    columns=st.integers(1, 8),
    dim=st.sampled_from([0, 1]),
    bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_a_flat_tensor_read_as_rows_gives_the_slice_of_its_reshape(tmp_path_factory, rows, columns, dim, bounds):
    """A tensor stored flat (bitsandbytes' packed 4-bit codes, ``(n, 1)``) read as ``(rows, columns)``: any rows or
    columns of it are those of the reshaped tensor."""
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    flat = torch.randint(0, 255, (rows * columns, 1), dtype=torch.uint8)
    save_file({"packed": flat}, str(path))
    size = (rows, columns)[dim]
    start, stop = sorted(round(bound * size) for bound in bounds)
    file = SafetensorsFile(path)
    got = file.read("packed", dim, start, stop, [rows, columns])
    assert torch.equal(got, flat.reshape(rows, columns).narrow(dim, start, stop - start))
    assert torch.equal(file.read("packed", None, view=[rows, columns]), flat.reshape(rows, columns))
    with pytest.raises(ValueError, match=r"tensor 'packed' of shape \[\d+, 1\] cannot be read as \[\d+, \d+\]"):
        file.read("packed", 0, 0, 1, [rows + 1, columns])
    file.close()


def test_columns_are_read_in_batches_of_iovecs_and_short_reads_are_continued(tmp_path, monkeypatch):
    tensor = torch.randn(3000, 10)  # 3000 runs of 4 columns: more than one preadv's iovecs
    save_file({"w": tensor}, str(tmp_path / "model.safetensors"))
    calls = []

    def short_preadv(fd, views, offset):  # the kernel may stop early: give at most 1000 bytes per call
        calls.append(len(views))
        budget = 1000
        data = os.pread(fd, min(budget, sum(v.nbytes for v in views)), offset)
        done = 0
        for view in views:
            part = data[done : done + view.nbytes]
            view[: len(part)] = part
            done += len(part)
            if done == len(data):
                break
        return done

    monkeypatch.setattr(safetensors_file, "_preadv", short_preadv)
    got = SafetensorsFile(tmp_path / "model.safetensors").read("w", 1, 3, 7)
    assert torch.equal(got, tensor[:, 3:7])
    assert max(calls) == safetensors_file._IOV_MAX and len(calls) > math.ceil(2 * 3000 / safetensors_file._IOV_MAX)


def test_a_read_leaves_no_mapping_of_the_file_and_close_lets_the_file_go(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(256, 256)}, str(path))
    file = SafetensorsFile(path)
    got = file.read("w", 0, 0, 128)
    assert str(path) not in Path("/proc/self/maps").read_text()
    file.close()
    assert torch.equal(got, SafetensorsFile(path).read("w")[:128])


def test_a_file_cut_short_after_its_header_was_read_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    file = SafetensorsFile(path)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 4096)
    with pytest.raises(ValueError, match="model.safetensors ended while reading it"):
        file.read("w")


def test_a_header_nested_past_the_parser_s_depth_is_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "nested.safetensors"
    header = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="nested.safetensors is not a safetensors file: its header is nested too deep"):
        safetensors_file.read_header(path)


def test_a_header_length_past_the_format_s_bound_is_refused_without_reading_it(tmp_path, monkeypatch):
    """A sparse file whose length field claims 256 MiB: refused from the field alone (nothing past it is read)."""
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as file:
        file.write((256 << 20).to_bytes(8, "little"))
        file.truncate(8 + (256 << 20) + 8)  # a hole: no disk, but reading it would fill memory
    reads: list[int] = []
    real_open = open

    def watched_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        real_read = handle.read
        handle.read = lambda size=-1: (reads.append(size), real_read(size))[1]
        return handle

    monkeypatch.setattr("builtins.open", watched_open)
    with pytest.raises(ValueError, match="sparse.safetensors is not a safetensors file: its header claims 268435456"):
        safetensors_file.read_header(path)
    assert reads == [8]
