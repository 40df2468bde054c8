"""The tiny model's training code on CPU: labels, a loss that goes down, checkpoint/resume, export."""

from __future__ import annotations

import json
import multiprocessing as mp

import numpy as np
import pytest
import torch
from transformers import VoxtralForConditionalGeneration

from wnw_exp.backbones.audio_windows import windowed_features
from wnw_exp.backbones.word_tokenizer import AUDIO, EOS, SPECIAL_TOKENS
from wnw_exp.data.base import Word
from wnw_exp.data.synthetic import vocabulary
from wnw_exp.train.data import AUDIO_OFFSET, CURRICULUM, SyntheticBatches, cut_clips, pack_batch
from wnw_exp.train.model import FrameHeads, LossWeights, TinyArch, build_tiny_model, training_losses, use_guided_attention
from wnw_exp.backbones.audio_windows import device_features as batch_features
from wnw_exp.train.tiny import batch_curriculum, feature_extractor, main

MICRO = dict(audio_hidden=32, audio_layers=1, audio_heads=2, text_hidden=32, text_layers=2, text_heads=4,
             text_kv_heads=2, head_dim=8, text_mlp=64)  # fmt: skip
VOCAB = 200


@pytest.fixture(scope="module")
def vocab() -> list[str]:
    return SPECIAL_TOKENS + vocabulary("en", VOCAB)


@pytest.fixture(scope="module")
def batch(vocab):
    step = mp.Value("i", 0)
    stream = SyntheticBatches(vocab, seed=0, first_index=0, step=step, vocab_size=VOCAB,
                              curriculum=batch_curriculum(CURRICULUM, 2))  # fmt: skip
    return next(iter(stream))


def test_pack_batch_labels(vocab):
    ids = {w: i for i, w in enumerate(vocab)}
    audio = np.zeros(16000 * 2, np.float32)
    words = [("the", 0.10, 0.30), ("of", 0.50, 0.90)]
    b = pack_batch([(audio, words)], ids)
    assert b["windows"].shape == (1, 480000)
    seq = b["ids"][0]
    assert (seq == AUDIO).sum() == 375
    assert b["answer_targets"][0].tolist() == [ids["the"], ids["of"], EOS]
    # rows: [TRANSCRIBE] predicts "the", "the" predicts "of", "of" predicts </s>
    assert seq[b["answer_rows"][0, 1]] == ids["the"] and seq[b["answer_rows"][0, 2]] == ids["of"]
    spans = (b["spans"][0] - AUDIO_OFFSET).tolist()
    assert spans[0] == [1, 4] and spans[1] == [6, 11]  # tokens of 80 ms whose centres lie in the word
    assert spans[2] == [11, 375]  # </s>: the audio after the last word, padding included
    cur = b["frame_cur"]
    assert cur[2] == ids["the"] and cur[8] == ids["of"] and cur[5] == 8 and cur[20] == EOS
    assert b["frame_prev"][8] == ids["the"] and b["frame_prev"][2] == 1 and b["frame_prev"][20] == ids["of"]


def test_batch_features_match_the_adapter():
    rng = np.random.default_rng(0)
    audio = (rng.integers(-3000, 3000, 16000 * 35) / 32768.0).astype(np.float32)
    windows = np.zeros((2, 480000), np.int16)
    windows.reshape(-1)[: len(audio)] = np.round(audio * 32768.0).astype(np.int16)
    extractor = feature_extractor()
    got = batch_features(torch.from_numpy(windows), extractor, torch.device("cpu"))
    assert torch.allclose(got, windowed_features(audio, extractor, "cpu"), atol=1e-5)


def test_cut_clips_at_word_boundaries():
    rng = np.random.default_rng(0)
    words = [Word(f"w{i}", 0.5 * i + 0.05, 0.5 * i + 0.4) for i in range(100)]
    audio = np.ones(16000 * 51, np.float32)
    for lo, hi in [(1.0, 8.0), (60.0, 90.0)]:
        for clip, ws in cut_clips(audio, words, lo, hi, rng, 5):
            assert ws and ws[0][1] >= 0 and ws[-1][2] <= len(clip) / 16000 + 1e-6
            assert all(a[2] <= b[1] for a, b in zip(ws, ws[1:]))


def test_losses_go_down_on_a_fixed_batch(batch, vocab):
    torch.manual_seed(0)
    arch = TinyArch(**MICRO)
    model = build_tiny_model(len(vocab), arch)
    heads = FrameHeads(arch.text_hidden, len(vocab))
    use_guided_attention(model, True)
    b = {k: v for k, v in batch.items() if k not in ("windows", "n_words", "audio_seconds", "next_index")}
    b["features"] = batch_features(batch["windows"], feature_extractor(), torch.device("cpu"))
    opt = torch.optim.AdamW(list(model.parameters()) + list(heads.parameters()), lr=3e-3)
    first = None
    for _ in range(4):
        loss, logs = training_losses(model, heads, b, (1,), (0, 1), LossWeights())
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or logs
    assert {"ce", "frame", "guided", "guided_acc", "audio_rms"} <= set(logs)
    assert logs["loss"] < first["loss"] and logs["frame"] < first["frame"]


def test_train_resume_export_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("WNW_CACHE", str(tmp_path / "cache"))
    run, out = tmp_path / "run", tmp_path / "model"
    common = ["--run-dir", str(run), "--workers", "0", "--device", "cpu", "--vocab-size", str(VOCAB),
              "--arch", json.dumps(MICRO), "--batch-windows", "1", "--log-every", "1", "--eval-clips", "0"]  # fmt: skip
    main(["train", "--total-steps", "1", *common])
    state = torch.load(run / "state.pt", weights_only=False)
    assert state["meta"]["step"] == 1
    main(["train", "--total-steps", "2", *common])  # resumes at step 1, does one more
    state2 = torch.load(run / "state.pt", weights_only=False)
    assert state2["meta"]["step"] == 2 and len(state2["meta"]["sessions"]) == 2
    assert state2["meta"]["next_index"] > state["meta"]["next_index"]
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    main(["export", "--run-dir", str(run), "--out", str(out)])
    model = VoxtralForConditionalGeneration.from_pretrained(out)
    for name, p in model.state_dict().items():
        assert torch.equal(p, state2["model"][name]), name
    assert model.config.audio_token_id == AUDIO
    assert (out / "tokenizer.json").exists() and (out / "preprocessor_config.json").exists()
    assert all(f.stat().st_size < 16 * 2**20 for f in out.glob("*.safetensors"))
    # a new run directory can start from the exported folder and go on counting steps
    # ... with the frame heads of the same checkpoint, on one stage of mixed clip lengths (fine-tuning)
    torch.save(state2["heads"], tmp_path / "heads.pt")
    run2 = tmp_path / "run2"
    main(["train", "--total-steps", "3", "--init-from", str(out), "--init-heads", str(tmp_path / "heads.pt"),
          "--clip-seconds", "1", "3", *common[:1], str(run2), *common[2:]])  # fmt: skip
    state3 = torch.load(run2 / "state.pt", weights_only=False)
    assert state3["meta"]["step"] == 3 and len(state3["meta"]["sessions"]) == 3
    assert state3["meta"]["sessions"][-1]["args"]["clip_seconds"] == [1.0, 3.0]
    log3 = [json.loads(line) for line in (run2 / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log3] == [1, 2, 3]  # the exported history is carried on
    assert log3[-1]["clip_seconds"] == [1.0, 3.0]
