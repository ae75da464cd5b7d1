"""The served model is the model: transformers' own ``generate()`` runs in the caller, with everything the user
passes (streamers, stopping criteria, logits processors, the generation config as it is now), its forward
steps served by the ranks, which keep the KV cache; the caller holds a ``Cache`` that names it.

Every test goes through ``tpcore.parallelize`` (a model object, and a saved directory whose caller-side model
holds no weights) and compares with the unsplit model: tokens identical, logits within the fp32 tolerance.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import transformers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DynamicCache,
    LlamaForCausalLM,
    LogitsProcessor,
    StoppingCriteria,
    TextIteratorStreamer,
)

import tpcore
from tpcore.testing import compare_outputs, tiny_llama, word_tokenizer

VOCAB = 100  # tiny_llama's and word_tokenizer's


def llama() -> LlamaForCausalLM:
    """tiny_llama with word_tokenizer's eos (``w1``) and eager attention."""
    return tiny_llama(eos_token_id=1, attn_implementation="eager")


def bart() -> BartForConditionalGeneration:
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).eval()


PROMPTS = torch.tensor([[5, 7, 9, 11, 3], [0, 0, 4, 8, 6]])
MASK = (PROMPTS != 0).long()


@pytest.fixture(scope="module")
def reference():
    return llama()


@pytest.fixture(scope="module", params=["object", "directory"])
def served(request, tmp_path_factory):
    """A tiny Llama split over 2 ranks, from the model object or from its saved directory."""
    if request.param == "object":
        model = tpcore.parallelize(llama(), num_gpus=2)
    else:
        directory = tmp_path_factory.mktemp("llama")
        llama().save_pretrained(directory)
        model = tpcore.parallelize(str(directory), num_gpus=2)
    yield model
    model.deparallelize()


@pytest.mark.parametrize(
    "mode",
    [{}, {"num_beams": 3}, {"do_sample": True, "top_k": 20}, {"num_beams": 2, "num_return_sequences": 2}],
    ids=["greedy", "beam", "sample", "beams-returned"],
)
def test_generate_is_the_model_s_own_and_gives_the_unsplit_tokens(served, reference, mode):
    torch.manual_seed(3)
    expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=7, **mode)
    torch.manual_seed(3)
    assert torch.equal(served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=7, **mode), expected)


def test_one_rank_alone_serves_sampling_and_the_cache_it_also_reports(reference):
    """With one rank, rank 0 returns the output and the states the last rank reports in a larger world."""
    model = tpcore.parallelize(llama(), num_gpus=1)
    try:
        torch.manual_seed(3)
        expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=5, do_sample=True, top_k=20)
        torch.manual_seed(3)
        assert torch.equal(
            model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=5, do_sample=True, top_k=20), expected
        )
        output = model(PROMPTS, attention_mask=MASK, use_cache=True)
        assert isinstance(output.past_key_values, DynamicCache) and output.past_key_values.get_seq_length() == 5
        compare_outputs(reference(PROMPTS, attention_mask=MASK).logits, output.logits)
    finally:
        model.deparallelize()


def test_assisted_decoding_with_prompt_lookup_crops_the_ranks_cache(served, reference):
    prompt = torch.tensor([[5, 7, 9, 5, 7, 9, 5, 7]])
    expected = reference.generate(prompt, max_new_tokens=8, prompt_lookup_num_tokens=3)
    assert torch.equal(served.generate(prompt, max_new_tokens=8, prompt_lookup_num_tokens=3), expected)


def test_streamers_stopping_criteria_and_logits_processors_run_in_the_caller(served, reference):
    class Counting(StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            return torch.full((input_ids.shape[0],), self.calls >= 4, dtype=torch.bool)

    class Banning(LogitsProcessor):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores):
            self.seen.append(input_ids.shape[1])
            scores[:, 13] = -float("inf")
            return scores

    words = word_tokenizer()
    streamer = TextIteratorStreamer(words, skip_prompt=True)
    stop, ban = Counting(), Banning()
    options = {"max_new_tokens": 10, "stopping_criteria": [stop], "logits_processor": [ban]}
    thread = threading.Thread(target=lambda: served.generate(PROMPTS[:1], streamer=streamer, **options))
    thread.start()
    streamed = "".join(streamer)  # the consumer reads what the caller's generate puts, token by token
    thread.join(60)
    assert stop.calls == 4 and ban.seen == [5, 6, 7, 8]  # the caller's own instances, with their state
    expected = reference.generate(PROMPTS[:1], stopping_criteria=[Counting()], logits_processor=[Banning()], **{
        "max_new_tokens": 10
    })  # fmt: skip
    assert streamed.split() == words.convert_ids_to_tokens(expected[0, 5:].tolist())


