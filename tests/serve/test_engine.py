"""The serve engine (``Scheduler``) without HTTP: requests are queued before it starts, so they are admitted
together, on the tiny Llama whole and split over 2 ranks.

- Grouped prefill: waiting prompts of similar lengths are prefilled in one left-padded forward, then join the
  running batch; each request still gets its solo greedy text.
- State-space and hybrid decoders: each row's state kept in the running batch; a cache layer the batch cannot keep,
  or a forward it cannot drive, refused at start in one line.
- ``tpcore serve --compile``: the ranks' decode step compiled, its graphs made at load from the running batch's
  own calls, so serving compiles nothing more.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field

import pytest
import torch

import tpcore
from tpcore.serve import batch as batch_module
from tpcore.serve import scheduler as scheduler_module
from tpcore.serve.encoder_decoder_batch import EncoderDecoderBatch
from tpcore.serve.requests import Delta, Failed, Finished, Request, Segment, Transcript
from tpcore.serve.sampling import SamplingParams
from tpcore.serve.scheduler import Generation, Scheduler, prefill_groups
from tpcore.serve.schemas import transcription_response
from tpcore.serve.server import NotServable, load_model, refuse_unbatchable_cache
from tpcore.serve.spmd import TurnPlan
from tpcore.serve.whole_requests import WholeRequests
from tpcore.served.cache_batches import STATES_COUNT_POSITIONS
from tpcore.served.compiled import compiled_calls, compiled_graphs
from tpcore.testing import compare_outputs, tiny_bert, tiny_llama, tiny_seq2seq, word_tokenizer
from tpcore.tools.cli import main

#: (prompt, max_tokens): lengths 2 to 9; one request ends at its first token, inside its group
PROMPTS = [([5, 9], 6), ([7, 3, 8], 1), ([40, 41, 42, 43], 7), ([11] * 5, 5), ([12, 13, 14, 15, 16, 17], 8),
           ([20, 21, 22, 23, 24, 25, 26, 27, 28], 4)]  # fmt: skip


@dataclass
class Collected(Request):
    """A request whose events are kept in a list (the engine's side only: no HTTP handler awaits them)."""

    got: list = field(default_factory=list)

    def push(self, event) -> None:
        self.got.append(event)


def collected(prompt: list[int], max_tokens: int) -> Collected:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Collected(Generation(prompt, params), asyncio.new_event_loop())


def run_to_the_end(model, requests: list[Collected]) -> Scheduler:
    """Queue ``requests`` on a new engine for ``model``, start it and wait until each request has ended."""
    scheduler = Scheduler(model, word_tokenizer(), eos_ids={1})
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    try:
        for _ in range(600):
            if all(request.got and isinstance(request.got[-1], (Finished, Failed)) for request in requests):
                break
            scheduler.thread.join(0.1)
    finally:
        scheduler.stop()
    return scheduler


def solo_text(reference, prompt: list[int], max_tokens: int) -> str:
    """The unsplit model's greedy text for ``prompt`` alone."""
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return word_tokenizer().decode(out[0, len(prompt) :], skip_special_tokens=True)


def text(request: Collected) -> str:
    return "".join(event.text for event in request.got if isinstance(event, Delta))


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(eos_token_id=1, attn_implementation="eager")


@pytest.fixture(scope="module", params=["whole", pytest.param("split", marks=pytest.mark.slow)])  # split: ranks
def model(request, reference):
    if request.param == "whole":
        yield reference
        return
    split = tpcore.parallelize(tiny_llama(eos_token_id=1, attn_implementation="eager"), num_gpus=2)
    yield split
    split.deparallelize()


def test_prompts_queued_together_are_prefilled_together_and_each_gets_its_solo_tokens(model, reference):
    requests = [collected(prompt, max_tokens) for prompt, max_tokens in PROMPTS]
    scheduler = run_to_the_end(model, requests)
    assert scheduler.largest_prefill == 3  # groups by length [2, 3, 4] [5, 6] [9]: padding within a quarter
    for request, (prompt, max_tokens) in zip(requests, PROMPTS, strict=True):
        assert isinstance(request.got[-1], Finished), request.got[-1]
        assert text(request) == solo_text(reference, prompt, max_tokens), prompt
    assert len(scheduler.batch) == 0 and scheduler.batch.cache is None


def test_a_prefill_that_fails_is_retried_alone_and_fails_only_its_own_request(model, reference, monkeypatch):
    prefill = batch_module.RunningBatch.prefill

    def refuse_token_99(self, prompts, extras=None):
        if any(99 in prompt for prompt in prompts):
            raise RuntimeError("token 99 refused")
        return prefill(self, prompts, extras)

    monkeypatch.setattr(batch_module.RunningBatch, "prefill", refuse_token_99)
    requests = [collected([5, 9, 10], 4), collected([99, 9, 10], 4), collected([6, 7, 8], 3)]
    run_to_the_end(model, requests)
    assert isinstance(requests[1].got[-1], Failed) and "token 99 refused" in str(requests[1].got[-1].error)
    for index in (0, 2):
        prompt, max_tokens = requests[index].payload.prompt_ids, requests[index].payload.params.max_tokens
        assert text(requests[index]) == solo_text(reference, prompt, max_tokens)


def test_prefill_groups_sort_by_length_and_bound_positions_and_padding(monkeypatch):
    def lengths(groups):
        return [[len(request.payload.prompt_ids) for request in group] for group in groups]

    requests = [collected([3] * length, 1) for length in (8, 2, 7, 8, 3, 6)]
    # sorted 2 3 6 7 8 8: 2,3 pad 1 of 6; adding 6 would pad 7 of 18 (> a quarter)
    assert lengths(prefill_groups(requests)) == [[2, 3], [6, 7, 8, 8]]
    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", 16)
    assert lengths(prefill_groups(requests)) == [[2, 3], [6, 7], [8, 8]]
    assert lengths(prefill_groups([collected([3] * 40, 1)])) == [[40]]  # one prompt over the bound: alone
    assert prefill_groups([]) == []


def test_compile_is_refused_for_a_whole_model_and_an_encoder(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "llama")
    tiny_bert().save_pretrained(tmp_path / "bert")
    for directory in ("llama", "bert"):
        word_tokenizer().save_pretrained(tmp_path / directory)
    with pytest.raises(ValueError, match="--num-gpus 0, a decoder"):
        load_model(str(tmp_path / "llama"), 0, compile=True)
    with pytest.raises(ValueError, match="--num-gpus 2, not a decoder"):
        load_model(str(tmp_path / "bert"), 2, compile=True)


#: whole tiny decoders whose cache keeps a state per row: Mamba (its mixers take the new positions' mask),
#: Falcon-Mamba (Mamba with its states normalized), Mamba2 (chunked scan), Jamba (Mamba beside attention), Qwen3-Next
#: (gated DeltaNet beside RoPE attention)
STATE_CONFIGS = {
    "Mamba": {"state_size": 8, "expand": 2, "conv_kernel": 4},
    "FalconMamba": {"state_size": 8, "expand": 2, "conv_kernel": 4},
    "Mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 8, "chunk_size": 8},
    "Jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "num_experts": 2,
              "mamba_d_state": 8, "mamba_dt_rank": 8},
    "Qwen3Next": {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "head_dim": 16},
}  # fmt: skip


