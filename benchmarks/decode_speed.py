"""Decode speed at the text-decoder shapes of Voxtral-Mini-3B and Qwen2.5-Omni-3B (random bf16 weights, GPU).

Every engine row is one call of the engine `wnw-run` runs (`engine.serve.generate`, as `engine.runner` calls it:
on CUDA the packed store, the fused step and one CUDA graph per token) with the real methods of
src/wnw_exp/methods/; transformers' generate() is the anchor. There is no decoder here.

    PYTHONPATH=src python3 benchmarks/decode_speed.py --out $OUT/decode_speed.json
    PYTHONPATH=src python3 benchmarks/decode_speed.py --gpu-check --out $OUT/gpu_check.json   # issue 15's targets
    python3 benchmarks/decode_speed.py --smoke [--out x.json]   # every row at tiny dims on the CPU, < 1 min
                                                  # (the engine rows on the fused step, its kernels in PyTorch)

Rows per model and audio length (`{model}/{n_audio}/...`):
- hf_generate: transformers' generate() (SDPA, dynamic cache), warmed; per repeat (t(1 + n steps) - t(1)) / n,
  the median of `--repeats`. hf_generate_static_compiled: the same with `cache_implementation="static"`, for which
  transformers compiles the forward with torch.compile itself on CUDA (its error is the row if that fails).
- engine_reference_full: the engine's reference path (HF modules layer by layer, reference store: what the CPU
  runs), full cache. engine_full_eager: the fused step without the graph. engine_full: the default path.
- engine_{adakv,arkvale,wnw}_r{r}: the methods at retention r (default path). ArkVale: page scores, top-k and
  the swap on the device before each layer's attention, ArkVale proper's timing. WnW: the chunk swap on the device
  after each step, in force at the next one (§2.3); _pipelined: in force one step later (`lag=2`); _recall_off:
  prefill placement only (no swap). sweep_tidal{n}: Table 4's tidal-head counts.
- fused_vs_reference: greedy tokens and logits of the default path against the reference path (full cache).
Reported: median ms/token over forced greedy steps (no EOS) as the engine times them (wall time per step,
the token read included), the mean and p90, H2D MB/step, r_GPU, r_GPU+CPU, steps with H2D traffic, peak GPU
memory, the device bytes of the audio KV, and the path (fused, graph).

Scripted anchor attention (WnW rows; random weights have no audio grounding to follow): before each decision the
anchors' accumulated weights A (n_audio,) become (1 - beta) * A + beta * M * g_s, M = the number of anchor query
heads, beta = 0.9, g_s a Gaussian over audio positions (sum 1, sigma = half a chunk) centred at (12 * s) mod n_audio:
the focus moves 12 audio tokens (~1 s) per generated token, about 3x a transcript's pace, so the top-3 chunks
change every few steps and the tidal heads recall and release throughout (`--anchor-speed`, `--anchor-beta`).
The g_s are precomputed on the device and mixed in inside the step's graph (`ScriptedWnW`). Head scores: a
synthetic head_scores.json (seeded VS ~ Beta(2, 20), HS ~ LogNormal(-11, 1) per KV head, the format of
wnw_exp/head_scores.py), loaded through `method.head_scores` as a calibrated file would be.

--gpu-check measures issue 15's targets at the Voxtral-3B shape, 3,000 audio tokens, and writes `targets`:
Full <= 3.0 ms/token; WnW@0.2 (strict) <= 1.05x Full; ArkVale@0.2 <= 1.5x Full; the fused graph path against the
reference path (tokens while they agree, logits); and wnw-run's own per-sample call (`engine.runner._run_sample`,
the prompt from a benchmark backbone) within 10% of the engine row.

Imports only torch, numpy, transformers, triton and wnw_exp modules that need none of hydra, omegaconf, soxr,
soundfile, espeak or jiwer (tests/test_fused_decode.py runs --smoke with those made unimportable).
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
from functools import partial
from pathlib import Path

import numpy as np
import torch

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
FAST: dict = {}  # the engine path of the engine rows: {} = wnw-run's default; --smoke: the fused step on the CPU


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


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_backbone(model, n_audio: int):
    """The engine's view of a random-weight text decoder: an adapter whose prompt is PRE text tokens, `n_audio`
    'audio' tokens and POST text tokens (random ids), with no end token (every row decodes its full length)."""
    from wnw_exp.backbones.base import Backbone, Prompt

    cfg = model.config

    class RandomBackbone(Backbone):
        def build_prompt(self, audio=None, task="transcribe", language="en", target_language=None) -> Prompt:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(100, cfg.vocab_size - 100, (1, PRE + n_audio + POST), generator=g)
            return Prompt(ids.to(DEV), (PRE, PRE + n_audio))

        def embed_prompt(self, prompt):
            return self.embed_tokens(prompt.input_ids)

        def prompt_positions(self, prompt):
            return torch.arange(prompt.input_ids.shape[1], device=DEV)[None]

        def next_positions(self, prompt_positions, n_done, n_new=1):
            return torch.arange(n_new, device=DEV)[None] + prompt_positions.shape[-1] + n_done

        def decode(self, token_ids):
            return " ".join(map(str, token_ids))

        def check_fits(self, seconds, max_new_tokens, prompt_overhead=256):
            pass

    bb = RandomBackbone()
    bb.name, bb.model = "random", model
    bb.layers, bb.final_norm, bb.lm_head = model.model.layers, model.model.norm, model.lm_head
    bb.embed_tokens, bb.rotary = model.model.embed_tokens, model.model.rotary_emb
    bb.n_layers, bb.n_q_heads, bb.n_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    bb.head_dim, bb.token_rate, bb.eos_token_ids, bb.max_positions = cfg.head_dim, TOKEN_RATE, [], 32768
    bb.fused_layers()  # as load_backbone does
    return bb


# --- transformers generate() -------------------------------------------------------------------------
@torch.no_grad()
def hf_generate(model, ids, steps: int, repeats: int, compiled: bool = False) -> dict:
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if compiled:  # transformers compiles the forward itself (torch.compile) for a static cache on CUDA
        kw["cache_implementation"] = "static"
    for _ in range(2 if compiled else 1):  # warm (and, compiled, compile for both lengths' shapes)
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw)
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)

    def timed(n):
        _sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t0

    _reset_peak()
    per = [(timed(steps + 1) - timed(1)) / steps * 1e3 for _ in range(repeats)]
    return dict(ms_per_token=statistics.median(per), ms_per_token_repeats=per, peak_gb=_peak_gb(), steps=steps,
                note="per repeat (time(generate 1+steps) - time(generate 1)) / steps; the median of the repeats")


# --- policies -------------------------------------------------------------------------------------------
def backbone_info(name: str, cfg) -> dict:
    return dict(name=f"{name}_random_weights", n_layers=cfg.num_hidden_layers, n_q_heads=cfg.num_attention_heads,
                n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, token_rate=TOKEN_RATE)


def synthetic_head_scores(info: dict, path: Path, seed: int = 0) -> Path:
    """A head_scores.json for a random-weight model: seeded VS ~ Beta(2, 20), HS ~ LogNormal(-11, 1) per KV head, and
    the calibration's per-head attention measurements that `method.head_scale=spread|reading` read (audio share ~
    Beta(2, 5), the fraction of positions holding 90% of it ~ Beta(2, 10))."""
    from wnw_exp.head_scores import HeadScores

    rng = np.random.default_rng(seed)
    shape = (info["n_layers"], info["n_kv_heads"])
    vs, hs = rng.beta(2, 20, shape), rng.lognormal(-11, 1, shape)
    head_attention = dict(audio=rng.beta(2, 5, shape).tolist(), audio_positions_90=rng.beta(2, 10, shape).tolist())
    HeadScores(model=info["name"], n_layers=info["n_layers"], n_q_heads=info["n_q_heads"],
               n_kv_heads=info["n_kv_heads"], head_dim=info["head_dim"], token_rate=info["token_rate"],
               voice_score=vs, head_sensitivity=hs,
               calibration=dict(synthetic="benchmarks/decode_speed.py: seeded random VS ~ Beta(2, 20), "
                                          "HS ~ LogNormal(-11, 1), head_attention; not measured", seed=seed,
                                head_attention=head_attention)).save(path)
    return path


_BUMPS: dict = {}  # (n_audio, steps, speed, device) -> the scripted bumps g_s of every step, shared by the streams


def scripted_wnw(info: dict, head_scores: Path, n_audio: int, steps: int, speed: float, beta: float,
                 recall: bool = True, **kw):
    """WnW with the scripted anchor attention of the module docstring (or, `recall=False`, placement only)."""
    return scripted_wnw_class(n_audio, steps, speed, beta, recall)(head_scores=str(head_scores),
                                                                    backbone_info=info, **kw)


def scripted_wnw_class(n_audio: int, steps: int, speed: float, beta: float, recall: bool = True) -> type:
    """The class of `scripted_wnw`'s policies."""
    from wnw_exp.methods.wnw import WnW

    class ScriptedWnW(WnW):
        def start(self, ctx, store):
            super().start(ctx, store)
            key = (n_audio, steps, speed, str(ctx.device))  # g_s, computed ahead, one table for every stream
            if key not in _BUMPS:
                x = torch.arange(n_audio, dtype=torch.float32)
                sigma = max(math.ceil(4.0 * TOKEN_RATE) / 2, 1.0)
                bumps = [torch.exp(-0.5 * ((x - (speed * s) % n_audio) / sigma) ** 2) for s in range(steps + 2)]
                _BUMPS[key] = torch.stack([b / b.sum() for b in bumps]).to(ctx.device)
            self._bumps = _BUMPS[key]
            self._s = torch.zeros(1, dtype=torch.long, device=ctx.device)
            self._mass = float(sum(len(self.observe_heads(li)) for li in range(ctx.n_layers)))

        def _adjust_signal(self, step):  # before every decision, alone or in a batch (`WnW.after_step_all`)
            if step != -1:  # decode steps (the prefill decision keeps the prompt's own attention)
                self.scores_acc.mul_(1 - beta).add_(torch.index_select(self._bumps, 0, self._s)[0],
                                                    alpha=beta * self._mass)
                self._s += 1

        tabled_signals = True  # a batch seated in a bucket's step: one launch through tables (scripted_signal.py)

        @classmethod
        def _signal_tables(cls, policies, held):
            """The bucket's scripted-signal tables, rewritten in place for `policies` (outside a capture)."""
            from scripted_signal import SignalTables

            tables = held.get("signal_tables")
            if tables is None or tables.key != [id(p) for p in policies]:
                if tables is None or not tables.bind(policies):
                    tables = held["signal_tables"] = SignalTables(held["capacity"], policies[0].ctx.device)
                    tables.bind(policies)
            return tables

        @classmethod
        def prepare_step_all(cls, policies, held):
            super().prepare_step_all(policies, held)
            if held.get("capacity") is not None:
                cls._signal_tables([p for p in policies if cls._joins(p)], held)

        @classmethod
        def _adjust_signals(cls, together, held=None):
            """A batch's scripted signals in five launches, not four per stream (in a bucket's step, one launch
            through its tables): the scripted signal stands in for the anchor heads' attention, which the real
            method already sums in the batched step's body (`ObserverSum`); its own cost is the benchmark's, not
            WnW's. The streams of one audio length share one table of bumps; each keeps its own step counter."""
            if held is not None and held.get("capacity") is not None and all(i != -1 for _, i in together):
                cls._signal_tables([p for p, _ in together], held)(beta)
                return
            groups: dict = {}
            for p, i in together:
                if i != -1:
                    groups.setdefault((id(p._bumps), p._mass), []).append(p)
            for ps in groups.values():
                accs = [p.scores_acc for p in ps]
                torch._foreach_mul_(accs, 1 - beta)
                rows = torch.index_select(ps[0]._bumps, 0, torch.cat([p._s for p in ps]))
                torch._foreach_add_(accs, list(rows.unbind(0)), alpha=beta * ps[0]._mass)
                torch._foreach_add_([p._s for p in ps], 1)

        if not recall:  # placement only: no decision, alone or in a batch
            def after_step(self, step):
                return

            @classmethod
            def after_step_all(cls, policies, steps, held):
                return

    return ScriptedWnW


