"""Speech models split over 1-4 gloo ranks give the unsplit outputs and tokens.

Every model runs every head transformers ships for it: the first head over 1-4 ranks (Wav2Vec2,
WavLM and Whisper in the quick suite), the others (slow) over 2 and 3. Encoders have 6 heads and
Whisper's and Speech2Text's decoders 4, so 3 and 4 ranks deal them unevenly (6 over 4: 2, 2, 1, 1;
4 over 3: 2, 1, 1). Inputs are batches of 3 waveforms (or log-mel features), row 0 half padding
where the model takes an attention mask (:func:`tpcore.testing.samples.sample_inputs`), and decoder ids.
Whisper (forced language and task tokens, timestamps off and on) and Speech2Text ``generate()``
run 32 tokens greedy and with 4 beams; saved directories load with each rank reading its slices,
Whisper also through ``tpcore.parallelize()``; ``tpcore check`` runs each family from its default
config; a hypothesis property draws random uneven sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import HALF_PRECISION_RTOL, ModelSpec, SavedModelSpec, check_equivalence, sample_batches, seeds
from tpcore.testing.samples import forward_parameters, sample_inputs
from tpcore.tools.check import run_check

ENCODER_HEADS, DECODER_HEADS, HEAD_DIM = 6, 4, 8
VOCAB = 1024
#: weights large enough that the generated tokens follow the audio (at 0.02 every row repeats one token)
INIT_STD = 0.2
#: Whisper's special tokens: end of text, start of transcript, two languages, the two tasks, "no
#: timestamps", then one timestamp token per 0.02 s up to the vocabulary's end (room for 32 tokens)
EOS, START, ENGLISH, GERMAN, TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS = range(50, 57)


def speech_encoder(config_class, heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40, **options):
    """A wav2vec 2.0-style config: two convolutions (hop 10 samples) of 16 channels, ``heads`` heads of
    ``head_dim``, every task head small (CTC over ``VOCAB``, 3 labels, x-vectors, 2 codebooks of 4)."""
    sizes = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_hidden_layers": layers}
    sizes |= {"intermediate_size": ffn, "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3)}
    sizes |= {"num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 2, "vocab_size": VOCAB, "num_labels": 3}
    sizes |= {"tdnn_dim": (16, 16, 16, 16, 24), "xvector_output_dim": 8, "classifier_proj_size": 16}
    sizes |= {"codevector_dim": 8, "proj_codevector_dim": 8, "num_codevectors_per_group": 4}
    sizes |= {"num_codevector_groups": 2, "pad_token_id": 0}
    return config_class(**(sizes | options))


def _speech_encoder(config_class, **options):
    return lambda heads, decoder_heads, **sizes: speech_encoder(config_class, heads, **sizes, **options)


def _width(heads: int, decoder_heads: int, head_dim: int) -> int:
    """``heads x head_dim``, or the least width both head counts divide (in features of at least 2)."""
    width = heads * head_dim
    return width if width % decoder_heads == 0 else math.lcm(heads, decoder_heads) * 2


def whisper(heads: int, decoder_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40):
    """An encoder of ``heads`` heads over 16 mel bins x 32 frames, a decoder of ``decoder_heads``."""
    width = _width(heads, decoder_heads, head_dim)
    sizes = {"d_model": width, "encoder_attention_heads": heads, "decoder_attention_heads": decoder_heads}
    sizes |= {"encoder_layers": layers, "decoder_layers": layers, "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn}
    sizes |= {"vocab_size": VOCAB, "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 64}
    tokens = {"pad_token_id": EOS, "bos_token_id": EOS, "eos_token_id": EOS, "decoder_start_token_id": START}
    tokens |= {"begin_suppress_tokens": None, "suppress_tokens": None, "num_labels": 3, "classifier_proj_size": 16}
    return transformers.WhisperConfig(**sizes, **tokens, init_std=INIT_STD)


def speech2text(heads: int, decoder_heads: int, head_dim: int = HEAD_DIM, layers: int = 2, ffn: int = 40):
    """Two strided convolutions over 16 features a frame, an encoder of ``heads`` heads, a decoder of
    ``decoder_heads``."""
    width = _width(heads, decoder_heads, head_dim)
    sizes = {"d_model": width, "encoder_attention_heads": heads, "decoder_attention_heads": decoder_heads}
    sizes |= {"encoder_layers": layers, "decoder_layers": layers, "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn}
    sizes |= {"vocab_size": VOCAB, "input_feat_per_channel": 16, "input_channels": 1, "conv_channels": 16}
    sizes |= {"max_source_positions": 64, "max_target_positions": 64}
    tokens = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2}
    return transformers.Speech2TextConfig(**sizes, **tokens, init_std=INIT_STD)


@dataclass(frozen=True)
class Family:
    name: str
    prefix: str
    heads: tuple[str, ...]
    #: (encoder heads, decoder heads, head_dim=, layers=, ffn=) -> config
    config: Callable[..., Any]

    def model_class(self, head: str) -> type:
        return getattr(transformers, self.prefix + head)


_CLASSIFIERS = ("ForSequenceClassification", "ForAudioFrameClassification", "ForXVector")
_STABLE = {"do_stable_layer_norm": True, "feat_extract_norm": "layer"}

FAMILIES = {
    family.name: family
    for family in (
        Family(
            "Wav2Vec2",
            "Wav2Vec2",
            ("ForCTC", "Model", "ForPreTraining", *_CLASSIFIERS),
            _speech_encoder(transformers.Wav2Vec2Config),
        ),
        Family(
            "Wav2Vec2-stable-layer-norm",  # pre-norm blocks with attention adapters
            "Wav2Vec2",
            ("ForCTC",),
            _speech_encoder(transformers.Wav2Vec2Config, **_STABLE, adapter_attn_dim=8),
        ),
        Family(
            "Wav2Vec2-Conformer",  # relative position embeddings
            "Wav2Vec2Conformer",
            ("ForCTC", "Model", "ForPreTraining", *_CLASSIFIERS),
            _speech_encoder(transformers.Wav2Vec2ConformerConfig, conv_depthwise_kernel_size=3),
        ),
        Family(
            "Wav2Vec2-Conformer-rotary",
            "Wav2Vec2Conformer",
            ("Model",),
            _speech_encoder(
                transformers.Wav2Vec2ConformerConfig, conv_depthwise_kernel_size=3, position_embeddings_type="rotary"
            ),
        ),
        Family(
            "Wav2Vec2-BERT",  # Conformer blocks over 16 features a frame, relative-key positions
            "Wav2Vec2Bert",
            ("ForCTC", "Model", *_CLASSIFIERS),
            _speech_encoder(
                transformers.Wav2Vec2BertConfig, feature_projection_input_dim=16, conv_depthwise_kernel_size=3
            ),
        ),
        Family(
            "Hubert",
            "Hubert",
            ("ForCTC", "Model", "ForSequenceClassification"),
            _speech_encoder(transformers.HubertConfig),
        ),
        Family("Hubert-stable-layer-norm", "Hubert", ("Model",), _speech_encoder(transformers.HubertConfig, **_STABLE)),
        Family("WavLM", "WavLM", ("ForCTC", "Model", *_CLASSIFIERS), _speech_encoder(transformers.WavLMConfig)),
        Family("WavLM-stable-layer-norm", "WavLM", ("Model",), _speech_encoder(transformers.WavLMConfig, **_STABLE)),
        Family(
            "Data2VecAudio",  # a positional embedding of 2 convolutions of kernel 5
            "Data2VecAudio",
            ("ForCTC", "Model", *_CLASSIFIERS),
            _speech_encoder(transformers.Data2VecAudioConfig, num_conv_pos_embeddings=2, conv_pos_kernel_size=5),
        ),
        Family(
            "UniSpeech",
            "UniSpeech",
            ("ForCTC", "Model", "ForPreTraining", "ForSequenceClassification"),
            _speech_encoder(transformers.UniSpeechConfig),
        ),
        Family(
            "UniSpeechSat",
            "UniSpeechSat",
            ("ForCTC", "Model", "ForPreTraining", *_CLASSIFIERS),
            _speech_encoder(transformers.UniSpeechSatConfig, **_STABLE),
        ),
        Family("SEW", "SEW", ("ForCTC", "Model", "ForSequenceClassification"), _speech_encoder(transformers.SEWConfig)),
        Family(
            "SEW-D",
            "SEWD",
            ("ForCTC", "Model", "ForSequenceClassification"),
            _speech_encoder(transformers.SEWDConfig, position_buckets=16, max_position_embeddings=32),
        ),
        Family(
            "SEW-D-position-projections",  # no shared keys: pos_key_proj, pos_query_proj of their own
            "SEWD",
            ("Model",),
            _speech_encoder(
                transformers.SEWDConfig, position_buckets=16, max_position_embeddings=32, share_att_key=False
            ),
        ),
        Family(
            "Whisper",
            "Whisper",
            ("ForConditionalGeneration", "Model", "ForAudioClassification", "ForCausalLM"),
            whisper,
        ),
        Family("Speech2Text", "Speech2Text", ("ForConditionalGeneration", "Model"), speech2text),
    )
}
CASES = [(family, head) for family in FAMILIES for head in FAMILIES[family].heads]


def model_spec(
    family: str, head: str, seed: int = 1, heads: int = ENCODER_HEADS, decoder_heads: int = DECODER_HEADS, **sizes
):
    return ModelSpec(FAMILIES[family].model_class(head), FAMILIES[family].config(heads, decoder_heads, **sizes), seed)


def head_inputs(spec: ModelSpec, batch: int = 3, seq: int = 7, seed: int = 2) -> dict:
    """What the head takes (:func:`tpcore.testing.samples.sample_inputs`), every hidden state asked for where
    the head returns them."""
    model = spec.build()
    inputs = sample_inputs(model, batch=batch, seq=seq, seed=seed)
    if "output_hidden_states" in forward_parameters(model):
        inputs["output_hidden_states"] = True
    return inputs


#: the families whose first head runs in the quick suite: the plain layout, the gated per-head position
#: bias, an encoder-decoder over log-mel features
QUICK = ("Wav2Vec2", "WavLM", "Whisper")


def every_head_cases():
    for family, head in CASES:
        if head == FAMILIES[family].heads[0]:
            marks = [] if family in QUICK else [pytest.mark.slow]
            yield pytest.param(family, head, (1, 2, 3, 4), id=f"{family}-{head}", marks=marks)
        else:
            yield pytest.param(family, head, (2, 3), id=f"{family}-{head}", marks=pytest.mark.slow)


@pytest.mark.parametrize(("family", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, family, head, world_sizes):
    """Every output (logits, embeddings, hidden states of every block) over each world size."""
    spec = model_spec(family, head)
    report = check_equivalence(spec, head_inputs(spec), world_sizes=world_sizes, pools=rank_pools)
    assert sorted(report) == list(world_sizes) and all(report.values())


# -- generation: Whisper and Speech2Text transcribe -----------------------------------------------------


def whisper_generation_config(config) -> transformers.GenerationConfig:
    """What Whisper's ``generate()`` reads of a multilingual checkpoint: its languages, tasks and the
    timestamp tokens (every id above "no timestamps")."""
    return transformers.GenerationConfig(
        decoder_start_token_id=START,
        eos_token_id=EOS,
        pad_token_id=EOS,
        is_multilingual=True,
        lang_to_id={"<|en|>": ENGLISH, "<|de|>": GERMAN},
        task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        no_timestamps_token_id=NO_TIMESTAMPS,
        max_initial_timestamp_index=8,
        begin_suppress_tokens=[EOS],
        suppress_tokens=[],
        max_length=config.max_target_positions,
    )


def generate_inputs(spec: ModelSpec, num_beams: int, timestamps: bool = False, seed: int = 4) -> dict:
    """Features for a batch of 2 and 32 new tokens; Whisper's in German, translated (forced language
    and task tokens), with or without timestamps."""
    inputs = head_inputs(spec, batch=2, seq=6, seed=seed)
    inputs = {key: inputs[key] for key in ("input_features", "attention_mask") if key in inputs}
    options = {"max_new_tokens": 32, "min_new_tokens": 32, "num_beams": num_beams, "do_sample": False}
    if spec.model_class is transformers.WhisperForConditionalGeneration:
        options |= {"generation_config": whisper_generation_config(spec.config), "language": "de", "task": "translate"}
        options |= {"return_timestamps": timestamps}
    return inputs | options


GENERATION_CASES = [
    pytest.param("Whisper", 1, False, id="Whisper-greedy"),
    pytest.param("Whisper", 1, True, id="Whisper-greedy-timestamps", marks=pytest.mark.slow),
    pytest.param("Whisper", 4, False, id="Whisper-beam", marks=pytest.mark.slow),
    pytest.param("Whisper", 4, True, id="Whisper-beam-timestamps", marks=pytest.mark.slow),
    pytest.param("Speech2Text", 1, False, id="Speech2Text-greedy", marks=pytest.mark.slow),
    pytest.param("Speech2Text", 4, False, id="Speech2Text-beam", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "num_beams", "timestamps"), GENERATION_CASES)
def test_generate_tokens_match(rank_pools, family, num_beams, timestamps):
    """32 new tokens for a batch of 2, identical to the unsplit model's on every rank, over 2 and 4 ranks."""
    spec = model_spec(family, "ForConditionalGeneration", seed=3)
    inputs = generate_inputs(spec, num_beams, timestamps)
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


