"""Decode speed at the text-decoder shapes of Voxtral-Mini-3B and Qwen2.5-Omni-3B (random bf16 weights, GPU):
transformers' generate() as the anchor, the engine as written (engine/decode.py), and the fast path:
PackedAudioKVStore + the Triton ragged decode kernel + the fused decode step (engine/fused.py: one q|k|v
GEMM, one gate|up GEMM, fused add+RMSNorm, RoPE+KV-append and SiLU*mul kernels), the whole step captured
in one CUDA graph, with the REAL policies of src/wnw_exp/methods/ (full, adakv, arkvale, wnw).

    PYTHONPATH=src python3 benchmarks/decode_speed.py --out $OUT/decode_speed.json
    python3 benchmarks/decode_speed.py --smoke [--out x.json]   # every row at tiny dims on the CPU, < 1 min

Reported per row: median ms/token over forced greedy steps (no EOS; CUDA events, one per step, so host work
between two replays counts), the mean wall time, the host time per step of the store's flush and of the
policy's decision + issuing its copies (`host_flush_ms`, `host_decide_ms`: median; `_mean`: mean), H2D
MB/step, r_GPU and r_GPU+CPU (§3.4, mean over steps), peak GPU memory (torch.cuda.max_memory_allocated),
and the GPU bytes held by the audio KV: the storage of the packed audio K/V/position buffers
(`audio_kv_bytes`) and what the CUDA caching allocator frees when they are dropped after the run
(`audio_kv_alloc_bytes`).

How each policy runs on the graph (per step: flush queued moves -> replay -> one device-to-host copy of the
policy's per-step signal -> one host wait -> the policy's own host decision -> recalls issued on the side
stream, overlapping the next step):
- full, adakv: placement at prefill only (`place`); nothing per step.
- wnw: the kernel writes the anchor query heads' softmax weights at audio positions into static buffers and
  the policy's own `observe` (inside the graph) sums them into its accumulator A; at the end of the graph A is
  snapshotted and zeroed. On the host, the snapshot goes through the scripted anchor attention (below) and
  the policy's own `after_step` (ChunkSwap, recall/release of the tidal heads' segments). `_move` issues one
  vectorised store call for all the segments a step recalls, one for those it releases (`recall_rows` /
  `release_rows`). Decisions after step s apply at s+1, as in §2.3 (`lag 1`); `_pipelined` rows decide
  from step s while step s+1 runs and apply at s+2 (`lag 2`).
- arkvale: inside the graph each layer's page scores (the policy's own `page_scores` on its key digests and
  the step's query) go into a (L, H_kv, n_pages) buffer; on the host the policy's own `select_pages_all`
  (its per-head `select_pages` rule, vectorised over every layer and head) swaps pages. This is one step
  late against ArkVale proper, which recalls before the layer's attention (a host sync per layer, which a
  graph cannot hold).
Scripted anchor attention (WnW only; random weights have no audio grounding to follow): after each step,
the anchors' accumulated weights A (n_audio,) are replaced by (1 - beta) * A + beta * M * g_s, where M is the
number of anchor query heads (so both parts have the mass of M softmax rows), beta = 0.9, and g_s a Gaussian
over audio positions (sum 1, sigma = half a chunk) centred at (12 * s) mod n_audio: the focus moves 12 audio
tokens (~1 s of audio) per generated token, about 3x a transcript's pace, so the top-3 chunks change every
few steps and the tidal heads recall and release segments throughout (`--anchor-speed`, `--anchor-beta`).
The g_s of a run's steps are computed before its timed loop (they stand in for device-side attention).
The head scores come from a synthetic head_scores.json written by `synthetic_head_scores` (seeded random VS
~ Beta(2, 20) and HS ~ LogNormal(-11, 1) per KV head; the file format of wnw_exp/head_scores.py),
loaded by the policy through `method.head_scores` as a calibrated file would be.

Imports only torch, numpy, transformers, triton and wnw_exp modules that need none of hydra, omegaconf,
soxr, soundfile, espeak or jiwer (tests/test_fused_decode.py runs --smoke with those made unimportable).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = {
    "voxtral": dict(arch="llama", vocab_size=131072, hidden_size=3072, intermediate_size=8192, num_hidden_layers=30,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e8),
    "qwen_omni": dict(arch="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                      num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                      rope_theta=1e6),
    # --smoke: every row on the CPU (4 x 4 = 16 KV heads, so one anchor fits a 0.2 budget)
    "tiny": dict(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=1e4),
    "tiny_qwen": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=1e4),
}
PRE, POST = 20, 30  # text tokens before and after the audio (a 3,000-token audio gives a 3,050-token prefix)
TOKEN_RATE = 12.5  # audio tokens per second (Voxtral, Qwen2.5-Omni)

DEV = "cuda"


def _cuda() -> bool:
    return DEV == "cuda"


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if _cuda() else float("nan")


def _reset_peak() -> None:
    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if _cuda() else 0


def build_model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s = dict(SHAPES[name])
    arch = s.pop("arch")
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(**s, max_position_embeddings=32768, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = model_cls(cfg).to(torch.bfloat16 if _cuda() else torch.float32).eval()
    if not _cuda():  # random init at tiny dims gives near-uniform logits: scale up so tokens are not all ties
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompt(n_audio: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, vocab - 100, (1, PRE + n_audio + POST), generator=g)
    return ids.to(DEV), (PRE, PRE + n_audio)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- transformers generate() -------------------------------------------------------------------------
@torch.no_grad()
def hf_generate(model, ids, steps: int) -> dict:
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:, :64], max_new_tokens=4, min_new_tokens=4, **kw)  # warm

    def timed(n):
        _sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t0

    _reset_peak()
    t1 = min(timed(1), timed(1))
    tn = timed(steps + 1)
    return dict(ms_per_token=(tn - t1) / steps * 1e3, peak_gb=_peak_gb(), steps=steps,
                note="(time(generate 1+steps) - time(generate 1)) / steps: a mean, not a median")


# --- the engine as written ----------------------------------------------------------------------------
def engine_as_written(model, ids, span, steps: int) -> dict:
    from wnw_exp.backbones.base import Backbone, Prompt
    from wnw_exp.engine.decode import generate
    from wnw_exp.methods.base import Policy

    bb = _backbone(model, Backbone)
    prompt = Prompt(ids, span)
    _reset_peak()
    res = generate(bb, prompt, Policy(), retention=1.0, max_new_tokens=steps)
    return dict(ms_per_token=res.ms_per_token, n_steps=len(res.step_ms), prefill_ms=res.prefill_ms,
                peak_gb=_peak_gb(), audio_kv_bytes=res.store_summary["audio_bytes_on_device"])


def _backbone(model, base):
    cfg = model.config

    class RandomBackbone(base):
        def embed_prompt(self, prompt):
            return self.embed_tokens(prompt.input_ids)

        def prompt_positions(self, prompt):
            return torch.arange(prompt.input_ids.shape[1], device=DEV)[None]

        def next_positions(self, prompt_positions, n_done, n_new=1):
            return torch.arange(n_new, device=DEV)[None] + prompt_positions.shape[-1] + n_done

    bb = RandomBackbone()
    bb.name, bb.model = "random", model
    bb.layers, bb.final_norm, bb.lm_head = model.model.layers, model.model.norm, model.lm_head
    bb.embed_tokens, bb.rotary = model.model.embed_tokens, model.model.rotary_emb
    bb.n_layers, bb.n_q_heads, bb.n_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    bb.head_dim, bb.token_rate, bb.eos_token_ids, bb.max_positions = cfg.head_dim, TOKEN_RATE, [], 32768
    return bb


# --- policies -------------------------------------------------------------------------------------------
def backbone_info(name: str, cfg) -> dict:
    return dict(name=f"{name}_random_weights", n_layers=cfg.num_hidden_layers, n_q_heads=cfg.num_attention_heads,
                n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, token_rate=TOKEN_RATE)


def synthetic_head_scores(info: dict, path: Path, seed: int = 0) -> Path:
    """A head_scores.json for a random-weight model: seeded VS ~ Beta(2, 20), HS ~ LogNormal(-11, 1) per KV head."""
    from wnw_exp.head_scores import HeadScores

    rng = np.random.default_rng(seed)
    shape = (info["n_layers"], info["n_kv_heads"])
    HeadScores(model=info["name"], n_layers=info["n_layers"], n_q_heads=info["n_q_heads"],
               n_kv_heads=info["n_kv_heads"], head_dim=info["head_dim"], token_rate=info["token_rate"],
               voice_score=rng.beta(2, 20, shape), head_sensitivity=rng.lognormal(-11, 1, shape),
               calibration=dict(synthetic="benchmarks/decode_speed.py: seeded random VS ~ Beta(2, 20) and "
                                          "HS ~ LogNormal(-11, 1); not measured", seed=seed)).save(path)
    return path


def make_policy(method: str, info: dict, head_scores: Path | None = None, **kw):
    from wnw_exp.methods import build_policy

    cfg = dict(name=method, **kw)
    if method == "wnw":
        cfg["head_scores"] = str(head_scores)
    return build_policy(cfg, info)


class ScriptedAnchor:
    """A <- (1 - beta) A + beta * M * g_s (see the module docstring)."""

    def __init__(self, n_audio: int, width: float, speed: float, beta: float):
        self.n_audio, self.sigma, self.speed, self.beta = n_audio, max(width / 2, 1.0), speed, beta
        self.mass = 1.0  # M: set to the number of anchor query heads by WnWOnGraph
        self.x = torch.arange(n_audio, dtype=torch.float32)
        self._bumps: list[torch.Tensor] = []  # g_s of steps 0, 1, ... computed ahead by `prepare`

    def bump(self, step: int) -> torch.Tensor:
        c = (self.speed * step) % self.n_audio
        g = torch.exp(-0.5 * ((self.x - c) / self.sigma) ** 2)
        return g / g.sum()

    def prepare(self, steps: int) -> None:
        """Compute the bumps of steps [0, steps) ahead, outside the timed loop: the script stands in for
        attention the model computes on the device, so its own host cost is no part of the policy's."""
        self._bumps = [self.bump(s) for s in range(steps)]

    def apply(self, a: torch.Tensor, step: int) -> None:
        g = self._bumps[step] if step < len(self._bumps) else self.bump(step)
        a.mul_(1 - self.beta).add_(g.to(a.device), alpha=self.beta * self.mass)


