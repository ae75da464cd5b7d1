"""``tpcore serve``: the real server on a free loopback port, talked to with the ``openai`` client and plain HTTP.

A tiny Llama split over 2 ranks (fp32) answers as the unsplit model does alone: streamed and non-streamed chat
give its greedy tokens, and 16 concurrent requests (rows joining and leaving one running batch) each give its
solo result. Every bad request is answered 4xx and the server serves on; a client that leaves mid-stream frees
its row. State-space and hybrid decoders (Mamba, Jamba, Qwen3-Next) keep a state per row in the same running
batch. A T5 saved in a directory translates: its rows keep their encoder states per cohort. Encoders serve
embeddings, batched. ``tpcore serve`` as a process stops its ranks on SIGTERM and turns a
dead rank into 503s.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import functools
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import numpy
import openai
import pytest
import torch
import transformers
from process_probes import children
from transformers import BertConfig, BertModel

import tpcore
from tpcore.serve import Limits, Server, Service, free_port, load_model
from tpcore.serve.embeddings import pool
from tpcore.testing import ModelSpec, tiny_llama, tiny_llama_config, tiny_seq2seq, word_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
WORDS = [f"w{index}" for index in range(100)]  # word_tokenizer's


def llama() -> transformers.PreTrainedModel:
    """tests/served/test_served_model.py's Llama: tiny_llama with word_tokenizer's eos (``w1``), eager attention."""
    return tiny_llama(eos_token_id=1, attn_implementation="eager")


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    words = word_tokenizer()
    words.chat_template = TEMPLATE
    return words


@pytest.fixture(scope="module")
def reference():
    return llama()


@pytest.fixture(scope="module")
def server():
    """The split tiny Llama served on a free loopback port."""
    model = tpcore.parallelize(llama(), num_gpus=2)
    service = Service(model, chat_tokenizer(), "tiny-llama", Limits(max_model_len=64, default_max_tokens=8))
    running = Server(service, port=free_port()).start()
    yield running
    running.stop()
    model.deparallelize()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def solo(reference, prompt: str, max_tokens: int) -> str:
    """The unsplit model's greedy text for ``prompt`` alone."""
    words = word_tokenizer()
    ids = torch.tensor([words.encode(prompt)])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return words.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_streamed_and_not_gives_the_unsplit_model_s_greedy_tokens(client, reference):
    messages = [{"role": "user", "content": "w5 w7 w9 w33"}]
    expected = solo(reference, "w5 w7 w9 w33", 12)
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == 4
    stream = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
    assert "".join(pieces) == expected and len([p for p in pieces if p]) > 1  # token by token
    models_listed = client.models.list()
    assert [card.id for card in models_listed.data] == ["tiny-llama"]


def test_sixteen_concurrent_requests_each_give_their_solo_result(server, client, reference):
    prompts = [" ".join(WORDS[20 + (i * 7 + j * 3) % 80] for j in range(1 + i % 6)) for i in range(16)]  # no w0*, w1*
    lengths = [3 + (i * 5) % 14 for i in range(16)]
    seeded = {3: 11, 9: 12}  # requests that sample with a seed: the same text alone and in the crowd
    results: dict[int, str] = {}

    def ask(i: int) -> str:
        sampling = {"temperature": 0.9, "seed": seeded[i]} if i in seeded else {"temperature": 0}
        answer = client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=lengths[i], **sampling)
        return answer.choices[0].text

    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(i))) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.service.scheduler.largest_batch > 1  # they shared decode steps
    for i in range(16):
        expected = ask(i) if i in seeded else solo(reference, prompts[i], lengths[i])
        assert results[i] == expected, (i, prompts[i])


@pytest.mark.slow  # its own 2-rank world
def test_gpt_oss_s_sliding_attention_and_biased_experts_are_served_as_the_unsplit_model_answers():
    """GPT-OSS (tp-gpt's policies: attention sinks, experts with biases, the down bias on rank 0 alone), its sliding
    window shorter than the prompts: 6 concurrent chats each give the unsplit model's greedy text alone."""
    config = transformers.GptOssConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=128, eos_token_id=1, pad_token_id=0, initializer_range=0.3,
    )  # fmt: skip
    reference = ModelSpec(transformers.GptOssForCausalLM, config, 1, bias_std=0.1).build()
    model = tpcore.parallelize(reference, num_gpus=2)
    running = Server(Service(model, chat_tokenizer(), "tiny-gpt-oss", Limits(max_model_len=64)), port=free_port())
    running.start()
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        prompts = [" ".join(WORDS[20 + (i * 11 + j * 5) % 80] for j in range(2 + i)) for i in range(6)]

        def ask(prompt: str) -> str:
            messages = [{"role": "user", "content": prompt}]
            answer = client.chat.completions.create(
                model="tiny-gpt-oss", messages=messages, max_tokens=10, temperature=0
            )
            return answer.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(6) as pool_:
            answers = list(pool_.map(ask, prompts))
        assert answers == [solo(reference, f"{prompt} ", 10) for prompt in prompts]  # the template's trailing space
    finally:
        running.stop()
        model.deparallelize()


#: decoders whose cache keeps a state per row (state-space and linear-attention layers), alone or beside attention
STATE_MODELS = {
    "mamba": (transformers.MambaForCausalLM, transformers.MambaConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        initializer_range=0.3)),  # its default init repeats the last word
    "jamba": (transformers.JambaForCausalLM, transformers.JambaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
        mamba_d_state=8, mamba_dt_rank=8)),
    "qwen3-next": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}  # fmt: skip


