"""Calibration: word alignments (oracle, WhisperX files), answer tokens <-> words, the score pass, the file."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers import noise_audio, tiny_voxtral
from wnw_exp.backbones.word_tokenizer import build_word_tokenizer
from wnw_exp.calibration.alignment import (AlignmentError, OracleAligner, WhisperXAligner, alignment_filename,
                                           build_aligner, parse_whisperx)
from wnw_exp.methods.wnw import triage
from wnw_exp.head_scores import FORMAT, HeadScores, HeadScoresError
from wnw_exp.calibration.scores import (answer_token_words, default_k_top, gradient_tokens, group_mean,
                                        score_sample, token_audio_spans)
from wnw_exp.data.base import Sample, Word

RECORDED = Path(__file__).parent / "data" / "whisperx_alignment.json"


def sample_with(reference, words=None, sid="s-0"):
    return Sample(id=sid, load_audio=lambda: noise_audio(4.0), duration=4.0, reference=reference, words=words)


# --- alignments ---------------------------------------------------------------------------------------
def test_whisperx_recorded_output_is_parsed_and_filtered(tmp_path):
    data = json.loads(RECORDED.read_text())
    words = parse_whisperx(data)
    assert [w.text for w in words][:3] == ["THE", "CAT", "SAT"] and words[6].start is None
    assert parse_whisperx({"segments": data["segments"]}) == words  # without word_segments
    sample = sample_with(data["reference"], sid=data["id"])
    shutil.copy(RECORDED, tmp_path / alignment_filename(sample.id))
    aligner = build_aligner(dict(name="whisperx", dir=str(tmp_path), min_word_score=0.85))
    got = aligner.words(sample)
    assert len(got) == len(data["reference"].split()) == 10
    assert got[0] == Word("THE", 0.31, 0.451)
    assert got[3] is None  # "ON" scored 0.61 < 0.85
    assert got[4] == Word("THE", 1.354, 1.455)  # 0.853 passes
    assert got[5] == Word("MAT.", 1.515, 1.902)
    assert got[6] is None  # "42": WhisperX could not align it (no start/end/score)
    assert got[9] == Word("ALOUD", 3.306, 3.91)  # exactly 0.85 passes
    lenient = WhisperXAligner(str(tmp_path), min_word_score=0.5).words(sample)
    assert lenient[3] == Word("ON", 1.214, 1.314)
    with pytest.raises(AlignmentError, match="another transcript"):
        aligner.words(sample_with("SOMETHING ELSE ENTIRELY", sid=data["id"]))
    with pytest.raises(AlignmentError, match="wnw-align"):
        aligner.words(sample_with("NO FILE", sid="missing"))


def test_oracle_alignment_and_reference_matching():
    words = [Word("hello", 0.1, 0.4), Word("big", 0.5, 0.7), Word("world", 0.8, 1.2)]
    assert OracleAligner().words(sample_with("hello big world", words)) == words
    # punctuation in the reference and a word the alignment lacks still map to the right positions
    got = OracleAligner().words(sample_with("Hello, big new world.", words))
    assert got == [Word("Hello,", 0.1, 0.4), Word("big", 0.5, 0.7), None, Word("world.", 0.8, 1.2)]
    with pytest.raises(AlignmentError, match="whisperx"):
        OracleAligner().words(sample_with("no timings"))


# --- answer tokens <-> words ----------------------------------------------------------------------------
def test_word_tokenizer_maps_one_token_per_word():
    tok = build_word_tokenizer(["the", "cat", "sat"])
    ids, words = answer_token_words(tok, "the cat sat the")
    assert ids == [9, 10, 11, 9] and words == [0, 1, 2, 3]


def subword_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    from tokenizers import decoders

    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "a cat and a hat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_subword_tokens_share_their_word_and_punctuation_is_skipped():
    tok = subword_tokenizer()
    ref = "catonhat , the mat"
    ids, words = answer_token_words(tok, ref)
    assert len(ids) >= 6  # "catonhat" is split into several pieces
    assert words.count(0) >= 2 and words[-2:] == [2, 3] and 1 not in words
    enc = tok(ref, add_special_tokens=False, return_offsets_mapping=True)
    for (a, b), w in zip(enc["offset_mapping"], words):
        assert (w is None) == (not any(c.isalnum() for c in ref[a:b]))

    class NoOffsets:  # a tokenizer without character offsets: words are found by incremental decoding
        def __call__(self, *a, **k):
            raise NotImplementedError

        encode = staticmethod(lambda text, add_special_tokens=False: tok.encode(text, add_special_tokens=False))
        decode = staticmethod(lambda ids, skip_special_tokens=True: tok.decode(ids, skip_special_tokens=True))

    clean = "catonhat the mat"
    ids, words = answer_token_words(tok, clean)
    fb_ids, fb_words = answer_token_words(NoOffsets(), clean)
    assert fb_ids == ids
    assert [w for w in fb_words if w is not None] == [w for w, f in zip(words, fb_words) if f is not None]
    assert fb_words[-2:] == [1, 2] and fb_words.count(0) >= 2


def test_token_spans_and_helpers():
    words = [Word("a", 0.0, 0.39), None, Word("c", 1.0, 2.5)]
    assert token_audio_spans([0, 0, 1, None, 2], words, 12.5, 20) == [(0, 4), (0, 4), None, None, (12, 20)]
    assert default_k_top(12.5) == 4 and default_k_top(25) == 8
    assert gradient_tokens(10, None) == list(range(10)) and gradient_tokens(10, 4) == [0, 3, 6, 9]
    np.testing.assert_allclose(group_mean(np.arange(8.0).reshape(1, 8), 4), [[0.5, 2.5, 4.5, 6.5]])


# --- the score pass -------------------------------------------------------------------------------------
def test_score_sample_gradients_match_a_reference_computation():
    backbone = tiny_voxtral()
    prompt = backbone.build_prompt(noise_audio(3.0))
    answer = [20, 21, 22, 23, 24]
    spans = [(0, 10), None, (10, 30), (100, 140), None]
    res = score_sample(backbone, prompt, answer, spans, k_top=4, hs_tokens=None)
    assert res.n_vs_tokens == 3 and res.n_hs_tokens == 6
    assert res.hit.shape == (3, 8) and ((res.hit >= 0) & (res.hit <= 1)).all()
    assert res.sensitivity.shape == (3, 4) and (res.sensitivity > 0).all()

    # reference: HF's own forward with hooks on the key projections, one backward per target token
    ids = torch.cat([prompt.input_ids, torch.tensor([answer])], 1)
    model = backbone.model
    s, e = prompt.audio_span
    keys = []

    def hook(mod, inp, out):
        out.retain_grad()
        keys.append(out)

    handles = [layer.self_attn.k_proj.register_forward_hook(hook) for layer in backbone.layers]
    try:
        with torch.enable_grad():
            out = model(input_ids=ids, input_features=prompt.audio_inputs["input_features"])
    finally:
        for h in handles:
            h.remove()
    P = prompt.input_ids.shape[1]
    targets = answer + backbone.eos_token_ids[:1]
    logits = out.logits[0, P - 1:P - 1 + len(targets)].float()
    losses = torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="none")
    ref = np.zeros((3, 4))
    for i in range(len(targets)):
        grads = torch.autograd.grad(losses[i], keys, retain_graph=True)
        for li, gk in enumerate(grads):  # gradient wrt pre-RoPE keys; RoPE is a rotation: same norms
            ref[li] += gk[0, s:e].view(e - s, 4, 16).norm(dim=-1).mean(0).numpy()
    np.testing.assert_allclose(res.sensitivity, ref / len(targets), rtol=1e-3)


def test_oracle_calibration_end_to_end(tmp_path):
    """wnw-calibrate's loop on the synthetic set (oracle timings) and the tiny_random model."""
    from wnw_exp.calibration.run import run_calibration

    cfg = dict(model=dict(name="tiny_random", family="voxtral", random=True, seed=0, vocab_size=None, layers=3,
                          q_heads=8, kv_heads=4, head_dim=16, max_new_tokens_per_second=1.0, min_new_tokens=4),
               dataset=dict(name="synthetic", n=1, split="calib", min_seconds=6.0, max_seconds=8.0,
                            cache_dir=str(tmp_path / "cache")),
               alignment=dict(name="oracle"), device="cpu", dtype="float32", seed=0, k_top="auto", hs_tokens=3,
               recall_samples=1)
    out = tmp_path / "head_scores.json"
    scores = run_calibration(cfg, out, progress=False)
    d = json.loads(out.read_text())
    assert d["format"] == FORMAT and d["model"] == "tiny_random"
    assert (d["n_layers"], d["n_q_heads"], d["n_kv_heads"], d["token_rate"]) == (3, 8, 4, 12.5)
    assert np.shape(d["voice_score"]) == (3, 4) and np.shape(d["head_sensitivity"]) == (3, 4)
    cal = d["calibration"]
    assert cal["n_samples"] == 1 and cal["n_vs_tokens"] > 10 and cal["n_hs_tokens"] == 3 and cal["k_top"] == 4
    assert cal["alignment"] == {"name": "oracle"} and cal["dataset"]["split"] == "calib"
    mob = cal["swap_mobility"]
    assert mob["n_samples"] == 1 and 0 <= mob["value"] <= 1 and len(mob["mean_resident_segments"]) == 1
    # the value is the sample's mean recalled-segment count mapped through the estimate's bounds (8 s clip:
    # padded to 30 s = 375 tokens, 15 segments; bounds 4 and 15)
    assert mob["value"] == pytest.approx(triage.mobility_of(mob["mean_resident_segments"][0], 375, 25, 50, 3, 3))
    assert (mob["top_k"], mob["delta"], mob["signal"]) == (3, 3, "vs_hs")
    assert d["code_version"]["wnw_exp"]
    loaded = HeadScores.load(out)
    loaded.check_matches(dict(name="tiny_random", n_layers=3, n_q_heads=8, n_kv_heads=4))
    assert np.allclose(loaded.voice_score, scores.voice_score)
    with pytest.raises(HeadScoresError, match="calibrated for model 'tiny_random'.*4 KV heads.*2 KV heads"):
        loaded.check_matches(dict(name="tiny_random", n_layers=3, n_q_heads=8, n_kv_heads=2))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HeadScoresError, match="not a valid head-score file"):
        HeadScores.load(tmp_path / "bad.json")


