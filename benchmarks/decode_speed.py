"""Decode speed on the GPU at the text-decoder shapes of Voxtral-Mini-3B and Qwen2.5-Omni-3B (random bf16
weights): transformers' generate() as the anchor, the engine as written (engine/decode.py), and the fast
path (PackedAudioKVStore + Triton kernel + the whole decode step captured in one CUDA graph).

    PYTHONPATH=src python3 benchmarks/decode_speed.py --out benchmarks/results/<date>-<gpu>.json

Reports median ms/token over forced greedy steps (no EOS stop), H2D MB/step, peak GPU memory
(torch.cuda.max_memory_allocated) and the bytes of audio KV held on the GPU (storage sizes of the packed
buffers, which is what the caching allocator holds for them, and the allocator's own delta).

`recall` rows: a scripted policy with the store's real mechanics, not the WnW method: each (layer, KV head)
keeps r_GPU of the audio resident (random positions), the rest is recallable from the pinned host mirror;
on `n_tidal` heads a chunk of `chunk` positions that moves through the audio is recalled every step
(issued on the side stream right after the step is launched, waited for by the next step) and the chunk
recalled before is released, so the resident count stays at r_GPU while recall is really active.
Needs CUDA and triton; imports nothing that needs hydra.
"""

from __future__ import annotations

import argparse
import gc
import json
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
}
PRE, POST = 20, 30  # text tokens before and after the audio (a 3,000-token audio gives a 3,050-token prefix)


DEV = "cuda"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEV == "cuda" else float("nan")


