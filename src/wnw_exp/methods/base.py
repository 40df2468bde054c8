"""The policy interface: a method decides, the store executes.

At prefill a method returns its decision as data: `place` gives each layer's `Placement` (which audio positions
each KV head keeps on the device, which get a host copy) and the engine sets the store's tiers from it.

The engine calls these hooks at fixed points with plain tensors; a method overrides only the hooks it
needs. The base class does nothing (everything stays on the device): `FullCache`, the reference, is it under its
own name. A method's class attributes say what the CLI and the report need without building it: `uses_retention`,
and how the report shows it (`label`, `color`, `marker`, `role`, `variants`).

Prefill hooks (`start`, `prefill_transform`, `place`, `after_prefill`) run once per sample and may do anything.
The decode hooks (`before_attention`, `observe`, `after_step`) run every step, and a method whose decode hooks are
graph-safe (`graph_safe = True`) lets the engine capture them, with the step, in one CUDA graph: on a store that
queues its moves (`store.queues_moves`, the packed GPU store) they then

- observe inside the graph: accumulate what they watch into their own device tensors, in place;
- decide on tensors: scores, top-k and any state machine as device tensors updated in place (no `.item()`,
  `.cpu()`, `.tolist()`, Python branches on tensor values, or per-step Python state: a captured hook runs once,
  at capture, and its recorded kernels every step after; `after_step` gets `step=None` there);
- queue moves without a host sync: `store.recall` / `store.release` with fixed-shape (rows, positions, select)
  tensors. Moves queued in `after_step` are applied by the engine before the next step (`store.flush`); a method
  that moves before a layer's attention flushes that layer itself (`store.flush(layer)`).
On the reference store (the CPU) the same hooks run eagerly and may use the host; that path is the specification
the device path is tested against, step by step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from wnw_exp.head_scores import HeadScores
from wnw_exp.kv.base import KVStore


@dataclass
class SampleContext:
    """What a method may know about the sample being decoded (set by the engine before prefill)."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    token_rate: float  # audio tokens per second
    n_audio: int  # audio tokens in the prompt
    retention: float  # target r_GPU
    device: torch.device

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads


@dataclass
class PrefillScores:
    """Computed once by the engine per layer, for every method.

    `post_audio`: (H_q, n_post, n_audio_layer) softmax weights from each prompt token after the audio
    (the "text" of §2.3) to the layer's audio positions.
    `last_window`: (H_q, min(32, T), n_audio_layer) the same from the last 32 prompt rows, audio rows
    included (SnapKV's observation window when few text tokens follow the audio).
    `audio_keys`: (H_kv, n_audio_layer, D) the layer's audio keys after RoPE (ArkVale's page digests).
    """

    post_audio: torch.Tensor
    last_window: torch.Tensor | None = None
    audio_keys: torch.Tensor | None = None


@dataclass
class Placement:
    """One layer's tiers, decided at prefill: for its KV heads (store rows layer * n_kv_heads + head), `gpu`
    (n_kv_heads, n_audio) bool, the positions kept on the device; `cpu` (same shape) bool or None, the positions
    given a host copy (a position in both is resident and recallable after a release); every other position is
    dropped; `select` (n_kv_heads,) bool or None: only these heads are set, the others keep everything."""

    gpu: torch.Tensor
    cpu: torch.Tensor | None = None
    select: torch.Tensor | None = None

    def apply(self, store: KVStore, layer: int) -> None:
        """Set the tiers of `layer`'s heads in `store` (`KVStore.set_tiers_block`)."""
        store.set_tiers_block(layer * self.gpu.shape[0], self.gpu, self.cpu, self.select)