def state_model(name: str):
    import transformers

    config = getattr(transformers, f"{name}Config")(
        vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, initializer_range=0.3, eos_token_id=1, pad_token_id=0, **STATE_CONFIGS[name],
    )  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


@pytest.mark.skipif(not STATES_COUNT_POSITIONS, reason="this transformers' state layers count no positions: refused")
@pytest.mark.parametrize("name", sorted(STATE_CONFIGS))
def test_state_space_and_hybrid_decoders_batch_their_states_and_each_request_gets_its_solo_tokens(name):
    """Prompts of 1 to 9 tokens prefilled in left-padded groups, rows joining and leaving one running batch: each
    row's convolution window and recurrent state kept beside the attention layers' keys and values, so each request
    gets its greedy text alone (transformers' ``batch_select_indices`` has no state layer: tpcore's ``keep_rows``)."""
    reference = state_model(name)
    prompts = [([33], 6), *PROMPTS]
    requests = [collected(prompt, max_tokens) for prompt, max_tokens in prompts]
    scheduler = run_to_the_end(reference, requests)
    assert scheduler.largest_prefill > 1 and scheduler.largest_batch > 1
    texts = [solo_text(reference, prompt, max_tokens) for prompt, max_tokens in prompts]
    assert len(set(texts)) == len(texts) and all(len(set(text_.split())) > 1 for text_ in texts if text_.count(" ") > 2)
    assert [text(request) for request in requests] == texts