@pytest.mark.slow  # its own 2-rank world per model
@pytest.mark.parametrize("kind", sorted(STATE_MODELS))
def test_a_decoder_whose_cache_keeps_a_state_serves_8_concurrent_chats_each_its_solo_answer(kind):
    """Mamba's convolution window and recurrent state, Jamba's beside attention layers, Qwen3-Next's gated DeltaNet
    beside RoPE attention: rows of different lengths join, step and leave one running batch (each row's state kept,
    the attention layers left-padded), and each of 8 concurrent chats gives the unsplit model's greedy text alone."""
    model_class, config = STATE_MODELS[kind]
    config.eos_token_id, config.pad_token_id = 1, 0
    reference = ModelSpec(model_class, config, 2).build()
    model = tpcore.parallelize(reference, num_gpus=2)
    service = Service(model, chat_tokenizer(), f"tiny-{kind}", Limits(max_model_len=64))
    running = Server(service, port=free_port()).start()
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        prompts = [" ".join(WORDS[20 + (i * 13 + j * 7) % 80] for j in range(1 + 2 * i)) for i in range(8)]
        lengths = [4 + (i * 3) % 9 for i in range(8)]  # rows leave at different steps

        def ask(i: int) -> str:
            messages = [{"role": "user", "content": prompts[i]}]
            answer = client.chat.completions.create(
                model=f"tiny-{kind}", messages=messages, max_tokens=lengths[i], temperature=0
            )
            return answer.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(8) as pool_:
            answers = list(pool_.map(ask, range(8)))
        assert service.scheduler.largest_batch > 1  # they shared decode steps
        assert answers == [solo(reference, f"{prompts[i]} ", lengths[i]) for i in range(8)]
    finally:
        running.stop()
        model.deparallelize()


@pytest.mark.slow  # its own 2-rank world
def test_a_translator_saved_in_a_directory_serves_8_concurrent_completions_each_its_solo_translation(tmp_path):
    """``tpcore serve`` of a T5 directory (shard-on-load over 2 ranks): each prompt is the encoder's input, rows
    prefilled together keep their encoder states and cross-attention caches per row (a cohort), and each of 8
    concurrent completions, streamed or not, gives ``generate()``'s text for it alone; chat is refused (no
    template)."""
    reference = tiny_seq2seq("T5", seed=3)
    reference.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), 2)
    service = Service(model, tokenizer, "tiny-t5", Limits(max_model_len=64))
    running = Server(service, port=free_port()).start()
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        prompts = [" ".join(WORDS[20 + (i * 13 + j * 7) % 80] for j in range(1 + 2 * i)) for i in range(8)]
        lengths = [4 + (i * 3) % 9 for i in range(8)]

        def ask(i: int) -> str:
            if i % 2:
                stream = client.completions.create(
                    model="tiny-t5", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
                )
                return "".join(chunk.choices[0].text for chunk in stream)
            answer = client.completions.create(model="tiny-t5", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
            return answer.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool_:
            answers = list(pool_.map(ask, range(8)))
        assert service.scheduler.largest_batch > 1
        expected = []
        for i in range(8):
            ids = torch.tensor([word_tokenizer().encode(prompts[i])])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=lengths[i])
            expected.append(word_tokenizer().decode(out[0, 1:], skip_special_tokens=True))
        assert answers == expected and len(set(expected)) > 4
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny-t5", messages=[{"role": "user", "content": "w5"}])
    finally:
        running.stop()
        model.deparallelize()


#: a tiny Whisper's special tokens (tp-audio's): end of text, start of transcript, English, German, translate,
#: transcribe, no timestamps
EOS, START, ENGLISH, GERMAN, TRANSLATE, TRANSCRIBE, PREVIOUS, NO_TIMESTAMPS = range(50, 58)


def tiny_whisper_directory(directory: Path) -> transformers.WhisperForConditionalGeneration:
    """A random Whisper (16 mel bins, a window of 1 s at 16 kHz: 32 frames) saved in ``directory`` with its feature
    extractor, a word tokenizer of its 1024 ids (the special tokens marked special) and a multilingual generation
    config; the model returned, whole."""
    config = transformers.WhisperConfig(
        d_model=48, encoder_attention_heads=6, decoder_attention_heads=4, encoder_layers=2, decoder_layers=2,
        encoder_ffn_dim=40, decoder_ffn_dim=40, vocab_size=1024, num_mel_bins=16, max_source_positions=16,
        max_target_positions=40, pad_token_id=EOS, bos_token_id=EOS, eos_token_id=EOS, decoder_start_token_id=START,
        begin_suppress_tokens=None, suppress_tokens=None, init_std=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=EOS, is_multilingual=True,
        lang_to_id={"<|en|>": ENGLISH, "<|de|>": GERMAN}, task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        no_timestamps_token_id=NO_TIMESTAMPS, prev_sot_token_id=PREVIOUS, max_initial_timestamp_index=8,
        begin_suppress_tokens=[EOS],
        suppress_tokens=[], max_length=config.max_target_positions,
    )  # fmt: skip
    model.save_pretrained(directory)
    transformers.WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=500, chunk_length=1, n_fft=1000
    ).save_pretrained(directory)
    words = word_tokenizer(1024)
    words.add_special_tokens({"additional_special_tokens": [f"w{token}" for token in range(EOS, NO_TIMESTAMPS + 1)]})
    words.save_pretrained(directory)
    return model


def wav(samples, rate: int = 16000) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def prompt_ids(tokenizer):
    """A ``get_prompt_ids`` as Whisper's tokenizer has: the previous-text token, then the prompt's words."""
    return lambda text, return_tensors=None: numpy.array([PREVIOUS, *tokenizer.encode(text)])


