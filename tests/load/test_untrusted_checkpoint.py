"""An untrusted checkpoint: its index names files inside its directory, and its safetensors headers are read as
strictly as safetensors reads them, in the caller, before any rank starts (docs/security.md).

The headers and indices are drawn as a fuzzer would: valid ones, then broken in up to two ways at once. A header
is accepted exactly where safetensors itself accepts it, except for the forms tpcore refuses by design (a tensor
named twice; an entry or a dtype in a form no writer emits), and a refusal is a ``ValueError`` naming the file (and
the tensor, where one entry is at fault), reading no more than the header. A few examples in the quick suite, many
in the slow one.
"""

from __future__ import annotations

import builtins
import functools
import json
import math
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GPT2LMHeadModel
from transformers.utils import hub

import tpcore
from tpcore.load.checkpoint import Checkpoint, _check_shard_names
from tpcore.load.safetensors_file import DTYPE_BITS, MAX_HEADER_BYTES, read_header
from tpcore.testing import compare_outputs, tiny_gpt2

QUICK = settings(max_examples=50, deadline=None)
SLOW = settings(max_examples=1500, deadline=None)
INDEX = "model.safetensors.index.json"

#: tiny_gpt2 with its special ids inside the vocabulary
gpt2 = functools.partial(tiny_gpt2, bos_token_id=0, eos_token_id=0)


# -- headers, side by side with safetensors ------------------------------------------------------


class Raw(str):
    """JSON text written as it is (``NaN``, ``-0``, an escaped surrogate, deep nesting)."""


class Obj(list):
    """A JSON object as its ``(key, value)`` pairs, in order: a key may repeat."""


