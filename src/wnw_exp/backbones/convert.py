"""Converters from the formats pretrained parts ship in on the package registry to transformers state dicts.

- CTranslate2 (`model.bin`, the format faster-whisper uses): `read_ctranslate2` parses the file,
  `whisper_encoder_state_dict` maps a Whisper encoder's variables to the names of transformers'
  Whisper / Voxtral audio encoder (the two share them).
- GGUF (llama.cpp): transformers reads and dequantises it itself (`from_pretrained(dir, gguf_file=...)`,
  needs the `gguf` package); `gguf_llama` wraps that and returns a plain fp32 model and its tokenizer.

The CTranslate2 file layout (version 6, what `ctranslate2.converters` writes): uint32 version, a
length-prefixed spec name, uint32 revision, uint32 variable count, then per variable: uint16 name length
(with its NUL), the name, uint8 rank, rank x uint32 dims, uint8 dtype, uint32 byte count, the data; then
uint32 alias count and (alias, target) name pairs (identical variables are stored once). Attention projections are fused: `linear_0` of a
self-attention block is q|k|v stacked on the output dimension (Whisper's k projection has no bias, so
the middle third of the fused bias is zero).
"""

from __future__ import annotations

import functools

import re
import struct
from pathlib import Path

import numpy as np
import torch

# CTranslate2's DataType enum (include/ctranslate2/types.h).
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: None}  # 5 = bfloat16


class ConversionError(ValueError):
    """A pretrained file is not what the converter expects (wrong format, version or model)."""


def read_ctranslate2(path: str | Path, prefix: str = "") -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) of a CTranslate2 model file, for the names starting with `prefix`.

    The file is indexed first (names, shapes, offsets), then only the wanted variables are read; an alias
    (CTranslate2 stores identical variables once and names the others as aliases) gets its target's array."""
    path = Path(path)
    index: dict[str, tuple[tuple[int, ...], int, int, int]] = {}  # name -> (dims, dtype, offset, nbytes)
    with open(path, "rb") as f:
        def take(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ConversionError(f"{path} ends early: not a complete CTranslate2 model file (truncated?)")
            return struct.unpack("<" + fmt, data)

        def name() -> str:
            (n,) = take("H")
            raw = f.read(n)
            if len(raw) != n:
                raise ConversionError(f"{path} ends early: not a complete CTranslate2 model file (truncated?)")
            return raw.rstrip(b"\0").decode()

        (version,) = take("I")
        if version != 6:
            raise ConversionError(f"{path}: CTranslate2 model version {version}, this reader knows version 6")
        spec = name()
        take("I")  # spec revision
        (count,) = take("I")
        for _ in range(count):
            var = name()
            (rank,) = take("B")
            dims = take("I" * rank) if rank else ()
            dtype, nbytes = take("B")[0], take("I")[0]
            index[var] = (dims, dtype, f.tell(), nbytes)
            f.seek(nbytes, 1)
        aliases = {}
        if f.read(1):  # an alias section follows
            f.seek(-1, 1)
            (n_alias,) = take("I")
            for _ in range(n_alias):
                alias = name()
                aliases[alias] = name()
        if f.tell() > path.stat().st_size:
            raise ConversionError(f"{path} ends inside its data: the file is truncated")
        out: dict[str, np.ndarray] = {}
        for var in [v for v in list(index) + list(aliases) if v.startswith(prefix)]:
            target = aliases.get(var, var)
            if target not in index:
                raise ConversionError(f"{path}: alias {var} points to {target}, which is not in the file")
            dims, dtype, offset, nbytes = index[target]
            np_dtype = _CT2_DTYPES.get(dtype)
            if np_dtype is None:
                raise ConversionError(f"{path}: variable {target} has CTranslate2 dtype {dtype}, not supported here")
            f.seek(offset)
            data = f.read(nbytes)
            if len(data) != nbytes:
                raise ConversionError(f"{path} ends inside variable {target}: the file is truncated")
            out[var] = np.frombuffer(data, dtype=np_dtype).reshape(dims).copy()
    return spec, out


def whisper_encoder_state_dict(variables: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """transformers Whisper/Voxtral encoder weights (conv1, conv2, embed_positions, layers.i.*, layer_norm)
    from a CTranslate2 WhisperSpec's `encoder/...` variables, in the dtype they are stored in."""
    def t(name: str) -> torch.Tensor:
        if name not in variables:
            raise ConversionError(f"the CTranslate2 Whisper model has no variable {name!r}")
        return torch.from_numpy(variables[name])

    sd = {
        "conv1.weight": t("encoder/conv1/weight"), "conv1.bias": t("encoder/conv1/bias"),
        "conv2.weight": t("encoder/conv2/weight"), "conv2.bias": t("encoder/conv2/bias"),
        "embed_positions.weight": t("encoder/position_encodings/encodings"),
        "layer_norm.weight": t("encoder/layer_norm/gamma"), "layer_norm.bias": t("encoder/layer_norm/beta"),
    }
    layer_ids = {k.split("/")[1] for k in variables if re.match(r"encoder/layer_\d+/", k)}
    n_layers = 1 + max(int(name.split("_")[1]) for name in layer_ids)
    for i in range(n_layers):
        src, dst = f"encoder/layer_{i}", f"layers.{i}"
        qkv_w, qkv_b = t(f"{src}/self_attention/linear_0/weight"), t(f"{src}/self_attention/linear_0/bias")
        q_w, k_w, v_w = qkv_w.chunk(3, dim=0)
        q_b, k_b, v_b = qkv_b.chunk(3, dim=0)
        if k_b.abs().max() != 0:
            raise ConversionError(f"{src}: the fused key bias is not zero; Whisper's k projection has no bias")
        sd.update({
            f"{dst}.self_attn.q_proj.weight": q_w, f"{dst}.self_attn.q_proj.bias": q_b,
            f"{dst}.self_attn.k_proj.weight": k_w,
            f"{dst}.self_attn.v_proj.weight": v_w, f"{dst}.self_attn.v_proj.bias": v_b,
            f"{dst}.self_attn.out_proj.weight": t(f"{src}/self_attention/linear_1/weight"),
            f"{dst}.self_attn.out_proj.bias": t(f"{src}/self_attention/linear_1/bias"),
            f"{dst}.self_attn_layer_norm.weight": t(f"{src}/self_attention/layer_norm/gamma"),
            f"{dst}.self_attn_layer_norm.bias": t(f"{src}/self_attention/layer_norm/beta"),
            f"{dst}.fc1.weight": t(f"{src}/ffn/linear_0/weight"), f"{dst}.fc1.bias": t(f"{src}/ffn/linear_0/bias"),
            f"{dst}.fc2.weight": t(f"{src}/ffn/linear_1/weight"), f"{dst}.fc2.bias": t(f"{src}/ffn/linear_1/bias"),
            f"{dst}.final_layer_norm.weight": t(f"{src}/ffn/layer_norm/gamma"),
            f"{dst}.final_layer_norm.bias": t(f"{src}/ffn/layer_norm/beta"),
        })
    return {k: v.contiguous() for k, v in sd.items()}


def gguf_llama(folder: str | Path, gguf_file: str):
    """(LlamaForCausalLM in fp32, its tokenizer) dequantised from a GGUF file by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the per-tensor progress bars of a one-time conversion
    hf_logging.disable_progress_bar()
    bar = gguf_utils.tqdm  # its "Converting and de-quantizing" bar is a plain tqdm that ignores the switch above
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    finally:
        gguf_utils.tqdm = bar
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model, tokenizer