def test_wnw_align_worker_round_trip_with_a_stub_whisperx(tmp_path):
    """wnw-align's manifest -> the worker (in a separate interpreter, whisperx stubbed) -> the reader."""
    import subprocess
    import sys

    from wnw_exp.cli.align import prepare, worker_command

    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "whisperx.py").write_text(
        "__version__ = 'stub'\n"
        "def load_align_model(language_code, device, model_name=None):\n"
        "    return object(), {'language': language_code}\n"
        "def align(segments, model, meta, audio, device, return_char_alignments=False):\n"
        "    words = segments[0]['text'].split()\n"
        "    step = len(audio) / 16000 / len(words)\n"
        "    ws = [{'word': w, 'start': round(i * step, 3), 'end': round((i + 0.8) * step, 3), 'score': 0.9}\n"
        "          for i, w in enumerate(words)]\n"
        "    return {'segments': [dict(segments[0], words=ws)], 'word_segments': ws}\n")
    cfg = dict(dataset=dict(name="synthetic", n=1, split="calib", min_seconds=3.0, max_seconds=4.0,
                            cache_dir=str(tmp_path / "cache")),
               alignment=dict(name="whisperx", dir=str(tmp_path / "al")))
    manifest, out_dir, n = prepare(cfg)
    assert n == 1
    env = dict(__import__("os").environ, PYTHONPATH=str(stub))
    cmd = worker_command(sys.executable, manifest, out_dir, "cpu", None)
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    from wnw_exp.data import build_dataset

    sample = build_dataset(cfg["dataset"])[0]
    words = build_aligner(cfg["alignment"]).words(sample)
    assert len(words) == len(sample.reference.split()) and all(w is not None for w in words)
    assert words[1].start == pytest.approx(sample.duration / len(words), abs=2e-3)
    assert prepare(cfg)[2] == 0  # resumable: nothing left to align