@pytest.mark.slow  # its own 2-rank world
def test_a_speech_model_saved_in_a_directory_serves_concurrent_transcriptions_each_its_solo_text(tmp_path):
    """``tpcore serve`` of a Whisper directory over 2 ranks: 10 concurrent uploads (WAV at 16 and 8 kHz, in German,
    English or the model's choice of language, one with a prompt; json, text, and with the model's timestamps
    verbose_json, srt and vtt; two longer than the window, transcribed window by window) in batched ``generate()``
    calls, each the text and segments the unsplit model gives for that audio alone; a file that is no audio, audio
    over the server's limit, an unknown language, a prompt too long and a completion are refused 400 with a
    message."""
    from tpcore.serve.transcription import read_audio

    reference = tiny_whisper_directory(tmp_path)
    features_of = transformers.WhisperFeatureExtractor.from_pretrained(tmp_path)
    words = transformers.AutoTokenizer.from_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), 2)
    tokenizer.get_prompt_ids = prompt_ids(tokenizer)
    service = Service(model, tokenizer, "tiny-whisper", Limits(max_audio_seconds=3.0), directory=str(tmp_path))
    running = Server(service, port=free_port()).start()
    noise = numpy.random.default_rng(0)
    rates = [8000 if i % 3 == 0 else 16000 for i in range(10)]
    lengths = [4000 + 1500 * i for i in range(8)] + [40000, 27000]  # 0.25 to 0.9 s, then 2.5 and 1.7 s
    uploads = [wav(noise.uniform(-0.5, 0.5, lengths[i] * rates[i] // 16000).astype("float32"), rates[i])
               for i in range(10)]  # fmt: skip
    languages = [None, "de", "en", "de", None, "en", "de", None, "en", None]
    formats = ["json", "text", "verbose_json", "srt", "vtt", "json", "text", "json", "verbose_json", "json"]
    prompts = {5: "w7 w9 w11"}
    first_timestamp = NO_TIMESTAMPS + 1

    def alone(i: int) -> tuple[str, list[tuple[float, float, str]] | None]:
        """The unsplit model's text for upload ``i`` and, with timestamps, its segments (start, end, text)."""
        samples = read_audio(uploads[i], 16000)
        timed = formats[i] in ("verbose_json", "srt", "vtt") or len(samples) > 16000
        options = {"language": languages[i]} if languages[i] else {}
        if i in prompts:
            options["prompt_ids"] = torch.tensor(prompt_ids(words)(prompts[i]))
        if len(samples) > 16000:
            inputs = features_of(samples, sampling_rate=16000, return_tensors="pt", truncation=False,
                                 padding="longest", return_attention_mask=True)  # fmt: skip
            options["attention_mask"] = inputs.attention_mask
        else:
            inputs = features_of(samples, sampling_rate=16000, return_tensors="pt")
        if timed:
            options.update(return_timestamps=True, return_segments=True)
        output = reference.generate(input_features=inputs.input_features, **options)

        def text(ids) -> str:
            kept = [token for token in ids.tolist() if not (timed and token >= first_timestamp)]
            return words.decode(kept, skip_special_tokens=True).strip()

        if not timed:
            return text(output[0]), None
        segments = [(float(part["start"]), float(part["end"]), text(part["tokens"])) for part in output["segments"][0]]
        return text(output["sequences"][0]), segments

    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)

        def ask(i: int):
            options = {"language": languages[i]} if languages[i] else {}
            if i in prompts:
                options["prompt"] = prompts[i]
            return client.audio.transcriptions.create(
                model="tiny-whisper", file=(f"{i}.wav", uploads[i]), response_format=formats[i], **options
            )

        with concurrent.futures.ThreadPoolExecutor(10) as pool_:
            answers = list(pool_.map(ask, range(10)))
        expected = [alone(i) for i in range(10)]
        assert len({text for text, _ in expected}) > 7 and service.scheduler.largest_batch > 1  # some shared a call
        for i, answer in enumerate(answers):
            text, segments = expected[i]
            if formats[i] in ("json", "verbose_json"):
                assert answer.text == text, i
            if formats[i] == "text":
                assert answer == text, i
            if formats[i] == "verbose_json":
                got = [(part.start, part.end, part.text) for part in answer.segments]
                assert got == segments and len(segments) >= 1, i
            if formats[i] in ("srt", "vtt"):
                cues = [block.splitlines() for block in answer.split("\n\n") if "-->" in block]
                assert [cue[-1] if len(cue) > 1 and "-->" not in cue[-1] else "" for cue in cues] == [
                    part[2] for part in segments
                ], i
        assert answers[2].language == "en" and answers[2].duration == pytest.approx(7000 / 16000)
        assert answers[8].duration == pytest.approx(2.5) and answers[8].segments[-1].end > 1.0  # past the window
        refusals = [
            ({"file": ("x.wav", b"not audio at all")}, "no audio this server reads"),
            ({"file": ("long.wav", wav(numpy.zeros(64000, "float32")))}, "up to 3 s a request"),
            ({"file": ("a.wav", uploads[0]), "language": "fr"}, "knows no language 'fr'"),
            ({"file": ("a.wav", uploads[0]), "prompt": " ".join(["w5"] * 30)}, "takes up to 20"),
        ]
        for fields, message in refusals:
            with pytest.raises(openai.BadRequestError, match=message):
                client.audio.transcriptions.create(model="tiny-whisper", **fields)
        with pytest.raises(openai.BadRequestError, match="serves /v1/audio/transcriptions only"):
            client.completions.create(model="tiny-whisper", prompt="w5")
    finally:
        running.stop()
        model.deparallelize()


#: the tiny LLaVA's image token (tests/user_path/test_composite.py's), a word its tokenizer keeps whole
IMAGE_TOKEN = 63
#: the tiny Qwen2-VL's image, vision start, vision end and video words
QWEN_IMAGE, QWEN_START, QWEN_END, QWEN_VIDEO = 60, 61, 62, 59


def vision_template(image_words: str) -> str:
    """A processor's chat template: each image part becomes ``image_words`` (its image token expanded by the
    processor), text parts their words."""
    return (
        "{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image_words + " "
        "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endfor %}"
    )


def tiny_llava_directory(directory: Path) -> tuple[transformers.LlavaForConditionalGeneration, object]:
    """A random LLaVA (CLIP tower of 8 x 8 pixels in 4 patches, a Llama of 64 words) saved with its processor
    (CLIP's image processor, a word tokenizer, the template above); the model whole and the processor."""
    text = tiny_llama_config(vocab_size=64, hidden_size=32, intermediate_size=64, eos_token_id=1)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN)
    model = ModelSpec(transformers.LlavaForConditionalGeneration, config, seed=3).build()
    model.save_pretrained(directory)
    words = word_tokenizer(64)
    words.add_special_tokens({"additional_special_tokens": [f"w{IMAGE_TOKEN}"]})
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=words, patch_size=4, vision_feature_select_strategy="default",
        image_token=f"w{IMAGE_TOKEN}", num_additional_image_tokens=1, chat_template=vision_template(f"w{IMAGE_TOKEN}"),
    )  # fmt: skip
    processor.save_pretrained(directory)
    return model, processor


