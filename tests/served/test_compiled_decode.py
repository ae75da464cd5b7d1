"""``parallelize(model, num_gpus, compile=True)`` (:mod:`tpcore.served.compiled`): each rank's decode step runs
under ``torch.compile``, its graphs made at load; a generation then compiles nothing more, and its tokens
equal the unsplit model's (greedy, fp32), its logits within the fp32 tolerance of a fused kernel.
"""

from __future__ import annotations

import pytest
import torch
from process_probes import gone
from transformers import DynamicCache

import tpcore
from tpcore.served.compiled import CompiledDecode, compile_ranks, compiled_calls, compiled_graphs
from tpcore.testing import tiny_bert, tiny_llama

PROMPTS = torch.tensor([[5, 7, 9, 11, 3], [0, 0, 4, 8, 6], [1, 2, 3, 4, 5]])
MASK = (PROMPTS != 0).long()


def test_only_one_position_calls_go_to_the_compiled_forward():
    def forward(input_ids, scale=1.0):
        return (input_ids.float() * scale).sin()

    wrapped = CompiledDecode(forward, backend="eager")
    step, sequence = torch.tensor([[3], [4]]), torch.tensor([[3, 4, 5]])
    assert torch.equal(wrapped(step, scale=2.0), forward(step, scale=2.0))
    assert torch.equal(wrapped(input_ids=step), forward(step))
    assert wrapped.compiled_calls == 2
    assert torch.equal(wrapped(sequence), forward(sequence))
    assert torch.equal(wrapped(input_ids=torch.tensor([3, 4])), forward(torch.tensor([3, 4])))  # 1-d: not a step
    assert wrapped.compiled_calls == 2


@pytest.mark.parametrize("model", [tiny_bert, lambda: tiny_llama().model], ids=["encoder", "base"])
def test_a_model_without_a_decode_step_is_refused_before_any_rank_starts(model, spawned):
    """Refused before any rank is forked or spawned (the process's other children may come and go meanwhile:
    torch's compile workers, the ranks of earlier tests' pools ending)."""
    with pytest.raises(ValueError, match="compile=True compiles a decoder's decode step"):
        tpcore.parallelize(model(), num_gpus=2, compile=True)
    assert spawned == []


@pytest.mark.slow  # ~40 s: two ranks compile three graphs each with inductor
def test_a_compiled_split_generates_the_unsplit_tokens_without_compiling_again():
    reference = tiny_llama(eos_token_id=None)
    model = tpcore.parallelize(tiny_llama(eos_token_id=None), num_gpus=2, compile=True)
    try:
        pool = model._tpcore_handle.pool
        made, calls = pool.run(compiled_graphs), pool.run(compiled_calls)
        assert made[0] >= 3 and calls == [6, 6]  # the warm-up: 2 steps at batch 1, 2 at batch 2, 2 padded
        with torch.inference_mode():
            for rows in (1, 3):
                expected = reference.generate(PROMPTS[:rows], attention_mask=MASK[:rows], max_new_tokens=6)
                tokens = model.generate(PROMPTS[:rows], attention_mask=MASK[:rows], max_new_tokens=6)
                assert torch.equal(tokens, expected)
            assert pool.run(compiled_graphs) == made  # generate at batch 1 and 3 fit the graphs made at load
            assert pool.run(compiled_calls) == [16, 16]
            caches = DynamicCache(), DynamicCache()
            prefill = dict(input_ids=PROMPTS, attention_mask=MASK, use_cache=True)
            reference(**prefill, past_key_values=caches[0])
            model(**prefill, past_key_values=caches[1])
            step = dict(input_ids=torch.tensor([[7], [8], [9]]), attention_mask=torch.cat([MASK, MASK[:, :1]], 1))
            expected = reference(**step, past_key_values=caches[0]).logits
            logits = model(**step, past_key_values=caches[1]).logits
        assert all(calls > 16 for calls in pool.run(compiled_calls))  # the step (and the ranks' guesses)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    finally:
        model.deparallelize()


@pytest.mark.slow  # ~10 s: one rank started, then stopped
def test_a_failed_compile_stops_the_ranks_and_gives_the_model_back():
    model = tpcore.parallelize(tiny_llama(), num_gpus=1)
    pids = model._tpcore_handle.pool.pids
    with pytest.raises(Exception, match="no-such-backend"):
        compile_ranks(model, backend="no-such-backend")  # the ranks' torch.compile refuses it
    assert not hasattr(model, "_tpcore_handle") and type(model).__name__ == "LlamaForCausalLM"
    assert all(gone(pid) for pid in pids)
    assert model(input_ids=PROMPTS).logits.shape == (3, 5, 100)