def test_a_cache_layer_the_batch_cannot_keep_is_refused_at_start_in_one_line(tmp_path, capsys, no_process_starts):
    """DeepSeek-V4's compressed attention layers are no cache the running batch keeps: ``tpcore serve`` says so in one
    line and exits 2 before any rank starts or any tokenizer is read (the directory has none). State-space and
    hybrid decoders pass the same check."""
    import transformers

    config = transformers.AutoConfig.for_model("deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
    config.save_pretrained(tmp_path)
    assert main(["serve", str(tmp_path), "--num-gpus", "2"]) == 2
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1
    assert refusal.startswith("tpcore serve: DeepseekV4ForCausalLM keeps a cache layer the running batch cannot keep")
    with pytest.raises(NotServable, match="'heavily_compressed_attention', layer 0"):
        load_model(str(tmp_path), 0)
    for name in STATE_CONFIGS:
        if STATES_COUNT_POSITIONS:
            refuse_unbatchable_cache(state_model(name).config, f"{name}ForCausalLM")  # no NotServable
        else:  # Mamba's batched tokens differ from its solo ones on such a transformers (5.17): refused
            with pytest.raises(NotServable, match="count no positions"):
                refuse_unbatchable_cache(state_model(name).config, f"{name}ForCausalLM")


@pytest.mark.skipif(not STATES_COUNT_POSITIONS, reason="MiniMax's state layers are refused by its config already")
def test_a_model_whose_forward_the_batch_cannot_drive_is_refused_before_it_is_served():
    """MiniMax asks for a cache class of its own: the server's start runs each operation of a running batch once
    (:func:`tpcore.serve.batch.check_batching`) and refuses it in one line, where every request would fail."""
    import transformers

    from tpcore.serve import Service
    from tpcore.testing.samples import small_config

    model = transformers.MiniMaxForCausalLM(small_config(transformers.MiniMaxConfig())).eval()
    with pytest.raises(NotServable, match="MiniMaxForCausalLM cannot be served: a running batch's step fails") as error:
        Service(model, word_tokenizer(), "minimax")
    assert "\n" not in str(error.value) and "cache of its own" in str(error.value)


#: relative bias (T5), learned (BART) or sinusoidal positions (M2M100, Pegasus, Marian)
SEQ2SEQ = ["Bart", "M2M100", "MBart", "Marian", "Pegasus", "T5"]


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_an_encoder_decoder_s_rows_get_their_solo_logits_in_cohorts(name):
    """Two prompts of different lengths prefilled together (the encoder right-padded), a third joining a step later
    (a second cohort), rows fed tokens of their own and one leaving: every row's logits at every step are those of
    the unsplit model run alone on its prompt and decoder tokens, within fp32 rounding."""
    model = tiny_seq2seq(name)
    batch = EncoderDecoderBatch(model)
    prompts = {"a": [5, 9], "b": [40, 41, 42, 43, 44], "c": [12, 13, 14]}
    fed: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}

    def take(rows: list[str], logits: torch.Tensor, step: int) -> list[int]:
        tokens = []
        for index, row in enumerate(rows):
            got[row].append(logits[index])
            fed[row].append(5 + (7 * step + 13 * index) % 90)  # tokens of the test's, not the model's choice
            tokens.append(fed[row][-1])
        return tokens

    cohort, mask, logits = batch.prefill([prompts["a"], prompts["b"]])
    batch.join(["a", "b"], cohort, mask, take(["a", "b"], logits, 0))
    batch.keep([0, 1], take(batch.rows, batch.step(), 1))
    cohort, mask, logits = batch.prefill([prompts["c"]])
    batch.join(["c"], cohort, mask, take(["c"], logits, 1))
    for step in range(2, 5):
        tokens = take(batch.rows, batch.step(), step)
        indices = [index for index, row in enumerate(batch.rows) if not (row == "a" and step == 3)]
        batch.keep(indices, [tokens[index] for index in indices])
    assert batch.rows == ["b", "c"] and len(batch.cohorts) == 2
    for row, logits_ in got.items():
        decoder = torch.tensor([[model.config.decoder_start_token_id, *fed[row][: len(logits_) - 1]]])
        with torch.inference_mode():
            alone = model(input_ids=torch.tensor([prompts[row]]), decoder_input_ids=decoder).logits[0]
        compare_outputs(alone, torch.stack(logits_))


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_an_encoder_decoder_is_served_each_request_its_solo_tokens(name):
    """The engine on a whole encoder-decoder: prompts grouped in padded prefills, cohorts stepped side by side, rows
    leaving at different lengths; each request's text is ``generate()``'s for it alone."""
    model = tiny_seq2seq(name)
    prompts = [([33], 6), *PROMPTS]
    requests = [collected(prompt, max_tokens) for prompt, max_tokens in prompts]
    scheduler = run_to_the_end(model, requests)
    assert scheduler.largest_prefill > 1 and scheduler.largest_batch > 1
    for request, (prompt, max_tokens) in zip(requests, prompts, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        assert text(request) == word_tokenizer().decode(out[0, 1:], skip_special_tokens=True), prompt


def test_an_image_encoder_decoder_is_refused_at_start_in_one_line(tmp_path, capsys, no_process_starts):
    """A vision encoder-decoder (ViT and GPT-2) generates from pixels, which the server does not take yet: refused
    before any rank starts."""
    import transformers

    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.ViTConfig(), transformers.GPT2Config()
    )
    config.architectures = ["VisionEncoderDecoderModel"]
    config.save_pretrained(tmp_path)
    assert main(["serve", str(tmp_path), "--num-gpus", "2"]) == 2
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1
    assert refusal.startswith("tpcore serve: VisionEncoderDecoderModel is an encoder-decoder of other inputs than")


