"""Backbone adapters and the one loader the runner and calibration use."""

from __future__ import annotations

from pathlib import Path

import torch

from wnw_exp.backbones.base import Backbone, Prompt, WeightsNotFoundError, find_weights

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for but no CUDA GPU is visible; use device=cpu or device=auto")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


def set_cpu_threads(threads: int | None, device: torch.device) -> None:
    """On the CPU, run torch's kernels on `threads` threads (None: torch's default, one per core).

    The default configs use 1: the decode step of a small model is a chain of small kernels, and a
    thread pool that spins on a machine whose cores are busy with anything else slows it by 10-30x
    (measured on this project's 2-core machine: 1,227 against 42 ms/token)."""
    if threads is None or device.type != "cpu":
        return
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"cpu_threads={threads!r}: use a positive integer, or null for torch's default")
    torch.set_num_threads(threads)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def load_backbone(cfg: dict, device: torch.device, dtype: torch.dtype) -> Backbone:
    """Build the adapter for `cfg` (a `conf/model/*.yaml` as a dict) on `device` in `dtype`."""
    family = cfg["family"]
    try:
        backbone = _build(cfg, family)
    except (WeightsNotFoundError, ValueError):
        raise
    except Exception as e:  # a truncated or corrupt checkpoint: one message, not a deep traceback
        raise WeightsNotFoundError(f"could not load the weights of model {cfg['name']} "
                                   f"({type(e).__name__}: {str(e)[:200]}); re-download them or fix model.path") from e
    backbone.model.to(device=device, dtype=dtype)
    backbone.fused_layers()  # q|k|v and gate|up fused once, on the device, in the dtype the run computes in
    return backbone


def _build(cfg: dict, family: str) -> Backbone:
    if cfg.get("random"):
        from wnw_exp.backbones.tiny_random import build_tiny_random

        backbone = build_tiny_random(cfg)
    elif cfg.get("parts") == "whisper_smollm2" and not cfg.get("path"):
        from wnw_exp.backbones.whisper_smollm2 import build_whisper_smollm2

        backbone = build_whisper_smollm2(cfg)
    elif family == "voxtral":
        backbone = _load_voxtral(cfg)
    elif family == "qwen_omni":
        backbone = _load_qwen_omni(cfg)
    else:
        raise ValueError(f"unknown model family {family!r} (voxtral, qwen_omni)")
    return backbone


def _weights_dir(cfg: dict) -> Path:
    return find_weights(cfg.get("path"), cfg.get("repo_id"))


def _load_voxtral(cfg: dict) -> Backbone:
    from transformers import (AutoProcessor, PreTrainedTokenizerFast, VoxtralConfig,
                              VoxtralForConditionalGeneration, WhisperFeatureExtractor)

    from wnw_exp.backbones.voxtral import VoxtralBackbone

    folder = _weights_dir(cfg)
    _check_architecture(folder, VoxtralConfig.model_type)
    model = VoxtralForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    if (folder / "tokenizer.json").exists() and not (folder / "tekken.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        fe = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
        return VoxtralBackbone(model, cfg["name"], tokenizer=tokenizer, feature_extractor=fe)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    return VoxtralBackbone(model, cfg["name"], processor=processor, model_id=cfg.get("repo_id") or str(folder))


def _load_qwen_omni(cfg: dict) -> Backbone:
    from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

    from wnw_exp.backbones.qwen_omni import QwenOmniBackbone

    folder = _weights_dir(cfg)
    _check_architecture(folder, "qwen2_5_omni", "qwen2_5_omni_thinker")
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                       local_files_only=True)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    return QwenOmniBackbone(model, cfg["name"], processor=processor)


def _check_architecture(folder: Path, *model_types: str) -> None:
    import json

    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in model_types:
        raise ValueError(
            f"the weights in {folder} are a {model_type!r} model, not {' or '.join(model_types)}: "
            f"point model.path at a matching checkpoint or choose the model= that fits it")


__all__ = ["Backbone", "Prompt", "WeightsNotFoundError", "load_backbone", "resolve_device", "resolve_dtype"]