def apply_placements(store: KVStore, placements: list[tuple[int, Placement]]) -> None:
    """Several layers' placements ((layer, Placement), in layer order) in the store: each run of consecutive layers of
    the same shape in one `set_tiers_block` call (consecutive layers' rows are consecutive and each row is set on its
    own, so one call sets what one call per layer would; a layer without `cpu` gets none, one without `select` every
    head), a few launches for every layer at once instead of a few per layer."""
    i = 0
    while i < len(placements):
        j = i + 1
        while (j < len(placements) and placements[j][0] == placements[j - 1][0] + 1
               and placements[j][1].gpu.shape == placements[i][1].gpu.shape):
            j += 1
        run = placements[i:j]
        i = j
        if len(run) == 1:
            layer, p = run[0]
            p.apply(store, layer)
            continue
        (layer0, first), dev = run[0], run[0][1].gpu.device
        H = first.gpu.shape[0]
        gpu = torch.cat([p.gpu.to(dev, torch.bool) for _, p in run])
        cpu = None if all(p.cpu is None for _, p in run) else torch.cat(
            [p.cpu.to(dev, torch.bool) if p.cpu is not None else torch.zeros_like(p.gpu, dtype=torch.bool, device=dev)
             for _, p in run])
        select = None if all(p.select is None for _, p in run) else torch.cat(
            [p.select.to(dev, torch.bool) if p.select is not None else torch.ones(H, dtype=torch.bool, device=dev)
             for _, p in run])
        store.set_tiers_block(layer0 * H, gpu, cpu, select)


