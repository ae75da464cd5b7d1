"""The ranks' lookahead (:mod:`tpcore.served.lookahead`): after a decode step they run the greedy guess of the next one
while the caller runs ``generate()``'s own work, and answer the next call from it when it is that call.

The caller must not be able to tell: every output equals the unsplit model's whether a guess hit or missed,
and whatever else touches the cache (crop, reading its tensors, a config change, another cache) sees it as the
caller left it. Two ways in: a model served by 2 ranks through ``tpcore.parallelize`` (the user's path), and
:func:`tpcore.served.lookahead.serve` run in this process on one unsplit model, where a guessed step's output must be
identical, bit for bit, to the step computed when it is asked for.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import tpcore
from tpcore.ranks.worker import RankContext
from tpcore.served.caches import CacheRef, cache_keyword
from tpcore.served.call import Call
from tpcore.served.lookahead import ENABLED_ENV, Lookahead, decode_shaped, predicted_call, serve
from tpcore.served.random_state import RandomState
from tpcore.testing import compare_outputs, tiny_llama

VOCAB = 100  # tiny_llama's
PROMPTS = torch.tensor([[5, 7, 9, 11, 3], [0, 0, 4, 8, 6]])
MASK = (PROMPTS != 0).long()
#: tiny_llama's sizes, for a Mistral of the same shape
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def llama() -> LlamaForCausalLM:
    """tiny_llama with no eos: no row finishes early, each step's argmax is the caller's next token."""
    return tiny_llama(eos_token_id=None)


def counts(context) -> tuple[int, int]:
    """On a rank: the guessed steps run and used so far."""
    lookahead = context.store.get("lookahead")
    return (lookahead.run_count, lookahead.used_count) if lookahead else (0, 0)


# --- the user's path: a model served by 2 ranks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return llama()


@pytest.fixture(scope="module")
def served():
    model = tpcore.parallelize(llama(), num_gpus=2)
    yield model
    model.deparallelize()


def guesses(served) -> tuple[int, int]:
    """The guessed steps run and used so far, the same on every rank."""
    every_rank = served._tpcore_handle.pool.run(counts)
    assert len(set(every_rank)) == 1, every_rank
    return every_rank[0]


def test_greedy_generate_is_answered_from_guessed_steps_and_gives_the_unsplit_tokens(served, reference):
    expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12)
    run, used = guesses(served)
    got = served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12)
    assert torch.equal(got, expected)
    run_after, used_after = guesses(served)
    # 11 decode steps follow the prefill, each guessed after the call before it; none after the 12th and last step
    assert (run_after - run, used_after - used) == (11, 11)


@pytest.mark.parametrize("given", ["call", "generation config"])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_no_guess_follows_the_last_step_of_a_generate_so_the_next_call_never_waits_for_one(
    served, reference, given, new_tokens
):
    """``max_new_tokens`` of the call or of its generation config bounds the steps; the last one says so and the
    ranks guess none after it (a prefill alone included), which the next call would wait for."""
    from transformers import GenerationConfig

    arguments = (
        {"max_new_tokens": new_tokens}
        if given == "call"
        else {"generation_config": GenerationConfig(max_new_tokens=new_tokens, do_sample=False)}
    )
    expected = reference.generate(PROMPTS, attention_mask=MASK, **arguments)
    run, used = guesses(served)
    assert torch.equal(served.generate(PROMPTS, attention_mask=MASK, **arguments), expected)
    run_after, used_after = guesses(served)
    assert (run_after - run, used_after - used) == (new_tokens - 1, new_tokens - 1)


def test_the_steps_of_a_generate_are_bounded_only_where_each_new_token_is_one_step(served):
    from tpcore.served.handle import _generate_steps

    assert _generate_steps(served, {"max_new_tokens": 5}) == 5
    assert _generate_steps(served, {}) is None  # max_length alone: not counted
    assert _generate_steps(served, {"max_new_tokens": 5, "prompt_lookup_num_tokens": 3}) is None
    assert _generate_steps(served, {"max_new_tokens": 5, "assistant_model": object()}) is None


def test_a_row_that_finished_in_a_batch_is_guessed_its_pad_token_from_the_step_after(served, reference):
    eos = 12  # the second row's third new token, which the first row never gives
    expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, eos_token_id=eos)
    assert expected[1, 7] == eos and (expected[1, 8:] == 0).all() and not (expected[0, 5:] == eos).any()
    run, used = guesses(served)
    assert torch.equal(served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, eos_token_id=eos), expected)
    run_after, used_after = guesses(served)
    # guessed after the prefill and the steps of new tokens 1-3 (used at 1-3); the step of token 4 (a pad token
    # where the argmax was guessed) misses; the prediction after it holds that row at the pad token, so the step
    # of token 5 matches it and guesses run again after the steps of tokens 5-10 (used at 6-11), none after the last
    assert (run_after - run, used_after - used) == (10, 9)


def test_a_step_the_guess_missed_and_what_else_touches_the_cache_see_the_cache_the_caller_left(served, reference):
    """A manual decode loop: steps that take the argmax (guesses hit) and steps that take another token (they miss
    and are taken back), a crop and a read of the cache's tensors while a guess is pending: every step's logits
    equal the unsplit model's, and the cache holds what the unsplit one holds."""
    out, expected = served(PROMPTS, attention_mask=MASK, use_cache=True), reference(PROMPTS, attention_mask=MASK)
    mine, theirs, mask = out.past_key_values, expected.past_key_values, MASK
    run, used = guesses(served)
    for step in range(8):
        token = expected.logits[:, -1:].argmax(-1)
        if step in (3, 4):
            token = (token + 1) % VOCAB  # not the guess
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = served(token, attention_mask=mask, past_key_values=mine)
        expected = reference(token, attention_mask=mask, past_key_values=theirs)
        compare_outputs(expected.logits, out.logits)
        assert mine.get_seq_length() == theirs.get_seq_length() == 6 + step
    run_after, used_after = guesses(served)
    # guessed after steps 0-2 (used at 1 and 2; 3 misses); none after the misses at 3 and 4, nor after 5, whose
    # argmax the prediction after 4 did not give the rows that took other tokens; step 6 is the prediction made
    # (not run) after 5: guessed again after 6 and 7 (used at 7; the last is pending)
    assert (run_after - run, used_after - used) == (5, 3)

    # a crop while a guess is pending: the guessed position is never seen, the crop removes the caller's last
    mine.crop(-2)
    theirs.crop(-2)
    assert mine.get_seq_length() == theirs.get_seq_length() == 11
    token, mask = torch.tensor([[13], [17]]), mask[:, :-1]
    compare_outputs(
        reference(token, attention_mask=mask, past_key_values=theirs).logits,
        served(token, attention_mask=mask, past_key_values=mine).logits,
    )
    # the cache's tensors read in the caller while a guess is pending: the caller's positions only
    kept = mask.bool()
    for layer, expected_layer in zip(mine.layers, theirs.layers, strict=True):
        assert layer.keys.shape == expected_layer.keys.shape
        compare_outputs(expected_layer.keys.transpose(1, 2)[kept], layer.keys.transpose(1, 2)[kept])