# --- rows ----------------------------------------------------------------------------------------------
def engine_row(bb, prompt, steps: int, policy=None, retention: float = 1.0, **path) -> dict:
    from wnw_exp.engine.decode import decode_path
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods.base import Policy

    policy = policy if policy is not None else Policy()
    policy.check(retention)
    path = path or dict(FAST)
    _sync()
    _reset_peak()
    res = generate(bb, prompt, policy, retention=retention, max_new_tokens=steps + 1, **path)
    ms = res.step_ms
    s = res.store_summary
    p = decode_path(bb.device, policy, **path)
    out = dict(ms_per_token=res.ms_per_token, ms_per_token_mean=float(np.mean(ms)),
               ms_per_token_p90=float(np.percentile(ms, 90)), h2d_mb_per_step=s["mb_per_step"], r_gpu=s["r_gpu"],
               r_gpu_cpu=s["r_gpu_cpu"], steps_with_h2d=sum(b > 0 for b in res.trace["h2d_bytes"]),
               peak_gb=_peak_gb(), audio_kv_bytes=s["audio_bytes_on_device"], steps=len(ms), prefill_ms=res.prefill_ms,
               store=p.store, fused=p.fused, graph=p.graph, kernels=p.kernels)
    knobs = policy.knobs()
    out["knobs"] = {k: v for k, v in knobs.items() if isinstance(v, (int, float, str))}
    return out