def test_sliding_window_and_full_attention_decoders_pass_the_start_check():
    """Gemma2 mixes sliding-window layers in, Mistral's are all sliding: served as full layers, the window kept by
    the attention mask."""
    import transformers

    for config_class, architecture in (("Gemma2Config", "Gemma2ForCausalLM"), ("MistralConfig", "MistralForCausalLM")):
        config = getattr(transformers, config_class)(num_hidden_layers=4)
        assert any(layer.is_sliding for layer in transformers.DynamicCache(config=config).layers)
        refuse_unbatchable_cache(config, architecture)  # no NotServable


@pytest.mark.slow  # ~40 s: two ranks compile two graphs each with inductor
def test_a_compiled_split_serves_the_solo_texts_without_compiling_again(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), 2, compile=True)
    try:
        pool = model._tpcore_handle.pool
        made, warm_up_calls = pool.run(compiled_graphs), pool.run(compiled_calls)
        assert all(calls >= 4 for calls in warm_up_calls)  # two steps of one row, two of two rows (and guesses)
        requests = [collected(prompt, max_tokens) for prompt, max_tokens in PROMPTS]
        run_to_the_end(model, requests)
        for request, (prompt, max_tokens) in zip(requests, PROMPTS, strict=True):
            assert text(request) == solo_text(reference, prompt, max_tokens), prompt
        assert pool.run(compiled_graphs) == made  # batches of 1 to 6 rows fit the graphs made at load
        assert all(now > then for now, then in zip(pool.run(compiled_calls), warm_up_calls, strict=True))
    finally:
        model.deparallelize()