def test_a_config_change_between_steps_is_not_answered_from_the_guess(served, reference):
    prompt, mine, theirs = PROMPTS[:1], DynamicCache(), DynamicCache()
    token = None
    for _ in range(3):  # a prompt and two greedy steps: the guess after the second is pending
        got = served(prompt if token is None else token, past_key_values=mine)
        expected = reference(prompt if token is None else token, past_key_values=theirs)
        token = expected.logits[:, -1:].argmax(-1)
    run, used = guesses(served)
    served.config.output_hidden_states = reference.config.output_hidden_states = True
    try:
        got, expected = served(token, past_key_values=mine), reference(token, past_key_values=theirs)
    finally:
        served.config.output_hidden_states = reference.config.output_hidden_states = False
    assert got.hidden_states is not None and len(got.hidden_states) == 3
    compare_outputs(expected.hidden_states, got.hidden_states)
    compare_outputs(expected.logits, got.logits)
    assert guesses(served)[1] == used and run > 0


def test_sampling_stops_the_guesses_while_they_miss_and_draws_the_unsplit_tokens(served, reference):
    torch.manual_seed(5)
    expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=10, do_sample=True, temperature=2.0)
    run, used = guesses(served)
    torch.manual_seed(5)
    got = served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=10, do_sample=True, temperature=2.0)
    assert torch.equal(got, expected)
    run_after, used_after = guesses(served)
    assert run_after - run <= 4  # once one misses, only a prediction that came true starts them again