def dumps(value, ascii_only: bool) -> str:
    if isinstance(value, Raw):
        return value
    if isinstance(value, Obj):
        return "{" + ",".join(f"{dumps(key, ascii_only)}:{dumps(item, ascii_only)}" for key, item in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(item, ascii_only) for item in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


@dataclass
class Header:
    """A header drawn: its pairs, the data's size, how its text is spoilt, what the refusal must name."""

    pairs: Obj
    data_size: int
    ascii_only: bool = True
    length_change: int | None = None  # the header's length field: the text's length plus this, or this if large
    text_edit: tuple = ()
    must_name: str | None = None  # the tensor whose entry alone was broken
    changes: list[str] = field(default_factory=list)

    @property
    def stricter(self) -> list[str]:
        """The forms in this header that tpcore refuses by design, though safetensors may read them."""
        keys = [decoded(key) for key, _ in self.pairs]
        entries = [value for key, value in self.pairs if decoded(key) != "__metadata__"]
        forms = ["a tensor named twice"] if len(set(keys)) < len(keys) else []
        if any(isinstance(entry, list) and not isinstance(entry, Obj) for entry in entries):
            forms.append("an entry as an array")  # serde reads a struct from an array; no writer emits one
        if any(isinstance(entry, Obj) and isinstance(dict(entry).get("dtype"), Obj) for entry in entries):
            forms.append("a dtype as a map")  # {"F32": null}: serde reads an enum so
        return forms

    def tensor_names(self) -> list[str]:
        return [key for key in map(decoded, dict(self.pairs)) if key != "__metadata__"]

    def bytes(self) -> bytes:
        text = dumps(self.pairs, self.ascii_only).encode("utf-8", "surrogatepass")  # a lone one: not UTF-8
        edit, *arguments = self.text_edit or ("none",)
        if edit == "wrap":
            text = arguments[0] + text + arguments[1]
        elif edit == "byte":
            at = arguments[0] % (len(text) + 1)
            text = text[:at] + arguments[1] + text[at + 1 :]
        elif edit == "cut":
            text = text[: arguments[0] % (len(text) + 1)]
        elif edit == "utf-16":
            text = text.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
        change = self.length_change or 0
        length = change if change > 1000 else max(len(text) + change, 0)
        return length.to_bytes(8, "little") + text + bytes(self.data_size)


STRANGE_NUMBERS = [-1, 2**62, 2**63, 2**64 - 1, 2**64, True, 2.0, "2", None, [2], Raw("-0"), Raw("1e400")]
JUNK_DTYPES = ["F31", "f32", "", "FLOAT32", None, 32, ["F32"]]
EXTRA_VALUES = [
    1, "x", None, [1, [2, {}]], Obj([("k", 1), ("k", 2)]), 2**70, Raw("1e400"), Raw("NaN"), Raw("-Infinity"),
    Raw('"\\ud800"'), Raw('"\\ud83d\\ude00"'), Raw("1" * 400), Raw("[" * 124 + "]" * 124), Raw("[" * 126 + "]" * 126),
]  # fmt: skip


def pick(draw, header: Header) -> tuple[str, Obj] | None:
    """A tensor's name and entry, drawn from ``header`` (``None`` when it has none)."""
    entries = [(decoded(key), value) for key, value in header.pairs if isinstance(value, Obj)]
    entries = [(key, value) for key, value in entries if key != "__metadata__"]
    return draw(st.sampled_from(entries)) if entries else None


def decoded(key: str) -> str:
    """A header key as JSON reads it."""
    return json.loads(key) if isinstance(key, Raw) else key


def set_field(entry: Obj, name: str, value) -> None:
    entry[:] = [(key, value if key == name else item) for key, item in entry]


def shape_changed(draw, header: Header, name: str, entry: Obj) -> None:
    shape = dict(entry).get("shape")
    shape = list(shape) if isinstance(shape, list) else []  # another change may have replaced it
    how = draw(st.sampled_from(["grown", "strange", "replaced", "enormous before a zero", "zero before enormous"]))
    sizes = [at for at, size in enumerate(shape) if type(size) is int]
    if how == "grown" and sizes:
        at = draw(st.sampled_from(sizes))
        shape[at] += draw(st.sampled_from([-1, 1, 2]))
    elif how == "strange":
        shape.insert(draw(st.integers(0, len(shape))), draw(st.sampled_from(STRANGE_NUMBERS)))
    elif how == "replaced":
        shape = draw(st.sampled_from([None, Obj([]), "2", 2]))
    elif how == "enormous before a zero":
        shape = [*shape, 2**62, 2**62, 0]  # safetensors counts the elements in order: 2**124 overflows first
    else:
        shape = [0, 2**62, 2**62, *shape]
    set_field(entry, "shape", shape)
    header.must_name = name


def dtype_changed(draw, header: Header, name: str, entry: Obj) -> None:
    dtype = draw(st.sampled_from([*DTYPE_BITS, *JUNK_DTYPES, "map form"]))
    if dtype == "map form":
        dtype = Obj([("F32", None)])
    set_field(entry, "dtype", dtype)
    header.must_name = name


def offsets_changed(draw, header: Header, name: str, entry: Obj) -> None:
    offsets = dict(entry).get("data_offsets")
    whole = isinstance(offsets, list) and len(offsets) == 2 and all(type(offset) is int for offset in offsets)
    begin, end = offsets if whole else (0, 0)  # another change may have spoilt them
    how = draw(st.sampled_from(["moved", "swapped", "malformed"]))
    if how == "moved":  # a gap, an overlap, or past the file: the tensors around it may be the ones named
        offsets = [max(begin + draw(st.integers(-2, 2)), 0), max(end + draw(st.integers(-2, 2)), 0)]
    elif how == "swapped":
        offsets = [end, begin]
    else:
        offsets = draw(
            st.sampled_from(
                [[begin], [begin, end, end], [begin, Raw(f"{end}.0")], None, [begin, 2**64], [-1, end], Raw("[-0,0]")]
            )
        )
        header.must_name = name
    set_field(entry, "data_offsets", offsets)


def entry_changed(draw, header: Header, name: str, entry: Obj) -> None:
    how = draw(st.sampled_from(["field dropped", "field repeated", "extra field", "replaced", "as an array"]))
    if how == "field dropped":
        dropped = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[:] = [(key, item) for key, item in entry if key != dropped]
    elif how == "field repeated":
        key, item = draw(st.sampled_from(list(entry)))
        entry.append((key, item if draw(st.booleans()) else None))
    elif how == "extra field":  # ignored by safetensors, unless its JSON is invalid or nested past serde's depth
        entry.insert(draw(st.integers(0, len(entry))), (draw(st.text(max_size=3)), draw(st.sampled_from(EXTRA_VALUES))))
    else:
        fields = dict(entry)
        array = [fields.get(key) for key in ("dtype", "shape", "data_offsets")]
        replaced = array if how == "as an array" else draw(st.sampled_from([None, 1, "x", []]))
        header.pairs[:] = [(key, replaced if decoded(key) == name else item) for key, item in header.pairs]
    header.must_name = name if how != "extra field" else None


def name_repeated(draw, header: Header, name: str, entry: Obj) -> None:
    header.pairs.insert(draw(st.integers(0, len(header.pairs))), (name, Obj(entry)))  # safetensors keeps the last


def odd_name(draw, header: Header) -> None:
    raw = draw(st.sampled_from([Raw('"\\ud800"'), Raw('"\\udc00x"'), Raw('"\\ud83d\\ude00"'), Raw('"a\\u0000"')]))
    header.pairs.append((raw, Obj([("dtype", "F32"), ("shape", [0]), ("data_offsets", [0, 0])])))


def metadata_changed(draw, header: Header) -> None:
    metadata = draw(
        st.sampled_from(
            [
                Obj([("k", "v")]),
                Obj([("k", "v"), ("k", "w")]),
                Obj([("k", 1)]),
                Obj([("k", Obj([]))]),
                [],
                Raw("null"),
                "x",
            ]
        )
    )
    header.pairs.insert(draw(st.integers(0, len(header.pairs))), ("__metadata__", metadata))


def data_resized(draw, header: Header) -> None:
    header.data_size = max(header.data_size + draw(st.sampled_from([-3, -1, 1, 2])), 0)


#: what may follow a header's JSON: spaces are fine, anything else is not
ENDS = [b"", b"  ", b"\x00", b"x"]


def text_edited(draw, header: Header) -> None:
    header.text_edit = draw(
        st.one_of(
            st.tuples(st.just("wrap"), st.sampled_from([b"", b" ", b"\n\t", b"\xef\xbb\xbf"]), st.sampled_from(ENDS)),
            st.tuples(st.just("byte"), st.integers(0, 2**16), st.sampled_from([b"\xff", b"\xc3", b"\x00", b"{", b"]"])),
            st.tuples(st.just("cut"), st.integers(0, 2**16)),
            st.just(("utf-16",)),
        )
    )  # fmt: skip


def length_misdeclared(draw, header: Header) -> None:
    header.length_change = draw(st.sampled_from([-2, -1, 1, 2, MAX_HEADER_BYTES + 1, 2**64 - 1]))


#: changes to one tensor's entry (drawn from those there are), then changes to the whole
ENTRY_CHANGES = [shape_changed, dtype_changed, offsets_changed, entry_changed, name_repeated]
CHANGES = [*ENTRY_CHANGES, odd_name, metadata_changed, data_resized, text_edited, length_misdeclared]


@st.composite
def headers(draw) -> Header:
    """A valid header laid out in any order, with up to two changes that may break it."""
    names = draw(st.lists(st.text(max_size=6).filter(lambda name: name != "__metadata__"), max_size=4, unique=True))
    specs = {
        name: (draw(st.sampled_from(list(DTYPE_BITS))), draw(st.lists(st.integers(0, 4), max_size=3))) for name in names
    }
    offsets, end = {}, 0
    for name in draw(st.permutations(names)):  # the data in any order, the entries in another
        dtype, shape = specs[name]
        count = math.prod(shape)
        while count * DTYPE_BITS[dtype] % 8:  # whole bytes (4 and 6 bit dtypes)
            shape.append(2)
            count *= 2
        offsets[name] = [end, end + count * DTYPE_BITS[dtype] // 8]
        end = offsets[name][1]
    pairs = Obj(
        (name, Obj([("dtype", specs[name][0]), ("shape", specs[name][1]), ("data_offsets", offsets[name])]))
        for name in names
    )
    if draw(st.booleans()):
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", Obj([("format", "pt")])))
    header = Header(pairs, end, ascii_only=draw(st.booleans()))
    changes = [draw(st.sampled_from(CHANGES)) for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2])))]
    for change in changes:
        if change not in ENTRY_CHANGES:
            change(draw, header)
        elif (picked := pick(draw, header)) is not None:
            change(draw, header, *picked)
    header.changes = [change.__name__ for change in changes]
    if len(changes) != 1:
        header.must_name = None
    return header


def safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt") as file:
            file.keys()
    except Exception:  # SafetensorError, and whatever its bindings raise for a file they refuse
        return False
    return True


@contextmanager
def reads_counted():
    """The sizes of the reads made through :func:`open`'s file objects while in the block."""
    sizes: list[int] = []
    real_open = builtins.open

    def watched_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        real_read = handle.read
        handle.read = lambda size=-1: (sizes.append(size), real_read(size))[1]
        return handle

    with mock.patch("builtins.open", watched_open):
        yield sizes


def accepted_as_safetensors_accepts_it(directory: Path, header: Header) -> None:
    path = directory / "drawn.safetensors"
    path.write_bytes(header.bytes())
    size = path.stat().st_size
    with reads_counted() as reads:
        try:
            read_header(path)
            refusal = None
        except ValueError as error:
            refusal = str(error)
    assert reads[:1] == [8] and len(reads) <= 2 and 8 + sum(reads[1:]) <= max(size, 8), reads  # the header alone
    if header.stricter:
        assert refusal is not None, header.stricter
    else:
        assert (refusal is None) == safetensors_accepts(path), refusal
    if refusal is None:
        return
    assert refusal.startswith(path.name), refusal
    if header.must_name is not None and "not a safetensors file" not in refusal:
        assert repr(header.must_name) in refusal, refusal
    elif not header.text_edit and "not a safetensors file" not in refusal and "no tensors" not in refusal:
        assert any(repr(name) in refusal for name in header.tensor_names()), refusal