def test_a_transcript_s_segments_become_verbose_json_segments_and_srt_and_vtt_cues():
    """A segment each (OpenAI's fields), times as ``hh:mm:ss,mmm`` (srt, numbered cues) and ``hh:mm:ss.mmm``
    (vtt); a transcript without segments is one over the whole audio."""
    segments = [Segment(0.0, 2.5, "w1 w2", [1, 2]), Segment(2.5, 3725.04, "w3", [3])]
    timed = Transcript("w1 w2 w3", [1, 2, 3], 3726.0, "en", segments)
    verbose = transcription_response(timed, "verbose_json", 0.0)
    assert [(part["id"], part["start"], part["end"], part["text"], part["tokens"]) for part in verbose["segments"]] == [
        (0, 0.0, 2.5, "w1 w2", [1, 2]), (1, 2.5, 3725.04, "w3", [3])
    ]  # fmt: skip
    assert verbose["duration"] == 3726.0 and verbose["language"] == "en" and verbose["text"] == "w1 w2 w3"
    srt = transcription_response(timed, "srt", 0.0).body.decode()
    assert srt == "1\n00:00:00,000 --> 00:00:02,500\nw1 w2\n\n2\n00:00:02,500 --> 01:02:05,040\nw3\n"
    vtt = transcription_response(timed, "vtt", 0.0).body.decode()
    assert vtt == "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nw1 w2\n\n00:00:02.500 --> 01:02:05.040\nw3\n"
    whole = transcription_response(Transcript("w1", [1], 1.5), "verbose_json", 0.5)["segments"]
    assert whole == [{"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": "w1", "tokens": [1], "temperature": 0.5}]


class PlanPipe:
    """A :class:`~tpcore.serve.spmd.TurnSync` stand-in between two engines of one process: the plans rank 0 sends,
    queued for the follower."""

    def __init__(self):
        self.plans: queue.Queue = queue.Queue()

    def send(self, admitted, cancelled, seed=None) -> None:
        self.plans.put(TurnPlan(list(admitted or ()), set(cancelled), stop=admitted is None, seed=seed))

    def receive(self) -> TurnPlan:
        return self.plans.get(timeout=30)


class Draws(WholeRequests):
    """An engine whose every call draws from torch's RNG (as a sampled transcription does): each call's draws."""

    def __init__(self):
        super().__init__(tiny_bert(), word_tokenizer())
        self.draws: list[torch.Tensor] = []

    def answer(self, requests) -> None:
        self.draws.append(torch.rand(4))
        for request in requests:
            request.push(Finished(None, 0))


def test_under_torchrun_a_whole_request_engine_s_follower_makes_each_call_with_rank_0_s_seed():
    """Rank 0's engine sends each call's requests with a seed and seeds torch with it; the follower replays the
    plans (empty ones while idle make no call): the same calls, the same random draws, then it stops."""
    leader, follower, pipe = Draws(), Draws(), PlanPipe()
    leader.turns = follower.turns = pipe
    requests = [Collected(f"input {i}", asyncio.new_event_loop()) for i in range(3)]
    leader.start()
    try:
        for request in requests:
            leader.submit(request)
            for _ in range(300):
                if request.got:
                    break
                leader.thread.join(0.1)
        leader.thread.join(1.5)  # at least one idle second: an empty plan
    finally:
        leader.stop()
    assert all(isinstance(request.got[-1], Finished) for request in requests)
    plans = list(pipe.plans.queue)
    assert plans[-1].stop and any(not plan.admitted and not plan.stop for plan in plans)
    assert [request_id for plan in plans for request_id, _ in plan.admitted] == [r.id for r in requests]
    follower.follow()  # the whole queue, to its stop plan
    assert len(leader.draws) == len(follower.draws) == len([plan for plan in plans if plan.admitted])
    assert all(torch.equal(a, b) for a, b in zip(leader.draws, follower.draws, strict=True))
    assert len({tuple(draw.tolist()) for draw in leader.draws}) == len(leader.draws)  # a new seed a call