def test_generate_works_in_one_thread_of_the_caller_while_cpu_ranks_compute_and_restores_its_threads(served):
    """CPU ranks hold this host's cores: the caller's part of generate() (logits processors, the next token)
    runs in one intra-op thread, so that it does not take cores from the ranks' steps."""

    class Threads(LogitsProcessor):
        seen: set[int] = set()

        def __call__(self, input_ids, scores):
            self.seen.add(torch.get_num_threads())
            return scores

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=3, logits_processor=[Threads()])
        assert Threads.seen == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_what_the_user_sets_after_parallelize_is_what_the_next_call_uses(served, reference):
    served.generation_config.max_new_tokens = 3
    reference.generation_config.max_new_tokens = 3
    try:
        assert served.generate(PROMPTS[:1]).shape[1] == 5 + 3
    finally:
        served.generation_config.max_new_tokens = reference.generation_config.max_new_tokens = None
    served.config.output_hidden_states = True
    try:
        hidden = served(PROMPTS, attention_mask=MASK).hidden_states
        assert len(hidden) == 3
    finally:
        served.config.output_hidden_states = False
    assert served(PROMPTS, attention_mask=MASK).hidden_states is None


def test_output_attentions_gives_every_head_in_order(served, reference):
    served.set_attn_implementation("eager")  # a directory's model loads with sdpa, which returns no attentions
    expected = reference(PROMPTS, attention_mask=MASK, output_attentions=True)
    got = served(PROMPTS, attention_mask=MASK, output_attentions=True)
    assert [tuple(a.shape) for a in got.attentions] == [(2, 4, 5, 5)] * 2
    compare_outputs(expected.attentions, got.attentions)


def test_past_key_values_steps_and_a_cache_reused_across_calls_equal_the_unsplit_model(served, reference):
    first, expected_first = (
        served(PROMPTS, attention_mask=MASK, use_cache=True),
        reference(PROMPTS, attention_mask=MASK),
    )
    cache = first.past_key_values
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 5  # the caller's stand-in
    step = expected_first.logits[:, -1:].argmax(-1)
    mask = torch.cat([MASK, torch.ones_like(step)], dim=1)
    got = served(step, attention_mask=mask, past_key_values=cache)
    expected = reference(step, attention_mask=mask, past_key_values=expected_first.past_key_values)
    compare_outputs(expected.logits, got.logits)
    assert got.past_key_values is cache and cache.get_seq_length() == 6
    # the cache's tensors read in this process (as Whisper's timestamps do): every head, gathered from the ranks
    kept = mask.bool()  # a directory's model attends by sdpa (attn_implementation is not saved): padding differs
    for mine, theirs in zip(cache.layers, expected.past_key_values.layers, strict=True):
        compare_outputs(theirs.keys.transpose(1, 2)[kept], mine.keys.transpose(1, 2)[kept])
        compare_outputs(theirs.values.transpose(1, 2)[kept], mine.values.transpose(1, 2)[kept])

    # a cache the user keeps across generate calls (a conversation): filled on the ranks, reused there
    mine, theirs = DynamicCache(), DynamicCache()
    turn = served.generate(PROMPTS[:1], past_key_values=mine, max_new_tokens=4)
    assert torch.equal(turn, reference.generate(PROMPTS[:1], past_key_values=theirs, max_new_tokens=4))
    assert mine.get_seq_length() == theirs.get_seq_length() == 8
    follow = torch.cat([turn, torch.tensor([[17, 19]])], dim=1)
    expected = reference.generate(follow, past_key_values=theirs, max_new_tokens=4)
    assert torch.equal(served.generate(follow, past_key_values=mine, max_new_tokens=4), expected)


