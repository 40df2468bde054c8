"""Serving throughput at a fixed KV memory budget (issue 16): continuous batching of many long-audio requests.

Every request is a stream of the engine's `decode_batch` (the loop `wnw-run batch_size=` runs) on the model shapes,
random weights and scripted anchor attention of `decode_speed.py` (imported from there, not copied). All requests
arrive at once; the KV budget is one real allocation (`kv.pool.KVPool`): a request joins when the pool has room for
its placed KV (an extent for each head's resident audio and recall room, dense pages for its prompt's text) and its
expected growth (the dense pages of the scenario's mean answer, `Request.expected_new_tokens`, besides the growth
still expected of the running streams); its generated tokens' K/V then come in dense pages (one 64-row pool block
per layer and KV head) as the answer grows, and where the pool has no block left the newest stream is preempted
(freed, restarted from scratch later: `preempted` counts them; its discarded tokens are not counted in
tokens_per_s). A stream leaves at its length cap (random weights: no end token), freeing all it holds. Prefill
runs `--prefill-chunk-layers` layers between two decode steps.

    PYTHONPATH=src python3 benchmarks/serving.py --gpu --out $OUT/serving.json    # the H200 scenario, docs/gpu.md
    python3 benchmarks/serving.py --smoke [--out x.json]                         # tiny shapes on the CPU, seconds

--gpu: Voxtral-Mini-3B decoder shape, bf16, `--kv-budget-gb` (6) of KV, `--requests-4min` (48) requests of 3,000
audio tokens (4 min at 12.5 tokens/s) and `--requests-10min` (20) of 7,500 (10 min), all arriving at once, each
answering about 3 tokens per second of audio (720 / 1,800 tokens, +-20% per request, seeded), for `--methods`
(Full, AdaKV@0.2, ArkVale@0.2, WnW@0.2, WnW@0.2 with recall off) and `--retention`. Scripted anchors (WnW): the
focus sweeps the clip once over the answer (n_audio / n_new audio tokens per token, a transcript's pace). The
scenarios run method by method, both lengths each, with eager decode steps for every method of `--methods` but the
last, then `--graph-methods` (WnW, Full) with one CUDA graph per composition of the batch (captured after
`WNW_WARM_STEPS`, 1, eager step of each composition), then the last of `--methods` (`--methods ""` runs the graph
rows alone). No scenario starts after `--deadline-s` (150 s); rows are written as each scenario ends, so a call cut
short keeps what finished. The budget is 6 GB rather than the issue's 40 so that the scenarios fit one call (the
stream counts scale with the budget). The request counts exceed every method's peak (Full 12 / 5 streams, the 0.2
methods about 3x as many), so the pool and not the request count sets it: `max_concurrent` < `requests` in a row
shows it did.

A row per (method, audio length): {"kind": "throughput", "method", "retention", "audio_tokens", "kv_budget_gb",
"max_concurrent", "tokens_per_s", "p50_ms", "p95_ms", "h2d_gb_per_s", "preempted"} plus: requests, generated tokens,
wall seconds, mean batch size, prefill ms (mean per request, and the longest stall of the running streams by one
prefill chunk), the pool's peak use, its host arena (size, peak, mirrors pinned outside it), requests refused, the GPU, date and command. tokens_per_s: every generated
token over the wall time from the arrival to the last finish (prefills included); p50/p95: inter-token latency of
every stream over every token (the prefill chunks interleaved included; a preempted stream's tokens before its
restart are not); h2d_gb_per_s: host -> device bytes of the recalls (of the runs that finished) over the decode
steps run at peak concurrency, over their time; tokens_per_s_at_peak: the steady state, max_concurrent tokens per step
over the steps run at peak concurrency (with few requests per wave, tokens_per_s is mostly ramp-up and tail);
preempted: preemptions (a stream restarted from scratch); where the wall went, over every step (`_wall_parts`:
steps and seconds by kind, prefill between steps, admissions that waited for room). Then a "latency_bs1" row per
method: the same request alone (p50/p95 at batch size 1, the reference for the peak's p95).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_speed as ds  # noqa: E402  (the model shapes, the benchmark backbone, the scripted WnW)

TOKENS_PER_AUDIO_SECOND = 3.0  # a transcript's length: about 3 tokens per second of speech
METHODS = ("full", "wnw", "adakv", "arkvale", "wnw_recall_off")  # the last one runs after the graph rows
WARMUP_REQUESTS, WARMUP_TOKENS = 8, 32  # a scenario's warm-up before its clock (`scenario`)


def target(method: str, retention: float) -> float:
    """The retention a row of `method` runs at: 1.0 for a method that keeps every audio position (its policy class
    says `uses_retention = False`: Full Cache), else `retention` (the benchmark's own WnW variants included)."""
    from wnw_exp.methods import registered_methods

    cls = registered_methods().get(method.split(":")[0])
    return 1.0 if cls is not None and not cls.uses_retention else retention


def policy_for(method: str, info: dict, scores: Path, n_audio: int, n_new: int):
    """The real method (or WnW with the scripted anchor attention), before any sample: forked per stream. A name may
    carry method options after a colon, joined by `+` (the method lists are comma-separated):
    `wnw:max_recalled=6`, `wnw:max_recalled=6+top_k=2`."""
    from wnw_exp.methods import build_policy

    method, _, spec = method.partition(":")
    kw = ds.wnw_variants([spec.replace("+", ",")])[0][1] if spec else {}
    if method.startswith("wnw"):
        speed = n_audio / max(n_new, 1)
        return ds.scripted_wnw(info, scores, n_audio, n_new + 2, speed, 0.9, recall=method == "wnw", **kw)
    return build_policy(dict(name=method, **kw), info)


def lengths(n: int, mean: int, seed: int = 0) -> list[int]:
    """Answer lengths of `n` requests: `mean` +-20%, seeded."""
    rng = np.random.default_rng(seed)
    return [max(2, int(round(mean * f))) for f in rng.uniform(0.8, 1.2, n)]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of `n` requests at `rate` requests per second (exponential gaps, seeded); rate 0: all at 0."""
    if rate <= 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first arrives at once


def scenario(bb, prompt, method: str, info: dict, scores: Path, caps: list[int], budget_gb: float, retention: float,
             chunk_layers: int | None, path: dict, expected: int | None = None,
             arrivals: list[float] | None = None, overlap: bool | None = None, host_gb: float | None = None,
             warmup: bool = True, freeze_gc: bool = True, decode_priority: bool = False) -> dict:
    from wnw_exp.engine.serve import BatchStats, Request, decode_batch, default_pool
    from wnw_exp.kv.pool import KVPool

    r = target(method, retention)
    template = policy_for(method, info, scores, prompt.n_audio, max(caps))
    template.check(r)
    pool = (default_pool(bb, budget_gb, host_gb=host_gb, cpu_tier=template.cpu_tier)  # (pinned before the clock)
            or KVPool.of_bytes(budget_gb * 1e9, bb.head_dim, bb.dtype, bb.device))
    # Warm-up before the clock, as a server starts: WARMUP_REQUESTS short requests through the same pool and path
    # (an overlapped prefill, a placement, steps of a few batch sizes), so that kernels compile here, not in the
    # run (a Triton kernel's first launch in a process compiles it or loads it from the on-disk cache: seconds).
    # The run still captures its own graphs (reported: steps_capture).
    ds._sync()
    t_warm = time.perf_counter()
    if warmup:
        warm = [Request(f"warm{i}", prompt, c, c) for i, c in enumerate(min(c, WARMUP_TOKENS)
                                                                           for c in caps[:WARMUP_REQUESTS])]
        for _, res in decode_batch(bb, warm, template.fork, retention=r, pool=pool, prefill_chunk_layers=chunk_layers,
                                   overlap_prefill=overlap, decode_priority=decode_priority, **path):
            if isinstance(res, Exception):
                raise res
        ds._sync()
    warmup_s = time.perf_counter() - t_warm
    stats = BatchStats()
    ds._sync()
    t0 = time.perf_counter()
    results = {}
    expected = expected if expected is not None else int(round(float(np.mean(caps))))  # the mean answer
    arrivals = arrivals if arrivals is not None else [0.0] * len(caps)
    requests = [Request(i, prompt, c, expected, arrival_s=a) for i, (c, a) in enumerate(zip(caps, arrivals))]
    for key, res in decode_batch(bb, requests, template.fork, retention=r, pool=pool, prefill_chunk_layers=chunk_layers,
                                 stats=stats, overlap_prefill=overlap, freeze_gc=freeze_gc,
                                 decode_priority=decode_priority, **path):
        if isinstance(res, Exception):
            raise res
        results[key] = res
    ds._sync()
    wall = time.perf_counter() - t0
    n_tokens = sum(len(x.tokens) for x in results.values())
    load = load_metrics(stats, results, arrivals)
    peak = max(stats.batch_sizes) if stats.batch_sizes else 0
    at_peak = [i for i, b in enumerate(stats.batch_sizes) if b == peak]
    h2d = np.zeros(len(stats.batch_sizes))
    for key, res in results.items():
        j0 = stats.joined_at.get(key)
        if j0 is not None:
            steps = res.trace["h2d_bytes"]
            h2d[j0: j0 + len(steps)] += steps[: len(h2d) - j0]
    peak_s = sum(stats.step_ms[i] for i in at_peak) / 1e3
    return dict(kind="throughput", method=method, retention=r, audio_tokens=prompt.n_audio, kv_budget_gb=budget_gb,
                max_concurrent=peak, tokens_per_s=n_tokens / wall,
                # the steady state: the tokens of the steps run at peak concurrency (one per stream) over their time
                tokens_per_s_at_peak=peak * len(at_peak) / peak_s if peak_s else 0.0,
                p50_ms=load["itl_ms_p50"], p95_ms=load["itl_ms_p95"],  # (the issue-16 schema's names)
                h2d_gb_per_s=float(h2d[at_peak].sum()) / 1e9 / peak_s if peak_s else 0.0,
                requests=len(caps), finished=len(results), tokens=n_tokens, wall_s=wall,
                mean_batch=float(np.mean(stats.batch_sizes)) if stats.batch_sizes else 0.0,
                steps=len(stats.batch_sizes), step_ms_p50_at_peak=_pct([stats.step_ms[i] for i in at_peak], 50),
                step_ms_p95_at_peak=_pct([stats.step_ms[i] for i in at_peak], 95), steps_at_peak=len(at_peak),
                **_kinds_at_peak(stats, at_peak), **_wall_parts(stats), **load,
                prefill_ms_mean=float(np.mean([x.prefill_ms for x in results.values()])),
                prefill_stall_ms_max=max(stats.prefill_ms_between_steps, default=0.0),
                prefill_chunk_layers=chunk_layers, overlap_prefill=bool(overlap is not False and bb.device.type == "cuda"),
                pool_peak_gb=pool.stats()["peak_bytes"] / 1e9,
                pool_capacity_gb=pool.capacity_bytes / 1e9, refused=len(stats.refused),
                host_arena_gb=pool.stats()["host_arena_bytes"] / 1e9,
                host_arena_peak_gb=pool.stats()["host_arena_peak_bytes"] / 1e9,
                host_pinned_outside=pool.stats()["host_pinned_outside"],
                preempted=len(stats.preempted), expected_new_tokens=expected, warmup_s=warmup_s,
                gc_s=stats.gc_s, gc_passes=stats.gc_passes, gc_max_ms=stats.gc_max_ms, gc_frozen=freeze_gc,
                decode_priority=bool(decode_priority and bb.device.type == "cuda"),
                arrivals="poisson" if any(arrivals) else "burst", arrival_span_s=max(arrivals),
                r_gpu_mean=float(np.mean([x.store_summary["r_gpu"] for x in results.values()])),
                path={k: v for k, v in path.items()})


def latency_bs1(bb, prompt, method: str, info: dict, scores: Path, n_new: int, retention: float, path: dict) -> dict:
    from wnw_exp.engine.serve import generate

    r = target(method, retention)
    policy = policy_for(method, info, scores, prompt.n_audio, n_new)
    policy.check(r)
    res = generate(bb, prompt, policy, retention=r, max_new_tokens=n_new, **path)
    return dict(kind="latency_bs1", method=method, retention=r, audio_tokens=prompt.n_audio, max_concurrent=1,
                p50_ms=_pct(res.step_ms, 50), p95_ms=_pct(res.step_ms, 95), tokens=len(res.tokens),
                prefill_ms=res.prefill_ms)


def gemm_tflops(dev, n: int = 8192, reps: int = 10) -> float:
    """The device's achievable dense bf16 matmul rate (TFLOP/s), timed: the compute floor's denominator."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    a @ b
    ds._sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    ds._sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


@torch.no_grad()
def prefill_row(bb, prompt, method: str, info: dict, scores: Path, retention: float, path: dict, reps: int = 5,
                top: int = 12) -> dict:
    """One request's prefill as admission runs it while streams decode (`Stream.prefill_layers`, every layer placed
    after the forward pass by `finish_prefill`, into a pool), on its own on the GPU, median of
    `reps` after a warm one, against its compute floor: the decoder's matmul FLOPs (2 x weights x tokens, and the
    causal attention's 2 x T^2 x H_q x D per layer) at the GEMM rate measured in the same call; and the `top`
    device kernels of one prefill (torch.profiler); `layers_host` and `finish_host`: the `top` host operations of its
    layers' launches and of its `finish_prefill` (the placement) by self time, CUDA runtime calls such as a stream
    synchronisation or a pinned allocation among them."""
    from torch.profiler import ProfilerActivity, profile

    from wnw_exp.engine.decode import Stream, decode_path
    from wnw_exp.kv.pool import KVPool

    r = target(method, retention)
    template = policy_for(method, info, scores, prompt.n_audio, 8)
    template.check(r)
    pool = KVPool.of_bytes(2e9 if bb.device.type == "cuda" else 1e8, bb.head_dim, bb.dtype, bb.device)
    cuda = bb.device.type == "cuda"

    def once(layers_prof=None, finish_prof=None) -> tuple[float, float]:
        policy = template.fork()
        st = Stream(bb, prompt, policy, retention=r, max_new_tokens=8, path=decode_path(bb.device, policy, **path),
                    pool=pool, expected_new_tokens=8, defer_place=True)
        ds._sync()
        t0 = time.perf_counter()
        with layers_prof if layers_prof is not None else nullcontext():
            for _ in st.prefill_layers():
                pass
            ds._sync()
        t1 = time.perf_counter()
        with finish_prof if finish_prof is not None else nullcontext():
            st.finish_prefill()
            ds._sync()
        t2 = time.perf_counter()
        st.store.release_memory()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    once()
    runs = [once() for _ in range(reps)]
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        once()
    # the host's time alone, the layers' launches and the placement's: ops, CUDA runtime calls (syncs, copies)
    layers, finish = profile(activities=[ProfilerActivity.CPU]), profile(activities=[ProfilerActivity.CPU])
    once(layers, finish)
    T, L = prompt.input_ids.shape[1], bb.n_layers
    linear = sum(p.numel() for layer in bb.layers for p in layer.parameters() if p.dim() == 2)
    flops = 2 * linear * T + L * 2 * T * T * bb.n_q_heads * bb.head_dim  # causal: half of 4 T^2 H D
    rate = gemm_tflops(bb.device) if cuda else None
    layers_ms, finish_ms = float(np.median([a for a, _ in runs])), float(np.median([b for _, b in runs]))
    return dict(kind="prefill", method=method, retention=r, audio_tokens=prompt.n_audio, prompt_tokens=T,
                prefill_ms=layers_ms + finish_ms, layers_ms=layers_ms, finish_ms=finish_ms,
                floor_ms=flops / (rate * 1e12) * 1e3 if rate else None, gemm_tflops=rate, tflop=flops / 1e12,
                **ds.per_step(ds.kernel_times(prof, cuda), 1, top),
                layers_host=ds.per_step(ds.kernel_times(layers, False), 1, top),
                finish_host=ds.per_step(ds.kernel_times(finish, False), 1, top))


class _PeakSteps(list):
    """`BatchStats.batch_sizes` that runs a torch.profiler over `steps` decode steps once the batch holds `peak`
    streams, after `skip` steps at that size (the graph's capture and warm steps stay out) and `steps` more timed
    without the profiler (`BatchStats.step_ms`: each step's wall time, which ends with the host reading its tokens)."""

    def __init__(self, prof, peak: int, steps: int, skip: int):
        super().__init__()
        self.prof, self.peak, self.steps, self.skip, self.seen = prof, peak, steps, skip, 0

    def append(self, n: int) -> None:
        super().append(n)
        if n != self.peak or self.seen > self.skip + 2 * self.steps:
            return
        self.seen += 1
        if self.seen == self.skip + self.steps:
            ds._sync()
            self.prof.start()
        elif self.seen == self.skip + 2 * self.steps:
            ds._sync()
            self.prof.stop()


ABLATIONS = ("copy", "flush", "records", "decide")


def ablated(parts: str):
    """A diagnostic, for `--profile` only: the named parts of the work after each decode step left out, to time
    the step without them (the answers are then wrong). copy: the flush without its copy of the recalled rows;
    flush: no flush at all (queued moves stay queued); records: no per-step accounting; decide: no method decision
    (`Policy.after_step_all`). Returns a function that puts everything back."""
    from wnw_exp.kv import packed
    from wnw_exp.methods.base import Policy

    undo = []

    def patch(obj, name, value):
        undo.append((obj, name, obj.__dict__[name]))
        setattr(obj, name, value)

    for part in filter(None, parts.split(",")):
        if part not in ABLATIONS:
            raise SystemExit(f"--ablate {part!r}: choose from {', '.join(ABLATIONS)}")
        if part == "copy":
            from wnw_exp.kv import triton_moves as tm

            def flush_only(self):
                if self.n_rows:
                    self.flush()
                    self.count.zero_()  # the list emptied as the copy would
            patch(tm.FlushTables, "__call__", flush_only)
        elif part == "flush":
            patch(packed, "flush_stores", lambda stores, held=None: None)
        elif part == "records":
            patch(packed, "record_steps", lambda stores, held=None: None)
        elif part == "decide":
            classes, i = [Policy], 0
            while i < len(classes):  # every Policy class, however deep
                classes += [c for c in classes[i].__subclasses__() if c not in classes]
                i += 1
            for cls in classes:
                if "after_step_all" in cls.__dict__:
                    patch(cls, "after_step_all", classmethod(lambda cls, policies, steps, held: None))

    def restore():
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
    return restore


STEP_KINDS = ("replay", "capture", "eager")  # `BatchStats.step_kinds`


def _of_kind(stats, steps, kind: str) -> list[int]:
    """The indices among `steps` of the decode steps of `kind` (a value of `BatchStats.step_kinds`)."""
    return [i for i in steps if stats.step_kinds[i] == kind]


def _wall_parts(stats) -> dict:
    """Where a scenario's wall time went: every part of the engine's loop (`BatchStats.wall_s`, `wall_s_<part>`:
    waiting for arrivals, making streams, prefill, placement, dense pages, decode steps, reading tokens, finishing
    streams, the caller, the loop's bookkeeping; they add up to the wall), and the decode steps by kind over every
    step (count and seconds: replays, captures, eager steps; a new composition of the batch costs eager + capture
    steps), the prefill chunks run between two steps, the admissions that waited for room in the pool, and the
    placements' host time by part (`place_s_<part>`, `engine.decode.PLACE_PARTS`: most of `wall_s_place`)."""
    from wnw_exp.engine.serve import WALL_PARTS

    out = {f"wall_s_{part}": stats.wall_s.get(part, 0.0) for part in WALL_PARTS}
    for kind in STEP_KINDS:
        idx = _of_kind(stats, range(len(stats.step_ms)), kind)
        out[f"steps_{kind}"], out[f"step_s_{kind}"] = len(idx), sum(stats.step_ms[i] for i in idx) / 1e3
    out["prefill_s_between_steps"] = sum(stats.prefill_ms_between_steps) / 1e3
    out["room_waits"] = stats.room_waits
    from wnw_exp.engine.decode import PLACE_PARTS

    out.update({f"place_s_{part}": stats.place_s.get(part, 0.0) for part in PLACE_PARTS})  # parts of wall_s_place
    return out


def load_metrics(stats, results: dict, arrivals: list[float]) -> dict:
    """A serving engineer's view of one scenario, from the engine's own clocks (`BatchStats`):

    - whole run (arrival of the first request to the last token): output tokens/s and requests/s;
    - the steady window: from the end of the first decode step run at peak concurrency (the ramp-up before it) to
      the last admission (after it the queue is empty and the batch drains: the tail); the tokens emitted and the
      requests finished inside it, over its length (None where the batch never ran at peak before the last admission);
    - TTFT (a request's arrival to its first token, queueing and prefill included) and inter-token latency, p50/p95/p99
      over every request / every gap (ITL in the window too).
    `results`: key -> DecodeResult of the requests that finished; `arrivals[key]`: their arrival, s after the start."""
    t0 = stats.started_at
    wall = sum(stats.wall_s.values())
    times = {k: np.asarray(stats.emitted_at[k]) for k in results}
    every = np.sort(np.concatenate(list(times.values()))) if times else np.zeros(0)
    ttft = [stats.first_token_at[k] - (t0 + arrivals[k]) for k in results]
    gaps = np.concatenate([np.diff(t) for t in times.values()]) * 1e3 if times else np.zeros(0)
    out = dict(tokens_per_s_whole=len(every) / wall if wall else 0.0,
               requests_per_s_whole=len(results) / wall if wall else 0.0,
               **{f"ttft_ms_p{q}": _pct(1e3 * np.asarray(ttft), q) for q in (50, 95, 99)},
               **{f"itl_ms_p{q}": _pct(gaps, q) for q in (50, 95, 99)})
    peak = max(stats.batch_sizes, default=0)
    start = stats.step_at[stats.batch_sizes.index(peak)] if peak else None
    end = max(stats.first_token_at.values(), default=None)
    if start is None or end is None or end <= start:
        return dict(out, window_s=None, ramp_s=None, tail_s=None, tokens_per_s_window=None, requests_per_s_window=None,
                    **{f"itl_ms_window_p{q}": None for q in (50, 95, 99)})
    in_window = (every > start) & (every <= end)
    finished = sum(1 for t in times.values() if start < t[-1] <= end)
    gaps_w = np.concatenate([np.diff(t)[(t[1:] > start) & (t[1:] <= end)] for t in times.values()]) * 1e3
    return dict(out, window_s=end - start, ramp_s=start - t0, tail_s=t0 + wall - end,
                tokens_per_s_window=int(in_window.sum()) / (end - start), requests_per_s_window=finished / (end - start),
                **{f"itl_ms_window_p{q}": _pct(gaps_w, q) for q in (50, 95, 99)})


def _kinds_at_peak(stats, at_peak: list[int]) -> dict:
    """The steps at peak by kind (`BatchStats.step_kinds`: replays of a composition's CUDA graph, its capture, the
    eager steps before it): how many, and their mean wall time. What separates the at-peak mean from the replays'."""
    out = {}
    for kind in STEP_KINDS:
        idx = _of_kind(stats, at_peak, kind)
        out[f"steps_at_peak_{kind}"] = len(idx)
        out[f"step_ms_mean_at_peak_{kind}"] = float(np.mean([stats.step_ms[i] for i in idx])) if idx else None
        if kind != "replay":  # of that mean: making the composition's step, and the decisions and moves after it
            for part, xs in (("build", stats.step_build_ms), ("after", stats.step_after_ms)):
                out[f"step_{part}_ms_mean_at_peak_{kind}"] = float(np.mean([xs[i] for i in idx])) if idx else None
    return out


def profile_batch(bb, prompt, method: str, info: dict, scores: Path, n_streams: int, steps: int, retention: float,
                  path: dict, top: int = 18) -> dict:
    """Where a batched decode step's GPU time goes at `n_streams` streams: `n_streams` equal requests in an
    unbounded pool, torch.profiler over `steps` decode steps taken while all of them run (eagerly, or replaying the
    composition's CUDA graph); the `top` kernels by GPU time per step (us) with their launches per step."""
    from torch.profiler import ProfilerActivity, profile

    from wnw_exp.engine.serve import BatchStats, Request, decode_batch
    from wnw_exp.kv.pool import KVPool

    skip = 4  # steps at the peak left out: the composition's eager steps and its capture
    r = target(method, retention)
    cap = n_streams + 2 * steps + 2 * skip  # every stream still runs when the last one joins, 2 x `steps` later too
    template = policy_for(method, info, scores, prompt.n_audio, cap)
    template.check(r)
    cuda = bb.device.type == "cuda"
    pool = KVPool.of_bytes(0.5 * (torch.cuda.mem_get_info()[0] if cuda else 1e9), bb.head_dim, bb.dtype, bb.device)
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    stats = BatchStats()
    stats.batch_sizes = _PeakSteps(prof, n_streams, steps, skip)
    for _, res in decode_batch(bb, [Request(i, prompt, cap, cap) for i in range(n_streams)], template.fork,
                               retention=r, pool=pool, stats=stats, **path):
        if isinstance(res, Exception):
            raise res
    if stats.batch_sizes.seen < skip + 2 * steps:
        if stats.batch_sizes.seen >= skip + steps:  # started, never stopped
            prof.stop()
        raise RuntimeError(f"the batch reached {n_streams} streams for {stats.batch_sizes.seen} steps only")
    at_peak = [ms for n, ms in zip(stats.batch_sizes, stats.step_ms) if n == n_streams]
    # on the CPU (the smoke's check only) the ops' times
    return dict(kind="profile", method=method, retention=r, audio_tokens=prompt.n_audio, streams=n_streams,
                steps=steps, graph=path.get("graph"), step_ms_p50=_pct(at_peak[skip:skip + steps], 50),
                step_ms_wall_p50=_pct(at_peak[skip + steps:skip + 2 * steps], 50),
                **ds.per_step(ds.kernel_times(prof, cuda), steps, top))


def _pct(x, q) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu", action="store_true", help="the H200 scenario (Voxtral-Mini-3B shape, bf16)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the test's)")
    ap.add_argument("--kv-budget-gb", type=float, help="the KV pool (default: 6 with --gpu, 0.0025 with --smoke)")
    # enough requests that the pool, not their number, sets the 0.2-retention methods' peak in 6 GB (Full holds
    # 12 / 5 there; WnW and AdaKV, whose answers' pages now come as they grow, about 3x as many)
    ap.add_argument("--kv-host-gb", type=float, help="--gpu: the pool's pinned host arena for the host mirrors "
                    "(default: twice the pool for a method with a CPU tier, at most a quarter of the memory)")
    ap.add_argument("--requests-4min", type=int, default=48)
    ap.add_argument("--requests-10min", type=int, default=20)
    ap.add_argument("--lengths", default="4,10", help="--gpu: which scenarios run, in minutes of audio (4, 10)")
    ap.add_argument("--arrival-rate", type=float, default=0.0,
                    help="requests per second, Poisson (seeded); 0: every request arrives at once (a burst)")
    ap.add_argument("--retention", type=float, default=0.2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--prefill-chunk-layers", type=int, default=6, help="prefill layers between two decode steps")
    ap.add_argument("--no-overlap-prefill", action="store_true",
                    help="--gpu: run each prefill between decode steps on the decode stream (the default runs it on a "
                         "CUDA stream of its own, beside the decode steps)")
    ap.add_argument("--bs1-tokens", type=int, default=32, help="answer length of the batch-size-1 latency rows")
    ap.add_argument("--graph-methods", default="wnw,full",
                    help="--gpu: after every scenario ran without CUDA graphs, these again with one graph per batch "
                         "composition ('' for none); a name may carry method options: wnw:max_recalled=6")
    ap.add_argument("--profile", default="",
                    help="--gpu: instead of the scenarios, profile rows 'method:streams:audio[:graph][:-part+part]', "
                         "comma-separated (e.g. wnw:33:3000:graph,wnw:33:3000:graph:-copy,adakv:35:3000); the parts "
                         "are --ablate's, for that row")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--prefill", default="", help="instead of the scenarios, prefill rows of these methods "
                    "(comma-separated) at the first of --lengths: time against the compute floor, top kernels")
    ap.add_argument("--ablate", default="", help="--profile only, a diagnostic: parts of the work after each step "
                    f"left out (comma-separated: {', '.join(ABLATIONS)}); the answers are then wrong")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time each scenario from a cold start (its kernels compile inside the run)")
    ap.add_argument("--decode-priority", action="store_true",
                    help="--gpu: the loop's work, decode steps included, on a CUDA stream of the highest priority "
                         "(decode_batch's decode_priority=True), an overlapped prefill's on the lowest")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="let the garbage collector's passes scan every object (decode_batch's freeze_gc=False)")
    ap.add_argument("--deadline-s", type=float, default=150.0, help="--gpu: start no scenario after this many seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        ds.DEV = "cpu"
        torch.set_num_threads(1)
        # 200 audio tokens, 6-token answers, room for 2 Full streams (1.1 MB each) and 4 WnW@0.2 ones (0.5 MB)
        model_name, audio, budget = "tiny", [(200, 6)], a.kv_budget_gb or 0.0025
        tok_mean, bs1_tokens = 6, 4
        path = dict(store="packed", fused=True, kernels="torch")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --smoke for the CPU check")
        model_name, budget, tok_mean, bs1_tokens = "voxtral", a.kv_budget_gb or 6.0, None, a.bs1_tokens
        audio = [x for x, m in (((3000, a.requests_4min), "4"), ((7500, a.requests_10min), "10"))
                 if m in a.lengths.split(",")]
        path = dict(graph=False)
    out = Path(a.out) if a.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    import transformers
    from wnw_exp.engine import decode as engine_decode

    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() and not a.smoke else "cpu (smoke)",
                command=" ".join(["benchmarks/serving.py", *(sys.argv[1:] if argv is None else argv)]),
                torch=torch.__version__, transformers=transformers.__version__,
                engine=dict(warm_steps=engine_decode.WARM_STEPS))
    model = ds.build_model(model_name)
    info = ds.backbone_info(model_name, model.config)
    tmp = (out.parent if out is not None else Path("/tmp")) / "serving_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    scores = ds.synthetic_head_scores(info, tmp / f"{info['name']}_head_scores.json")
    # method by method, both lengths each: a call cut short keeps whole comparisons. The graph rows come after the
    # eager rows of every method but the last (recall off), so a failing capture costs no eager row of the others.
    methods = [m for m in a.methods.split(",") if m]
    eager = lambda ms: [(n_audio, n_req, m, path) for m in ms for n_audio, n_req in audio]  # noqa: E731
    jobs = eager(methods[:-1])
    if not a.smoke:
        jobs += [(n_audio, n_req, m, {}) for m in a.graph_methods.split(",") if m for n_audio, n_req in audio]
    jobs += eager(methods[-1:])
    if a.profile or a.prefill:
        jobs = []
    rows: list[dict] = []

    def emit(row: dict) -> None:  # every row, measured or skipped, printed and in the file at once
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out is not None:
            out.write_text(json.dumps(rows, indent=1))

    t_start = time.perf_counter()
    backbones: dict = {}
    for spec in filter(None, a.profile.split(",")):
        method, n, n_audio, *extra = spec.split(":")  # extra: "graph", "-part+part" (ablations of this row)
        parts = ",".join(filter(None, [a.ablate] + [x[1:].replace("+", ",") for x in extra if x.startswith("-")]))
        if int(n_audio) not in backbones:
            backbones[int(n_audio)] = ds.make_backbone(model, int(n_audio))
        bb = backbones[int(n_audio)]
        restore = ablated(parts)
        try:
            row = profile_batch(bb, bb.build_prompt(), method, info, scores, int(n), a.profile_steps, a.retention,
                                path if a.smoke else dict(graph="graph" in extra))
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            row = dict(kind="profile", method=method, spec=spec, error=f"{type(e).__name__}: {e}")
        finally:
            restore()
        emit(dict(row, ablate=parts or None, **meta))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for method in filter(None, a.prefill.split(",")):
        n_audio = audio[0][0]
        if n_audio not in backbones:
            backbones[n_audio] = ds.make_backbone(model, n_audio)
        bb = backbones[n_audio]
        try:
            row = prefill_row(bb, bb.build_prompt(), method, info, scores, a.retention, path if a.smoke else {})
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            row = dict(kind="prefill", method=method, error=f"{type(e).__name__}: {e}")
        emit(dict(row, **meta))
    for n_audio, n_req, method, job_path in jobs:
        graph = job_path.get("graph", True) and not a.smoke
        if not a.smoke and time.perf_counter() - t_start > a.deadline_s:
            emit(dict(kind="throughput", method=method, audio_tokens=n_audio, graph=graph,
                      skipped=f"not started: past --deadline-s {a.deadline_s:g}", **meta))
            continue
        if n_audio not in backbones:
            backbones[n_audio] = ds.make_backbone(model, n_audio)
        bb = backbones[n_audio]
        prompt = bb.build_prompt()
        mean = tok_mean or int(round(n_audio / ds.TOKEN_RATE * TOKENS_PER_AUDIO_SECOND))
        caps = lengths(n_req, mean)
        arrivals = poisson_arrivals(n_req, a.arrival_rate, seed=1)
        for kind, fn in (("throughput", lambda: scenario(bb, prompt, method, info, scores, caps, budget, a.retention,
                                                         a.prefill_chunk_layers, job_path, mean, arrivals,
                                                         False if a.no_overlap_prefill else None, a.kv_host_gb,
                                                         not a.no_warmup, not a.no_gc_freeze, a.decode_priority)),
                         ("latency_bs1", lambda: latency_bs1(bb, prompt, method, info, scores, min(bs1_tokens, mean),
                                                             a.retention, job_path))):
            try:
                row = fn()
            except Exception as e:  # noqa: BLE001 - the row says what failed, the others run
                import traceback
                traceback.print_exc()
                row = dict(kind=kind, method=method, audio_tokens=n_audio, error=f"{type(e).__name__}: {e}")
            emit(dict(row, graph=graph, **meta))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