def test_calibrate_refuses_to_overwrite_a_file_made_on_other_clips(tmp_path):
    """The default folder names model, data set, split, n and alignment only: a calibration of other clips (here
    other lengths) into it gets one line and exit 2 before any work; the same recipe, or another cache folder, may
    recompute it."""
    import subprocess
    import sys

    from wnw_exp.calibration.run import check_output_is_free

    out = tmp_path / "cal" / "tiny_random" / "synthetic-calib-n50-oracle" / "head_scores.json"
    out.parent.mkdir(parents=True)
    made = dict(name="synthetic", split="calib", n=50, min_seconds=6.0, max_seconds=8.0, cache_dir="/a")
    out.write_text(json.dumps(dict(model="tiny_random", calibration=dict(dataset=made, alignment=dict(name="oracle")))))
    cfg = dict(model=dict(name="tiny_random"), dataset=dict(made), alignment=dict(name="oracle"))
    check_output_is_free(out, cfg)
    check_output_is_free(out, {**cfg, "dataset": {**made, "cache_dir": "/b", "voices": "six"}})  # a key the file lacks
    with pytest.raises(ValueError, match=r"other data \(dataset.min_seconds=6.0 -> 3.0\): pass output=PATH"):
        check_output_is_free(out, {**cfg, "dataset": {**made, "min_seconds": 3.0}})
    with pytest.raises(ValueError, match=r"model tiny_random -> voxtral"):
        check_output_is_free(out, {**cfg, "model": dict(name="voxtral")})
    res = subprocess.run([sys.executable, "-m", "wnw_exp.cli.calibrate", f"calibration_root={tmp_path / 'cal'}",
                          "dataset.min_seconds=7.0", "dataset.max_seconds=8.0"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [f"wnw-calibrate: error: {out} holds head scores calibrated on other data "
                                       "(dataset.min_seconds=6.0 -> 7.0): pass output=PATH or calibration_root=DIR to "
                                       "keep both, or delete the file to replace it"]


def test_head_score_properties_by_hand(tmp_path):
    """`HeadScores.properties` on a 5-layer, 2-head file whose numbers are checked by hand: layers 2-4 (the upper
    60%) for the first-token share, every head for the sink count, the median for the 90%-mass positions."""
    first = [[0.0, 0.1], [0.2, 0.4], [0.5, 0.3], [0.6, 0.2], [0.1, 0.7]]
    a90 = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8], [0.9, 1.0]]
    vs = np.array([[0.01, 0.5], [0.02, 0.03], [0.3, 0.04], [0.05, 0.06], [0.07, 0.4]])
    hs = HeadScores(model="m", n_layers=5, n_q_heads=4, n_kv_heads=2, head_dim=8, token_rate=12.5, voice_score=vs,
                    head_sensitivity=np.zeros((5, 2)),
                    calibration=dict(n_samples=3, head_attention=dict(first_token=first, audio=a90,
                                                                      audio_positions_90=a90)))
    path = hs.save(tmp_path / "h.json")
    p = HeadScores.load(path).properties()
    assert p["first_token_layers"] == [2, 4]
    assert p["first_token"] == pytest.approx((0.5 + 0.3 + 0.6 + 0.2 + 0.1 + 0.7) / 6, abs=1e-4)
    assert p["sink_heads"] == 4 and p["n_kv_heads_total"] == 10  # 0.4, 0.5, 0.6, 0.7 (0.3 is not above it)
    assert p["audio_positions_90"] == pytest.approx(0.55)
    assert p["voice_score_top3"] == [0.5, 0.4, 0.3] and p["voice_score_median"] == pytest.approx(0.055)
    hs.calibration = dict(n_samples=3)
    with pytest.raises(HeadScoresError, match="head_attention"):
        hs.properties()