def fused_vs_reference(bb, prompt, steps: int) -> dict:
    """Greedy tokens and logits of the default path against the reference path, full cache. In bf16 the tokens may
    part (random weights give near-tied logits): the logits are compared while the inputs agree."""
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods.base import Policy

    runs = {name: generate(bb, prompt, Policy(), retention=1.0, max_new_tokens=steps, keep_logits=True, **path)
            for name, path in (("reference", dict(store="reference", fused=False)), ("default", dict(FAST)))}
    ref, new = runs["reference"], runs["default"]
    same = 0
    while same < len(ref.tokens) and same < len(new.tokens) and ref.tokens[same] == new.tokens[same]:
        same += 1
    diff = max((float((a - b).abs().max()) for a, b in zip(ref.logits[:same + 1], new.logits[:same + 1])),
               default=float("nan"))
    return dict(same_tokens_prefix=same, steps=steps, max_abs_logit_diff=diff,
                max_abs_logit=float(ref.logits[0].abs().max()), tokens_reference=ref.tokens, tokens_default=new.tokens)


def runner_row(bb, policy, retention: float, steps: int) -> dict:
    """wnw-run's own per-sample call (`engine.runner._run_sample`) on the benchmark backbone: its recorded ms/token."""
    from wnw_exp.engine.runner import _run_sample

    class Clip:  # a sample whose audio the backbone ignores; its duration sets the answer cap to `steps + 1`
        id, reference, task, language, target_language = "bench", "", "transcribe", "en", None
        duration = 1.0

        def audio(self):
            return np.zeros(16000, np.float32)

    cfg = dict(retention=retention, model=dict(max_new_tokens_per_second=0.0, min_new_tokens=steps + 1))
    policy.check(retention)
    rec = _run_sample(Clip(), bb, policy, cfg)
    if rec["error"] is not None:
        raise RuntimeError(rec["error"])
    return dict(ms_per_token=rec["ms_per_token"], n_new_tokens=rec["n_new_tokens"], r_gpu=rec["r_gpu"],
                mb_per_step=rec["mb_per_step"])