def test_whisper_generation_reads_the_forced_tokens_and_timestamps():
    """The generation inputs above do what they say (unsplit): 32 new tokens; the forced language token
    reaches the decoder (German and English transcripts differ); with timestamps, the first token is a
    timestamp no later than ``max_initial_timestamp_index`` and the timestamps never go back."""
    spec = model_spec("Whisper", "ForConditionalGeneration", seed=3)
    model = spec.build()
    german = model.generate(**generate_inputs(spec, 1))
    english = model.generate(**(generate_inputs(spec, 1) | {"language": "en"}))
    stamped = model.generate(**generate_inputs(spec, 1, timestamps=True))
    assert german.shape == english.shape == stamped.shape == (2, 32)
    assert not torch.equal(german, english)
    first = stamped[:, 0] - (NO_TIMESTAMPS + 1)
    assert ((first >= 0) & (first <= whisper_generation_config(spec.config).max_initial_timestamp_index)).all()
    for row in stamped.tolist():
        times = [token for token in row if token > NO_TIMESTAMPS]
        assert times == sorted(times) and len(times) >= 4


# -- saved directories ---------------------------------------------------------------------------------

SAVED = [("Wav2Vec2", "ForCTC"), ("WavLM", "Model"), ("Wav2Vec2-Conformer", "ForCTC")]
SAVED += [("Whisper", "ForConditionalGeneration"), ("Speech2Text", "ForConditionalGeneration")]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "head"), SAVED, ids=[family for family, _ in SAVED])
def test_a_saved_directory_loads_each_rank_reading_its_slices(rank_pools, tmp_path, family, head):
    """``save_pretrained`` (Wav2Vec2's positional convolution under weight norm), then each of 3 ranks
    reads only its slices (``ParallelEngine.parallelize(path)``): the outputs (transcripts: 4-beam
    tokens) of ``from_pretrained``'s unsplit model."""
    built = model_spec(family, head, seed=5)
    built.build().save_pretrained(tmp_path)
    spec = SavedModelSpec(str(tmp_path), built.model_class)
    if head == "ForConditionalGeneration":
        inputs = generate_inputs(built, 4, timestamps=family == "Whisper", seed=6)
        report = check_equivalence(spec, inputs, world_sizes=(3,), pools=rank_pools, method="generate", rtol=0)
        assert all(diff == 0 for diff in report[3].values())
    else:
        report = check_equivalence(spec, head_inputs(built, seed=6), world_sizes=(3,), pools=rank_pools)
        assert report[3]