class OnGraph:
    """How a policy's per-step work runs around the captured step: `setup` hooks device work into the step,
    `end_of_step` adds device work at the end of the graph, `snap` is the device tensor copied to the host
    after each step, `decide(step, host)` the policy's host decision."""

    snap: torch.Tensor | None = None

    def setup(self, fstep) -> None:
        pass

    def end_of_step(self) -> None:
        pass

    def decide(self, step: int, host: torch.Tensor) -> None:
        pass


class WnWOnGraph(OnGraph):
    def __init__(self, policy, store, script: ScriptedAnchor | None):
        self.policy, self.store, self.script = policy, store, script
        self.acc = policy.scores_acc  # the policy's own device accumulator (its `observe` adds into it)
        self.snap = torch.zeros_like(self.acc)

    def setup(self, fstep) -> None:
        for li in range(fstep.store.n_layers):
            heads = self.policy.observe_heads(li)
            if heads:
                fstep.observe[li] = (torch.tensor(heads, dtype=torch.int32, device=self.acc.device),
                                     torch.zeros(len(heads), self.store.n_audio, device=self.acc.device))
        fstep.on_probs = self.policy.observe
        if self.script is not None:
            self.script.mass = float(sum(len(o) for o, _ in fstep.observe.values()))

    def end_of_step(self) -> None:
        self.snap.copy_(self.acc)
        self.acc.zero_()

    def decide(self, step: int, host: torch.Tensor) -> None:
        if self.script is not None:
            self.script.apply(host, step)
        self.policy.scores_acc = host  # after_step reads A^(s) from the host copy (and zeroes it)
        try:
            self.policy.after_step(step)
        finally:
            self.policy.scores_acc = self.acc