def kernel_times(prof, cuda: bool) -> dict:
    """A torch.profiler run's {name: (self time us, count)}: on CUDA its device-side events only (an op's kernels,
    not the op that launched them again), on the CPU its ops."""
    from torch.autograd import DeviceType

    out = {}
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t > 0:
            out[e.key] = (t, e.count)
    return out


def per_step(times: dict, steps: int, top: int) -> dict:
    """`kernel_times` over `steps` decode steps: their sum and the `top` names by time, per step (us, launches)."""
    rows = sorted(((t, k, c) for k, (t, c) in times.items()), reverse=True)
    return dict(device_us_per_step=round(sum(t for t, _, _ in rows) / steps, 1),
                top=[dict(kernel=k[:90], us_per_step=round(t / steps, 1), launches_per_step=round(c / steps, 2))
                     for t, k, c in rows[:top]])


def profile_row(bb, prompt, policy, retention: float, steps: int, top: int = 15) -> dict:
    """Where a decode step's GPU time goes: the fused step run eagerly (a graph hides its kernels from the
    profiler) under torch.profiler, once for `steps` answer tokens and once for the prefill alone; the difference
    per kernel over `steps`: the `top` kernels by GPU time per step (us), with their launches per step."""
    from torch.profiler import ProfilerActivity, profile

    from wnw_exp.engine.serve import generate

    policy.check(retention)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])

    def kernels(n_new: int) -> dict:
        with profile(activities=acts) as prof:
            generate(bb, prompt, policy.fork(), retention=retention, max_new_tokens=n_new,
                     **{**FAST, "graph": False})
            _sync()
        return kernel_times(prof, _cuda())

    kernels(2)  # warm: compilation and allocation stay out of both runs
    base, run = kernels(1), kernels(steps + 1)
    decode = {k: (t - base.get(k, (0, 0))[0], c - base.get(k, (0, 0))[1]) for k, (t, c) in run.items()}
    return dict(steps=steps, note="eager fused step, decode only (a prefill-only run subtracted); us per step",
                **per_step(decode, steps, top))


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
    floor = wb / results["copy_tb_s"] / 1e9 if "copy_tb_s" in results else None
    results[f"{name}/weights"] = dict(bytes=wb, floor_ms=floor)
    info = backbone_info(name, cfg)
    scores = synthetic_head_scores(info, tmp / f"{info['name']}_head_scores.json")
    r = a.retention
    for n_audio in [int(n) for n in a.audio.split(",")]:
        bb = make_backbone(model, n_audio)
        prompt = bb.build_prompt()
        p = f"{name}/{n_audio}"
        lead = first and n_audio == int(a.audio.split(",")[0])
        # the check beyond its lead shape: Full and WnW strict (voxtral at 12,000 tokens), with wnw-run's rows for the
        # second family (qwen_omni at 3,000)
        short = a.gpu_check and not lead
        if a.gpu_check and lead and a.long_only:
            continue
        first_audio = n_audio == int(a.audio.split(",")[0])

        def wnw(steps=a.steps, **kw):
            return scripted_wnw(info, scores, n_audio, steps, a.anchor_speed, a.anchor_beta, **kw)

        def method(m):
            from wnw_exp.methods import build_policy
            return build_policy(dict(name=m), info)

        if lead:
            section(results, f"{p}/fused_vs_reference", lambda: fused_vs_reference(bb, prompt, a.check_steps), out)
        if short:
            if first == first_audio:  # voxtral's long audio, qwen_omni's first length
                continue
            section(results, f"{p}/engine_full", lambda: engine_row(bb, prompt, a.steps), out)
            section(results, f"{p}/engine_wnw_r{r}", lambda: engine_row(bb, prompt, a.steps, wnw(), r), out)
            if not first_audio:  # the long length: a 0.2 cache with no per-step work, the floor WnW's overhead sits on
                section(results, f"{p}/engine_adakv_r{r}",
                        lambda: engine_row(bb, prompt, a.steps, method("adakv"), r), out)
                if a.profile:
                    section(results, f"{p}/profile_wnw_r{r}", lambda: profile_row(bb, prompt, wnw(), r, a.profile), out)
            if first_audio:
                section(results, f"{p}/runner_full", lambda: runner_row(bb, method("full"), 1.0, a.steps), out)
                section(results, f"{p}/runner_wnw_r{r}", lambda: runner_row(bb, wnw(), r, a.steps), out)
            continue
        if a.hf_steps:
            section(results, f"{p}/hf_generate", lambda: hf_generate(model, prompt.input_ids, a.hf_steps, a.repeats), out)
        if lead:
            section(results, f"{p}/engine_reference_full",
                    lambda: engine_row(bb, prompt, a.engine_steps, store="reference", fused=False), out)
            section(results, f"{p}/engine_full_eager", lambda: engine_row(bb, prompt, a.steps, graph=False), out)
        section(results, f"{p}/engine_full", lambda: engine_row(bb, prompt, a.steps), out)
        if a.gpu_check:
            section(results, f"{p}/runner_full", lambda: runner_row(bb, method("full"), 1.0, a.steps), out)
            section(results, f"{p}/runner_wnw_r{r}", lambda: runner_row(bb, wnw(), r, a.steps), out)
        section(results, f"{p}/engine_adakv_r{r}", lambda: engine_row(bb, prompt, a.steps, method("adakv"), r), out)
        section(results, f"{p}/engine_arkvale_r{r}",
                lambda: engine_row(bb, prompt, a.policy_steps, method("arkvale"), r), out)
        section(results, f"{p}/engine_wnw_r{r}", lambda: engine_row(bb, prompt, a.steps, wnw(), r), out)
        for label, kw in wnw_variants(a.wnw_variant):
            section(results, f"{p}/engine_wnw_r{r}_{label}", lambda: engine_row(bb, prompt, a.steps, wnw(**kw), r), out)
        section(results, f"{p}/engine_wnw_r{r}_pipelined", lambda: engine_row(bb, prompt, a.steps, wnw(lag=2), r), out)
        section(results, f"{p}/engine_wnw_r{r}_recall_off",
                lambda: engine_row(bb, prompt, a.steps, wnw(recall=False), r), out)
        if lead and a.profile:
            section(results, f"{p}/profile_wnw_r{r}", lambda: profile_row(bb, prompt, wnw(), r, a.profile), out)
            section(results, f"{p}/profile_arkvale_r{r}",
                    lambda: profile_row(bb, prompt, method("arkvale"), r, a.profile), out)
        if lead and a.hf_steps and _cuda():  # last: torch.compile takes a while
            section(results, f"{p}/hf_generate_static_compiled",
                    lambda: hf_generate(model, prompt.input_ids, a.hf_steps, a.repeats, compiled=True), out)
        if lead and a.sweep:
            for n_t in [int(n) for n in a.sweep.split(",")]:
                # Table 4 times n_t tidal heads: the paper's mean-matching λ (recall_budget expected), since the
                # per-step budget (the default) would demote tidal heads to fit its peak and change the count timed
                kw = dict(n_voice=n_t + a.sweep_anchors, n_anchor=a.sweep_anchors, recall_budget="expected")
                section(results, f"{p}/sweep_tidal{n_t}",
                        lambda: engine_row(bb, prompt, a.sweep_steps, wnw(a.sweep_steps, **kw), r), out)
    del model
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()