@pytest.mark.slow  # a world of its own
def test_whisper_through_parallelize_from_a_saved_directory(tmp_path):
    """The one-liner over 2 ranks from a ``save_pretrained`` directory (with its generation config):
    Whisper transcribes to the unsplit model's greedy and beam tokens, timestamps on."""
    spec = model_spec("Whisper", "ForConditionalGeneration", seed=7)
    reference = spec.build()
    reference.generation_config = whisper_generation_config(spec.config)
    reference.save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        for num_beams in (1, 4):
            inputs = generate_inputs(spec, num_beams, timestamps=True, seed=8)
            del inputs["generation_config"]  # both read the saved one
            assert torch.equal(served.generate(**inputs), reference.generate(**inputs))
    finally:
        served.deparallelize()


# -- what is split and how (pure) -----------------------------------------------------------------------


def test_wavlm_splits_its_position_bias_by_heads():
    """Over 4 ranks, 6 heads as 2, 2, 1, 1: the first block's bucket embedding ``(buckets, heads)`` and every
    block's gate constant ``(1, heads, 1, 1)`` keep the rank's heads; the gate's linear layer stays whole."""
    model = model_spec("WavLM", "Model").build()
    plan = tpcore.TensorReplacer(model, None, False, 4, rank=3).split_plan()
    first, second = "encoder.layers.0.attention", "encoder.layers.1.attention"
    assert plan.shard_shape(f"{first}.rel_attn_embed.weight", 3) == (model.config.num_buckets, 1)
    assert plan.shard_shape(f"{second}.gru_rel_pos_const", 0) == (1, 2, 1, 1)
    assert plan.attributes[f"{second}.first_head"] == tpcore.PerRank((0, 2, 4, 5))
    assert plan.attributes[f"{second}.num_heads"] == tpcore.PerRank((2, 2, 1, 1))
    assert f"{first}.gru_rel_pos_linear.weight" not in plan.splits
    assert "encoder.pos_conv_embed.conv.parametrizations.weight.original1" not in plan.splits  # convolutions whole


