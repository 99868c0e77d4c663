"""An in-car voice assistant on edgeroute: partial transcripts prefilled while the driver
speaks, car tools, the answer spoken sentence by sentence with espeak-ng, barge-in.

    python -m examples.voice_assistant --bundle bundles/qwen-pair --say "navigate to the airport"

See README.md beside this file and docs/guide/voice.md.
"""

from examples.voice_assistant.asr import (
    AudioInputError,
    Partial,
    PocketsphinxRecognizer,
    Recognizer,
    ScriptedRecognizer,
    Utterance,
    timed_partials,
)
from examples.voice_assistant.assistant import DEMO_SETTINGS, SYSTEM, TurnRecord, VoiceAssistant, cache_system_prompt
from examples.voice_assistant.car import CAR_TOOLS, CarState
from examples.voice_assistant.speech import EspeakSpeaker, NullSpeaker, SentenceSplitter, Speaker, espeak_available

__all__ = ["CAR_TOOLS", "DEMO_SETTINGS", "SYSTEM", "AudioInputError", "CarState", "EspeakSpeaker", "NullSpeaker", "Partial",
           "PocketsphinxRecognizer", "Recognizer", "ScriptedRecognizer", "SentenceSplitter", "Speaker", "TurnRecord",
           "Utterance", "VoiceAssistant", "cache_system_prompt", "espeak_available", "timed_partials"]
