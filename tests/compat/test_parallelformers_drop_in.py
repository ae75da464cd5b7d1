"""Drop-in for parallelformers' users: its README flow and documented parameters, unchanged but for the import.

parallelformers' README loads a causal LM, calls ``parallelize(model, num_gpus=N, fp16=True, verbose='detail')``
ignoring the return value, generates with beam search and n-gram blocking, reads the memory methods and
ends the parallelization with ``.cuda()``/``.cpu()``/``.to()``; its FAQ gives a second model its own
``master_port``. Each step runs here as its users wrote it, on CPU ranks (so ``'detail'`` prints resident
and tensor memory rather than the CUDA allocator's summary), against the unsplit model token for token.

Spawning ranks costs seconds: the README's fp16 model and an fp32 one started from a checkpoint (3 ranks
each) are shared by the tests that only call them; the tests that end a parallelization start their own.
"""

from __future__ import annotations

import contextlib
import errno
import io
import multiprocessing
import os
import re
import socket

import pytest
import rank_helpers
import torch
import transformers
from process_probes import children, gone
from tp_gpt.policies import LlamaPolicy

from tpcore import parallelize  # the one line that changes: was `from parallelformers import parallelize`
from tpcore.load.precision import cast_model, resolve_dtype
from tpcore.ranks.distributed import free_port
from tpcore.testing import ModelSpec, compare_outputs

