"""tp-audio: tpcore policies for speech encoders (Wav2Vec2, Wav2Vec2-Conformer, Hubert, WavLM,
Data2VecAudio, UniSpeech, SEW, SEW-D) and speech-to-text models (Whisper, Speech2Text)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_audio.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
