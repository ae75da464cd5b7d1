"""``tpcore.parallelize()``: a split model served from the caller's process.

Equivalence with the unsplit model through the proxy (BERT family, world sizes 2-4), output types,
``generate()`` (greedy and seeded sampling), validation before any process starts, fault injection
(a raise on every rank, a killed rank, threads), lifecycle (two models at once, repeated cycles, the
caller exiting in every way), ``CUDA_VISIBLE_DEVICES`` and interactive use (a policy in
``__main__``, no ``if __name__ == "__main__"`` guard, a script read from stdin).

Spawning ranks costs seconds, so one parallelized BERT masked LM (world 2) is shared by the tests
that only call it, and every other test uses the smallest model that shows its point.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import rank_helpers
import torch
import transformers
from output_probes import bar_states, on_terminal, records_of
from process_probes import children, gone, is_zygote, listening_of, listening_sockets, parent_of
from torch import nn
from tqdm import tqdm

import tpcore
from tpcore.plan import bytes_summary, replicated_warning
from tpcore.ranks.process import WorkerDiedError, WorkerError
from tpcore.testing import ModelSpec, compare_outputs, tiny_bert

VOCAB = 64
#: hidden 48, 12 heads and an MLP of 96 split evenly over 1, 2, 3 and 4 ranks
SIZES = {"hidden": 48, "heads": 12, "layers": 2, "intermediate": 96}


# -- models and inputs ---------------------------------------------------------------------------


def bert_family_spec(arch: str, head: str, seed: int = 1, **overrides) -> ModelSpec:
    """A small seeded model of ``transformers.<arch><head>`` (``DistilBert`` has its own config names)."""
    names = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
    if arch == "DistilBert":
        names = ("dim", "n_heads", "n_layers", "hidden_dim")
    values = dict(zip(names, SIZES.values(), strict=True))
    if arch == "Electra":
        values["embedding_size"] = 24  # ELECTRA projects its embeddings up to the hidden size
    values["num_labels"] = 2 if head == "ForQuestionAnswering" else 3
    config = getattr(transformers, f"{arch}Config")(vocab_size=VOCAB, **values, **overrides)
    return ModelSpec(getattr(transformers, arch + head), config, seed)


def padded_batch(lengths: list[int], seq: int, seed: int, choices: int | None = None) -> dict:
    """Token ids with right padding: row ``i`` has ``lengths[i]`` real tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=generator)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask  # padding token 0 where the mask is 0
    if choices:
        ids, mask = (t[:, None, :].expand(len(lengths), choices, seq).contiguous() for t in (ids, mask))
    return {"input_ids": ids, "attention_mask": mask}


def run_unsplit(model: nn.Module, *args, **kwargs):
    with torch.inference_mode():
        return model(*args, **kwargs)