def wnw_variants(specs: list[str]) -> list[tuple[str, dict]]:
    """`--wnw-variant` values ('max_recalled=6', 'max_recalled=6,top_k=2'): (row label, WnW keyword arguments)."""
    out = []
    for spec in specs:
        kw = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--wnw-variant {spec!r}: write KEY=VALUE[,KEY=VALUE] (WnW's method.* options)")
            try:
                kw[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                kw[key.strip()] = value
        out.append((spec.replace("=", "").replace(",", "_"), kw))
    return out


def targets(results: dict, model: str, n_audio: int, r: float) -> dict:
    """Issue 15's targets from the rows (None where a row is missing or failed)."""
    def at(name: str, n: int, row: str):
        return results.get(f"{name}/{n}/{row}", {}).get("ms_per_token")

    ms = partial(at, model, n_audio)

    full, wnw, ark = ms("engine_full"), ms(f"engine_wnw_r{r}"), ms(f"engine_arkvale_r{r}")
    run_full, run_wnw = ms("runner_full"), ms(f"runner_wnw_r{r}")
    check = results.get(f"{model}/{n_audio}/fused_vs_reference", {})
    ratio = lambda x, y: x / y if x and y else None  # noqa: E731
    t = dict(full_ms=full, full_ok=full is not None and full <= 3.0,
             wnw_over_full=ratio(wnw, full), wnw_ok=ratio(wnw, full) is not None and ratio(wnw, full) <= 1.05,
             arkvale_over_full=ratio(ark, full), arkvale_ok=ratio(ark, full) is not None and ratio(ark, full) <= 1.5,
             runner_full_over_engine=ratio(run_full, full), runner_wnw_over_engine=ratio(run_wnw, wnw),
             fused_same_tokens_prefix=check.get("same_tokens_prefix"),
             fused_max_abs_logit_diff=check.get("max_abs_logit_diff"), fused_max_abs_logit=check.get("max_abs_logit"))
    long_full, long_wnw = at(model, 12000, "engine_full"), at(model, 12000, f"engine_wnw_r{r}")
    t.update(wnw_12000_over_full=ratio(long_wnw, long_full),
             adakv_12000_over_full=ratio(at(model, 12000, f"engine_adakv_r{r}"), long_full),
             wnw_12000_ok=ratio(long_wnw, long_full) is not None and ratio(long_wnw, long_full) <= 1.0)
    other = "qwen_omni" if model != "qwen_omni" else None  # the second family's wnw-run rows, where measured
    if other and f"{other}/{n_audio}/runner_full" in results:
        o = partial(at, other, n_audio)
        t.update({f"{other}_runner_full_over_engine": ratio(o("runner_full"), o("engine_full")),
                  f"{other}_runner_wnw_over_engine": ratio(o(f"runner_wnw_r{r}"), o(f"engine_wnw_r{r}"))})
    t["runner_ok"] = all(x is not None and x <= 1.10 for k, x in t.items() if "runner" in k and k.endswith("_engine"))
    return t


def main(argv: list[str] | None = None) -> dict:
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="every row at tiny dims on the CPU")
    ap.add_argument("--gpu-check", action="store_true", help="issue 15's targets: Voxtral shape, 3,000 audio tokens (Full and WnW also at 12,000)")
    ap.add_argument("--models", default="voxtral,qwen_omni")
    ap.add_argument("--audio", default="3000,12000")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--policy-steps", type=int, default=128, help="steps of the arkvale rows")
    ap.add_argument("--hf-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the hf_generate rows (their median)")
    ap.add_argument("--check-steps", type=int, default=16, help="steps of the fused-vs-reference check")
    ap.add_argument("--engine-steps", type=int, default=16, help="steps of the reference-path row")
    ap.add_argument("--retention", type=float, default=0.2)
    ap.add_argument("--sweep", default="35,75,115,155,195,235", help="Table 4: tidal heads (n_voice - n_anchor)")
    ap.add_argument("--sweep-anchors", type=int, default=5)
    ap.add_argument("--sweep-steps", type=int, default=96)
    ap.add_argument("--anchor-speed", type=float, default=12.0, help="audio tokens the scripted anchor focus moves per step")
    ap.add_argument("--anchor-beta", type=float, default=0.9)
    ap.add_argument("--long-only", action="store_true",
                    help="--gpu-check without its lead shape (voxtral at 3,000): the 12,000-token and Qwen rows only")
    ap.add_argument("--profile", type=int, default=0, help="steps of a torch.profiler row for WnW and ArkVale (0: none)")
    ap.add_argument("--wnw-variant", action="append", default=[],
                    help="a further WnW row with these method options, KEY=VALUE[,KEY=VALUE] (repeatable), e.g. "
                         "max_recalled=6")
    ap.add_argument("--kernels", choices=("triton", "torch"), default="torch",
                    help="--smoke: the fused step's kernels on the CPU (triton: Triton's interpreter)")
    a = ap.parse_args(argv)
    if a.smoke:
        DEV = "cpu"
        FAST.update(store="packed", fused=True, kernels=a.kernels)
        if a.kernels == "triton":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        torch.set_num_threads(1)  # tiny ops: threads only spin (the CPU may be shared)
        a.models, a.audio = "tiny,tiny_qwen", "200,500"
        a.steps, a.policy_steps, a.hf_steps, a.engine_steps, a.sweep_steps, a.check_steps = 6, 6, 3, 3, 4, 5
        a.repeats, a.sweep, a.sweep_anchors, a.anchor_speed = 2, "3,9", 1, 25.0
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke for the CPU check")
    if a.gpu_check:
        a.models, a.audio, a.sweep = "voxtral,qwen_omni", "3000,12000", ""
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
                         transformers=transformers.__version__, triton=triton_version,
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
    if a.gpu_check:
        results["targets"] = targets(results, "voxtral", 3000, a.retention)
        print("targets", json.dumps(results["targets"]), flush=True)
        if out is not None:
            out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