#: 6 query heads over 3 grouped KV heads: each of 3 ranks holds 2 query heads and 1 KV head
CONFIG = transformers.LlamaConfig(
    vocab_size=192,
    hidden_size=192,
    num_attention_heads=6,
    num_key_value_heads=3,
    intermediate_size=384,
    num_hidden_layers=2,
    max_position_embeddings=64,
    initializer_range=0.1,  # peaked logits: fp16 reductions in another order do not flip a beam
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SPEC = ModelSpec(transformers.LlamaForCausalLM, CONFIG, seed=5)
RANKS = ["cpu:0", "cpu:1", "cpu:2"]
#: what ``fp16=True`` gives the ranks here: float16 with CUDA, bfloat16 or no cast on a CPU without float16 arithmetic
FP16_TRUE = resolve_dtype(True, None, "cpu") or torch.float32
#: the README's generate() arguments
README_GENERATE = {"num_beams": 5, "no_repeat_ngram_size": 4, "max_length": 15}

SIMPLE_LINE = re.compile(r"tpcore (cpu:\d): allocated ([\d.]+) MiB, reserved ([\d.]+) MiB")
DETAIL_LINE = re.compile(
    r"tpcore (cpu:\d): resident ([\d.]+) MiB \(VmRSS\), peak ([\d.]+) MiB \(VmHWM\), tensors ([\d.]+) MiB"
)


def tokenized(*lengths: int) -> dict:
    """What ``tokenizer(texts, return_tensors="pt", padding=True)`` gives a decoder: left-padded rows."""
    seq = max(lengths)
    ids = torch.randint(3, CONFIG.vocab_size, (len(lengths), seq), generator=torch.Generator().manual_seed(seq))
    mask = (torch.arange(seq)[None, :] >= seq - torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def unsplit_generate(model, inputs: dict, **kwargs):
    with torch.inference_mode():
        return model.generate(**inputs, **kwargs)


def mib(size: int) -> str:
    """Bytes as the verbose lines print them."""
    return f"{size / 2**20:.1f}"


def printed_lines(pattern: re.Pattern, text: str) -> list[re.Match]:
    """Every printed line matches ``pattern``, one per rank in rank order."""
    matches = [pattern.fullmatch(line) for line in text.splitlines()]
    assert all(matches) and [m[1] for m in matches] == RANKS, text
    return matches


def parallelized_printing(**kwargs) -> tuple[torch.nn.Module, str]:
    """A fresh model of ``SPEC``, parallelized in place (return value ignored), and what that printed."""
    model, printed = SPEC.build(), io.StringIO()
    with contextlib.redirect_stdout(printed):
        parallelize(model, **kwargs)
    return model, printed.getvalue()


def assert_ended(model, pids: list[int]) -> None:
    """The parallelization is over: ranks gone, the model's own methods back."""
    assert all(gone(pid) for pid in pids)
    assert not hasattr(model, "_tpcore_handle") and not hasattr(model, "memory_allocated")
    assert {"forward", "generate", "to", "cpu", "cuda"}.isdisjoint(vars(model))


# -- the README's model: fp16, verbose='detail' ---------------------------------------------------


@pytest.fixture(scope="module")
def readme_model():
    """The README's step 2 as written (3 ranks, pinned to gloo: a CPU test on any machine):
    ``parallelize(model, num_gpus=3, fp16=True, verbose='detail')``."""
    model, printed = parallelized_printing(num_gpus=3, backend="gloo", fp16=True, verbose="detail")
    yield model, printed
    model.deparallelize()


@pytest.mark.slow
def test_readme_generate_gives_the_unsplit_tokens_in_the_dtype_of_fp16_true(readme_model):
    model, _ = readme_model
    reference = cast_model(SPEC.build(), FP16_TRUE)  # as the ranks are cast
    for inputs in (tokenized(4), tokenized(6, 3, 5)):
        outputs = model.generate(**inputs, num_beams=5, no_repeat_ngram_size=4, max_length=15)
        assert torch.equal(outputs, unsplit_generate(reference, inputs, **README_GENERATE))
        for row in outputs.tolist():
            ngrams = [tuple(row[i : i + 4]) for i in range(len(row) - 3)]
            assert len(ngrams) == len(set(ngrams)), row  # n-gram blocking ran on the ranks
    assert outputs.shape == (3, 15)
    assert next(model.parameters()).dtype == torch.float32  # unlike parallelformers, the caller's copy stays as it was


@pytest.mark.slow
def test_verbose_detail_prints_each_ranks_resident_peak_and_tensor_memory(readme_model):
    model, printed = readme_model
    allocated = model.memory_allocated()
    for line in printed_lines(DETAIL_LINE, printed):
        resident, peak, tensors = map(float, line.groups()[1:])
        assert line[4] == mib(allocated[line[1]])  # tensor bytes, which memory_allocated() reports on CPU
        assert 0 < tensors < resident <= peak


@pytest.mark.slow
def test_memory_methods_as_the_readme_calls_them(readme_model):
    model, _ = readme_model
    unsplit = SPEC.build()
    model_bytes = FP16_TRUE.itemsize * sum(t.numel() for t in [*unsplit.parameters(), *unsplit.buffers()])
    allocated, reserved, cached = model.memory_allocated(), model.memory_reserved(), model.memory_cached()
    for figures in (allocated, reserved, cached):
        assert list(figures) == RANKS and all(type(size) is int for size in figures.values())
    assert all(model_bytes / 3 <= size < model_bytes / 2 for size in allocated.values()), (allocated, model_bytes)
    assert all(reserved[rank] > allocated[rank] and cached[rank] > allocated[rank] for rank in RANKS)


# -- fp32 from a checkpoint, at a chosen master_port, verbose=True -----------------------------------


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    """``SPEC`` saved and parallelized from its directory (3 ranks, fp32) at a master_port of the caller's
    choosing, the predecessor's FAQ advice for a second model; the caller holds no weights."""
    directory, port = tmp_path_factory.mktemp("llama"), free_port()
    SPEC.build().save_pretrained(directory)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = parallelize(str(directory), num_gpus=3, backend="gloo", fp16=False, master_port=port, verbose=True)
    yield model, port, printed.getvalue()
    model.deparallelize()


@pytest.mark.slow
def test_fp32_beam_search_with_ngram_blocking_matches_the_unsplit_model(fp32_model):
    model, _, _ = fp32_model
    reference = SPEC.build()
    for inputs in (tokenized(4), tokenized(2, 7, 5)):
        kwargs = README_GENERATE | {"return_dict_in_generate": True, "output_scores": True}
        expected, got = unsplit_generate(reference, inputs, **kwargs), model.generate(**inputs, **kwargs)
        assert type(got) is type(expected) and torch.equal(got.sequences, expected.sequences)
        compare_outputs(expected.sequences_scores, got.sequences_scores)


@pytest.mark.slow
def test_verbose_true_prints_one_line_per_rank_with_the_memory_methods_figures(fp32_model):
    model, _, printed = fp32_model
    allocated = model.memory_allocated()
    for line in printed_lines(SIMPLE_LINE, printed):
        assert line[2] == mib(allocated[line[1]])
        assert float(line[3]) > max(float(line[2]), 10.0)  # a rank's resident memory: an interpreter with torch


@pytest.mark.slow
def test_a_model_started_from_a_checkpoint_refuses_to_move_and_serves_on(fp32_model):
    model, _, _ = fp32_model
    for move in (lambda: model.to("cpu"), model.cpu, model.cuda):
        with pytest.raises(RuntimeError, match="holds no weights to move"):
            move()
    inputs = tokenized(6)
    expected = unsplit_generate(SPEC.build(), inputs, **README_GENERATE)
    assert torch.equal(model.generate(**inputs, **README_GENERATE), expected)


@pytest.mark.slow
def test_three_models_at_once_a_taken_master_port_refused_and_deparallelize_frees_its_port(
    readme_model, fp32_model, spawned, capsys
):
    """The README's model (free port), the checkpoint one (its own master_port) and a third at another
    chosen port serve side by side; the checkpoint model's port, given to one more, is refused before any
    rank starts."""
    readme, _ = readme_model
    model, port, _ = fp32_model
    assert model._tpcore_handle.pool.master_port == port != readme._tpcore_handle.pool.master_port
    refused, kids = SPEC.build(), children()
    with pytest.raises(
        OSError, match=f"cannot listen on 127.0.0.1:{port}.*master_port=None picks a free one"
    ) as caught:
        parallelize(refused, num_gpus=3, master_port=port)
    assert caught.value.errno == errno.EADDRINUSE
    assert spawned == [] and children() <= kids and not hasattr(refused, "_tpcore_handle")

    third, third_port = SPEC.build(), free_port()
    parallelize(third, num_gpus=1, backend="gloo", master_port=third_port, verbose=None)
    assert capsys.readouterr().out == ""
    inputs = tokenized(5)
    expected = unsplit_generate(SPEC.build(), inputs, **README_GENERATE)
    served = [(readme, unsplit_generate(SPEC.build().half(), inputs, **README_GENERATE)), (model, expected)]
    for parallelized, tokens in [*served, (third, expected)]:
        assert torch.equal(parallelized.generate(**inputs, **README_GENERATE), tokens)
    pids = third._tpcore_handle.pool.pids
    assert third.deparallelize() is third
    assert_ended(third, pids)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a store binds: past TIME_WAIT
        sock.bind(("127.0.0.1", third_port))  # fails while anything still listens there
    assert torch.equal(unsplit_generate(third, inputs, **README_GENERATE), expected)  # unsplit, same weights
    for parallelized, tokens in served:  # the others serve on
        assert torch.equal(parallelized.generate(**inputs, **README_GENERATE), tokens)


# -- the signature, and ending the parallelization ------------------------------------------------


class AttentionOnlyLlamaPolicy(LlamaPolicy):
    """Splits attention only: proves ``custom_policies`` replaces the installed policy."""

    @staticmethod
    def mlp_in():
        return []

    @staticmethod
    def mlp_out():
        return []


INVALID = [
    ("verbose-word", (), {"verbose": "yes"}, ValueError, "verbose must be None, False, True, 'simple' or 'detail'"),
    ("verbose-int", (), {"verbose": 1}, ValueError, "verbose must be None, False, True, 'simple' or 'detail'"),
    ("init-method-url", (), {"init_method": "tcp://127.0.0.1:29500"}, ValueError, "multiprocessing start method"),
    ("predecessor-positional-order", (True, 3), {}, TypeError, "pass fp16= and num_gpus= by keyword"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_arguments_fail_before_any_rank_starts(spawned, args, kwargs, error, match):
    model, kids = SPEC.build(), children()
    with pytest.raises(error, match=re.escape(match)):
        parallelize(model, *(args or (3,)), **kwargs)
    assert spawned == [] and children() <= kids and "forward" not in vars(model)


@pytest.mark.slow
def test_every_parameter_of_the_predecessors_signature_keeps_its_meaning_and_cpu_ends_it(capsys):
    """``parallelize(model, fp16, num_gpus, custom_policies, master_addr, master_port, backend, verbose,
    init_method, daemon, seed)``, then README step 6: ``model.cpu()`` ends the parallelization."""
    model, reference, port = SPEC.build(), SPEC.build(), free_port()
    environment, start_method = dict(os.environ), multiprocessing.get_start_method(allow_none=True)
    parallelize(
        model,
        fp16=False,
        num_gpus=3,
        custom_policies=AttentionOnlyLlamaPolicy,  # one class, not a list: used, not ignored
        master_addr="127.0.0.1",
        master_port=port,
        backend="gloo",
        verbose="simple",
        init_method="spawn",  # accepted; ranks are fresh interpreters whatever it says
        daemon=True,  # accepted; ranks always end with the caller
        seed=1234,
    )
    try:
        handle = model._tpcore_handle
        assert dict(os.environ) == environment  # no CUDA_VISIBLE_DEVICES, MASTER_PORT, RANK, ... written
        assert multiprocessing.get_start_method(allow_none=True) == start_method
        assert (handle.pool.master_port, handle.pool.backend, handle.pool.world_size) == (port, "gloo", 3)
        printed_lines(SIMPLE_LINE, capsys.readouterr().out)
        for shapes in handle.pool.run(rank_helpers.parameter_shapes):
            hidden, intermediate = CONFIG.hidden_size, CONFIG.intermediate_size
            assert shapes["model.layers.0.self_attn.q_proj.weight"] == (hidden // 3, hidden)  # split: 2 of 6 heads
            assert shapes["model.layers.0.mlp.gate_proj.weight"] == (intermediate, hidden)  # whole, as the policy says
        inputs = tokenized(4, 2)
        sampled = model.generate(**inputs, do_sample=True, max_new_tokens=8)
        torch.manual_seed(1234)
        assert torch.equal(sampled, unsplit_generate(reference, inputs, do_sample=True, max_new_tokens=8))

        pids = handle.pool.pids
        assert model.cpu() is model
        assert_ended(model, pids)
        assert torch.equal(
            unsplit_generate(model, inputs, **README_GENERATE), unsplit_generate(reference, inputs, **README_GENERATE)
        )
    finally:
        if hasattr(model, "_tpcore_handle"):
            model.deparallelize()


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_to_ends_the_parallelization_then_moves_the_callers_model(capsys):
    """One rank is enough here: what ``.to()`` does to the ranks does not depend on how many there are."""
    model = SPEC.build()
    parallelize(model, num_gpus=1, backend="gloo", fp16=False, verbose=False)
    assert capsys.readouterr().out == ""
    pids = model._tpcore_handle.pool.pids
    assert model.to(torch.float16) is model
    assert_ended(model, pids)
    assert next(model.parameters()).dtype == torch.float16
    inputs = tokenized(3, 5)
    expected = unsplit_generate(SPEC.build().half(), inputs, **README_GENERATE)
    assert torch.equal(unsplit_generate(model, inputs, **README_GENERATE), expected)