def test_a_dropped_cache_is_freed_on_the_ranks_and_a_filled_one_is_refused(served, reference):
    def held() -> int:
        return served._tpcore_handle.pool.run(lambda context: len(context.store["state"].caches.caches))[0]

    gc.collect()
    served(PROMPTS[:1], use_cache=False)  # carries the ids of the caches earlier calls' outputs dropped
    before = held()
    cache = served(PROMPTS, attention_mask=MASK, use_cache=True).past_key_values
    assert held() == before + 1
    del cache
    gc.collect()
    served(PROMPTS[:1], use_cache=False)  # the next call carries the ids to free
    assert held() == before
    filled = reference(PROMPTS, attention_mask=MASK, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="holds tensors of this process cannot be used by the split model"):
        served(PROMPTS[:1, :1], past_key_values=filled)


def test_a_large_input_sent_again_unchanged_is_kept_on_the_ranks_and_freed_when_dropped(served, reference):
    """As ``generate()`` passes an encoder's output to every step: from the second send the ranks keep it,
    from the third only its id travels; written into, it travels again; dropped, the ranks free it."""

    def kept() -> int:
        return served._tpcore_handle.pool.run(lambda context: len(context.store["state"].kept.tensors))[0]

    embeds = torch.randn(1, 300, 64)  # 76.8 kB: above tpcore.served.kept_tensors.KEEP_BYTES
    with torch.inference_mode():
        expected = reference(inputs_embeds=embeds).logits
        for sends in range(1, 4):
            compare_outputs(expected, served(inputs_embeds=embeds).logits)
            assert kept() == (sends >= 2)
        embeds[0, 0] += 1
        compare_outputs(reference(inputs_embeds=embeds).logits, served(inputs_embeds=embeds).logits)
    del embeds
    gc.collect()
    served(PROMPTS[:1], use_cache=False)  # carries the ids to free
    assert kept() == 0


def test_torch_compile_of_the_served_model_and_of_its_forward_gives_the_unsplit_outputs(served, reference):
    """Nothing of the split model runs in the caller to compile: compiled, the served call runs as it is
    (no trace into tpcore's transport) and outputs stay the unsplit model's."""
    torch._dynamo.reset()
    kept = MASK.bool()  # a directory's model attends by sdpa (attn_implementation is not saved): padding differs
    with torch.inference_mode():
        expected = reference(PROMPTS, attention_mask=MASK).logits[kept]
        compare_outputs(expected, torch.compile(served)(PROMPTS, attention_mask=MASK).logits[kept])
    tokens = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=5)
    served.forward = torch.compile(served.forward)
    try:
        assert torch.equal(served.generate(PROMPTS, attention_mask=MASK, max_new_tokens=5), tokens)
    finally:
        served.__dict__["forward"] = served.forward._torchdynamo_orig_callable


def test_whisper_token_timestamps_read_the_ranks_cross_attentions_and_cache():
    config = transformers.WhisperConfig(
        vocab_size=60,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=20,
        max_target_positions=40,
        decoder_start_token_id=50,
        bos_token_id=50,
        eos_token_id=51,
        pad_token_id=51,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config.alignment_heads = [[1, 0], [1, 3]]  # a head of each rank's
    features = torch.randn(1, 8, 40)
    options = {"max_new_tokens": 5, "return_token_timestamps": True, "return_dict_in_generate": True}
    expected = model.generate(features, **options)
    served = tpcore.parallelize(model, num_gpus=2)
    try:
        got = served.generate(features, **options)
    finally:
        served.deparallelize()
    assert torch.equal(got["sequences"], expected["sequences"])
    compare_outputs(expected["token_timestamps"], got["token_timestamps"])
    key = "cache" if "cache" in expected else "past_key_values"  # the name before transformers 5.24
    layers = (got[key].self_attention_cache.layers, expected[key].self_attention_cache.layers)
    for mine, theirs in zip(*layers, strict=True):
        compare_outputs(theirs.keys, mine.keys)


def test_a_call_whose_arguments_cannot_travel_fails_alone(served):
    with pytest.raises(TypeError, match="cannot be sent to the ranks: cannot pickle '_thread.lock'"):
        served(PROMPTS, lock=threading.Lock())
    assert served(PROMPTS, attention_mask=MASK).logits.shape == (2, 5, VOCAB)  # the ranks serve on


@pytest.mark.parametrize("source", ["object", "directory"])
def test_an_encoder_decoder_generates_with_its_encoder_served_by_the_ranks(source, tmp_path):
    reference = bart()
    if source == "object":
        model = tpcore.parallelize(bart(), num_gpus=2)
    else:
        reference.save_pretrained(tmp_path)
        model = tpcore.parallelize(str(tmp_path), num_gpus=2)  # the caller's encoder holds no weights
    try:
        for mode in ({}, {"num_beams": 3}):
            expected = reference.generate(PROMPTS, attention_mask=MASK, max_new_tokens=6, **mode)
            assert torch.equal(model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=6, **mode), expected)
    finally:
        model.deparallelize()