def assert_split(model: nn.Module, world_size: int, min_split: int) -> None:
    """Every rank holds slices: at least ``min_split`` parameters cut to ``1/world_size`` along one dim
    (rounded up for vocabularies, which are padded to equal pieces)."""
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for rank, shapes in enumerate(model._tpcore_handle.pool.run(rank_helpers.parameter_shapes)):
        assert shapes.keys() == full.keys(), f"rank {rank} holds other parameters"
        split = 0
        for name, shape in shapes.items():
            if shape != full[name]:
                differing = [(a, b) for a, b in zip(shape, full[name], strict=True) if a != b]
                assert len(differing) == 1 and differing[0][0] == -(-differing[0][1] // world_size), (name, shape)
                split += 1
        assert split >= min_split, f"rank {rank}: only {split} parameters split"


# -- process, socket and shared-memory inspection ------------------------------------------------


def wait_gone(pids, limit: float) -> float:
    """Seconds until every pid in ``pids`` is gone; ``inf`` if not within ``limit``."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if all(gone(pid) for pid in pids):
            return time.monotonic() - started
        time.sleep(0.05)
    return float("inf")


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the shared model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def masked_lm_start():
    """``(parallelized BertForMaskedLM over 2 ranks, the same model unsplit, what its start wrote on a
    terminal, the tpcore records it logged at INFO)``, for the whole module."""
    spec = bert_family_spec("Bert", "ForMaskedLM")
    reference, model = spec.build(), spec.build()
    with on_terminal() as screen, records_of("tpcore", logging.INFO) as records:
        assert tpcore.parallelize(model, num_gpus=2, backend="gloo") is model
    yield model, reference, screen.getvalue(), records
    if getattr(model, "_tpcore_handle", None) is not None:
        model.deparallelize()


@pytest.fixture(scope="module")
def masked_lm(masked_lm_start):
    """``(parallelized BertForMaskedLM over 2 ranks, the same model unsplit)``, for the whole module."""
    return masked_lm_start[:2]


def mlm_batch(seed: int, lengths=(7, 3, 5), seq: int = 7) -> dict:
    return padded_batch(list(lengths), seq, seed)


# -- 1. equivalence ------------------------------------------------------------------------------

#: per span and per choice over 4 and 2 ranks (uneven worlds: tests/plan/test_uneven.py); every head of the
#: family runs through the engine in tp-bert's tests
EQUIVALENCE = [
    ("DistilBert", "ForQuestionAnswering", 4),
    ("Bert", "ForMultipleChoice", 2),
]


def labels_for(head: str, inputs: dict, seed: int) -> dict:
    """Labels for the heads whose loss is worth comparing too."""
    generator = torch.Generator().manual_seed(seed)
    batch = inputs["input_ids"].shape[0]
    if head == "ForSequenceClassification":
        return {"labels": torch.randint(0, 3, (batch,), generator=generator)}
    if head == "ForTokenClassification":
        return {"labels": torch.randint(0, 3, inputs["input_ids"].shape, generator=generator)}
    if head == "ForMultipleChoice":
        return {"labels": torch.randint(0, 2, (batch,), generator=generator)}
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "head", "world_size"), EQUIVALENCE, ids=[f"{a}{h}-{w}" for a, h, w in EQUIVALENCE])
def test_bert_family_through_parallelize_matches_unsplit(arch, head, world_size):
    """Several padded batches (shapes change between calls) on one parallelized model, dict and tuple outputs."""
    spec = bert_family_spec(arch, head)
    reference, model = spec.build(), spec.build()
    tpcore.parallelize(model, num_gpus=world_size, backend="gloo")
    try:
        assert_split(model, world_size, min_split=6 * SIZES["layers"])
        choices = 2 if head == "ForMultipleChoice" else None
        for seed, (lengths, seq) in enumerate([([7, 3, 5], 7), ([4], 4), ([2, 6, 6, 1], 6)]):
            labels = labels_for(head, padded_batch(lengths, seq, seed), seed)
            inputs = padded_batch(lengths, seq, seed, choices) | labels
            expected = run_unsplit(reference, **inputs)
            got = model(**inputs)
            assert type(got) is type(expected)
            diffs = compare_outputs(expected, got)
            assert ("loss" in diffs) == bool(labels)
            compare_outputs(run_unsplit(reference, **inputs, return_dict=False), model(**inputs, return_dict=False))
    finally:
        model.deparallelize()
    compare_outputs(expected, run_unsplit(model, **inputs))  # unsplit again, same weights


def test_masked_lm_matches_unsplit_with_loss(masked_lm):
    model, reference = masked_lm
    assert_split(model, 2, min_split=6 * SIZES["layers"])
    for seed in range(3):
        inputs = mlm_batch(seed)
        inputs["labels"] = torch.where(inputs["attention_mask"].bool(), inputs["input_ids"], -100)
        diffs = compare_outputs(run_unsplit(reference, **inputs), model(**inputs))
        assert set(diffs) == {"loss", "logits"}


def test_hidden_states_come_back_through_parallelize(masked_lm):
    model, reference = masked_lm
    inputs = mlm_batch(4)
    expected = run_unsplit(copy.deepcopy(reference), **inputs, output_hidden_states=True)
    got = model(**inputs, output_hidden_states=True)
    diffs = compare_outputs(expected, got)
    assert {f"hidden_states.{i}" for i in range(SIZES["layers"] + 1)} <= set(diffs)


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_a_model_that_already_returned_hidden_states_can_be_parallelized():
    model = tiny_bert()
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    expected = run_unsplit(model, **inputs, output_hidden_states=True)
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    try:
        compare_outputs(expected.last_hidden_state, model(**inputs).last_hidden_state)
    finally:
        model.deparallelize()


# -- 2. output types and attributes --------------------------------------------------------------


def test_outputs_keep_their_types_and_the_model_its_attributes(masked_lm):
    model, reference = masked_lm
    inputs = mlm_batch(5)
    out = model(**inputs)
    assert type(out) is transformers.modeling_outputs.MaskedLMOutput
    assert isinstance(out, transformers.utils.ModelOutput)
    assert isinstance(out.logits, torch.Tensor) and type(out.logits) is torch.Tensor
    assert out.logits.device.type == "cpu" and not out.logits.requires_grad
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, 7, VOCAB)
    assert out.loss is None and out[0] is out.logits  # indexing as a ModelOutput works
    torch.testing.assert_close(model.forward(**inputs).logits, out.logits, rtol=0, atol=0)  # forward is served
    as_tuple = model(**inputs, return_dict=False)
    assert type(as_tuple) is tuple and len(as_tuple) == 1 and type(as_tuple[0]) is torch.Tensor
    positional = model(inputs["input_ids"], inputs["attention_mask"])  # positional arguments travel too
    compare_outputs(run_unsplit(reference, **inputs), positional)

    assert isinstance(model, transformers.PreTrainedModel) and isinstance(model, transformers.BertForMaskedLM)
    assert model.config.hidden_size == SIZES["hidden"] and model.config.vocab_size == VOCAB
    assert model.main_input_name == "input_ids" and model.device.type == "cpu" and not model.training
    assert model.bert.embeddings.word_embeddings.weight.shape == (VOCAB, SIZES["hidden"])
    assert model.num_parameters() == reference.num_parameters()  # the caller's copy is whole, untouched
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def test_memory_queries_report_every_rank(masked_lm):
    model, _ = masked_lm
    full = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    allocated = model.memory_allocated()
    assert sorted(allocated) == ["cpu:0", "cpu:1"]
    assert all(isinstance(v, int) and 0 < v < full for v in allocated.values()), (allocated, full)
    for query in (model.memory_reserved, model.memory_cached, model.memory_peak):
        figures = query()
        assert sorted(figures) == ["cpu:0", "cpu:1"] and all(v > allocated[k] for k, v in figures.items())


def test_the_start_shows_a_bar_of_the_bytes_sent_to_every_rank_and_logs_what_was_split_how(masked_lm_start):
    model, _, screen, records = masked_lm_start
    plan = model._tpcore_handle.plan
    total = sum(plan.bytes_per_rank(rank) for rank in (0, 1))
    assert bar_states(screen, "tpcore: 2 ranks starting")
    assert bar_states(screen, "tpcore: 2 ranks loading")
    final = bar_states(screen, "tpcore: 2 ranks loaded")[-1]
    shown_total = tqdm.format_sizeof(total, divisor=1024)  # as the bar writes a size
    assert final.startswith("tpcore: 2 ranks loaded: 100%|") and f"| {shown_total}/{shown_total} [" in final
    pids = model._tpcore_handle.pool.pids
    logged = [(r.name, r.levelname, getattr(r, "rank", None), r.getMessage()) for r in records]
    forker = parent_of(pids[0])  # CPU ranks are forked by the zygote
    assert is_zygote(forker) and parent_of(pids[1]) == forker
    assert ("tpcore.process", "INFO", None, f"starting 2 gloo ranks (forked by pid {forker})") in logged
    joined = f"RankPool(2 gloo ranks on cpu, pids {pids[0]}, {pids[1]}): every rank joined"
    assert ("tpcore.process", "INFO", None, joined) in logged
    version = importlib.metadata.version("tp-bert")
    chose = f"AutoPolicy chose for BertForMaskedLM: BertPolicy (tp-bert {version})"
    assert ("tpcore.auto", "INFO", None, chose) in logged
    assert ("tpcore.plan", "INFO", None, f"BertForMaskedLM over 2 ranks: {bytes_summary(plan)}") in logged
    for rank in (0, 1):
        joined = [m for name, _, r, m in logged if name == "tpcore.worker" and r == rank]
        assert len(joined) == 1 and joined[0].startswith(
            f"rank {rank}: joined the gloo group on cpu (pid {pids[rank]})"
        )
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warnings == [replicated_warning(plan)]  # this tiny BERT's 512 positions outweigh its layers
    assert "bert.embeddings.position_embeddings (Embedding, 96.0 KiB) is replicated" in warnings[0]
    assert "word_embeddings" not in warnings[0]  # split over the vocabulary


def test_the_served_models_repr_and_its_handles_show_the_split(masked_lm):
    model, reference = masked_lm
    handle = model._tpcore_handle
    version = importlib.metadata.version("tp-bert")
    split = f"split over 2 gloo ranks on cpu by BertPolicy (tp-bert {version}): {bytes_summary(handle.plan)}"
    shown = repr(model).splitlines()
    assert shown[0] == "BertForMaskedLM(" and shown[1] == f"  tpcore: {split}"
    assert shown[2:] == repr(reference).splitlines()[1:]  # the model's own modules, unchanged
    pids = ", ".join(map(str, handle.pool.pids))
    assert repr(handle) == f"ParallelHandle(BertForMaskedLM {split}; RankPool(2 gloo ranks on cpu, pids {pids}))"
    assert "per rank 195.6 KiB of 274.7 KiB (71%; 116.6 KiB replicated on every rank)" in split


# -- 3. generate ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_head():
    """``(parallelized BertLMHeadModel decoder over 2 ranks, the same model unsplit)``, for generate()."""
    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    spec = bert_family_spec("Bert", "LMHeadModel", seed=7, is_decoder=True, **special)
    reference, model = spec.build(), spec.build()
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    yield model, reference
    model.deparallelize()


def generate_inputs() -> dict:
    """A batch of 3 prompts, left padded (2 and 4 pad tokens in the shorter rows)."""
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[2, :4] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "max_new_tokens": 20, "min_new_tokens": 20}


def test_greedy_generate_gives_the_unsplit_tokens(lm_head):
    model, reference = lm_head
    kwargs = generate_inputs()
    with torch.inference_mode():
        expected = reference.generate(**kwargs, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = model.generate(**kwargs, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert type(got) is type(expected) and model.generation_config.pad_token_id == 0  # still reachable
    assert got.sequences.shape == (3, 6 + 20)
    assert torch.equal(got.sequences, expected.sequences)
    compare_outputs(expected.logits, got.logits)
    assert torch.equal(model.generate(**kwargs), expected.sequences)  # plain tensor output


def test_seeded_sampling_gives_the_unsplit_draws_twice_in_a_row(lm_head):
    model, reference = lm_head
    kwargs = generate_inputs()

    def draws(m, seed):
        torch.manual_seed(seed)
        with torch.inference_mode():
            first, second = (m.generate(**kwargs, do_sample=True) for _ in range(2))
        return first, second, torch.rand(4)  # the caller's RNG continues where the ranks left it

    expected, got = draws(reference, 1234), draws(model, 1234)
    assert not torch.equal(expected[0], expected[1])  # the second draw follows the first's RNG state
    assert not torch.equal(expected[0], draws(reference, 99)[0])  # the seed matters
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


# -- 4. validation before any process starts -----------------------------------------------------


class NotATransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x)


@pytest.fixture
def only_tp_bert(monkeypatch):
    """Only the tp-bert plugin is loaded (another installed plugin may cover GPT-2)."""
    from tpcore.select.plugins import ONLY_PLUGINS_ENV, reset_plugins

    monkeypatch.setenv(ONLY_PLUGINS_ENV, "tp-bert")
    reset_plugins()
    yield
    monkeypatch.undo()
    reset_plugins()


def gpt2():
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2Model(config).eval()


def bert_with(**sizes):
    return tiny_bert(seed=None, **({"hidden_size": 48, "num_attention_heads": 12, "intermediate_size": 96} | sizes))


INVALID = [
    ("gpt2", gpt2, 2, tpcore.UnsupportedModelError, "GPT2Model"),
    ("custom-module", NotATransformer, 2, tpcore.UnsupportedModelError, "NotATransformer"),
    ("heads", bert_with, 13, tpcore.ShardingError, "BertModel over 13 ranks.*12 heads are fewer than the ranks"),
    (
        "intermediate",
        lambda: bert_with(intermediate_size=3),
        4,
        tpcore.ShardingError,
        "intermediate.dense.weight.*3 is",
    ),
]


@pytest.mark.parametrize(
    ("make", "world_size", "error", "match"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_models_fail_before_any_process_starts(only_tp_bert, spawned, make, world_size, error, match):
    model = make()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    kids = children()
    with pytest.raises(error, match=match):
        tpcore.parallelize(model, num_gpus=world_size)
    assert spawned == [] and children() <= kids
    assert not hasattr(model, "_tpcore_handle") and "forward" not in vars(model)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


# -- 5. never hang -------------------------------------------------------------------------------


def bad_inputs():
    ids = mlm_batch(6)["input_ids"]
    return {
        "out-of-vocabulary": ((), {"input_ids": ids + VOCAB}),
        "too-many-arguments": ((ids,) * 12, {}),
        "labels-of-another-batch": ((), {"input_ids": ids, "labels": torch.zeros(5, 2, dtype=torch.long)}),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_an_error_on_every_rank_comes_back_as_its_type_and_the_model_keeps_working(masked_lm, case, time_to_error):
    model, reference = masked_lm
    args, kwargs = bad_inputs()[case]
    with pytest.raises(Exception) as unsplit:
        run_unsplit(reference, *args, **kwargs)
    pids = model._tpcore_handle.pool.pids
    started = time.monotonic()
    with pytest.raises(unsplit.type) as caught:
        model(*args, **kwargs)
    time_to_error(f"every rank raises ({case})", time.monotonic() - started)
    assert type(caught.value) is unsplit.type and str(caught.value) == str(unsplit.value)
    cause = caught.value.__cause__
    assert isinstance(cause, WorkerError) and cause.type_name == unsplit.type.__qualname__
    assert cause.pool_consistent and "Traceback" in cause.remote_traceback
    assert "forward" in cause.remote_traceback and "--- rank" in str(cause)
    assert model._tpcore_handle.pool.pids == pids and model._tpcore_handle.pool.alive  # the same ranks serve on
    inputs = mlm_batch(7)
    compare_outputs(run_unsplit(reference, **inputs), model(**inputs))


def test_calls_from_eight_threads_each_get_their_own_result(masked_lm):
    model, reference = masked_lm
    inputs = [mlm_batch(100 + i, lengths=[1 + i % 4] * (1 + i % 3), seq=4 + i % 4) for i in range(8)]
    expected = [run_unsplit(reference, **batch) for batch in inputs]
    results: dict[int, object] = {}
    barrier = threading.Barrier(8)

    def call(i):
        barrier.wait()
        try:
            results[i] = model(**inputs[i])
        except BaseException as error:  # reported below, not lost in the thread
            results[i] = error

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(results) == list(range(8))
    for i in range(8):
        assert not isinstance(results[i], BaseException), results[i]
        compare_outputs(expected[i], results[i])


def stall_on_batch_of_three(module, args):
    """A forward pre-hook that keeps a rank busy, so that a call is in flight when a rank is killed."""
    if args[0].shape[0] == 3:
        time.sleep(30)


@pytest.mark.slow
def test_a_killed_rank_is_detected_not_waited_out_and_deparallelize_still_works(time_to_error):
    """Detected means a :class:`WorkerDiedError` naming the rank, where a wait would end in ``TimeoutError``."""
    reference, model = tiny_bert(seed=3), tiny_bert(seed=3)
    model.encoder.register_forward_pre_hook(stall_on_batch_of_three)  # travels to the ranks with the model
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), "attention_mask": torch.ones(2, 4)}
    inputs["attention_mask"][1, 3] = 0
    expected = run_unsplit(reference, **inputs)

    # a rank killed between calls
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    compare_outputs(expected, model(**inputs))
    pids = model._tpcore_handle.pool.pids
    started = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="rank 1 died|lost a rank"):
        model(**inputs)
    time_to_error("a rank killed between calls, next call", time.monotonic() - started)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="closed or lost a rank"):
        model(**inputs)  # refused at once, not sent to ranks that are gone
    time_to_error("the call after that", time.monotonic() - started)
    assert wait_gone(pids, 60) < 60 and not model._tpcore_handle.pool.alive
    assert repr(model).splitlines()[1].startswith("  tpcore: split over 2 gloo ranks on cpu (stopped) by BertPolicy")
    assert model.deparallelize() is model
    assert not hasattr(model, "_tpcore_handle") and "forward" not in vars(model)
    assert repr(model) == repr(reference)  # its own again
    compare_outputs(expected, run_unsplit(model, **inputs), rtol=0)

    # a rank killed while a call is in flight (the other rank is busy and cannot answer)
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    compare_outputs(expected, model(**inputs))
    pids = model._tpcore_handle.pool.pids
    killed_at = []
    killer = threading.Timer(1.0, lambda: (killed_at.append(time.monotonic()), os.kill(pids[0], signal.SIGKILL)))
    killer.start()
    with pytest.raises(WorkerDiedError, match="rank 0 died"):
        model(input_ids=torch.tensor([[5, 6], [7, 8], [9, 10]]))
    time_to_error("a rank killed mid-call", time.monotonic() - killed_at[0])
    assert wait_gone(pids, 60) < 60
    model.deparallelize()
    compare_outputs(expected, run_unsplit(model, **inputs), rtol=0)


# -- 6. lifecycle --------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_models_parallelized_at_once_use_their_own_ports():
    port = free_port()
    models = {"bert": tiny_bert(seed=1), "distilbert": bert_family_spec("DistilBert", "Model").build()}
    references = {name: copy.deepcopy(model) for name, model in models.items()}
    batch = mlm_batch(8)
    inputs = {"bert": {"input_ids": batch["input_ids"] % 32}, "distilbert": batch}
    expected = {name: run_unsplit(ref, **inputs[name]) for name, ref in references.items()}
    tpcore.parallelize(models["bert"], num_gpus=2, backend="gloo", master_port=port)
    try:
        tpcore.parallelize(models["distilbert"], num_gpus=2, backend="gloo")
        try:
            ports = {name: m._tpcore_handle.pool.master_port for name, m in models.items()}
            assert ports["bert"] == port and ports["distilbert"] != port, ports
            assert ("127.0.0.1", port) in listening_of([os.getpid()]).values()  # the caller serves the rendezvous
            for _ in range(2):  # interleaved calls
                for name, model in models.items():
                    compare_outputs(expected[name], model(**inputs[name]))
            with pytest.raises(RuntimeError, match="already parallelized"):
                tpcore.parallelize(models["bert"], num_gpus=2)
        finally:
            models["distilbert"].deparallelize()
        compare_outputs(expected["bert"], models["bert"](**inputs["bert"]))  # the other one serves on
    finally:
        models["bert"].deparallelize()


#: parallelize -> call -> deparallelize cycles: enough for a leak per cycle to show in every count below
CYCLES = 3


@pytest.mark.slow
def test_repeated_cycles_leave_no_process_port_or_shared_memory_behind():
    model = tiny_bert(seed=2)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    expected = run_unsplit(model, **inputs)
    kids, own_listening, shm = children(), listening_of([os.getpid()]), shm_entries()
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    cycle_times, rank_listeners = [], {}
    for _ in range(CYCLES):
        started = time.monotonic()
        tpcore.parallelize(model, num_gpus=2, backend="gloo")
        pids = model._tpcore_handle.pool.pids
        rank_listeners.update(listening_of(pids))
        compare_outputs(expected, model(**inputs))
        model.deparallelize()
        cycle_times.append(time.monotonic() - started)
        assert all(gone(pid) for pid in pids)
    assert rank_listeners, "the ranks' listening sockets should have been visible"
    assert children() <= kids
    assert not set(rank_listeners) & set(listening_sockets()), "a rank's listening socket outlived it"
    assert listening_of([os.getpid()]) == own_listening
    assert shm_entries() <= shm
    assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads
    compare_outputs(expected, run_unsplit(model, **inputs), rtol=0)
    mean = sum(cycle_times) / len(cycle_times)
    print(
        f"\nparallelize -> call -> deparallelize: mean {mean:.2f} s, min {min(cycle_times):.2f} s, "
        f"max {max(cycle_times):.2f} s over {len(cycle_times)} cycles (world 2)"
    )


CALLER = textwrap.dedent(
    """
    import json, signal, sys, time
    import torch, tpcore
    from tpcore.testing import tiny_bert

    # Ctrl-C raises KeyboardInterrupt here even when started with SIGINT ignored (as a background job is)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = sys.argv[1]
    model = tiny_bert(seed=None)

    def stall(module, args):
        time.sleep(900)

    if mode.endswith("-call"):
        model.encoder.register_forward_pre_hook(stall)
    tpcore.parallelize(model, num_gpus=1, backend="gloo")  # one rank each: five callers share two cores
    print(json.dumps(model._tpcore_handle.pool.pids), flush=True)
    ids = torch.tensor([[5, 6, 7]])
    if mode == "exit":
        model(input_ids=ids)
        print("READY", flush=True)
        sys.stdin.readline()  # the test says when
    else:
        print("READY", flush=True)
        if mode.endswith("-idle"):
            time.sleep(900)
        else:
            model(input_ids=ids)
    """
)


#: runs the rest of its argv with SIGINT ignored, as a shell starts a background job
SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
)


class Script:
    """A Python process in its own session whose stdout lines and stderr are collected by threads.

    The ranks inherit its pipes, so nothing may wait for them to close. ``sigint_ignored`` starts it
    with SIGINT ignored, as a shell starts a background job: what it does with Ctrl-C it must set itself.
    """

    def __init__(self, argv, stdin_text: str | None = None, env=None, cwd=None, sigint_ignored: bool = False):
        """``stdin_text``: written to its stdin, which is then closed; ``""`` leaves stdin open."""
        if sigint_ignored:
            argv = [sys.executable, "-c", SIGINT_IGNORED, *argv]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self._line), (self.proc.stderr, self.err.append))
        ]
        for pump in self.pumps:
            pump.start()
        if stdin_text:
            self.proc.stdin.write(stdin_text)
            self.proc.stdin.close()

    def _line(self, line: str) -> None:
        self.out.append(line)
        self.lines.put(line.rstrip("\n"))

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)

    def next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s; stderr:\n{self.stderr}") from None

    def finish(self, timeout: float) -> int:
        """Wait for the process to exit and for its output to be read (its ranks must be gone by then)."""
        code = self.proc.wait(timeout)
        for pump in self.pumps:
            pump.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


#: mode -> (signal to send once READY, to the whole process group as a terminal's Ctrl-C does)
EXITS = {
    "exit": (None, False),
    "sigint-idle": (signal.SIGINT, False),
    "sigint-call": (signal.SIGINT, False),
    "ctrl-c-call": (signal.SIGINT, True),
    "sigkill-call": (signal.SIGKILL, False),
}


#: generous bounds (the watchdog polls twice a second; a caller ends in well under a second): they catch
#: orphans, never a slow machine
CALLER_END_S, RANKS_GONE_S = 120, 30


@pytest.mark.slow
def test_the_caller_exiting_in_any_way_leaves_no_orphans(tmp_path, time_to_error):
    """The ways a caller ends, run side by side: normal exit, SIGINT (to the caller only, or to its
    process group like Ctrl-C in a terminal) while idle or mid-call, SIGKILL mid-call.

    The callers start with SIGINT ignored, as a background job does, and set what they need themselves.
    The ranks must be gone within ``RANKS_GONE_S`` of the caller's end (of the signal, for a signalled caller).
    """
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    callers: dict[str, Script] = {}
    rank_pids: dict[str, list[int]] = {}
    ended_at: dict[str, float] = {}  # caller exit, or the signal sent to it
    gone_at: dict[str, float] = {}  # every rank of that caller gone
    stop = threading.Event()

    def monitor():
        # One last pass after ``stop``: the main thread may see a caller end before this thread does
        # (a loaded machine wakes it late), and that end must still be recorded.
        while True:
            stopping = stop.is_set()
            now = time.monotonic()
            for mode, caller in list(callers.items()):
                if EXITS[mode][0] is None and mode not in ended_at and caller.proc.poll() is not None:
                    ended_at[mode] = now
                pids = rank_pids.get(mode)
                if pids and mode not in gone_at and all(gone(pid) for pid in pids):
                    gone_at[mode] = now
            if stopping:
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    try:
        for mode in EXITS:  # one at a time: five callers and their ranks starting at once swamp two cores
            callers[mode] = Script([sys.executable, str(script), mode], stdin_text="", sigint_ignored=True)
            rank_pids[mode] = json.loads(callers[mode].next_line(300))
        for caller in callers.values():
            assert caller.next_line(120) == "READY"
        time.sleep(1.0)  # the "-call" modes are now inside a call
        for mode, (signum, group) in EXITS.items():
            assert mode not in gone_at, f"{mode}: ranks ended too early"
            if signum is None:
                callers[mode].proc.stdin.write("go\n")
                callers[mode].proc.stdin.close()
            else:
                ended_at[mode] = time.monotonic()
                (os.killpg if group else os.kill)(callers[mode].proc.pid, signum)
        deadline = time.monotonic() + CALLER_END_S
        while time.monotonic() < deadline and not all(c.proc.poll() is not None for c in callers.values()):
            time.sleep(0.05)
        while time.monotonic() < deadline and len(gone_at) < len(callers):
            if all(time.monotonic() > ended_at[mode] + RANKS_GONE_S for mode in callers if mode not in gone_at):
                break
            time.sleep(0.05)
        stop.set()
        watcher.join()  # its last pass is short
        failures, timings = [], {}
        for mode, caller in callers.items():
            code = caller.proc.poll()
            if code is None or mode not in ended_at:
                failures.append(f"{mode}: the caller did not end within {CALLER_END_S} s")
                continue
            timings[mode] = max(0.0, gone_at.get(mode, float("inf")) - ended_at[mode])  # 0: gone before it ended
            time_to_error(f"ranks gone after the caller's {mode}", timings[mode])
            if not timings[mode] <= RANKS_GONE_S:
                failures.append(f"{mode}: ranks {rank_pids[mode]} alive {RANKS_GONE_S} s after the caller ended")
            wanted = {"exit": code == 0, "sigkill-call": code == -9}
            if not wanted.get(mode, code != 0):
                failures.append(f"{mode}: exit code {code}; stderr:\n{caller.stderr[-2000:]}")
        assert not failures, "\n".join(failures)
    finally:
        stop.set()
        for caller in callers.values():
            caller.kill()
        for pid in (pid for pids in rank_pids.values() for pid in pids):
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


REPL = textwrap.dedent(
    """
    import json, signal, time
    import torch, tpcore
    from tpcore.testing import tiny_bert

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive interpreter has it
    model = tiny_bert(seed=None)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = model(input_ids=ids).last_hidden_state
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    pids = model._tpcore_handle.pool.pids
    print(json.dumps(pids), flush=True)
    try:  # READY inside: the Ctrl-C the test sends once it reads it may land before print returns
        print("READY", flush=True)
        time.sleep(120)  # idle at the prompt
    except KeyboardInterrupt:
        print("KeyboardInterrupt at the prompt", flush=True)
    got = model(input_ids=ids).last_hidden_state
    print("max abs diff", (got - expected).abs().max().item(), flush=True)
    print("same ranks", model._tpcore_handle.pool.pids == pids, flush=True)
    model.deparallelize()
    """
)


@pytest.mark.slow
def test_ctrl_c_at_an_idle_prompt_spares_the_ranks(tmp_path):
    """A terminal's Ctrl-C goes to the whole foreground process group; the REPL catches it and carries on,
    and so must its model: the ranks run in their own session and never see it."""
    script = tmp_path / "repl.py"
    script.write_text(REPL)
    caller = Script([sys.executable, str(script)], sigint_ignored=True)
    pids: list[int] = []
    try:
        pids = json.loads(caller.next_line(180))
        assert caller.next_line(60) == "READY"
        os.killpg(caller.proc.pid, signal.SIGINT)  # what the terminal does
        assert caller.next_line(60) == "KeyboardInterrupt at the prompt"
        diff = float(caller.next_line(60).removeprefix("max abs diff "))
        assert diff < 1e-5
        assert caller.next_line(60) == "same ranks True"
        assert caller.finish(60) == 0, caller.stderr
        assert "KeyboardInterrupt" not in caller.stderr, caller.stderr  # no rank printed one
        assert wait_gone(pids, 60) < 60
    finally:
        caller.kill()
        for pid in pids:
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# -- 7. CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------


@pytest.mark.slow  # seconds of rank start-up or a long equivalence run: the full suite only
def test_cuda_visible_devices_is_respected_and_never_rewritten(monkeypatch):
    """The ranks see the caller's value; the caller's environment, RNG and thread count are left alone."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,3")
    model = tiny_bert(seed=4)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]])}
    expected = run_unsplit(model, **inputs)
    environment, rng, threads = dict(os.environ), torch.get_rng_state(), torch.get_num_threads()
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    try:
        assert dict(os.environ) == environment  # no MASTER_PORT, RANK, ... set in the caller
        seen = model._tpcore_handle.pool.run(rank_helpers.environment_variable, "CUDA_VISIBLE_DEVICES")
        assert seen == ["7,3", "7,3"]
        compare_outputs(expected, model(**inputs))
        assert dict(os.environ) == environment
    finally:
        model.deparallelize()
    assert dict(os.environ) == environment and os.environ["CUDA_VISIBLE_DEVICES"] == "7,3"
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