@QUICK
@given(header=headers())
def test_a_header_is_accepted_exactly_where_safetensors_accepts_it(tmp_path_factory, header):
    accepted_as_safetensors_accepts_it(tmp_path_factory.mktemp("header"), header)


@pytest.mark.slow
@SLOW
@given(header=headers())
def test_many_more_headers_are_accepted_exactly_where_safetensors_accepts_them(tmp_path_factory, header):
    accepted_as_safetensors_accepts_it(tmp_path_factory.mktemp("header"), header)


@pytest.mark.parametrize(
    "text, data, match",
    [
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
         8, r"its header gives 'w' 2 times"),
        (b'{"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}}',
         0, r"tensor 'w' of dtype F32 and shape \[4611686018427387904, .*\] is larger than 64 bits count"),
        (b'{"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2, r"tensor 'w' of dtype F4 .* ends inside a byte"),
        (b'{"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', 0, r"tensor 'w': its shape \[-0.0\] is not"),
        (b'{"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}', 8, r"tensor 'w': its dtype 'f32' is none of"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + b"[" * 126 + b"]" * 126 + b"}}", 8,
         r"tensor 'w': its 'x' nests more than the 127 containers safetensors reads"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + b"[" * 126 + b"]" * 126 + b',"x":1}}', 8,
         r"tensor 'w': its 'x' nests more than the 127 containers"),
        (b'{"__metadata__":{"k":"\\ud800","k":"v"}}', 0, r"unpaired surrogate"),
        (b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, r"unpaired surrogate"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":NaN}}', 8, r"NaN is not JSON"),
        (b'{"__metadata__":{"k":1}}', 0, r"its __metadata__ is not a map of strings to strings"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 9, r"its last tensor, 'w', ends at byte \d+"),
    ],
)  # fmt: skip
def test_each_kind_of_malformed_header_is_named(tmp_path, text, data, match):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))
    with pytest.raises(ValueError, match=rf"^odd\.safetensors .*{match}"):
        read_header(path)


def test_a_pipe_or_a_directory_in_place_of_a_file_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")  # no writer: a blocking open would wait for ever
    (tmp_path / "folder.safetensors").mkdir()
    with pytest.raises(ValueError, match="pipe.safetensors is not a safetensors file: it is not a regular file"):
        read_header(tmp_path / "pipe.safetensors")
    with pytest.raises(ValueError, match="folder.safetensors is not a safetensors file: it is not a regular file"):
        read_header(tmp_path / "folder.safetensors")


# -- indices -------------------------------------------------------------------------------------

#: the shards every drawn checkpoint starts from: two tensors in each, and one more file left alone
SHARDS = {"a.safetensors": ("a0", "a1"), "b.safetensors": ("b0", "b1"), "c.safetensors": ("c0", "c1")}
EXTRA = "extra.safetensors"
SHARD_EDITS = {  # edit -> whether the checkpoint stays valid
    "linked": True, "in a subfolder": True, "listed twice alike": True,
    "absolute": False, "dotdot": False, "empty": False, "missing": False, "lacks": False, "also holds": False,
    "listed twice apart": False, "not a string": False, "pipe": False, "truncated": False,
}  # fmt: skip
INDEX_EDITS = ["none", "not UTF-8", "UTF-16", "cut", "no weight_map", "weight_map a list", "two weight maps"]


def saved(directory: Path, name: str, keys, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {key: torch.randn(3, 2, generator=generator) for key in keys}
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / name)
    return tensors