def test_a_directory_s_model_reports_the_ranks_device_works_in_a_pipeline_saves_and_deparallelizes(tmp_path):
    reference = llama()
    reference.save_pretrained(tmp_path / "saved")
    model = tpcore.parallelize(str(tmp_path / "saved"), num_gpus=2)
    try:
        assert model.device == torch.device("cpu") and model.dtype == torch.float32  # the ranks', not meta
        assert next(model.parameters()).device.type == "meta"  # this process holds no weights
        inputs = word_tokenizer()(["w5 w7 w9"], return_tensors="pt").to(model.device)
        compare_outputs(reference(**inputs).logits, model(**inputs).logits)
        words = word_tokenizer()
        generate = transformers.pipeline("text-generation", model=model, tokenizer=words)
        expected = transformers.pipeline("text-generation", model=reference, tokenizer=words)
        options = {"max_new_tokens": 5, "do_sample": False}
        assert generate("w5 w7 w9", **options) == expected("w5 w7 w9", **options)
        model.save_pretrained(tmp_path / "again")  # the ranks' shards, gathered a file at a time
        again = LlamaForCausalLM.from_pretrained(tmp_path / "again").eval()
        compare_outputs(reference(**inputs).logits, again(**inputs).logits)  # (it loads with sdpa: fp32 order)
    finally:
        unsplit = model.deparallelize()  # gathers the weights: a usable model, no longer on meta
    assert type(unsplit) is LlamaForCausalLM
    compare_outputs(reference(**inputs).logits, unsplit(**inputs).logits)


@pytest.mark.parametrize("num_gpus", [0, -1, "2", 2.0, None])
def test_num_gpus_that_is_no_count_of_ranks_is_refused_before_anything_starts(num_gpus, spawned):
    with pytest.raises(ValueError, match="num_gpus is the number of ranks to split the model over, a positive int"):
        tpcore.parallelize(llama(), num_gpus=num_gpus)
    assert spawned == []


def test_an_unmerged_lora_and_an_adapter_directory_are_refused_naming_the_layer_and_merged_ones_split(
    tmp_path, spawned, reference
):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path)  # an adapter directory: adapter_config.json and the adapter's weights
    before = len(spawned)  # PEFT's first LoRA may probe the system's libraries (GPTQModel's import runs ldconfig)
    with pytest.raises(ValueError, match=r"unmerged adapter in .*layers\.0\.self_attn\.q_proj .*merge_and_unload"):
        tpcore.parallelize(lora, num_gpus=2)
    with pytest.raises(ValueError, match="holds a PEFT adapter, not a model: merge the adapter"):
        tpcore.parallelize(str(tmp_path), num_gpus=2)
    assert spawned[before:] == []  # neither refusal started a rank
    merged = lora.merge_and_unload()  # LoRA's B starts at zero: merged, it is the base model
    model = tpcore.parallelize(merged, num_gpus=2)
    try:
        compare_outputs(reference(PROMPTS, attention_mask=MASK).logits, model(PROMPTS, attention_mask=MASK).logits)
    finally:
        model.deparallelize()


def test_a_count_in_a_fresh_cache_is_not_a_held_tensor():
    """transformers 5.25's linear-attention cache layers start with a 0-dim token count: a fresh cache still."""
    from types import SimpleNamespace

    from tpcore.served.caches import _holds_tensors

    fresh = SimpleNamespace(layers=[SimpleNamespace(cumulative_length_linear=torch.tensor(0), conv_states={})])
    assert not _holds_tensors(fresh)
    fresh.layers[0].conv_states = [torch.zeros(1, 4, 3)]
    assert _holds_tensors(fresh)