class Policy:
    """The protocol, and its default: keeps every audio position on the device and never moves anything."""

    name = "full"
    uses_retention = True  # False: the method keeps every audio position, a run's `retention` means nothing to it
    # How the report shows the method. None: the class name and a free colour and marker. role: reference | method
    # | ours | bound (report.methods.ROLES). variants: one curve each, (label, ((knob, value), ...), line style).
    label: str | None = None
    color: str | None = None
    marker: str | None = None
    role = "method"
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...], str], ...] = ()
    packed_store = True  # False: the method needs the reference store (it merges tokens, or moves anything anytime)
    recall_headroom = 0  # audio rows a head may gain between two decode steps (recalling methods)
    graph_safe = True  # on a queuing store its decode hooks only launch device work: they may be captured
    cpu_tier = False  # True: it keeps recallable audio KV on the host (the store then keeps a pinned host mirror)

    @classmethod
    def calibrate(cls, scores: HeadScores, prompts: list[tuple[Any, float]], decode: Callable[..., Any],
                  backbone_info: dict, progress: bool = False) -> dict:
        """What the method measures on the calibration set once the head scores are known (`wnw-calibrate`), for
        head_scores.json's `calibration` block under the returned keys; WnW: its swap mobility. `prompts`: the
        calibration samples' (prompt, audio seconds); `decode(policy, prompt, retention, seconds)` decodes one
        greedily with the engine and returns its `GenerationResult` (trace, store_summary). Default: nothing."""
        return {}

    def host_mirror(self, ctx: SampleContext) -> bool | Any:
        """Which rows (layer * n_kv_heads + KV head) of the sample may ever be put on the host tier: the packed store
        keeps a pinned host copy of those only. Default: all of them when the method has a CPU tier, else none (a
        bool, or an array of row indices)."""
        return self.cpu_tier

    def fork(self) -> "Policy":
        """A policy for one more sample decoded at the same time as this one's (a batch): the same knobs and caches,
        its own per-sample state (`start` sets that state up; a copy made before it shares nothing mutable)."""
        return copy.deepcopy(self)

    def check(self, retention: float) -> None:
        """Refuse a configuration that cannot work, once before any sample (raise ValueError)."""

    def start(self, ctx: SampleContext, store: KVStore) -> None:
        """Called once per sample before prefill."""
        self.ctx, self.store = ctx, store

    def observe_heads(self, layer: int) -> list[int]:
        """Query heads of `layer` whose softmax weights at audio positions `observe` wants each step."""
        return []

    def prefill_transform(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
                          audio_span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Before layer `layer` at prefill: may merge audio tokens (AffPool). Returns (hidden, positions, span)."""
        return hidden, positions, audio_span

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        """After prefill attention of `layer`: each KV head's GPU / CPU / dropped audio positions (None: all stay on
        the device). The engine applies it (`Placement.apply`); a method does not set the store's tiers itself."""
        return None

    def place_all(self, scored: list[tuple[int, PrefillScores]]) -> list[tuple[int, Placement]]:
        """`place` of several layers ((layer, scores) in layer order: the engine's deferred placement, once the
        forward pass has run), the layers with a placement in order. A method may decide them together (fewer
        launches), making the decisions `place` makes layer by layer."""
        return [(li, p) for li, scores in scored if (p := self.place(li, scores)) is not None]

    def before_attention(self, layer: int, q: torch.Tensor) -> None:
        """At decode, before attention of `layer`, with the step's query (H_q, D) after RoPE. Moves queued here
        must be flushed here (`store.flush(layer)`) to be in force for this layer's attention."""

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        """At decode, after attention of `layer`: (len(observe_heads(layer)), n_audio) softmax weights."""

    def observe_sum(self, layer: int) -> torch.Tensor | None:
        """Instead of `observe`, for a method that only sums its observer heads' weights: a (n_audio,) float32
        tensor to which the fused steps add, after attention of `layer`, the sum over `observe_heads(layer)` of
        their softmax weights at each audio position (with Triton kernels in one launch, no weights buffer).
        None (the default): `observe` gets the weights."""
        return None

    def after_prefill(self) -> None:
        """After every layer's `place` (and the store's compaction): decisions in force at decode step 0."""

    def after_step(self, step: int | None) -> None:
        """After all layers of decode step `step` (None inside a captured graph; -1 from `after_prefill`):
        decisions for the next step."""

    @classmethod
    def after_step_all(cls, policies: list["Policy"], steps: list, held: dict) -> None:
        """`after_step(steps[i])` of several policies of this class (a batch's streams, each with its own state and
        store); `held`: the caller's dict for what a method keeps between calls for this set of policies (its
        batched kernels' tables). The default calls each one's `after_step`."""
        for p, i in zip(policies, steps):
            p.after_step(i)

    @classmethod
    def graph_reusable(cls, policies: list["Policy"]) -> bool:
        """Whether a CUDA graph captured over a batched step of these policies (all of this class) may replay for
        another set of streams: every launch of their decode-time hooks must find each stream's tensors through
        tables that `prepare_step_all` rewrites in place when `held` has a "capacity" (the number of streams the
        tables seat). By default, only where the method does nothing after a step."""
        return cls.after_step is Policy.after_step and cls.after_step_all.__func__ is Policy.after_step_all.__func__

    @classmethod
    def prepare_step_all(cls, policies: list["Policy"], held: dict) -> None:
        """Build in `held` whatever `after_step_all(policies, ..., held)` would build at its first call (its batched
        kernels' tables), without deciding anything: what a CUDA graph captured at a batch's first step needs made
        before the capture. Nothing by default."""

    def read_records(self):
        """After decoding: start reading from the device what `trace` records there, without waiting for it
        (`kv.base.HostRead`; None: a method that records nothing on the device)."""
        return None

    def trace(self, read=None) -> dict:
        """Per-sample records for run_dir/trace/<id>.json (figures, analyses); JSON-serialisable. `read`: from
        `read_records`, called earlier."""
        return {}

    def knobs(self) -> dict:
        """Method-specific numbers worth recording with each sample (e.g. the solved λ)."""
        return {}


class FullCache(Policy):
    """Full Cache, the reference: every audio position stays on the device (the quality upper bound)."""

    name = "full"
    uses_retention = False
    label, color, marker, role = "Full Cache", "black", "", "reference"

    def __init__(self, backbone_info: dict | None = None):
        """Full Cache has no knobs; `backbone_info` is taken as every method's constructor takes it."""
