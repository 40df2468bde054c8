import numpy as np
import pytest
import soundfile as sf
import soxr

from wnw_exp.data.audio import AudioLoadError, audio_duration, load_audio, load_mix, safe_duration


def tone(seconds, rate, freq=440.0, amp=0.5, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    x = (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def test_load_resamples_and_mixes_to_mono_blockwise(tmp_path):
    stereo = tone(7.3, 22050, channels=2)
    stereo[:, 1] *= 0.5
    sf.write(tmp_path / "a.flac", stereo, 22050)
    audio = load_audio(tmp_path / "a.flac", block_seconds=1.0)  # many blocks
    expected = soxr.resample(stereo.mean(axis=1), 22050, 16000, quality="HQ")
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == len(expected)
    np.testing.assert_allclose(audio, expected, atol=1e-4)
    assert audio_duration(tmp_path / "a.flac") == pytest.approx(7.3, abs=1e-4)


def test_16k_wav_is_read_as_is(tmp_path):
    x = tone(2.0, 16000)
    sf.write(tmp_path / "a.wav", x, 16000, subtype="PCM_16")
    audio = load_audio(tmp_path / "a.wav", block_seconds=0.3)
    np.testing.assert_allclose(audio, x, atol=1 / 32768)


def test_mix_averages_without_clipping_and_pads_the_shorter(tmp_path):
    sf.write(tmp_path / "d.wav", tone(3.0, 16000, amp=0.99), 16000)
    sf.write(tmp_path / "p.wav", tone(2.0, 16000, amp=0.99), 16000)
    mix = load_mix([tmp_path / "d.wav", tmp_path / "p.wav"])
    assert len(mix) == 3 * 16000
    assert np.abs(mix).max() <= 1.0
    np.testing.assert_allclose(mix[:32000], tone(2.0, 16000, amp=0.99), atol=1e-4)
    np.testing.assert_allclose(mix[32000:], tone(3.0, 16000, amp=0.99)[32000:] / 2, atol=1e-4)


def test_unreadable_files_raise_audio_load_error(tmp_path):
    bad = tmp_path / "bad.flac"
    bad.write_bytes(b"fLaC" + b"\x00garbage" * 20)
    with pytest.raises(AudioLoadError, match="bad.flac"):
        load_audio(bad)
    with pytest.raises(AudioLoadError, match="missing.wav"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioLoadError):
        audio_duration(bad)
    assert np.isnan(safe_duration(bad))