# --- in this process: serve() on one unsplit model ------------------------------------------------------------


class OneRank:
    """``serve`` as one rank runs it, in this process, on an unsplit model; the work each call leaves, run."""

    def __init__(self, model, enabled: bool = True) -> None:
        self.context = RankContext(0, 1, "gloo", None, torch.device("cpu"), store={"model": model})
        self.context.store["lookahead"] = Lookahead(enabled)
        self.key = cache_keyword(model)
        self.caches = 0

    @property
    def lookahead(self) -> Lookahead:
        return self.context.store["lookahead"]

    def cache(self, ref: CacheRef):
        return self.context.store["state"].caches.caches[ref.id]

    def __call__(self, cache: CacheRef, idle: bool = True, **kwargs):
        output, _, _ = serve(self.context, Call("", (), {**kwargs, self.key: cache}, RandomState(None)))
        if idle:
            self.context.run_idle_work()
        return output

    def new_cache(self, config=None) -> CacheRef:
        self.caches += 1
        return CacheRef(self.caches, DynamicCache(config=config))


def test_a_guessed_step_is_bit_for_bit_the_step_run_when_asked_for():
    model = llama()
    rank, plain, cache = OneRank(model), copy.deepcopy(model), DynamicCache()
    ref = rank.new_cache()
    positions = (MASK.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=PROMPTS, attention_mask=MASK, position_ids=positions, use_cache=True, logits_to_keep=1)
    got, expected = rank(ref, **kwargs), plain(**kwargs, **{rank.key: cache})
    for _ in range(4):
        assert rank.lookahead.pending is not None  # the guess ran after the reply
        assert torch.equal(got.logits, expected.logits)
        kwargs = predicted_call(kwargs, expected.logits[:, -1].argmax(-1))
        got, expected = rank(CacheRef(ref.id), **kwargs), plain(**kwargs, **{rank.key: cache})
    assert torch.equal(got.logits, expected.logits)
    assert rank.lookahead.used_count == 4


def test_a_missed_guess_gives_the_cache_back_its_own_tensors_and_a_failed_one_turns_the_lookahead_off():
    rank = OneRank(llama())
    ref = rank.new_cache()
    rank(ref, input_ids=PROMPTS, attention_mask=MASK)
    cache = rank.cache(ref)
    assert rank.lookahead.pending is not None and cache.get_seq_length() == 6  # the guessed position
    before = rank.lookahead.pending.before
    rank.lookahead.drop()
    assert cache.get_seq_length() == 5
    taken_back = zip(cache.layers, before, strict=True)
    assert all(layer.keys is keys and layer.values is values for layer, (keys, values) in taken_back)

    # a guessed step that raises (out of memory, say): taken back, and no guess runs on this rank again
    mask = torch.cat([MASK, torch.ones(2, 1, dtype=MASK.dtype)], dim=1)
    rank(CacheRef(ref.id), idle=False, input_ids=torch.tensor([[3], [4]]), attention_mask=mask)
    assert rank.context.idle_work is not None

    def out_of_memory(module, args):
        raise RuntimeError("out of memory")

    failing = rank.context.store["model"].register_forward_pre_hook(out_of_memory)
    try:
        rank.context.run_idle_work()
    finally:
        failing.remove()
    assert not rank.lookahead.enabled and rank.lookahead.pending is None and cache.get_seq_length() == 6
    rank(CacheRef(ref.id), input_ids=torch.tensor([[3], [4]]), attention_mask=torch.cat([mask, mask[:, :1]], 1))
    assert rank.lookahead.pending is None and cache.get_seq_length() == 7