# -- 8. interactive use --------------------------------------------------------------------------

NOTEBOOK = textwrap.dedent(
    """
    import torch
    import transformers
    import tpcore
    from tpcore import Layer, Policy, divide

    consulted = []


    class InlineBertPolicy(Policy):
        layer_class = transformers.models.bert.modeling_bert.BertLayer

        @staticmethod
        def replace_arguments(config, world_size):
            consulted.append(world_size)
            heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
            head_size = config.hidden_size // config.num_attention_heads
            return {"attention.self.num_attention_heads": heads, "attention.self.all_head_size": heads * head_size}

        @staticmethod
        def attn_qkv():
            return [Layer(f"attention.self.{n}.weight", f"attention.self.{n}.bias") for n in ("query", "key", "value")]

        @staticmethod
        def attn_out():
            return [Layer("attention.output.dense.weight", "attention.output.dense.bias")]

        @staticmethod
        def mlp_in():
            return [Layer("intermediate.dense.weight", "intermediate.dense.bias")]

        @staticmethod
        def mlp_out():
            return [Layer("output.dense.weight", "output.dense.bias")]


    config = transformers.BertConfig(
        hidden_size=48, num_attention_heads=12, num_hidden_layers=2, intermediate_size=96, vocab_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).logits
    try:
        tpcore.parallelize(model, num_gpus=2)
    except tpcore.UnsupportedModelError:
        print("without custom_policies: UnsupportedModelError")
    tpcore.parallelize(model, num_gpus=2, backend="gloo", custom_policies=[InlineBertPolicy])
    print("policy consulted for world sizes", consulted)
    got = model(input_ids=ids, attention_mask=mask).logits
    print("query shards", model._tpcore_handle.pool.run(
        lambda context: list(context.store["model"].bert.encoder.layer[1].attention.self.query.weight.shape)
    ))
    print("max abs diff", (got - expected).abs().max().item())
    model.deparallelize()
    """
)


@pytest.mark.slow
def test_a_policy_defined_in_main_works_from_a_script_and_from_stdin(tmp_path):
    """No ``if __name__ == "__main__"`` guard, plugins and structural policies off: only the ``__main__`` policy
    can split BERT."""
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    env = dict(os.environ, TPCORE_DISABLE_PLUGIN_AUTOLOAD="1", TPCORE_STRUCTURAL="0")
    runs = {
        "python script.py": Script([sys.executable, str(script)], env=env, cwd=tmp_path),
        "python -": Script([sys.executable, "-"], stdin_text=NOTEBOOK, env=env, cwd=tmp_path),
    }
    try:
        for how, run in runs.items():
            code = run.finish(180)
            output = "".join(run.out)
            assert code == 0, f"{how}: exit code {code}\n{output}\n{run.stderr}"
            assert "without custom_policies: UnsupportedModelError" in output, f"{how}: plugins were loaded"
            assert "policy consulted for world sizes [2" in output, output
            assert "query shards [[24, 48], [24, 48]]" in output, output
            diff = float(re.search(r"max abs diff (\S+)", output).group(1))
            assert diff < 1e-5, f"{how}: max abs diff {diff}"
    finally:
        for run in runs.values():
            run.kill()
