"""Low-rank adapters (LoRA) on a Llama decoder's linear layers: trained as wrappers, shipped as A/B
matrices, merged into the frozen weights at load (W + (alpha / rank) B A), so inference runs the stock
modules and nothing downstream knows adapters exist."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """`base(x) + (alpha / rank) * B(A(x))` with `base` frozen; B starts at zero (the wrapper starts as `base`)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.rank, self.alpha = base, int(rank), float(alpha)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        base.weight.requires_grad_(False)

    @property
    def weight(self) -> torch.Tensor:  # the merged weight, for code that reads `.weight`
        return self.base.weight + self.delta().to(self.base.weight.dtype)

    def delta(self) -> torch.Tensor:
        return (self.alpha / self.rank) * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lora_A.to(x.dtype)
        return self.base(x) + (self.alpha / self.rank) * ((x @ a.t()) @ self.lora_B.to(x.dtype).t())


def _targets(decoder: nn.Module, targets: tuple[str, ...]):
    for li, layer in enumerate(decoder.layers):
        for name in targets:
            yield li, name, layer.self_attn if name in TARGETS else layer.mlp


def attach(decoder: nn.Module, rank: int, alpha: float,
           targets: tuple[str, ...] = TARGETS + MLP_TARGETS) -> list[nn.Parameter]:
    """Wrap `targets` of every layer of `decoder` (a LlamaModel) in LoRALinear; returns the new parameters."""
    params = []
    for _, name, parent in _targets(decoder, targets):
        wrapped = LoRALinear(getattr(parent, name), rank, alpha)
        setattr(parent, name, wrapped)
        params += [wrapped.lora_A, wrapped.lora_B]
    return params


def state(decoder: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(A/B tensors keyed `layers.{i}.{name}.lora_A|B` in float32, metadata with rank and alpha) of an attached
    decoder."""
    tensors, meta = {}, {}
    for li, layer in enumerate(decoder.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in parent.named_children():
                if isinstance(mod, LoRALinear):
                    tensors[f"layers.{li}.{name}.lora_A"] = mod.lora_A.detach().float().cpu().contiguous()
                    tensors[f"layers.{li}.{name}.lora_B"] = mod.lora_B.detach().float().cpu().contiguous()
                    meta = dict(rank=str(mod.rank), alpha=str(mod.alpha))
    return tensors, meta


def merge(decoder: nn.Module) -> None:
    """Replace every LoRALinear of `decoder` by its base layer with the adapter merged in."""
    for li, layer in enumerate(decoder.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, LoRALinear):
                    with torch.no_grad():
                        mod.base.weight += mod.delta().to(mod.base.weight.dtype)
                    setattr(parent, name, mod.base)


def load(decoder: nn.Module, path: str | Path) -> None:
    """Merge the adapters saved at `path` (safetensors written from `state`) into `decoder`'s weights."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        scale = float(meta["alpha"]) / float(meta["rank"])
        keys = set(f.keys())
        for key in sorted(k for k in keys if k.endswith(".lora_A")):
            stem = key[: -len(".lora_A")]
            _, li, name = stem.split(".")
            parent = decoder.layers[int(li)].self_attn if name in TARGETS else decoder.layers[int(li)].mlp
            lin = getattr(parent, name)
            with torch.no_grad():
                delta = f.get_tensor(stem + ".lora_B").float() @ f.get_tensor(key).float()
                lin.weight += (scale * delta).to(lin.weight.dtype)