def tiny_qwen2_vl_directory(directory: Path, version: str = "2") -> tuple[transformers.PreTrainedModel, object]:
    """A random Qwen2-VL (``version`` ``"2.5"``: Qwen2.5-VL, its tower's windowed attention in one block of two)
    saved with its tokenizer (a vision tower of 4-pixel patches merged 2 x 2; a text model of
    64 words whose rotary pairs turn by time, height and width: multimodal RoPE; weights drawn wide enough that
    positions change the answers), and its processor (Qwen2-VL's image processor: images resized to 64-1024 pixels,
    the word tokenizer, the template above with the vision start and end words around each image); the model whole
    and the processor."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 1, "initializer_range": 0.3,
            "rope_parameters": rope}  # fmt: skip
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    classes = (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLProcessor)
    if version == "2.5":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                  "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 16,
                  "fullatt_block_indexes": [1]}  # fmt: skip
        classes = (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   transformers.Qwen2_5_VLProcessor)  # fmt: skip
    config_class, model_class, processor_class = classes
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE, vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END, video_token_id=QWEN_VIDEO, initializer_range=0.3,
    )  # fmt: skip
    model = ModelSpec(model_class, config, seed=3).build()
    model.save_pretrained(directory)
    words = word_tokenizer(64)
    words.add_special_tokens({"additional_special_tokens": [f"w{n}" for n in (QWEN_IMAGE, QWEN_START, QWEN_END,
                                                                               QWEN_VIDEO)]})  # fmt: skip
    words.image_token, words.video_token = f"w{QWEN_IMAGE}", f"w{QWEN_VIDEO}"
    words.save_pretrained(directory)
    images = transformers.Qwen2VLImageProcessor(min_pixels=64, max_pixels=1024, patch_size=4, merge_size=2)
    # transformers checks each part of a processor against its class, the video processor's among them, which it
    # defines only where torchvision is installed (not here): the check is passed over to build the processor
    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        processor = processor_class(
            image_processor=images, tokenizer=words,
            chat_template=vision_template(f"w{QWEN_START} w{QWEN_IMAGE} w{QWEN_END}"),
        )  # fmt: skip
    return model, processor


def tiny_gemma3_directory(directory: Path) -> tuple[transformers.Gemma3ForConditionalGeneration, object]:
    """A random Gemma 3 saved with its tokenizer (a SigLIP tower of 16 x 16 pixels in 16 patches pooled to 4 image
    tokens; a text model of 64 words with sliding-window layers), and its processor (Gemma 3's
    image processor, the word tokenizer with Gemma's begin-image, image and end-image words, the template above with
    the begin-image word, which the processor expands); the model whole and the processor."""
    begin, image, end = 60, 61, 62
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "eos_token_id": 1, "sliding_window": 4,
            "initializer_range": 0.1}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 4}  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=begin, eoi_token_index=end,
        image_token_index=image, initializer_range=0.1,
    )  # fmt: skip
    model = ModelSpec(transformers.Gemma3ForConditionalGeneration, config, seed=3).build()
    with torch.no_grad():  # Gemma 3 starts its image projection at zero: drawn, so that images change the answers
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    words = word_tokenizer(64)
    words.add_special_tokens({"additional_special_tokens": [f"w{n}" for n in (begin, image, end)]})
    words.save_pretrained(directory)
    words.boi_token, words.image_token, words.eoi_token = f"w{begin}", f"w{image}", f"w{end}"
    words.boi_token_id, words.image_token_id, words.eoi_token_id = begin, image, end
    images = transformers.Gemma3ImageProcessor(size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=words, chat_template=vision_template(f"w{begin}"), image_seq_length=4
    )
    return model, processor


#: each vision-language model served with images: its directory's builder
VISION_MODELS = {
    "llava": tiny_llava_directory,
    "qwen2-vl": tiny_qwen2_vl_directory,
    "qwen2.5-vl": functools.partial(tiny_qwen2_vl_directory, version="2.5"),
    "gemma3": tiny_gemma3_directory,
}


def png_url(seed: int, size: tuple[int, int]) -> str:
    """A ``data:`` URL of a random RGB PNG of ``size`` (width, height)."""
    from PIL import Image

    pixels = numpy.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=numpy.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_chat(i: int) -> list[dict]:
    """The content of chat ``i``: words and none, one or two images (data URLs) of sizes of its own."""
    words = {"type": "text", "text": " ".join(f"w{3 + (i * 7 + j * 5) % 55}" for j in range(1 + i % 4))}
    pictures = [{"type": "image_url", "image_url": {"url": png_url(10 * i + k, (8 + 3 * i, 12 + 4 * k + i))}}
                for k in range(0 if i % 4 == 3 else 1 + (i == 2))]  # fmt: skip
    return [*pictures, words] if i % 2 else [words, *pictures]


def image_chats_get_their_solo_answers(client: openai.OpenAI, name: str, reference, processor, count: int) -> None:
    """``count`` concurrent chats (:func:`image_chat`), each ``reference``'s greedy answer for the processor's inputs
    alone, the answers of more than half of them different."""
    from tpcore.serve.images import ImageChat

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": image_chat(i)}]
        answer = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        return answer.choices[0].message.content

    def alone(i: int) -> str:
        parts = image_chat(i)
        shaped = [{"role": "user", "content": [{"type": "image"} if part["type"] == "image_url" else part
                                               for part in parts]}]  # fmt: skip
        pictures = [ImageChat(processor).image(part) for part in parts if part["type"] == "image_url"]
        text = processor.apply_chat_template(shaped, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=text, images=pictures or None, return_tensors="pt")
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False)
        return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    with concurrent.futures.ThreadPoolExecutor(count) as pool_:
        answers = list(pool_.map(ask, range(count)))
    expected = [alone(i) for i in range(count)]
    assert answers == expected and len(set(expected)) > count // 2


@pytest.mark.slow  # its own 2-rank world
@pytest.mark.parametrize("family", list(VISION_MODELS))
def test_images_in_chat_are_read_by_a_split_vision_model_and_8_concurrent_chats_get_their_solo_answers(
    tmp_path, family
):
    """``tpcore serve`` of a LLaVA directory, a Qwen2-VL one (multimodal RoPE: a row with images decodes at
    positions of its own) and a Gemma 3 one (sliding-window layers, image tokens marked by ``token_type_ids``) over
    2 ranks: chats with ``image_url`` parts (data URLs, images of different sizes, one or
    two a message) and chats of text alone, 8 at once, each the unsplit model's greedy answer for the processor's
    inputs alone; an http URL is refused while the server fetches none, a data URL that is no image is refused, and
    a text model is told it reads no images."""
    reference, processor = VISION_MODELS[family](tmp_path)
    model, tokenizer = load_model(str(tmp_path), 2)
    # LLaVA's processor is loaded from its directory; the Qwen VLs' load only with torchvision, Gemma 3's needs its
    # tokenizer's image words as attributes, which a word tokenizer does not save: those are handed over
    given = None if family == "llava" else processor
    service = Service(model, tokenizer, family, Limits(max_model_len=64), directory=str(tmp_path), processor=given)
    running = Server(service, port=free_port()).start()

    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)

        image_chats_get_their_solo_answers(client, family, reference, processor, 8)
        assert service.scheduler.largest_batch > 1
        refusals = [
            ({"url": "http://127.0.0.1:1/cat.png"}, "fetches no image URLs"),
            ({"url": "data:image/png;base64," + base64.b64encode(b"no picture").decode()}, "no image this server"),
        ]
        for image_url, message in refusals:
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}]
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model=family, messages=messages, max_tokens=2)
    finally:
        running.stop()
        model.deparallelize()


def test_a_model_that_reads_no_images_refuses_an_image_part(client):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(0, (8, 8))}}]}]
    with pytest.raises(openai.BadRequestError, match="reads no images"):
        client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)


def test_stop_strings_end_the_text_before_them(client, reference):
    full = solo(reference, "w5 w7", 10).split()
    stop = full[3]
    answer = client.completions.create(model="tiny-llama", prompt="w5 w7", max_tokens=10, temperature=0, stop=[stop])
    expected = " ".join(full[: full.index(stop)])
    assert answer.choices[0].text.strip() == expected and answer.choices[0].finish_reason == "stop"


def bad_requests(url: str) -> list[tuple[str, dict, int, str]]:
    """(what, httpx.post arguments, status, a word of the message)"""
    ok = {"model": "tiny-llama", "prompt": "w5 w7", "max_tokens": 2}
    return [
        ("malformed JSON", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "json"),
        ("unknown model", {"json": {**ok, "model": "gpt-9"}}, 404, "gpt-9"),
        ("prompt too long", {"json": {**ok, "prompt": " ".join(["w5"] * 70)}}, 400, "exceed"),
        ("bad temperature", {"json": {**ok, "temperature": 7}}, 400, "temperature"),
        ("several choices", {"json": {**ok, "n": 2}}, 400, "n"),
        ("no prompt", {"json": {"model": "tiny-llama"}}, 400, "prompt"),
        ("tokens outside the vocabulary", {"json": {**ok, "prompt": [5, 100000]}}, 400, "vocabulary"),
        ("body too large", {"content": b"x" * (2 << 20), "headers": {"content-type": "application/json"}}, 413, "body"),
    ]


def test_every_bad_request_is_answered_4xx_with_a_clear_message_and_the_server_serves_on(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for what, arguments, status, word in bad_requests(server.url):
            response = http.post("/v1/completions", **arguments)
            assert response.status_code == status, what
            assert word in response.json()["error"]["message"].lower(), (what, response.json())
        assert http.post("/v1/embeddings", json={"model": "tiny-llama", "input": "w5"}).status_code == 400
        assert http.get("/v1/nothing").status_code == 404
        chat = {"model": "tiny-llama", "messages": [{"role": "wizard", "content": "w5"}]}
        assert http.post("/v1/chat/completions", json=chat).status_code == 400
        scheduler = server.service.scheduler
        scheduler.max_queue, saved = 0, scheduler.max_queue
        try:
            full = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "w5", "max_tokens": 2})
        finally:
            scheduler.max_queue = saved
        assert full.status_code == 429
        server.service.limits.request_timeout, saved_timeout = 0.0, server.service.limits.request_timeout
        try:
            late = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "w5", "max_tokens": 2})
        finally:
            server.service.limits.request_timeout = saved_timeout
        assert late.status_code == 504
        still = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "w5 w7", "max_tokens": 2})
        assert still.status_code == 200 and http.get("/health").json() == {"status": "ok"}


def test_the_openapi_document_declares_the_errors_each_route_answers_and_a_405_says_allow(server):
    """The statuses the test above sees (and 401, 500, 503) are declared with the error body's schema, FastAPI's 422
    is not (an invalid body is 400); a route asked with the wrong method answers 405 with ``Allow``."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        document = http.get("/openapi.json").json()
        error_schema = {"$ref": "#/components/schemas/ErrorResponse"}
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            declared = document["paths"][path]["post"]["responses"]
            assert set(declared) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}, path
            assert all(declared[code]["content"]["application/json"]["schema"] == error_schema for code in declared
                       if code != "200")  # fmt: skip
        assert set(document["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
        wrong = http.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["code"] == 405


def test_a_schemathesis_run_with_every_check_finds_nothing(server):
    """``st run .../openapi.json --checks all`` (30 examples an operation, a fixed seed): schema-valid requests are
    accepted, invalid ones answered 4xx, every status and content type it sees is declared, and no request gets a
    5xx."""
    pytest.importorskip("schemathesis")
    st = Path(sys.executable).with_name("st")
    command = [str(st), "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", "30", "--seed", "1"]
    run = subprocess.run([*command, "--no-color"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:]
    assert re.search(r"(\d+) generated, \1 passed", run.stdout), run.stdout[-2000:]


def test_a_client_that_leaves_mid_stream_frees_its_row(server):
    body = {"model": "tiny-llama", "prompt": "w5 w7", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    scheduler = server.service.scheduler
    for _ in range(500):
        if not len(scheduler.batch) and not scheduler.waiting:
            break
        time.sleep(0.02)
    assert not len(scheduler.batch)


def test_an_api_key_is_asked_for_when_set(server):
    from tpcore.serve.app import create_app

    app = create_app(server.service, api_key="sesame")
    transport = httpx.ASGITransport(app=app)

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            wrong = await http.get("/v1/models", headers={"authorization": "Bearer nope"})
            right = await http.get("/v1/models", headers={"authorization": "Bearer sesame"})
            return [wrong.status_code, right.status_code, (await http.get("/health")).status_code]

    import asyncio

    assert asyncio.run(statuses()) == [401, 200, 200]


def bert_and_tokenizer():
    config = BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    return BertModel(config).eval(), word_tokenizer(len(WORDS), eos_token=None)


def test_concurrent_embedding_requests_are_batched_and_equal_the_unsplit_model_s(tmp_path):
    reference, words = bert_and_tokenizer()
    model = tpcore.parallelize(bert_and_tokenizer()[0], num_gpus=2)
    running = Server(Service(model, words, "tiny-bert"), port=free_port()).start()
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        inputs = [["w5 w6 w7"], ["w9", "w40 w41 w42 w43 w44"], ["w20 w21"], ["w30"]]
        results: dict[int, list] = {}

        def ask(i: int) -> None:
            answer = client.embeddings.create(model="tiny-bert", input=inputs[i])  # base64, as the client asks
            results[i] = [item.embedding for item in answer.data]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i, texts in enumerate(inputs):
            encoded = words(texts, padding=True, return_tensors="pt")
            with torch.inference_mode():
                expected = pool(reference(**encoded).last_hidden_state, encoded["attention_mask"], "mean")
            torch.testing.assert_close(torch.tensor(results[i]), expected, atol=1e-5, rtol=1e-4)
        with httpx.Client(base_url=running.url) as http:
            assert http.post("/v1/completions", json={"model": "tiny-bert", "prompt": "w5"}).status_code == 400
    finally:
        running.stop()
        model.deparallelize()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


def start_tpcore_serve(directory, *options: str) -> tuple[subprocess.Popen, str]:
    """``tpcore serve`` of a tiny Llama saved in ``directory``, over 2 ranks, in a process of its own."""
    llama().save_pretrained(directory)
    chat_tokenizer().save_pretrained(directory)
    port = free_port()
    command = [sys.executable, "-m", "tpcore", "serve", str(directory), "--num-gpus", "2", "--port", str(port)]
    return subprocess.Popen([*command, *options], stderr=subprocess.PIPE, text=True), f"http://127.0.0.1:{port}"


def rank_pids(process: subprocess.Popen) -> list[int]:
    return [pid for pid in children(process.pid) if "tpcore" in open(f"/proc/{pid}/cmdline").read()]


@pytest.mark.slow  # a fresh interpreter and its ranks, three times
@pytest.mark.parametrize("after_loss", ["restarts", "no-restart", "exit-on-loss"])
def test_a_dead_rank_gives_503_then_the_ranks_start_again_and_sigterm_stops_them(tmp_path, after_loss):
    """A rank killed: the request that meets it is answered 503. By default the server starts the ranks again from
    the directory (503 meanwhile) and then answers as before; with ``--no-restart`` it answers 503 from then on,
    ``/health`` included, for a supervisor; with ``--exit-on-loss`` the process exits with status 3 and one line
    saying why, for a supervisor to start it again. SIGTERM leaves no rank behind, old or new."""
    process, url = start_tpcore_serve(tmp_path, *(() if after_loss == "restarts" else (f"--{after_loss}",)))
    restart = after_loss == "restarts"
    try:
        wait_healthy(url, process)
        body = {"model": tmp_path.name, "prompt": "w5 w7", "max_tokens": 3, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200
        ranks = rank_pids(process)
        assert len(ranks) >= 2
        os.kill(ranks[-1], signal.SIGKILL)
        dead = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert dead.status_code == 503 and "rank" in dead.json()["error"]["message"]
        if restart:
            wait_healthy(url, process)
            again = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert again.status_code == 200
            assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            assert not set(rank_pids(process)) & set(ranks)
        elif after_loss == "exit-on-loss":
            assert process.wait(timeout=60) == 3
            lines = process.stderr.read().splitlines()
            assert lines[-1].startswith("tpcore serve: the ranks were lost (a rank died or hangs")
            assert lines[-1].endswith("exiting for a supervisor to start it again")
            assert not [pid for pid in ranks if alive(pid)]
            return
        else:
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 503
        started = set(ranks) | set(rank_pids(process))
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        assert not [pid for pid in started if alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow  # two torchrun agents and their ranks
def torchrun_serve(directory: Path, logs: Path) -> tuple[list[subprocess.Popen], str]:
    """``tpcore serve directory`` under ``torchrun --nnodes 2`` (two "nodes" on loopback, one rank each, gloo over
    TCP), node ``n`` logging to ``logs/node<n>.log``: the two agents and the server's URL."""
    port, rendezvous = free_port(), free_port()
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", str(rendezvous), "-m", "tpcore", "serve",
             str(directory), "--num-gpus", "2", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=open(logs / f"node{node}.log", "w"), env=environment,
        )
        for node in range(2)
    ]  # fmt: skip
    return agents, f"http://127.0.0.1:{port}"


def sigterm_stops_every_rank(agents: list[subprocess.Popen], logs: Path) -> None:
    """SIGTERM to every agent: each rank logs that it stopped and every agent ends."""
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    for agent in agents:
        agent.wait(timeout=60)
    texts = [(logs / f"node{node}.log").read_text() for node in range(len(agents))]
    assert all(f"rank {node} stopped" in texts[node] for node in range(len(agents))), texts


def stop_agents(agents: list[subprocess.Popen]) -> None:
    """Kill what is left of the agents, their ranks first (a killed agent leaves its ranks running)."""
    for agent in agents:
        if agent.poll() is None:
            for pid in children(agent.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            agent.kill()
            agent.wait()


def test_under_torchrun_over_two_nodes_rank_0_serves_and_every_request_gets_its_solo_text(tmp_path):
    """``tpcore serve`` under ``torchrun --nnodes 2`` (two "nodes" on loopback, one rank each, gloo over TCP): the
    model split over both, rank 0 listening, rank 1 following its turns. 8 concurrent requests (greedy, one seeded
    sample, one stream its client drops after 2 chunks) each get the unsplit model's text alone (the sample: its
    text asked again alone); SIGTERM to both agents stops every rank."""
    directory = tmp_path / "model"
    reference = llama()
    reference.save_pretrained(directory)
    chat_tokenizer().save_pretrained(directory)
    agents, url = torchrun_serve(directory, tmp_path)
    try:
        wait_healthy(url, agents[0])
        ranks = [pid for agent in agents for pid in children(agent.pid)]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompts = [" ".join(WORDS[20 + (i * 7 + j * 3) % 80] for j in range(1 + i % 5)) for i in range(8)]
        lengths = [3 + (i * 5) % 11 for i in range(8)]

        def ask(i: int) -> str:
            sampling = {"temperature": 0.9, "seed": 5} if i == 3 else {"temperature": 0}
            if i == 6:  # dropped by its client after 2 chunks
                stream = client.completions.create(model="model", prompt=prompts[i], max_tokens=30, stream=True)
                for count, _ in enumerate(stream):
                    if count == 1:
                        stream.close()
                        return ""
            answer = client.completions.create(model="model", prompt=prompts[i], max_tokens=lengths[i], **sampling)
            return answer.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool_:
            answers = list(pool_.map(ask, range(8)))
        for i in range(8):
            expected = "" if i == 6 else ask(i) if i == 3 else solo(reference, prompts[i], lengths[i])
            assert answers[i] == expected, (i, prompts[i])
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        sigterm_stops_every_rank(agents, tmp_path)
        assert ranks and not [pid for pid in ranks if alive(pid)]
    finally:
        stop_agents(agents)


def embeddings_equal_the_unsplit_model_s(client: openai.OpenAI, model: BertModel, words) -> None:
    """4 concurrent embedding requests, each within float rounding of ``model``'s vectors."""
    inputs = [["w5 w6 w7"], ["w9", "w40 w41 w42 w43 w44"], ["w20 w21"], ["w30"]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool_:
        answers = list(pool_.map(lambda texts: client.embeddings.create(model="bert", input=texts), inputs))
    for texts, answer in zip(inputs, answers, strict=True):
        encoded = words(texts, padding=True, return_tensors="pt")
        with torch.inference_mode():
            expected = pool(model(**encoded).last_hidden_state, encoded["attention_mask"], "mean")
        torch.testing.assert_close(torch.tensor([item.embedding for item in answer.data]), expected, atol=1e-5,
                                   rtol=1e-4)  # fmt: skip


def transcripts_equal_the_unsplit_model_s(client: openai.OpenAI, directory: Path, model) -> None:
    """4 concurrent uploads (one longer than the window, one with timestamps), each ``model``'s text alone; a
    sampled one answered."""
    from tpcore.serve.transcription import read_audio

    features_of = transformers.WhisperFeatureExtractor.from_pretrained(directory)
    words = transformers.AutoTokenizer.from_pretrained(directory)
    noise = numpy.random.default_rng(1)
    uploads = [wav(noise.uniform(-0.5, 0.5, n).astype("float32")) for n in (6000, 9000, 30000, 12000)]
    formats = ["json", "json", "json", "verbose_json"]

    def ask(i: int):
        return client.audio.transcriptions.create(model="whisper", file=(f"{i}.wav", uploads[i]),
                                                  response_format=formats[i])  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(4) as pool_:
        answers = list(pool_.map(ask, range(4)))
    for i, answer in enumerate(answers):
        samples = read_audio(uploads[i], 16000)
        long = len(samples) > 16000
        timed = formats[i] == "verbose_json" or long
        inputs = features_of(samples, sampling_rate=16000, return_tensors="pt", truncation=not long,
                             padding="longest" if long else "max_length", return_attention_mask=True)  # fmt: skip
        options = {"return_timestamps": True, "return_segments": True} if timed else {}
        output = model.generate(input_features=inputs.input_features,
                                attention_mask=inputs.attention_mask if long else None, **options)  # fmt: skip
        ids = (output["sequences"] if timed else output)[0].tolist()
        kept = [token for token in ids if not (timed and token > NO_TIMESTAMPS)]
        assert answer.text == words.decode(kept, skip_special_tokens=True).strip(), i
    sampled = client.audio.transcriptions.create(model="whisper", file=("s.wav", uploads[0]), temperature=0.8)
    assert isinstance(sampled.text, str)


@pytest.mark.slow  # three torchrun jobs
def test_under_torchrun_embeddings_transcriptions_and_images_are_served_each_as_the_unsplit_model_answers(tmp_path):
    """``tpcore serve`` under ``torchrun --nnodes 2`` of a BERT directory, a Whisper one and a LLaVA one: rank 1 makes
    each call rank 0 makes. 4 concurrent embedding requests each within float rounding of the unsplit model's
    vectors; 4 concurrent uploads (one longer than the window, one with timestamps) each the unsplit model's text
    alone, and a sampled one (temperature 0.8) answered with the server healthy after it (every rank seeds torch
    alike for it: ``tests/serve/test_engine.py``); 4 concurrent chats with none, one or two images (their pixels
    travel in the turn's plan) each the unsplit model's answer alone; SIGTERM stops every rank."""
    bert, words = bert_and_tokenizer()
    bert.save_pretrained(tmp_path / "bert")
    words.save_pretrained(tmp_path / "bert")
    whisper = tiny_whisper_directory(tmp_path / "whisper")
    llava, processor = tiny_llava_directory(tmp_path / "llava")
    for name in ("bert", "whisper", "llava"):
        agents, url = torchrun_serve(tmp_path / name, tmp_path)
        try:
            wait_healthy(url, agents[0])
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            if name == "bert":
                embeddings_equal_the_unsplit_model_s(client, bert, words)
            elif name == "whisper":
                transcripts_equal_the_unsplit_model_s(client, tmp_path / name, whisper)
            else:
                image_chats_get_their_solo_answers(client, name, llava, processor, 4)
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            sigterm_stops_every_rank(agents, tmp_path)
        finally:
            stop_agents(agents)


def test_text_that_may_start_a_stop_string_is_held_back_until_the_next_token_decides():
    from tpcore.serve.text import TextStream

    stream = TextStream(word_tokenizer(), stop=("w6 w7",))
    assert stream.add(5) == ("w5", False)
    assert stream.add(6) == (" ", False)  # "w6" may begin "w6 w7": held
    assert stream.add(7) == ("", True)  # it did: the text ends before it
    other = TextStream(word_tokenizer(), stop=("w6 w7",))
    assert [other.add(token)[0] for token in (5, 6, 8)] == ["w5", " ", "w6 w8"]


def test_a_server_on_another_address_than_loopback_warns_and_says_whether_a_key_guards_it(caplog):
    from tpcore.serve.server import _warn_if_exposed

    with caplog.at_level("WARNING", logger="tpcore.serve"):
        _warn_if_exposed("127.0.0.1", None)
        assert not caplog.records
        _warn_if_exposed("0.0.0.0", None)
        _warn_if_exposed("0.0.0.0", "key")
    assert "open to anyone" in caplog.records[0].getMessage()
    assert "open to anyone" not in caplog.records[1].getMessage()


@pytest.mark.slow  # a fresh interpreter and its ranks
def test_sigterm_lets_a_request_in_flight_end_and_leaves_no_process(tmp_path):
    process, url = start_tpcore_serve(tmp_path)
    try:
        wait_healthy(url, process)
        ranks = [pid for pid in children(process.pid) if "tpcore" in open(f"/proc/{pid}/cmdline").read()]
        body = {"model": tmp_path.name, "prompt": "w5 w7", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)  # mid-stream: the stream ends (finished or cancelled), not hangs
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest and rest[-1] == "data: [DONE]"
        process.wait(timeout=60)
        assert len(ranks) >= 2 and not [pid for pid in ranks if alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_throughput_is_logged_once_a_period_while_busy(caplog):
    import logging

    from tpcore.serve.stats import Throughput

    counter = Throughput(logging.getLogger("tpcore.serve"), "tokens", period=0.0)
    with caplog.at_level("INFO", logger="tpcore.serve"):
        counter.add(64)
        counter.idle()  # nothing since: no line
    assert [record.getMessage().split(":")[0] for record in caplog.records] == ["throughput"]