def _reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def build_model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s = dict(SHAPES[name])
    arch = s.pop("arch")
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(**s, max_position_embeddings=32768, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = model_cls(cfg).to(torch.bfloat16).eval()
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
    model.generate(ids[:, :64], max_new_tokens=8, min_new_tokens=8, **kw)  # warm

    def timed(n):
        _sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t0

    _reset_peak()
    t1 = min(timed(1), timed(1))
    tn = timed(steps + 1)
    return dict(ms_per_token=(tn - t1) / steps * 1e3, peak_gb=_peak_gb(),
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
                peak_gb=_peak_gb(),
                audio_kv_bytes=res.store_summary["audio_bytes_on_device"])


def _backbone(model, base):
    cfg = model.config
    T0 = None

    class RandomBackbone(base):
        def embed_prompt(self, prompt):
            return self.embed_tokens(prompt.input_ids)

        def prompt_positions(self, prompt):
            nonlocal T0
            T0 = prompt.input_ids.shape[1]
            return torch.arange(T0, device=DEV)[None]

        def next_positions(self, prompt_positions, n_done, n_new=1):
            return torch.arange(n_new, device=DEV)[None] + prompt_positions.shape[-1] + n_done

    bb = RandomBackbone()
    bb.name, bb.model = "random", model
    bb.layers, bb.final_norm, bb.lm_head = model.model.layers, model.model.norm, model.lm_head
    bb.embed_tokens, bb.rotary = model.model.embed_tokens, model.model.rotary_emb
    bb.n_layers, bb.n_q_heads, bb.n_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    bb.head_dim, bb.token_rate, bb.eos_token_ids, bb.max_positions = cfg.head_dim, 12.5, [], 32768
    return bb


# --- the fast path --------------------------------------------------------------------------------------
class Scripted:
    """Recall mechanics at r_GPU: see the module docstring."""

    def __init__(self, store, retention: float, chunk: int, n_tidal: int, seed: int = 0):
        self.store, self.chunk = store, chunk
        L, H, N = store.n_layers, store.n_kv_heads, store.n_audio
        rng = np.random.default_rng(seed)
        n_keep = int(round(retention * N))
        host = []
        for li in range(L):
            for h in range(H):
                perm = rng.permutation(N)
                store.set_tiers(li, h, torch.from_numpy(perm[:n_keep]), torch.from_numpy(perm[n_keep:]))
                host.append(np.sort(perm[n_keep:]))
        self.rows = np.arange(min(n_tidal, L * H))  # the first n_tidal (layer, head) pairs recall
        self.host = np.stack(host)[self.rows]  # (n_tidal, N - n_keep), moving through the audio in order
        self.n_chunks = max(1, self.host.shape[1] // chunk)
        self.prev = None

    def decide(self, step: int) -> None:
        """Recall the next chunk of host positions on every tidal head, release the chunk recalled before."""
        if not len(self.rows):
            return
        j = step % self.n_chunks
        c = self.host[:, j * self.chunk: (j + 1) * self.chunk]
        if self.prev is not None:
            self.store.release_batch(self.rows, self.prev)
        self.store.recall_batch(self.rows, c)
        self.prev = c


class FastDecoder:
    def __init__(self, model, ids, span, max_new: int, policy=None, retention: float = 1.0, chunk: int = 0,
                 n_tidal: int = 0):
        from wnw_exp.engine.decode import apply_rope, prefill_scores, project_qkv
        from wnw_exp.kv.packed import PackedAudioKVStore
        from wnw_exp.methods.base import SampleContext

        self.model, cfg = model, model.config
        self._qkv, self._rope = project_qkv, apply_rope
        L, Hq, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.dims = (Hq, H, D)
        n_audio = span[1] - span[0]
        mem0 = torch.cuda.memory_allocated() if DEV == "cuda" else 0
        self.store = PackedAudioKVStore(L, H, D, n_audio, torch.device(DEV), model.dtype, max_new + 8)
        if policy is not None:
            policy.start(SampleContext(L, Hq, H, D, 12.5, n_audio, retention, torch.device(DEV)), self.store)
        m = model.model
        with torch.no_grad():
            T = ids.shape[1]
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
        self.script = Scripted(self.store, retention, chunk, n_tidal) if chunk else None
        self.store.compact(headroom=2 * chunk)
        _sync()
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        self.store_alloc_bytes = (torch.cuda.memory_allocated() if DEV == "cuda" else 0) - mem0  # whole store: dense + audio + lengths
        self.tok = logits.argmax(-1).view(1, 1)
        self.pos = torch.full((1, 1), T, device=DEV, dtype=torch.long)
        self.graph = None

    @torch.no_grad()
    def step(self) -> None:
        m, (Hq, H, D) = self.model.model, self.dims
        hidden = m.embed_tokens(self.tok)
        cos, sin = m.rotary_emb(hidden, self.pos)
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._qkv(layer, x, Hq, H, D)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.store.append_dense(li, k[0, :, 0], v[0, :, 0])
            out = self.store.attend_device(li, q[0, :, 0], attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(m.norm(hidden))
        self.tok.copy_(logits.argmax(-1).view(1, 1))
        self.pos += 1
        self.store.dense_len += 1

    def capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (compiles the kernels); advances the dense part by two tokens
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def run(self, steps: int, recall: bool = True) -> dict:
        _sync()
        _reset_peak()
        if DEV != "cuda":  # smoke test on the CPU (Triton interpreter): wall times only
            evs = [type("E", (), {"record": lambda self: None})() for _ in range(steps + 1)]
        else:
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        t0 = time.perf_counter()
        for i in range(steps):
            self.store.flush()  # the step waits for the recall issued during the previous step
            evs[i].record()
            self.graph.replay() if self.graph is not None else self.step()
            if self.script is not None and recall:
                self.script.decide(i)
                self.store.issue()  # copies start on the side stream, overlapping this step
            self.store.end_step()
        evs[steps].record()
        _sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
        ms = [evs[i].elapsed_time(evs[i + 1]) for i in range(steps)] if DEV == "cuda" else [wall]
        summ = self.store.summary()
        return dict(ms_per_token=statistics.median(ms), ms_per_token_wall_mean=wall,
                    h2d_mb_per_step=summ["mb_per_step"], r_gpu=summ["r_gpu"], r_gpu_cpu=summ["r_gpu_cpu"],
                    peak_gb=_peak_gb(),
                    audio_kv_bytes=self.store.audio_bytes_on_device(), store_alloc_bytes=self.store_alloc_bytes,
                    steps=steps)


def _policy(name: str):
    try:
        from wnw_exp.methods import build_policy
        return build_policy({"name": name})
    except Exception as e:  # methods are written concurrently: record, do not fail the benchmark
        return f"{type(e).__name__}: {e}"


def section(results: dict, key: str, fn, out: Path) -> None:
    t0 = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as e:
        import traceback
        traceback.print_exc()
        results[key] = dict(error=f"{type(e).__name__}: {e}")
    results[key]["wall_s"] = round(time.perf_counter() - t0, 1)
    print(key, json.dumps(results[key]), flush=True)
    out.write_text(json.dumps(results, indent=1))
    gc.collect()
    torch.cuda.empty_cache()


def smoke() -> None:
    """CPU check of every code path but graph capture (tiny shape, Triton interpreter)."""
    global DEV
    DEV = "cpu"
    SHAPES["tiny"] = dict(arch="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4)
    model = build_model("tiny").float()
    ids, span = make_prompt(200, 256)
    print("engine", engine_as_written(model, ids, span, 4))
    for kw in (dict(), dict(chunk=8, n_tidal=3, retention=0.2)):
        d = FastDecoder(model, ids, span, 16, **kw)
        print("fast", kw, d.run(5), d.store.summary())
    pol = _policy("adakv")
    if not isinstance(pol, str):
        d = FastDecoder(model, ids, span, 16, pol, 0.2)
        print("adakv", d.run(3))


def main() -> None:
    if "--smoke" in sys.argv:
        return smoke()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="voxtral,qwen_omni")
    ap.add_argument("--audio", default="3000,12000")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--engine-steps", type=int, default=24)
    ap.add_argument("--retention", type=float, default=0.2)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--sweep", default="35,85,135,185,235")
    ap.add_argument("--sweep-steps", type=int, default=96)
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = dict(command=" ".join(sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    import transformers
    import triton
    results.update(transformers=transformers.__version__, triton=triton.__version__)
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
    for name in a.models.split(","):
        model = build_model(name)
        wb = weight_bytes(model)
        results[f"{name}/weights"] = dict(bytes=wb, floor_ms=wb / results["copy_tb_s"] / 1e9)
        for n_audio in [int(n) for n in a.audio.split(",")]:
            ids, span = make_prompt(n_audio, model.config.vocab_size)
            p = f"{name}/{n_audio}"
            steps = a.steps
            section(results, f"{p}/hf_generate", lambda: hf_generate(model, ids, steps), out)
            if name == "voxtral" and n_audio == 3000:
                section(results, f"{p}/engine_as_written_full", lambda: engine_as_written(model, ids, span, a.engine_steps), out)

                def eager():
                    d = FastDecoder(model, ids, span, 40)
                    d.step()
                    return d.run(32)
                section(results, f"{p}/fast_full_eager_kernel", eager, out)

            def graph(policy=None, chunk=0, n_tidal=0, recall=True, n_steps=steps):
                d = FastDecoder(model, ids, span, n_steps + 8, policy, a.retention if (policy or chunk) else 1.0,
                                chunk, n_tidal)
                d.capture()
                r = d.run(n_steps, recall)
                del d
                return r
            section(results, f"{p}/fast_full", graph, out)
            L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
            section(results, f"{p}/fast_r{a.retention}_recall_on", lambda: graph(chunk=a.chunk, n_tidal=L * H), out)
            section(results, f"{p}/fast_r{a.retention}_recall_off",
                    lambda: graph(chunk=a.chunk, n_tidal=L * H, recall=False), out)
            for m in ("adakv",):
                pol = _policy(m)
                if isinstance(pol, str):
                    results[f"{p}/fast_{m}"] = dict(error=pol)
                else:
                    section(results, f"{p}/fast_{m}_r{a.retention}", lambda: graph(policy=pol), out)
            if name == "voxtral" and n_audio == 3000 and a.sweep:
                for n_t in [int(n) for n in a.sweep.split(",")]:
                    section(results, f"{p}/sweep_tidal{n_t}",
                            lambda: graph(chunk=a.chunk, n_tidal=n_t, n_steps=a.sweep_steps), out)
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