def test_a_prefill_followed_by_another_cache_s_step_stops_the_guesses_after_prefills_only():
    """As a server runs: a new request's prefill on a cache of its own, then the running batch's step on another."""
    rank = OneRank(llama())
    batch = rank.new_cache()
    rank(batch, input_ids=PROMPTS, attention_mask=MASK)
    mask = torch.cat([MASK, torch.ones(2, 1, dtype=MASK.dtype)], dim=1)
    for request in range(3):
        rank(rank.new_cache(), input_ids=PROMPTS[:1, :4], attention_mask=MASK[:1, :4])  # a prefill
        assert (rank.lookahead.pending is not None) == (request == 0)  # guessed until a batch step followed one
        rank.lookahead.drop()  # the request joins the batch (a cache operation): the prefill's guess was not used
        assert rank.lookahead.hitting[True] is False
        rank(CacheRef(batch.id), input_ids=torch.tensor([[3 + request], [4]]), attention_mask=mask)  # a batch step
        assert rank.lookahead.pending is not None  # the batch's steps are guessed all the same
        mask = torch.cat([mask, mask[:, :1]], dim=1)


def test_guesses_run_only_where_taking_one_back_is_exact(monkeypatch):
    torch.manual_seed(0)
    config = MistralConfig(**SIZES, vocab_size=VOCAB, sliding_window=3)
    sliding = OneRank(MistralForCausalLM(config).eval())
    sliding(sliding.new_cache(config), input_ids=PROMPTS, attention_mask=MASK)
    assert sliding.lookahead.prediction is None and sliding.lookahead.pending is None

    training = OneRank(llama().train())
    training(training.new_cache(), input_ids=PROMPTS, attention_mask=MASK)
    assert training.lookahead.pending is None

    off = OneRank(llama(), enabled=False)
    off(off.new_cache(), input_ids=PROMPTS, attention_mask=MASK)
    assert off.lookahead.pending is None
    monkeypatch.setenv(ENABLED_ENV, "0")
    assert not Lookahead().enabled
    monkeypatch.setenv(ENABLED_ENV, "1")
    assert Lookahead().enabled


def _call(**kwargs) -> Call:
    return Call("", (), kwargs, RandomState(None))


def test_a_decode_shaped_call_and_the_call_predicted_after_it():
    ids, cache = torch.tensor([[4, 5], [6, 7]]), CacheRef(3)
    plain = dict(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, output_attentions=None)
    assert decode_shaped(_call(**plain, attention_mask=torch.ones(2, 2)))[0] == cache
    named = decode_shaped(Call("", (ids,), {"past_key_values": cache}, RandomState(None)), ("input_ids", "mask"))
    assert named == (cache, {"input_ids": ids, "past_key_values": cache})  # positional ids named by the forward
    assert decode_shaped(Call("", (ids,), {"past_key_values": cache}, RandomState(None))) is None  # names unknown
    assert decode_shaped(_call(input_ids=ids)) is None  # no cache
    assert decode_shaped(_call(**plain, inputs_embeds=torch.ones(2, 2, 4))) is None  # a tensor it cannot step
    assert decode_shaped(_call(**plain, attention_mask=torch.ones(2, 1, 2, 2))) is None  # a 4D mask
    assert decode_shaped(_call(**plain, other=CacheRef(4))) is None  # two caches
    assert decode_shaped(_call(**plain, labels=[1, 2])) is None  # a value it cannot compare
    assert decode_shaped(Call("", (), plain, RandomState(None), config_changes={"": {"use_cache": False}})) is None
    assert decode_shaped(Call("model", (), plain, RandomState(None))) is None  # a submodule's forward

    steps = dict(
        input_ids=ids,
        position_ids=torch.tensor([[0, 1], [0, 0]]),
        cache_position=torch.tensor([0, 1]),
        attention_mask=torch.tensor([[1, 1], [0, 1]]),
        past_key_values=CacheRef(3, DynamicCache()),
        use_cache=True,
    )
    following = predicted_call(steps, torch.tensor([8, 9]))
    assert torch.equal(following["input_ids"], torch.tensor([[8], [9]]))
    assert torch.equal(following["position_ids"], torch.tensor([[2], [1]]))
    assert torch.equal(following["cache_position"], torch.tensor([2]))
    assert torch.equal(following["attention_mask"], torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert following["past_key_values"] == CacheRef(3) and following["use_cache"] is True