def test_whisper_splits_encoder_and_decoder_by_their_own_heads_and_the_vocabulary():
    plan = tpcore.TensorReplacer(model_spec("Whisper", "ForConditionalGeneration").build(), None, False, 4, rank=0)
    plan = plan.split_plan()
    assert plan.attributes["model.encoder.layers.0.self_attn.num_heads"] == tpcore.PerRank((2, 2, 1, 1))
    assert plan.attributes["model.decoder.layers.1.encoder_attn.num_heads"] == 1
    assert plan.vocab == {"model.decoder.embed_tokens": VOCAB, "proj_out": VOCAB}  # tied: split together
    assert "model.encoder.conv1.weight" not in plan.splits


def test_more_ranks_than_heads_are_refused_naming_the_tensor():
    with pytest.raises(tpcore.ShardingError, match=r"HubertModel over 7 ranks.*heads are fewer"):
        tpcore.TensorReplacer(model_spec("Hubert", "Model").build(), None, False, 7, rank=0).validate()


# -- tpcore check from default configs; random sizes ---------------------------------------------------

DEFAULT_CONFIG_CASES = [FAMILIES[family].prefix + FAMILIES[family].heads[0] for family in FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dict.fromkeys(DEFAULT_CONFIG_CASES)))
def test_tpcore_check_passes_from_the_default_config(rank_pools, capsys, name):
    """``tpcore check CLASS`` on the default config shrunk (waveforms with a padded row, log-mel features)."""
    assert run_check(name, (2, 3), pools=rank_pools) == 0, capsys.readouterr().out


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    world_size=st.integers(2, 4),
    heads=st.integers(1, 3),
    decoder_heads=st.integers(1, 3),
    uneven=st.integers(0, 3),
    head_dim=st.sampled_from([4, 8]),
    layers=st.integers(1, 2),
    ffn=st.integers(9, 40),
    seed=seeds(),
)
def test_random_configs_match_unsplit(
    rank_pools, case, world_size, heads, decoder_heads, uneven, head_dim, layers, ffn, seed
):
    """Random head counts (``heads`` per rank, plus ``uneven`` more: 2-4 ranks dealing them unevenly),
    head widths, depths and feed-forward widths (dealt unevenly too)."""
    family, head = case
    spec = model_spec(
        family,
        head,
        seed,
        heads=heads * world_size + uneven % world_size,
        decoder_heads=decoder_heads * world_size,
        head_dim=head_dim,
        layers=layers,
        ffn=ffn,
    )
    report = check_equivalence(spec, head_inputs(spec, seed=seed % 97), world_sizes=(world_size,), pools=rank_pools)
    assert report[world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", ["Wav2Vec2", "WavLM", "Wav2Vec2-Conformer", "Whisper", "Speech2Text"])
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, family, world_size, dtype):
    """Every output on CUDA with NCCL in half precision; world sizes beyond the GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    spec = model_spec(family, FAMILIES[family].heads[0])
    report = check_equivalence(
        spec,
        head_inputs(spec),
        world_sizes=(world_size,),
        pools=nccl_rank_pools,
        rtol=HALF_PRECISION_RTOL[dtype],
        dtype=dtype,
    )
    assert report[world_size]


@pytest.mark.slow
def test_check_model_draws_audio_batches(tp_check):
    """``tpcore.testing.check_model`` (the ``tp_check`` fixture) on speech models: drawn waveforms with
    a padded row (WavLM), log-mel features and decoder ids (Whisper)."""
    tp_check(transformers.WavLMForCTC, model_spec("WavLM", "ForCTC").config, world_sizes=(2, 3), max_examples=4)
    tp_check(transformers.WhisperModel, model_spec("Whisper", "Model").config, world_sizes=(2,), max_examples=3)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_sample_batches_draw_waveforms_of_drawn_sizes_with_a_padded_row(data):
    """1-3 waveforms of 2 x (2-9) frames of the 10-sample hop; row 0's second half is padding."""
    batch = data.draw(sample_batches(model_spec("WavLM", "ForCTC").build(), batch=(1, 3), seq=(2, 9)))
    rows, samples = batch["input_values"].shape
    assert 1 <= rows <= 3 and samples % 20 == 0 and 40 <= samples <= 180
    assert batch["attention_mask"][0].sum() == samples // 2 and batch["attention_mask"][1:].all()
    assert not batch["input_values"][0, samples // 2 :].any()