class ArkValeOnGraph(OnGraph):
    def __init__(self, policy, store):
        self.policy, self.ctx = policy, policy.ctx
        n_pages = len(policy.bounds) - 1
        self.snap = torch.zeros(store.n_layers, store.n_kv_heads, n_pages, device=store.device)

    def setup(self, fstep) -> None:
        from wnw_exp.methods.arkvale import page_scores

        def score(li: int, q: torch.Tensor) -> None:
            if li in self.policy.digests:
                hi, lo = self.policy.digests[li]
                self.snap[li].copy_(page_scores(q.view(self.ctx.n_kv_heads, self.ctx.group, -1), hi, lo))
        fstep.on_layer = score

    def decide(self, step: int, host: torch.Tensor) -> None:
        self.policy.select_pages_all(host)  # = select_pages per layer, vectorised over every (layer, head)


# --- the fast path --------------------------------------------------------------------------------------
class FastDecoder:
    """Prefill with the HF modules into a PackedAudioKVStore (the policy places the audio), then decode with
    the fused step (`fused=True`) or the HF modules layer by layer (`fused=False`, full cache only: the
    numerics reference and the unfused timing), eagerly or replaying one CUDA graph per step."""

    def __init__(self, model, ids, span, max_new: int, policy=None, retention: float = 1.0, fused: bool = True,
                 impl: str = "triton", script: ScriptedAnchor | None = None):
        from wnw_exp.engine.decode import apply_rope, prefill_scores, project_qkv
        from wnw_exp.engine.fused import FusedDecoderStep, _ops
        from wnw_exp.kv.packed import PackedAudioKVStore
        from wnw_exp.methods.base import SampleContext

        self.model, cfg = model, model.config
        self._qkv, self._rope = project_qkv, apply_rope
        L, Hq, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.dims = (Hq, H, D)
        n_audio = span[1] - span[0]
        self.store = PackedAudioKVStore(L, H, D, n_audio, torch.device(DEV), model.dtype, max_new + 8)
        self.policy = policy
        if policy is not None:
            if hasattr(policy, "check"):
                policy.check(retention)
            policy.start(SampleContext(L, Hq, H, D, TOKEN_RATE, n_audio, retention, torch.device(DEV)), self.store)
        m = model.model
        T = ids.shape[1]
        with torch.no_grad():
            pos = torch.arange(T, device=DEV)[None]
            hidden = m.embed_tokens(ids)
            cos, sin = m.rotary_emb(hidden, pos)
            for li, layer in enumerate(m.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(hidden)
                q, k, v = project_qkv(layer, x, Hq, H, D)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
                self.store.write_prefill(li, k[0], v[0], span)
                if policy is not None:
                    policy.place(li, prefill_scores(q[0], k[0], span, attn.scaling))
                hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logits = model.lm_head(m.norm(hidden[:, -1:]))
        self.store.compact(headroom=policy.recall_headroom if policy is not None else 0)
        self.first_token = int(logits.argmax())
        self.on_graph: OnGraph | None = None
        if policy is not None and policy.name == "wnw":
            self.on_graph = WnWOnGraph(policy, self.store, script)
        elif policy is not None and policy.name == "arkvale":
            self.on_graph = ArkValeOnGraph(policy, self.store)
        elif policy is not None and policy.name not in ("full", "adakv"):
            raise ValueError(f"no GPU-path adapter for method {policy.name!r}")
        self.fstep = None
        if fused:
            self.fstep = FusedDecoderStep(model, self.store, T + max_new + 16, impl)
            self.fstep.tok.fill_(self.first_token)
            self.fstep.pos.fill_(T)
            if self.on_graph is not None:
                self.on_graph.setup(self.fstep)
        elif self.on_graph is not None:
            raise ValueError("the unfused step runs the full cache only")
        self._attn_fn = _ops(impl)[3]
        self._dlen_plus = torch.zeros(1, device=DEV, dtype=torch.long)
        self.tok = torch.full((1, 1), self.first_token, device=DEV, dtype=torch.long)
        self.pos = torch.full((1, 1), T, device=DEV, dtype=torch.long)
        self.tokens: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token, logits) per step, when kept
        self.graph = None
        _sync()
        gc.collect()
        if _cuda():
            torch.cuda.empty_cache()

    @torch.no_grad()
    def step(self) -> None:
        if self.fstep is not None:
            self.fstep.step()
            if self.on_graph is not None:
                self.on_graph.end_of_step()
            return
        m, (Hq, H, D) = self.model.model, self.dims
        hidden = m.embed_tokens(self.tok)
        cos, sin = m.rotary_emb(hidden, self.pos)
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._qkv(layer, x, Hq, H, D)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.store.append_dense(li, k[0, :, 0], v[0, :, 0])
            out = self._attention(li, q[0, :, 0], attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.logits = logits = self.model.lm_head(m.norm(hidden))
        self.tok.copy_(logits.argmax(-1).view(1, 1))
        self.pos += 1
        self.store.dense_len += 1

    def _attention(self, li: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        s = self.store
        torch.add(s.dense_len, 1, out=self._dlen_plus)
        return self._attn_fn(q, s.dense_k[li], s.dense_v[li], self._dlen_plus, s.audio_k, s.audio_v, s.offsets(li),
                             s.audio_len[li], scale, max_audio_per_head=int(s.caps.max()), scratch=s._scratch[li])

    def current_token(self) -> torch.Tensor:
        return self.fstep.tok if self.fstep is not None else self.tok

    def capture(self) -> None:
        """Two warm-up steps on a side stream (compiles the kernels; they advance the dense part by two tokens,
        the policy's host decisions are not run for them), then one step captured."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def run(self, steps: int, recall: bool = True, lag: int = 1, keep_tokens: bool = False) -> dict:
        """`recall`: run the policy's per-step decisions (off: placement only). `lag` 1: the decision after
        step s applies at s + 1 (§2.3); 2: it is made while step s + 1 runs and applies at s + 2."""
        if lag not in (1, 2):
            raise ValueError("lag is 1 or 2")
        og = self.on_graph if recall else None
        if og is not None and getattr(og, "script", None) is not None:
            og.script.prepare(steps)
        cuda = _cuda()
        hosts, done = [], [None, None]
        if og is not None and og.snap is not None:
            hosts = [torch.empty(og.snap.shape, dtype=og.snap.dtype, pin_memory=cuda) for _ in range(2)]
            if cuda:
                done = [torch.cuda.Event(), torch.cuda.Event()]
        _sync()
        _reset_peak()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else None
        t_flush, t_decide = [], []  # host seconds per step: store.flush(), and decide + issue
        t0 = time.perf_counter()
        for i in range(steps):
            tf = time.perf_counter()
            self.store.flush()  # the moves decided last time (their copies were issued on the side stream)
            t_flush.append(time.perf_counter() - tf)
            if cuda:
                evs[i].record()
            self.graph.replay() if self.graph is not None else self.step()
            if keep_tokens:
                logits = self.fstep.logits if self.fstep is not None else self.logits
                self.tokens.append((self.current_token().clone(), logits.float().reshape(-1).clone()))
            if og is not None:
                b = i % 2
                hosts[b].copy_(og.snap, non_blocking=cuda)
                if cuda:
                    done[b].record()
                j = i - (lag - 1)  # the step whose signal is decided on now
                if j >= 0:
                    if cuda:
                        done[j % 2].synchronize()
                    td = time.perf_counter()
                    og.decide(j, hosts[j % 2])
                    self.store.issue()  # copies start on the side stream, overlapping the step in flight
                    t_decide.append(time.perf_counter() - td)
            self.store.end_step()
        if cuda:
            evs[steps].record()
        _sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
        ms = [evs[i].elapsed_time(evs[i + 1]) for i in range(steps)] if cuda else [wall]
        summ = self.store.summary()
        out = dict(ms_per_token=statistics.median(ms), ms_per_token_wall_mean=wall,
                   ms_per_token_p90=float(np.percentile(ms, 90)),
                   h2d_mb_per_step=summ["mb_per_step"], r_gpu=summ["r_gpu"], r_gpu_cpu=summ["r_gpu_cpu"],
                   steps_with_h2d=sum(s.h2d_bytes > 0 for s in self.store.steps[-steps:]),
                   peak_gb=_peak_gb(), audio_kv_bytes=self.store.audio_bytes_on_device(), steps=steps,
                   fused=self.fstep is not None, graph=self.graph is not None, lag=lag if og is not None else None,
                   host_flush_ms=float(np.median(t_flush) * 1e3), host_flush_ms_mean=float(np.mean(t_flush) * 1e3))
        if t_decide:  # the policy's host decision (after_step / select_pages) + issuing its copies
            out.update(host_decide_ms=float(np.median(t_decide) * 1e3), host_decide_ms_mean=float(np.mean(t_decide) * 1e3))
        if self.policy is not None:
            try:
                out["knobs"] = {k: v for k, v in self.policy.knobs().items() if isinstance(v, (int, float, str))}
            except Exception as e:  # knobs are informational
                out["knobs"] = f"{type(e).__name__}: {e}"
        return out

    def release_audio(self) -> int:
        """Drop the audio KV buffers; return what the CUDA caching allocator freed (bytes)."""
        _sync()
        self.store._events = []
        gc.collect()
        before = _allocated()
        self.store.audio_k = self.store.audio_v = self.store.audio_pos = None
        gc.collect()
        return before - _allocated()


def fast_row(model, ids, span, steps: int, *, policy=None, retention: float = 1.0, fused: bool = True,
             graph: bool = True, recall: bool = True, lag: int = 1, impl: str = "triton",
             script: ScriptedAnchor | None = None) -> dict:
    d = FastDecoder(model, ids, span, steps + 8, policy, retention, fused, impl, script)
    if graph:
        d.capture()
    else:
        d.step()  # warm-up (compiles the kernels)
    r = d.run(steps, recall=recall, lag=lag)
    r["audio_kv_alloc_bytes"] = d.release_audio()
    del d
    return r


# --- the benchmark ---------------------------------------------------------------------------------------
def section(results: dict, key: str, fn, out: Path | None) -> None:
    t0 = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as e:
        import traceback
        traceback.print_exc()
        results[key] = dict(error=f"{type(e).__name__}: {e}")
    results[key]["wall_s"] = round(time.perf_counter() - t0, 1)
    print(key, json.dumps(results[key]), flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=1))
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()


def bench_model(results: dict, name: str, a, out: Path | None, tmp: Path, first: bool) -> None:
    model = build_model(name)
    cfg = model.config
    wb = weight_bytes(model)
    results[f"{name}/weights"] = dict(bytes=wb, floor_ms=wb / results["copy_tb_s"] / 1e9 if "copy_tb_s" in results else None)
    info = backbone_info(name, cfg)
    scores = synthetic_head_scores(info, tmp / f"{info['name']}_head_scores.json")
    r = a.retention
    impl = a.impl
    for n_audio in [int(n) for n in a.audio.split(",")]:
        ids, span = make_prompt(n_audio, cfg.vocab_size)
        p = f"{name}/{n_audio}"
        graph = _cuda()

        def script():
            return ScriptedAnchor(n_audio, math.ceil(4.0 * TOKEN_RATE), a.anchor_speed, a.anchor_beta)

        def row(steps=a.steps, method=None, **kw):
            pol = make_policy(method, info, scores, **kw.pop("policy_kw", {})) if method else None
            ret = r if method not in (None, "full") else 1.0
            return fast_row(model, ids, span, steps, policy=pol, retention=ret, graph=graph, impl=impl, **kw)

        if first and n_audio == int(a.audio.split(",")[0]):  # numerics: fused step vs the HF modules
            section(results, f"{p}/fused_vs_unfused_tokens",
                    lambda: fused_matches_unfused(model, ids, span, a.check_steps, impl), out)
        if a.hf_steps:
            section(results, f"{p}/hf_generate", lambda: hf_generate(model, ids, a.hf_steps), out)
        if first and n_audio == int(a.audio.split(",")[0]):
            section(results, f"{p}/engine_as_written_full", lambda: engine_as_written(model, ids, span, a.engine_steps), out)
            section(results, f"{p}/fast_full_unfused", lambda: row(fused=False), out)
        section(results, f"{p}/fast_full", lambda: row(), out)
        section(results, f"{p}/fast_adakv_r{r}", lambda: row(method="adakv"), out)
        section(results, f"{p}/fast_arkvale_r{r}", lambda: row(a.policy_steps, method="arkvale"), out)
        section(results, f"{p}/fast_wnw_r{r}", lambda: row(method="wnw", script=script()), out)
        section(results, f"{p}/fast_wnw_r{r}_recall_off", lambda: row(method="wnw", recall=False), out)
        section(results, f"{p}/fast_wnw_r{r}_pipelined", lambda: row(method="wnw", script=script(), lag=2), out)
        if first and n_audio == int(a.audio.split(",")[0]) and a.sweep:
            for n_t in [int(n) for n in a.sweep.split(",")]:
                kw = dict(n_voice=n_t + a.sweep_anchors, n_anchor=a.sweep_anchors)
                section(results, f"{p}/sweep_tidal{n_t}",
                        lambda: row(a.sweep_steps, method="wnw", policy_kw=kw, script=script()), out)
    del model
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()


def fused_matches_unfused(model, ids, span, steps: int, impl: str) -> dict:
    """Greedy tokens and logits of the fused step against the HF-module step (full cache, graphs on CUDA)."""
    runs = {}
    for fused in (False, True):
        d = FastDecoder(model, ids, span, steps + 8, fused=fused, impl=impl)
        if _cuda():
            d.capture()
        d.run(steps, keep_tokens=True)
        runs[fused] = d.tokens
        del d
    toks = {f: [int(t) for t, _ in r] for f, r in runs.items()}
    same = 0
    while same < steps and toks[False][same] == toks[True][same]:
        same += 1
    diff = max((float((a[1] - b[1]).abs().max()) for a, b in zip(runs[False][:same + 1], runs[True][:same + 1])),
               default=float("nan"))
    scale = float(runs[False][0][1].abs().max())
    return dict(same_tokens_prefix=same, steps=steps, max_abs_logit_diff=diff, max_abs_logit=scale,
                tokens_unfused=toks[False], tokens_fused=toks[True])


def main(argv: list[str] | None = None) -> dict:
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="every row at tiny dims on the CPU (Triton interpreter)")
    ap.add_argument("--models", default="voxtral,qwen_omni")
    ap.add_argument("--audio", default="3000,12000")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--policy-steps", type=int, default=64, help="steps of the arkvale rows (host-heavy)")
    ap.add_argument("--hf-steps", type=int, default=64)
    ap.add_argument("--check-steps", type=int, default=16, help="steps of the fused-vs-unfused token check")
    ap.add_argument("--engine-steps", type=int, default=16)
    ap.add_argument("--retention", type=float, default=0.2)
    ap.add_argument("--sweep", default="35,75,115,155,195,235", help="Table 4: tidal heads (n_voice - n_anchor)")
    ap.add_argument("--sweep-anchors", type=int, default=5)
    ap.add_argument("--sweep-steps", type=int, default=96)
    ap.add_argument("--anchor-speed", type=float, default=12.0, help="audio tokens the scripted anchor focus moves per step")
    ap.add_argument("--anchor-beta", type=float, default=0.9)
    ap.add_argument("--impl", choices=("triton", "torch"), default=None,
                    help="fused ops and attention: triton (default on CUDA) or torch (default with --smoke)")
    a = ap.parse_args(argv)
    if a.smoke:
        DEV = "cpu"
        a.impl = a.impl or "torch"
        torch.set_num_threads(1)  # tiny ops: threads only spin (the CPU may be shared)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (--impl triton)
        a.models, a.audio = "tiny,tiny_qwen", "200,500"
        a.steps, a.policy_steps, a.hf_steps, a.engine_steps, a.sweep_steps, a.check_steps = 6, 6, 3, 3, 4, 5
        a.sweep, a.sweep_anchors, a.anchor_speed = "3,9", 1, 25.0
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke for the CPU check")
    a.impl = a.impl or "triton"
    out = Path(a.out) if a.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = (out.parent if out is not None else Path("/tmp")) / "decode_speed_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    import importlib.util

    import transformers

    triton_version = None
    if importlib.util.find_spec("triton"):
        import triton
        triton_version = triton.__version__
    results: dict = dict(command=" ".join(sys.argv if argv is None else ["decode_speed.py", *argv]),
                         device=torch.cuda.get_device_name() if _cuda() else "cpu (smoke)", torch=torch.__version__,
                         transformers=transformers.__version__, triton=triton_version, impl=a.impl,
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if _cuda():
        x = torch.empty(2 ** 30, dtype=torch.uint8, device=DEV)
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        _sync()
        t0 = time.perf_counter()
        for _ in range(20):
            y.copy_(x)
        _sync()
        results["copy_tb_s"] = 2 * 2 ** 30 * 20 / (time.perf_counter() - t0) / 1e12
        del x, y
    for k, name in enumerate(a.models.split(",")):
        bench_model(results, name, a, out, tmp, first=k == 0)
    return results


if __name__ == "__main__":
    main()
