"""Prefill and greedy decode: one loop for every method, backbone and device, KV in the tier store.

Methods act only through the policy hooks; the engine has no `if method == ...`. The decode step is
`engine.step.TorchStep` (the reference) or `engine.step.FusedStep` (the fast path), optionally replayed from a
CUDA graph: options of this one loop, not second decoders.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections import deque
from contextlib import nullcontext
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from wnw_exp.backbones.base import Backbone, Prompt
from wnw_exp.backbones.layer import causal_attention, decoder_layer
from wnw_exp.engine.step import BatchedFusedStep, CapturedStep, FusedStep, TorchStep
from wnw_exp.methods.base import Policy, PrefillScores, SampleContext


@dataclass
class DecodeResult:
    tokens: list[int]
    terminated: bool  # stopped at EOS (not at the length cap)
    step_ms: list[float]  # wall time of each decode step (the first token comes from prefill)
    prefill_ms: float
    store_summary: dict
    trace: dict = field(default_factory=dict)  # per-step records for figures
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for
    knobs: dict = field(default_factory=dict)  # the stream's policy's `knobs()` (its own, in a batch)

    @property
    def ms_per_token(self) -> float:
        if not self.step_ms:
            return float("nan")
        s = sorted(self.step_ms)
        return s[len(s) // 2]


def max_new_tokens_for(duration_s: float, per_second: float, minimum: int) -> int:
    """The length cap tied to the audio duration: a transcript cannot be longer than speech allows."""
    return int(math.ceil(duration_s * per_second)) + minimum


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodePath:
    """How a run decodes (see `generate`)."""

    store: str  # reference | packed
    fused: bool
    graph: bool
    kernels: str  # triton | torch


def decode_path(device: torch.device, policy: Policy, store: str = "auto", fused: bool | None = None,
                graph: bool | None = None, kernels: str = "auto") -> DecodePath:
    """Resolve `generate`'s choices: on CUDA with Triton the packed store, the fused step and, when the method's
    decode hooks are graph-safe, one CUDA graph per step; on the CPU the reference store and step."""
    cuda = device.type == "cuda"
    triton = importlib.util.find_spec("triton") is not None
    if kernels == "auto":
        kernels = "triton" if cuda and triton else "torch"
    if kernels not in ("triton", "torch"):
        raise ValueError(f"unknown kernels {kernels!r}: auto, triton or torch")
    if store == "auto":
        # The packed store (one buffer, device-side moves) is the fast path on CUDA; the reference store is what
        # it is tested against. A method that merges tokens runs on the reference store (`packed_store`).
        store = "packed" if cuda and triton and policy.packed_store else "reference"
    if store not in ("reference", "packed"):
        raise ValueError(f"unknown store {store!r}: auto, reference or packed")
    if fused is None:
        fused = store == "packed" and cuda and kernels == "triton"
    if fused and store != "packed":
        raise ValueError("the fused step runs on the packed store (store=packed)")
    safe = cuda and triton and policy.graph_safe
    if graph is None:
        graph = fused and safe
    if graph and not (fused and safe):
        raise ValueError("a CUDA graph needs CUDA, Triton, the fused step and a method whose decode hooks are "
                         f"graph-safe ({policy.name}: graph_safe={policy.graph_safe})")
    return DecodePath(store, bool(fused), bool(graph), kernels)


# eager steps before a CUDA graph is captured: they compile the kernels, allocate the buffers and build the tables
# that must not be built inside a capture (one is enough: the CUDA tests pass with it, and a batch of 33 streams'
# eager steps cost 50-80 ms each on the H200, docs/gpu.md); WNW_WARM_STEPS overrides it, for measurements
WARM_STEPS = int(os.environ.get("WNW_WARM_STEPS", 1))


class Stream:
    """One sample through the engine: its store, its policy (its own state: WnW's chunk swap, ArkVale's pages,
    AdaKV's budgets), its positions and tokens. `generate` decodes one stream; `decode_batch` several at once.

    Prefill is `prefill_layers` (a generator: one layer per item, so a scheduler can interleave a long prefill
    with the decode steps of running streams) then `finish_prefill` (the method's placement of every layer, then
    the store's compaction, which raises `kv.pool.PoolFull` where the stream's KV does not fit its pool, changing
    nothing, so it can be retried). With `overlap` (a CUDA stream) the forward pass runs on that stream with no
    host read (the placement waits for `finish_prefill`) while the running streams decode: `prefill_ready` says
    when it is done.
    """

    def __init__(self, backbone: Backbone, prompt: Prompt, policy: Policy, *, retention: float, max_new_tokens: int,
                 path: DecodePath, keep_logits: bool = False, pool=None, key=None,
                 expected_new_tokens: int | None = None, overlap=None, defer_place: bool | None = None):
        self.backbone, self.prompt, self.policy, self.path, self.key = backbone, prompt, policy, path, key
        # `overlap`: a CUDA stream for this stream's prefill and placement (None: the current stream, each layer
        # timed by a device sync); the scheduler then polls `prefill_ready` instead of waiting
        self.overlap = overlap
        # place every layer after the forward pass (`finish_prefill`) rather than layer by layer (None: with overlap)
        self.defer_place = overlap is not None if defer_place is None else bool(defer_place)
        self._done_event = None
        self._scores: list = []
        self.request = None  # the `Request` it decodes, in a batch (preemption puts it back in the queue)
        self.max_new_tokens, self.keep_logits = max_new_tokens, keep_logits
        dev = backbone.device
        total = prompt.input_ids.shape[1] + max_new_tokens
        if total > backbone.max_positions:
            raise ValueError(f"prompt ({prompt.input_ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceeds "
                             f"the model's context of {backbone.max_positions} positions: use shorter audio")
        n_kv, d = backbone.n_kv_heads, backbone.head_dim
        self.ctx = SampleContext(backbone.n_layers, backbone.n_q_heads, n_kv, d, backbone.token_rate, prompt.n_audio,
                                 retention, dev)
        if path.store == "packed":
            from wnw_exp.kv.packed import PackedAudioKVStore

            self.store = PackedAudioKVStore(backbone.n_layers, n_kv, d, prompt.n_audio, dev, backbone.dtype,
                                            max_new_tokens + 1, kernels=path.kernels, pool=pool,
                                            expected_new_tokens=expected_new_tokens, host_mirror=policy.cpu_tier)
        else:
            if pool is not None:
                raise ValueError("a KV pool is the packed store's (store=packed)")
            from wnw_exp.kv.reference import AudioKVStore

            self.store = AudioKVStore(backbone.n_layers, n_kv, d, prompt.n_audio, dev, backbone.dtype,
                                      max_new_tokens + 1)
        policy.start(self.ctx, self.store)
        self.tokens: list[int] = []
        self.emitted_at: list[float] = []  # perf_counter() when each token was there (inter-token latency)
        self.step_ms: list[float] = []
        self.kept: list[torch.Tensor] = []
        self.terminated = self.done = False
        self.prefill_ms = 0.0
        self.logits: torch.Tensor | None = None
        self.step = None  # the stream's own decode step (TorchStep or FusedStep), made by `make_step`

    def prefill_layers(self):
        """Prefill layer by layer (the backbone's modules, `backbones.layer.decoder_layer`); yields after each. Each
        layer's K/V go to the store and the method places it (`Policy.place`). With `overlap` each layer's work is
        launched on that CUDA stream (the caller's stream is current between layers). With `defer_place` (the
        default with `overlap`) its `PrefillScores` are kept for `finish_prefill`, which places every layer in
        order once the forward pass has run (the same
        decisions: a layer's placement reads only its own scores and rows; the scores of all layers are held
        until then, about 20 MB a layer for 3,000 audio tokens and 32 query heads)."""
        bb, prompt, policy, store = self.backbone, self.prompt, self.policy, self.store
        n_q, n_kv, d = bb.n_q_heads, bb.n_kv_heads, bb.head_dim
        overlap = self.overlap is not None
        self._scores = []
        t0 = time.perf_counter()
        with self._on_overlap():
            if overlap:
                self._t0_event = torch.cuda.Event(enable_timing=True)
                self._t0_event.record(self.overlap)
            hidden = bb.embed_prompt(prompt)
            positions, span = bb.prompt_positions(prompt), prompt.audio_span
        rope_cache: tuple | None = None
        for li, layer in enumerate(bb.layers):
            with self._on_overlap():
                hidden, positions, span = policy.prefill_transform(li, hidden, positions, span)
                if rope_cache is None or rope_cache[0] is not positions:
                    rope_cache = (positions, *bb.rotary(hidden, positions))
                _, cos, sin = rope_cache

                def attention(q, k, v, scale, li=li, span=span):
                    out = causal_attention(q, k, v, scale)
                    store.write_prefill(li, k[0], v[0], span)
                    scores = prefill_scores(q[0], k[0], span, scale)
                    if self.defer_place:  # placed once the forward pass has run (`finish_prefill`): no host read
                        self._scores.append((li, scores))
                    else:
                        policy.place(li, scores)
                    return out

                hidden = decoder_layer(layer, hidden, cos, sin, attention, (n_q, n_kv, d))
            if not overlap:
                _sync(bb.device)
                self.prefill_ms += (time.perf_counter() - t0) * 1e3
            yield
            t0 = time.perf_counter()
        self._last_hidden = hidden[:, -1:]
        if overlap:
            self._done_event = torch.cuda.Event(enable_timing=True)
            self._done_event.record(self.overlap)

    def _on_overlap(self):
        return torch.cuda.stream(self.overlap) if self.overlap is not None else nullcontext()

    def prefill_ready(self) -> bool:
        """Whether the forward pass launched so far has run (always, without `overlap`: it ran synchronously)."""
        return self._done_event is None or self._done_event.query()

    def wait_prefill(self) -> None:
        """Block until the forward pass launched so far has run."""
        if self._done_event is not None:
            self._done_event.synchronize()

    def finish_prefill(self, reserve_blocks: int = 0) -> None:
        """With `defer_place`, the method's placement of every layer (in layer order; once); the store's compaction (frees
        the dropped rows; may raise PoolFull, `reserve_blocks` of its pool kept free, changing nothing: it can be
        called again), the decisions in force at decode step 0, the first token's logits."""
        with self._on_overlap():
            self._finish_prefill(reserve_blocks)
        if self.overlap is not None:  # the decode steps (current stream) read what this stream wrote
            torch.cuda.current_stream(self.backbone.device).wait_stream(self.overlap)

    def _finish_prefill(self, reserve_blocks: int) -> None:
        if self._done_event is not None:  # the forward pass's device time (it shared the GPU with decode steps)
            self._done_event.synchronize()
            self.prefill_ms += self._t0_event.elapsed_time(self._done_event)
            self._done_event = None
        t0 = time.perf_counter()
        for li, scores in self._scores:
            self.policy.place(li, scores)
        self._scores = []
        if reserve_blocks:
            self.store.compact(headroom=self.policy.recall_headroom, reserve_blocks=reserve_blocks)
        else:
            self.store.compact(headroom=self.policy.recall_headroom)
        self.policy.after_prefill()
        self.store.flush()  # decisions made at prefill are in force at decode step 0
        bb = self.backbone
        self.logits = bb.lm_head(bb.final_norm(self._last_hidden))[0, -1].float()
        self.next_token = int(torch.argmax(self.logits))
        del self._last_hidden
        self.cos, self.sin = bb.rope_table(bb.prompt_positions(self.prompt), self.max_new_tokens)
        if bb.device.type == "cuda":  # this stream's work (not the decode steps running beside an overlapped one)
            torch.cuda.current_stream(bb.device).synchronize()
        self.prefill_ms += (time.perf_counter() - t0) * 1e3

    def prefill(self) -> None:
        for _ in self.prefill_layers():
            pass
        self.finish_prefill()

    def make_step(self) -> None:
        """The stream's own decode step, its first token in place."""
        bb = self.backbone
        if self.path.fused:
            self.step = FusedStep(bb, self.store, self.policy, self.cos, self.sin, self.path.kernels)
        else:
            self.step = TorchStep(bb, self.store, self.policy, self.cos, self.sin)
        self.step.tok.copy_(torch.tensor(self.next_token).view_as(self.step.tok))

    def emit(self, token: int, logits: torch.Tensor | None) -> bool:
        """Record the token the last step (or prefill) produced; True while the stream goes on decoding."""
        if self.keep_logits:
            self.kept.append(logits.float().cpu())
        self.tokens.append(token)
        self.emitted_at.append(time.perf_counter())
        if token in self.backbone.eos_token_ids:
            self.terminated = self.done = True
        elif len(self.tokens) >= self.max_new_tokens:
            self.done = True
        return not self.done

    @property
    def index(self) -> int:
        """The decode step the stream runs next (0: the step that embeds the first generated token)."""
        return len(self.tokens) - 1

    def after_step(self, i: int | None) -> None:
        """The method's decision for the next step and the store's moves and accounting (fused path: the moves are
        queued, flushed here). A batch on the fused path does the same for all its streams at once (`_step_all`)."""
        self.policy.after_step(i)
        if self.path.fused:
            self.store.flush()
            self.store.record_step()
        else:
            self.store.end_step()

    def result(self) -> DecodeResult:
        store, prompt = self.store, self.prompt
        store.check()
        trace = dict(gpu_audio_tokens=[s.n_gpu for s in store.steps], h2d_bytes=[s.h2d_bytes for s in store.steps],
                     n_audio=prompt.n_audio, n_full=store.n_full,
                     n_prompt_text=prompt.input_ids.shape[1] - prompt.n_audio, **self.policy.trace())
        return DecodeResult(self.tokens, self.terminated, self.step_ms, self.prefill_ms, store.summary(), trace,
                            self.kept if self.keep_logits else None, self.policy.knobs())


class TokenRunner:
    """One token of a fused step (`FusedStep` for `generate`, `BatchedFusedStep` for a batch): the step's body, the
    methods' decisions and the stores' moves (`after(i)`) on the side stream `side` while the final norm and the LM
    head run, then the head. With `graph`, PyTorch's capture recipe: the first `warm_steps` tokens (WARM_STEPS) run
    eagerly on a warm-up stream, then the whole token (`after(None)`: the step index stays on the device) is captured
    in one CUDA graph and replayed. A batch whose kernels have compiled and whose tables `prepare` built (a shape
    already warm) captures its first token (`warm_steps=0`); should that capture fail, it warms up as usual."""

    def __init__(self, step, dev: torch.device, side, warm_steps: int | None = None):
        self.step, self.dev, self.side = step, dev, side
        self.warm_steps = WARM_STEPS if warm_steps is None else warm_steps
        self.graph: CapturedStep | None = None
        self.warm = None
        self.n = 0  # tokens run

    def _token(self, i: int | None, after) -> None:
        self.step.body()
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
            after(i)
        self.step.head()
        if self.side is not None:
            torch.cuda.current_stream(self.dev).wait_stream(self.side)

    def __call__(self, i: int, after, graph: bool) -> None:
        if self.graph is None and graph and self.n >= self.warm_steps:
            if self.warm is not None:
                torch.cuda.current_stream(self.dev).wait_stream(self.warm)
            try:
                self.graph = CapturedStep(lambda: self._token(None, after))
            except Exception:  # noqa: BLE001 - a capture without warm-up steps: warm up instead (a real failure
                if self.n >= WARM_STEPS:  # after them raises)
                    raise
                self.warm_steps = WARM_STEPS
        if self.graph is not None:
            self.graph()
        elif graph:
            self.warm = self.warm or torch.cuda.Stream(self.dev)
            self.warm.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(self.warm):
                self._token(i, after)
            torch.cuda.current_stream(self.dev).wait_stream(self.warm)
        else:
            self._token(i, after)
        self.n += 1


@torch.no_grad()
def generate(backbone: Backbone, prompt: Prompt, policy: Policy, *, retention: float, max_new_tokens: int,
             keep_logits: bool = False, store: str = "auto", fused: bool | None = None, graph: bool | None = None,
             kernels: str = "auto") -> DecodeResult:
    """Greedy decoding of one prompt with `policy` managing the audio KV: prefill layer by layer (the backbone's
    modules, `backbones.layer.decoder_layer`), then one decode step per token (`engine.step`).

    `store`: "reference" (kv.reference, the specification), "packed" (kv.packed) or "auto" (packed on CUDA with
    Triton when the method runs on it, `policy.packed_store`). `fused`: the fused step (`FusedStep`, packed store)
    instead of the reference step (`TorchStep`); None: on CUDA with Triton kernels. `graph`: capture the step,
    the method's per-step decision and the store's moves in one CUDA graph, replayed per token (the first
    `WARM_STEPS` run eagerly); None: whenever the fused step runs on CUDA and `policy.graph_safe`. `kernels`: the
    fused step's and the packed store's kernels, "triton", "torch" (their PyTorch equivalents) or "auto" (triton
    on CUDA when installed). The CPU default (reference store and step) is what every other path is tested
    against; on CUDA every backbone family gets the fused graph path by default.
    """
    dev = backbone.device
    path = decode_path(dev, policy, store, fused, graph, kernels)
    stream = Stream(backbone, prompt, policy, retention=retention, max_new_tokens=max_new_tokens, path=path,
                    keep_logits=keep_logits)
    stream.prefill()
    stream.make_step()
    step, store = stream.step, stream.store
    side = torch.cuda.Stream(dev) if path.fused and dev.type == "cuda" else None
    runner = TokenRunner(step, dev, side) if path.fused else None
    logits = stream.logits
    for i in range(max_new_tokens):
        if not stream.emit(int(step.tok), logits):
            break
        t0 = time.perf_counter()
        if runner is not None:  # (a store may have fallen back to host copies: then no graph)
            runner(i, stream.after_step, graph=path.graph and store.graph_safe)
        else:
            step(i)
            stream.after_step(i)
        logits = step.logits
        _sync(dev)
        stream.step_ms.append((time.perf_counter() - t0) * 1e3)
    return stream.result()


@dataclass
class Request:
    """One sample for `decode_batch`: its prompt and length cap; `key` names it in the results."""

    key: object
    prompt: Prompt
    max_new_tokens: int
    expected_new_tokens: int | None = None  # the answer admission expects (None: see `decode_batch`'s reserve_tokens)
    arrival_s: float = 0.0  # when it arrives, in seconds after `decode_batch` starts (0: it is there at once)


EXPECTED_ANSWER_FRACTION = 0.6  # of the length cap: 3 tokens a second of audio where the cap allows 5 (conf/model)


def expected_new_tokens(req: Request, reserve_tokens: int | float | None = None) -> int:
    """The tokens a request is expected to generate, what admission keeps pool room for: `reserve_tokens` tokens
    (an int), that fraction of its cap (a float in [0, 1]), or (None) its `expected_new_tokens` where set, else
    `EXPECTED_ANSWER_FRACTION` of its cap; never more than its cap."""
    cap = req.max_new_tokens
    if reserve_tokens is None:
        if req.expected_new_tokens is not None:
            return max(0, min(int(req.expected_new_tokens), cap))
        return int(math.ceil(EXPECTED_ANSWER_FRACTION * cap))
    if isinstance(reserve_tokens, float):
        if not 0.0 <= reserve_tokens <= 1.0:
            raise ValueError(f"reserve_tokens={reserve_tokens!r}: a float is a fraction of the cap, in [0, 1]")
        return int(math.ceil(reserve_tokens * cap))
    if int(reserve_tokens) < 0:
        raise ValueError(f"reserve_tokens={reserve_tokens!r}: at least 0 tokens")
    return min(int(reserve_tokens), cap)


@dataclass
class BatchStats:
    """What `decode_batch` saw: the batch size at each decode step, its wall time, and the prefill layers run
    between two steps (chunked prefill) with their time."""

    batch_sizes: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    step_kinds: list[str] = field(default_factory=list)  # each step: "replay" (its CUDA graph), "capture" or "eager"
    step_at: list[float] = field(default_factory=list)  # each step's end, perf_counter()
    # each step's host time (ms) making a new composition's batched step, and running the decisions and moves
    # after its layers (0 where none ran: a replay, a stream stepping on its own); parts of `step_ms`
    step_build_ms: list[float] = field(default_factory=list)
    step_after_ms: list[float] = field(default_factory=list)
    prefill_ms_between_steps: list[float] = field(default_factory=list)
    refused: list = field(default_factory=list)  # keys of requests that can never fit the pool
    room_waits: int = 0  # admissions that found no room in the pool (the prefilled stream waited for a leave)
    preempted: list = field(default_factory=list)  # keys of the streams preempted (restarted later), in order
    joined_at: dict = field(default_factory=dict)  # key -> the decode step (index into batch_sizes) it first ran in
    emitted_at: dict = field(default_factory=dict)  # key -> its tokens' perf_counter() times
    started_at: float = 0.0  # perf_counter() when `decode_batch` started: requests' `arrival_s` count from it
    first_token_at: dict = field(default_factory=dict)  # key -> perf_counter() of its first token (first attempt's)
    # where the wall went: seconds by part of the loop (`WALL_PARTS`), every second of it in exactly one part
    wall_s: dict = field(default_factory=dict)


# The parts of `decode_batch`'s wall time (`BatchStats.wall_s`), in the order a request meets them:
#   wait     no stream runs and the next request has not arrived yet
#   setup    making a request's stream: its policy (a fork), its store, its pool extents
#   prefill  prefill layers (`Stream.prefill_layers`), between decode steps or while none runs
#   place    the store's compaction, the method's decisions in force at step 0, the first token (`_admit`)
#   grow     dense pages for the next token of every stream (`_grow_dense`, preemption included)
#   step     the decode steps (`BatchStats.step_ms`, by kind in `step_kinds`)
#   emit     the tokens read into the streams after a step
#   finish   results of the streams that ended (`Stream.result`) and their memory released
#   caller   the consumer of `decode_batch`'s results, between a yield and the loop going on
#   loop     the loop's own bookkeeping between those parts
WALL_PARTS = ("wait", "setup", "prefill", "place", "grow", "step", "emit", "finish", "caller", "loop")


class _Laps:
    """Attributes wall time to named parts: `lap(part)` gives `part` the time since the last lap (so the parts add
    up to the wall, whatever runs between laps)."""

    def __init__(self, wall: dict):
        self.wall, self.t = wall, time.perf_counter()

    def lap(self, part: str) -> float:
        """Seconds since the last lap, given to `part`."""
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        self.wall[part] = self.wall.get(part, 0.0) + dt
        return dt


@torch.no_grad()
def decode_batch(backbone: Backbone, requests: Iterable[Request], make_policy: Callable[[], Policy], *,
                 retention: float, max_concurrent: int | None = None, pool=None, keep_logits: bool = False,
                 store: str = "auto", fused: bool | None = None, graph: bool | None = None, kernels: str = "auto",
                 prefill_chunk_layers: int | None = None, stats: BatchStats | None = None,
                 reserve_tokens: int | float | None = None,
                 overlap_prefill: bool | None = None) -> Iterator[tuple[object, DecodeResult | Exception]]:
    """Continuous batching: decode `requests` several at a time, yielding (key, result) as each stream finishes
    (or (key, exception) for one that failed), in the order they finish.

    A request joins when fewer than `max_concurrent` streams run (None: no limit but the pool's) and, with a
    `pool` (`kv.pool.KVPool`, the packed store's), when the pool has room for its placed KV (one extent for each
    head's resident audio and recall room, dense pages for its prompt's text) and its expected growth, besides the
    expected growth still to come of the running streams: the dense pages of `expected_new_tokens(request,
    reserve_tokens)` tokens (by default its `expected_new_tokens`, else 0.6 of its cap). Otherwise it waits, its
    prefill done, until a stream leaves; alone, it joins when its placed KV fits. One that cannot fit an empty pool
    is refused (`PoolFull` as its result). A running stream's dense part grows a page (one pool block per layer and
    KV head) whenever its last page is full; where the pool has no free block for it, the most recently admitted
    stream is preempted (vLLM's recompute preemption: all its memory freed, its request back at the head of the
    queue, restarted from scratch later; decoding is deterministic, so its result is the same): a newer stream than
    the one asking when there is one, the one asking itself when it is the newest, so the oldest stream always
    goes on. A stream that needs a page when it runs alone fails (`PoolFull`: the pool cannot hold its answer),
    alone. `stats.preempted` records the preemptions. Prefill runs `prefill_chunk_layers` layers between two
    decode steps (None: a whole prefill at once), so an admission does not stall the running streams for a whole
    prefill. With `overlap_prefill` (None: on CUDA) a request that arrives while streams run is prefilled on a
    CUDA stream of its own: its layers are launched (`prefill_chunk_layers` at a time) between decode steps and
    run on the GPU beside them; its placement and admission wait until its forward pass is done
    (`Stream.prefill_ready`), the running streams decoding meanwhile.

    Each stream has its own policy (`make_policy()`, e.g. `Policy.fork`), store, positions and tokens, so its
    result does not depend on the others: on the reference path each stream steps on its own (`TorchStep`, as
    `generate`: the same arithmetic, byte for byte); on the fused path with a pool one `BatchedFusedStep` steps
    every running stream at once (GEMMs over the batch, one attention launch over every stream's ragged regions),
    and on CUDA one CUDA graph per composition of the batch is captured after `WARM_STEPS` eager steps (at its first
    step where a composition of the same shape, `_warm_key`, ran before: its kernels are compiled).
    """
    dev = backbone.device
    stats = stats if stats is not None else BatchStats()
    limit = max_concurrent if max_concurrent is not None else 1 << 30
    if limit < 1:
        raise ValueError(f"max_concurrent={max_concurrent!r}: at least 1 stream")
    pending = iter(requests)
    queue: deque = deque()  # preempted requests, to run again before the new ones
    arriving: Request | None = None  # the next new request, read from `requests` before it has arrived
    exhausted = False
    active: list[Stream] = []
    admitting: tuple[Stream, Iterator] | None = None
    batched: dict = {}  # the fused path's step for the current composition (and its graph)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    if overlap_prefill and dev.type != "cuda":
        raise ValueError("overlap_prefill runs a prefill on its own CUDA stream: it needs a CUDA device")
    overlap = torch.cuda.Stream(dev) if dev.type == "cuda" and overlap_prefill is not False else None
    waiting_for_room = False  # a prefilled stream the pool could not take yet
    warmed: set = set()  # batch shapes whose kernels have run: a new composition of one is captured at once
    laps = _Laps(stats.wall_s)
    stats.started_at = laps.t
    while True:
        if admitting is None and (queue or arriving is not None or not exhausted) and len(active) < limit:
            req = queue.popleft() if queue else None
            if req is None:
                if arriving is None:
                    arriving = next(pending, None)
                    exhausted = arriving is None
                if arriving is not None:
                    due = stats.started_at + arriving.arrival_s
                    if not active and time.perf_counter() < due:  # nothing to do until it arrives
                        laps.lap("loop")
                        time.sleep(max(0.0, due - time.perf_counter()))
                        laps.lap("wait")
                    if time.perf_counter() >= due:
                        req, arriving = arriving, None
            if req is not None:
                laps.lap("loop")
                try:
                    policy = make_policy()
                    path = decode_path(dev, policy, store, fused, graph, kernels)
                    st = Stream(backbone, req.prompt, policy, retention=retention, max_new_tokens=req.max_new_tokens,
                                path=path, keep_logits=keep_logits, pool=pool if path.store == "packed" else None,
                                key=req.key, expected_new_tokens=expected_new_tokens(req, reserve_tokens),
                                overlap=overlap if active else None)
                    st.request = req
                    admitting = (st, st.prefill_layers())
                    laps.lap("setup")
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    laps.lap("setup")
                    yield req.key, e
                    laps.lap("caller")
                    continue
        if admitting is not None:
            st, layers = admitting
            try:
                laps.lap("loop")
                done_layers, ran = _advance(layers, prefill_chunk_layers)
                dt = laps.lap("prefill")
                if active and ran:
                    stats.prefill_ms_between_steps.append(dt * 1e3)
                if done_layers and not active and not st.prefill_ready():  # nothing to decode meanwhile
                    st.wait_prefill()
                if done_layers and not waiting_for_room and st.prefill_ready():
                    joined = _admit(st, active, stats)
                    laps.lap("place")
                    waiting_for_room = joined is None  # retried once a stream has left
                    stats.room_waits += waiting_for_room
                    if joined is not None:
                        admitting = None
                        stats.first_token_at.setdefault(st.key, st.emitted_at[0])
                        if joined:
                            stats.joined_at[st.key] = len(stats.batch_sizes)
                            active.append(st)
                            batched.clear()
                        else:  # its first token ended it
                            result = st.result()
                            _leave(st)
                            laps.lap("finish")
                            yield st.key, result
                            laps.lap("caller")
            except Exception as e:  # noqa: BLE001
                admitting = None
                _leave(st)
                laps.lap("finish")
                yield st.key, e
                laps.lap("caller")
        if not active:
            if admitting is None and arriving is None and exhausted and not queue:
                laps.lap("loop")
                return
            continue
        laps.lap("loop")
        preempted, failed_growth = _grow_dense(active)
        for st in preempted:  # newest first (their memory is already free): the oldest ends at the head of the queue
            stats.preempted.append(st.key)
            queue.appendleft(st.request)
        laps.lap("grow")
        for st, e in failed_growth:
            _leave(st)
            laps.lap("finish")
            yield st.key, e
            laps.lap("caller")
        if preempted or failed_growth:
            batched.clear()
            waiting_for_room = False
            if not active:
                continue
        laps.lap("loop")
        replayed = getattr(batched.get("runner"), "graph", None) is not None
        try:
            tokens, logits = _step_all(backbone, active, batched, side, keep_logits, warmed)
        except Exception as e:  # noqa: BLE001 - a failed step fails the streams it ran
            laps.lap("step")
            for st in active:
                _leave(st)
                laps.lap("finish")
                yield st.key, e
                laps.lap("caller")
            active, batched, waiting_for_room = [], {}, False
            continue
        ms = laps.lap("step") * 1e3
        stats.step_at.append(laps.t)
        stats.batch_sizes.append(len(active))
        stats.step_ms.append(ms)
        stats.step_kinds.append(_step_kind(batched.get("runner"), replayed))
        stats.step_build_ms.append(batched.pop("build_ms", 0.0))
        stats.step_after_ms.append(batched.pop("after_ms", 0.0))
        failed = {}
        for b, st in enumerate(active):
            if isinstance(tokens[b], Exception):  # its own step failed (a stream stepping on its own)
                failed[id(st)] = tokens[b]
                st.done = True
                continue
            st.step_ms.append(ms)
            st.emit(tokens[b], logits[b] if logits is not None else None)
        laps.lap("emit")
        if any(st.done for st in active):
            for st in [st for st in active if st.done]:
                stats.emitted_at[st.key] = st.emitted_at
                result = failed.get(id(st)) or st.result()
                _leave(st)
                laps.lap("finish")
                yield st.key, result
                laps.lap("caller")
            active = [st for st in active if not st.done]
            batched.clear()
            waiting_for_room = False


def _step_kind(runner, replayed: bool) -> str:
    """What a batched step just was: "replay" (of the composition's CUDA graph), "capture" (the step that recorded
    it), or "eager" (warm-up steps, and every step off the graph path)."""
    if replayed:
        return "replay"
    return "capture" if getattr(runner, "graph", None) is not None else "eager"


def default_pool(backbone: Backbone, gb: float | None = None, fraction: float = 0.8):
    """On CUDA, a `KVPool` of `gb` GB, or (None) `fraction` of the device memory free now: the budget batched
    streams share; None on other devices (streams then allocate their own)."""
    if backbone.device.type != "cuda":
        return None
    from wnw_exp.kv.pool import KVPool

    budget = gb * 1e9 if gb is not None else torch.cuda.mem_get_info(backbone.device)[0] * fraction
    return KVPool.of_bytes(budget, backbone.head_dim, backbone.dtype, backbone.device)


def _advance(layers: Iterator, n: int | None) -> tuple[bool, int]:
    """Run `n` more prefill layers (None: all): (whether every layer has run, how many ran now)."""
    k = 0
    for _ in layers:
        k += 1
        if n is not None and k >= n:
            return False, k
    return True, k


def _admit(st: Stream, active: list[Stream], stats: BatchStats) -> bool | None:
    """Place a prefilled stream's KV (in its pool, if any) and emit its first token. True: it joins the batch;
    False: it is already done (its first token ended it); None: the pool lacks room now for its placed KV and the
    expected growth of it and of the running streams (retry after a stream leaves). A stream that cannot fit an
    empty pool raises PoolFull."""
    from wnw_exp.kv.pool import PoolFull

    reserve = 0
    if active and getattr(st.store, "pool", None) is not None:  # alone, it joins when its placed KV fits
        reserve = st.store.growth_blocks() + sum(o.store.outstanding_blocks() for o in active
                                                 if getattr(o.store, "pool", None) is not None)
    try:
        st.finish_prefill(reserve)
    except PoolFull:
        if not active:
            stats.refused.append(st.key)
            raise
        return None
    if st.path.store != "packed" or st.store.pool is None or not st.path.fused:
        st.make_step()
    return st.emit(st.next_token, st.logits)


def _grow_dense(active: list[Stream]) -> tuple[list[Stream], list[tuple[Stream, Exception]]]:
    """Before a step: every pooled stream's dense page for the token it appends, oldest stream first. Where the
    pool has no free block, the newest stream is preempted (possibly the one asking, if it is the newest); a stream
    alone fails. Removes them from `active` (a preempted stream's memory is freed here); returns (preempted,
    newest first; [(failed, its error)])."""
    from wnw_exp.kv.pool import PoolFull

    preempted, failed = [], []
    i = 0
    while i < len(active):
        st = active[i]
        store = st.store
        if getattr(store, "pool", None) is None or store.ensure_dense(store.n_text + st.index + 1):
            i += 1
            continue
        if len(active) == 1:
            pool = store.pool
            rb = pool.block * pool.row_bytes
            failed.append((st, PoolFull(
                f"the KV pool cannot hold this stream's answer: at its generated token {st.index + 1} of at most "
                f"{st.max_new_tokens} it needs another dense page ({store.n_rows} blocks, {store.n_rows * rb / 1e6:.2f} "
                f"MB) and no other stream is left to preempt; it holds {store.pool_blocks() * rb / 1e6:.2f} MB of "
                f"the pool's {pool.capacity_bytes / 1e6:.2f} MB")))
            active.pop(i)
            continue
        victim = active.pop()  # the newest (st itself when it is the newest: then the loop ends)
        _leave(victim)  # its memory is free before st asks again
        preempted.append(victim)
    return preempted, failed


def _leave(st: Stream) -> None:
    release = getattr(st.store, "release_memory", None)
    if release is not None:
        release()


def _step_all(backbone: Backbone, active: list[Stream], batched: dict, side, keep_logits: bool,
              warmed: set | None = None) -> tuple[list[int], list | None]:
    """One decode step of every running stream; their next tokens (one host read) and, if kept, logits. `warmed`:
    the batch shapes (`_warm_key`) whose kernels have run, kept by the caller across compositions: a new composition
    of such a shape is captured at its first step (no eager warm-up step)."""
    if active[0].step is not None:  # each stream on its own step (reference path, or no pool): failures its own
        tokens = []
        for st in active:
            i = st.index
            try:
                if st.path.fused:
                    st.step.body()
                    st.after_step(i)
                    st.step.head()
                else:
                    st.step(i)
                    st.after_step(i)
                tokens.append(int(st.step.tok))
            except Exception as e:  # noqa: BLE001
                tokens.append(e)
        return tokens, [st.step.logits for st in active] if keep_logits else None
    graph = all(st.path.graph and st.store.graph_safe for st in active)
    if "runner" not in batched:
        t0 = time.perf_counter()
        step = BatchedFusedStep(backbone, active, active[0].path.kernels)
        batched["warm_key"] = key = _warm_key(active)
        warm_steps = None
        if graph and warmed is not None and key in warmed:  # compiled: build the tables, capture the first token
            _prepare_after_all(active, batched)
            warm_steps = 0
        batched["runner"] = TokenRunner(step, backbone.device, side, warm_steps)
        batched["build_ms"] = (time.perf_counter() - t0) * 1e3  # host time, read by decode_batch's stats
    runner = batched["runner"]
    step = runner.step

    def after_all(i: int | None) -> None:  # every decision, then every store's moves in one flush
        from wnw_exp.kv.packed import flush_stores, record_steps

        t0 = time.perf_counter()
        for cls, sts in _policy_groups(active):  # the policies of one class decide together
            cls.after_step_all([st.policy for st in sts], [None if i is None else st.index for st in sts],
                               batched.setdefault(("after_step", cls), {}))
        flush_stores([st.store for st in active], batched.setdefault("flush", {}))
        record_steps([st.store for st in active], batched.setdefault("record", {}))
        batched["after_ms"] = (time.perf_counter() - t0) * 1e3  # host time (not called by a graph's replay)

    runner(0, after_all, graph=graph)
    if warmed is not None and graph:  # this batch shape's kernels have run (eagerly or in a capture)
        warmed.add(batched["warm_key"])
    return step.tok.view(-1).tolist(), list(step.logits) if keep_logits else None


def _warm_key(active: list[Stream]) -> tuple:
    """What a batch's kernels are compiled for, besides the model: its size and its streams' audio lengths."""
    return len(active), tuple(sorted({st.store.n_audio for st in active}))


def _policy_groups(active: list[Stream]) -> list[tuple[type, list[Stream]]]:
    """The running streams by their policy's class, in order (`Policy.after_step_all` runs once per class)."""
    groups: dict = {}
    for st in active:
        groups.setdefault(type(st.policy), []).append(st)
    return list(groups.items())


def _prepare_after_all(active: list[Stream], batched: dict) -> None:
    """The tables that a batch's decisions and moves launch from (`Policy.prepare_step_all`, `kv.packed`'s
    `flush_stores` and `record_steps` with `launch=False`), built before a capture that has no eager step first."""
    from wnw_exp.kv.packed import flush_stores, record_steps

    for cls, sts in _policy_groups(active):
        cls.prepare_step_all([st.policy for st in sts], batched.setdefault(("after_step", cls), {}))
    flush_stores([st.store for st in active], batched.setdefault("flush", {}), launch=False)
    record_steps([st.store for st in active], batched.setdefault("record", {}), launch=False)


OBSERVATION_WINDOW = 32  # SnapKV-style window: the last prompt rows, audio rows included


def prefill_scores(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float) -> PrefillScores:
    """What every method's `place` gets for one layer: q (H_q, T, D), k (H_kv, T, D) after RoPE."""
    return PrefillScores(_probs_to_audio(q, k, span, scale, span[1]),
                         _probs_to_audio(q, k, span, scale, max(0, q.shape[1] - OBSERVATION_WINDOW)),
                         k[:, span[0]:span[1]])


def _probs_to_audio(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float,
                    first_row: int) -> torch.Tensor:
    """Softmax weights (H_q, T - first_row, n_audio) from prompt rows first_row.. to the audio positions.

    Each row's softmax runs over every key it can see (causal), exactly as in the prefill attention.
    """
    s, e = span
    n_q, T, _ = q.shape
    g = n_q // k.shape[0]
    if first_row >= T:
        return q.new_zeros(n_q, 0, e - s)
    kk = k.repeat_interleave(g, dim=0).float()
    scores = torch.einsum("hqd,hkd->hqk", q[:, first_row:].float(), kk) * scale  # (H_q, n_rows, T)
    rows = torch.arange(first_row, T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1)[:, :, s:e]