def drawn_checkpoint(base: Path, edits: dict[str, str], index_edit: str) -> tuple[Path, dict, list[str]]:
    """A sharded checkpoint with ``edits`` (shard -> edit) done to it: its directory, the tensors it should give
    when valid, and the names a refusal may give (the index, the files at fault)."""
    directory, elsewhere = base / "ckpt", base / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    tensors = saved(directory, EXTRA, ["d0"], seed=9)
    pairs = Obj([("d0", EXTRA)])
    named = [INDEX]
    for seed, (shard, keys) in enumerate(SHARDS.items()):
        edit = edits.get(shard)
        tensors.update(saved(directory, shard, [*keys, "d0"] if edit == "also holds" else keys, seed))
        name = shard
        if edit == "linked":  # as the hub's cache: the file elsewhere, a link in the directory
            shutil.move(directory / shard, elsewhere / shard)
            (directory / shard).symlink_to(elsewhere / shard)
        elif edit == "in a subfolder":
            name = f"sub/{shard}"
            (directory / "sub").mkdir(exist_ok=True)
            shutil.move(directory / shard, directory / name)
        elif edit in ("absolute", "dotdot"):
            shutil.move(directory / shard, elsewhere / shard)
            name = str(elsewhere / shard) if edit == "absolute" else f"../elsewhere/{shard}"
        elif edit == "pipe":
            (directory / shard).unlink()
            os.mkfifo(directory / shard)
        elif edit == "truncated":
            (directory / shard).write_bytes((directory / shard).read_bytes()[:-4])
        values = {
            "empty": "", "missing": "gone.safetensors", "not a string": None,
        }  # fmt: skip
        listed = [(key, values.get(edit, name)) for key in keys]
        if edit == "lacks":
            listed[0] = (keys[0], EXTRA)
        if edit in ("listed twice alike", "listed twice apart"):
            listed.append((keys[1], name if edit == "listed twice alike" else EXTRA))
        pairs.extend(listed)
        named += [shard, name, "gone.safetensors", EXTRA]
    weight_map = Obj(pairs)
    content = Obj([("metadata", Obj([])), ("weight_map", weight_map)])
    if index_edit == "no weight_map":
        content = Obj([("metadata", Obj([]))])
    elif index_edit == "weight_map a list":
        content = Obj([("weight_map", [list(pair) for pair in pairs])])
    elif index_edit == "two weight maps":
        content.append(("weight_map", Obj(pairs[:1])))
    text = dumps(content, ascii_only=True).encode()
    if index_edit == "not UTF-8":
        text = text.replace(b'"metadata"', b'"metadat\xe9"')
    elif index_edit == "UTF-16":
        text = text.decode().encode("utf-16")
    elif index_edit == "cut":
        text = text[: len(text) // 2]
    (directory / INDEX).write_bytes(text)
    return directory, tensors, named


@st.composite
def checkpoint_edits(draw) -> tuple[dict[str, str], str]:
    shards = draw(st.lists(st.sampled_from(list(SHARDS)), unique=True, max_size=2))
    edits = {shard: draw(st.sampled_from(list(SHARD_EDITS))) for shard in shards}
    return edits, draw(st.sampled_from(INDEX_EDITS[:1] * 3 + INDEX_EDITS[1:]))


def index_checked(base: Path, edits: dict[str, str], index_edit: str) -> None:
    directory, tensors, named = drawn_checkpoint(base, edits, index_edit)
    valid = index_edit == "none" and all(SHARD_EDITS[edit] for edit in edits.values())
    try:
        checkpoint = Checkpoint(directory)
        checkpoint.verify(checkpoint.files)
    except (ValueError, FileNotFoundError) as error:
        assert not valid, error
        assert any(name in str(error) for name in named if name), error
        return
    assert valid, (edits, index_edit)
    assert checkpoint.files.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert torch.equal(checkpoint.read(key, None, 0, 1), tensor)


@QUICK
@given(edits=checkpoint_edits())
def test_an_index_is_refused_naming_it_or_its_shard_where_its_files_leave_the_directory_or_disagree(
    tmp_path_factory, edits
):
    index_checked(tmp_path_factory.mktemp("index"), *edits)


@pytest.mark.slow
@SLOW
@given(edits=checkpoint_edits())
def test_many_more_indices_are_refused_or_read_as_they_should_be(tmp_path_factory, edits):
    index_checked(tmp_path_factory.mktemp("index"), *edits)


@pytest.mark.parametrize("edit", [*SHARD_EDITS, *INDEX_EDITS[1:]])
def test_each_edit_alone_is_refused_naming_the_index_or_the_shard_or_read_as_it_should_be(tmp_path, edit):
    if edit in SHARD_EDITS:
        index_checked(tmp_path, {"b.safetensors": edit}, "none")
    else:
        index_checked(tmp_path, {}, edit)


shard_names = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "/", "//", "./"]),
    st.lists(st.sampled_from(["a", "b.safetensors", "..", ".", "", "..a", "a..", " ", "\\..", "C:", "~"]), max_size=4),
)


@QUICK
@given(name=shard_names)
def test_a_shard_name_is_refused_as_transformers_refuses_it_and_an_empty_one_too(name):
    check = getattr(hub, "_check_shard_filenames_stay_in_model_dir", None)  # transformers >= 5.25
    if check is None:
        pytest.skip("this transformers does not check shard names")
    index = Path("model") / INDEX
    try:
        check([name], str(index))
        expected = None
    except ValueError as error:
        expected = str(error)
    try:
        _check_shard_names(index, [name])
        got = None
    except ValueError as error:
        got = str(error)
    if not Path(name).parts:  # the directory itself: transformers then fails reading it, tpcore says why
        assert (
            expected is None
            and got == f"The checkpoint index {index} has a shard filename that names no file: {name!r}"
        )
    else:
        assert got == expected


# -- the user's path: tpcore.parallelize(directory) ----------------------------------------------


@pytest.fixture(scope="module")
def gpt2_shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2-shards")
    gpt2().save_pretrained(directory, max_shard_size="100KB")
    return directory


def pointing_outside(source: Path, base: Path, how: str) -> tuple[Path, str]:
    """A copy of ``source`` whose index names its shards outside it (absolute, or through ``..``), one shard a link
    to elsewhere besides: the directory and the first name the index gives outside it."""
    directory, elsewhere = base / "model", base / "elsewhere"
    shutil.copytree(source, directory)
    elsewhere.mkdir()
    index = json.loads((directory / INDEX).read_text())
    names = sorted(set(index["weight_map"].values()))
    for name in names:
        shutil.move(directory / name, elsewhere / name)
    (directory / names[0]).symlink_to(elsewhere / names[0])
    outside = {name: str(elsewhere / name) if how == "absolute" else f"../elsewhere/{name}" for name in names[1:]}
    index["weight_map"] = {key: outside.get(name, name) for key, name in index["weight_map"].items()}
    (directory / INDEX).write_text(json.dumps(index))
    return directory, min(outside.values())


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_an_index_naming_shards_outside_its_directory_is_refused_as_transformers_refuses_it_before_any_rank_starts(
    gpt2_shards, tmp_path, how, monkeypatch, no_process_starts
):
    directory, first_outside = pointing_outside(gpt2_shards, tmp_path, how)
    message = (
        f"The checkpoint index {directory / INDEX} has a shard filename that points outside the model directory: "
        f"{first_outside}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tpcore.parallelize(directory, num_gpus=2)
    monkeypatch.setattr("tpcore.engine.tensor_parallel_group", lambda *a: pytest.fail("joined a process group"))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tpcore.ParallelEngine(2).parallelize(directory)
    if hasattr(hub, "_check_shard_filenames_stay_in_model_dir"):  # transformers >= 5.25 says the same
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            GPT2LMHeadModel.from_pretrained(str(directory))


def linked(source: Path, base: Path) -> Path:
    """A copy of ``source`` whose weight files are links to files elsewhere, as in the hub's cache."""
    directory, blobs = base / "snapshot", base / "blobs"
    shutil.copytree(source, directory)
    blobs.mkdir()
    for file in directory.glob("*.safetensors"):
        shutil.move(file, blobs / file.name)
        file.symlink_to(blobs / file.name)
    return directory


def test_shards_that_are_links_to_elsewhere_load_and_match(gpt2_shards, tmp_path):
    directory = linked(gpt2_shards, tmp_path)
    inputs = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = gpt2()(input_ids=inputs).logits
        got = tpcore.ParallelEngine(1, "gloo").parallelize(directory)(input_ids=inputs).logits
    compare_outputs(expected, got)


@pytest.mark.slow  # seconds of rank start-up
def test_shards_that_are_links_to_elsewhere_load_split_over_the_ranks(gpt2_shards, tmp_path):
    directory = linked(gpt2_shards, tmp_path)
    inputs = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = gpt2()(input_ids=inputs).logits
    model = tpcore.parallelize(directory, num_gpus=2, backend="gloo")
    try:
        compare_outputs(expected, model(input_ids=inputs).logits)
    finally:
        model.deparallelize()
