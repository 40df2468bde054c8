"""Prefill and greedy decode: one loop for every method, backbone and device, KV in the tier store.

Methods act only through the policy hooks; the engine has no `if method == ...`. The decode step is
`engine.step.TorchStep` (the reference) or `engine.step.FusedStep` (the fast path), optionally replayed from a
CUDA graph: options of this one loop, not second decoders. A batch on a KV pool steps together
(`engine.step.BatchedFusedStep`, `step_streams`), one step and its graphs per batch-size bucket (`BUCKETS`) where
the methods allow it (`Policy.graph_reusable`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from wnw_exp.backbones.base import Backbone, Prompt
from wnw_exp.backbones.layer import causal_attention, decoder_layer
from wnw_exp.engine.step import BatchedFusedStep, CapturedStep, FusedStep, TorchStep, prefill_layer
from wnw_exp.methods.base import Policy, PrefillScores, SampleContext, apply_placements


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


# Eager steps before a CUDA graph is captured: they compile the kernels, allocate the buffers and build the tables
# that must not be built inside a capture. One step does all of that (an eager step of a large batch costs many
# replays), so the default is one; the environment variable WNW_WARM_STEPS sets another count.
WARM_STEPS = int(os.environ.get("WNW_WARM_STEPS", 1))


class Laps:
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


# The parts of a placement's host time (`Stream.place_s`), in order:
#   decide   the method's decisions for every held layer and the store's tiers set (`place_all`, `apply_placements`)
#   compact  the store's compaction into its pool (its one host read waits for the device work before it)
#   start    the decisions in force at decode step 0 (`after_prefill`, `flush`)
#   first    the first token's logits and the RoPE table launched
#   wait     the host waiting for the placement's device work, then reading the first token
PLACE_PARTS = ("decide", "compact", "start", "first", "wait")


class Stream:
    """One sample through the engine: its store, its policy (its own state: WnW's chunk swap, ArkVale's pages,
    AdaKV's budgets), its positions and tokens. `engine.serve.decode_batch` decodes them, one or many at once.

    Prefill is `prefill_layers` (a generator: one layer per item, so a scheduler can interleave a long prefill
    with the decode steps of running streams) then `finish_prefill` (the method's placement of every layer, then
    the store's compaction, which raises `kv.pool.PoolFull` where the stream's KV does not fit its pool, changing
    nothing, so it can be retried). With `overlap` (a CUDA stream) the forward pass runs on that stream with no
    host read (the placement waits for `finish_prefill`) while the running streams decode: `prefill_ready` says
    when it is done.
    """

    def __init__(self, backbone: Backbone, prompt: Prompt, policy: Policy, *, retention: float, max_new_tokens: int,
                 path: DecodePath, keep_logits: bool = False, pool=None, key=None,
                 expected_new_tokens: int | None = None, overlap=None, defer_place: bool | None = None,
                 place_stream=None):
        self.backbone, self.prompt, self.policy, self.path, self.key = backbone, prompt, policy, path, key
        # `overlap`: a CUDA stream for this stream's prefill and placement (None: the current stream, each layer
        # timed by a device sync); the scheduler then polls `prefill_ready` instead of waiting
        self.overlap = overlap
        # `place_stream`: with `overlap`, a CUDA stream of high priority for `finish_prefill` (None: `overlap`): its
        # few small launches and the host's waits for them do not queue behind the decode steps' kernels
        self.place_stream = place_stream if overlap is not None else None
        # place every layer after the forward pass (`finish_prefill`) rather than layer by layer (None: with overlap)
        self.defer_place = overlap is not None if defer_place is None else bool(defer_place)
        self._done_event = None
        self._reads = None  # `finish`'s reads of the records
        self.decided = False  # `decide` has run
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
        # the store and the method's state are made on the prefill's stream (with `overlap`, their first device
        # work is ordered before the prefill that follows, whatever runs on the current stream meanwhile)
        with self._on_overlap():
            if path.store == "packed":
                from wnw_exp.kv.packed import PackedAudioKVStore

                self.store = PackedAudioKVStore(backbone.n_layers, n_kv, d, prompt.n_audio, dev, backbone.dtype,
                                                max_new_tokens + 1, kernels=path.kernels, pool=pool,
                                                expected_new_tokens=expected_new_tokens,
                                                host_mirror=policy.host_mirror(self.ctx))
            else:
                if pool is not None:
                    raise ValueError("a KV pool is the packed store's (store=packed)")
                from wnw_exp.kv.reference import AudioKVStore

                self.store = AudioKVStore(backbone.n_layers, n_kv, d, prompt.n_audio, dev, backbone.dtype,
                                          max_new_tokens + 1)
            if self.defer_place:  # every layer placed at once: one read of the store's checks, at its compaction
                self.store.defer_checks()
            policy.start(self.ctx, self.store)
        self.tokens: list[int] = []
        self.emitted_at: list[float] = []  # perf_counter() when each token was there (inter-token latency)
        self.step_ms: list[float] = []
        self.kept: list[torch.Tensor] = []
        self.terminated = self.done = False
        self.prefill_ms = 0.0
        # host seconds of `finish_prefill`'s parts (PLACE_PARTS) since `engine.serve` last collected them
        self.place_s: dict[str, float] = {}
        self.logits: torch.Tensor | None = None
        self.step = None  # the stream's own decode step (TorchStep or FusedStep), made by `make_step`
        self.runner = None  # its `TokenRunner` (a fused step of its own), made at its first step
        self._observers: list | None = None  # (`observers`)

    def observers(self) -> list[tuple[int, list[int], torch.Tensor | None, torch.Tensor]]:
        """The layers whose method observes query heads (`Policy.observe_heads`): (layer, those heads, the method's
        accumulator of their weights (`Policy.observe_sum`; None: it takes the weights), the layer's `slot_of` rows),
        made once, after the placement (a batched step reads them at each composition)."""
        if self._observers is None:
            L, H, policy, slot_of = self.backbone.n_layers, self.backbone.n_kv_heads, self.policy, self.store.slot_of
            self._observers = [(li, heads, policy.observe_sum(li), slot_of[li * H:(li + 1) * H])
                               for li in range(L) if (heads := policy.observe_heads(li))]
        return self._observers

    def prefill_layers(self):
        """Prefill layer by layer; yields after each. A layer runs in the fused step's kernels on the Triton path
        (`engine.step.prefill_layer`), else in the backbone's modules (`backbones.layer.decoder_layer`). Each
        layer's K/V go to the store and the method places it (`Policy.place`) from its `PrefillScores`; for a
        method without a placement (its `place` is `Policy.place`, asked through a wrapper too) none are computed.
        With `overlap` each layer's work is launched on that CUDA stream (the caller's stream is current between
        layers). With `defer_place` (the default with `overlap`) the scores are kept for `finish_prefill`, which
        places every layer in order once the forward pass has run (the same decisions: a layer's placement reads
        only its own scores and rows; the scores of all layers are held until then: a layer's are fp32 weights of
        H_q heads x the last `OBSERVATION_WINDOW` prompt rows, or the rows after the audio if more, x every prompt
        key, whose audio columns the scores view)."""
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
        fused = bb.fused_layers() if self.path.fused and self.path.kernels == "triton" else None
        scored = getattr(policy.place, "__func__", None) is not Policy.place
        for li, layer in enumerate(bb.layers):
            with self._on_overlap():
                hidden, positions, span = policy.prefill_transform(li, hidden, positions, span)
                if rope_cache is None or rope_cache[0] is not positions:
                    rope_cache = (positions, *bb.rotary(hidden, positions))
                _, cos, sin = rope_cache

                def attention(q, k, v, scale, li=li, span=span):
                    out = causal_attention(q, k, v, scale)
                    store.write_prefill(li, k[0], v[0], span)
                    if not scored:
                        return out
                    scores = prefill_scores(q[0], k[0], span, scale, "triton" if fused is not None else "torch")
                    if self.defer_place:  # placed once the forward pass has run (`finish_prefill`): no host read
                        self._scores.append((li, scores))
                    else:
                        place(policy, store, li, scores)
                    return out

                if fused is not None:
                    hidden = prefill_layer(fused[li], hidden, cos, sin, attention, (n_q, n_kv, d))
                else:
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

    def decide(self) -> None:
        """Once the forward pass has run (`prefill_ready`): with `defer_place`, the method's placement of every
        layer, in layer order, launched (on `place_stream` where set, else on `overlap`); once. `finish_prefill`
        runs it first where it has not run; called a turn of the loop before it, its device work is done by the
        time the compaction reads the residency back."""
        if not self.decided:
            with self._on_place_stream():
                self._decide()

    def finish_prefill(self, reserve_blocks: int = 0) -> None:
        """`decide` where it has not run; the store's compaction (frees the dropped rows; may raise PoolFull,
        `reserve_blocks` of its pool kept free, changing nothing: it can be called again), the decisions in force at
        decode step 0, the first token's logits. On `place_stream` where set, else on `overlap`."""
        with self._on_place_stream() as stream:
            self._finish_prefill(reserve_blocks)
        if stream is not None:  # the decode steps (current stream) read what this stream wrote
            torch.cuda.current_stream(self.backbone.device).wait_stream(stream)

    @contextmanager
    def _on_place_stream(self):
        stream = self.place_stream if self.place_stream is not None else self.overlap
        if self.place_stream is not None:  # (the forward pass on `overlap` has run: `prefill_ready`)
            self.place_stream.wait_stream(self.overlap)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            yield stream

    def _decide(self) -> None:
        if self._done_event is not None:  # the forward pass's device time (it shared the GPU with decode steps)
            self._done_event.synchronize()
            self.prefill_ms += self._t0_event.elapsed_time(self._done_event)
            self._done_event = None
        lap = Laps(self.place_s).lap
        placed = self.policy.place_all(self._scores)
        apply_placements(self.store, placed)  # consecutive layers in one call each
        self._scores = []
        self.decided = True
        self.prefill_ms += lap("decide") * 1e3

    def _finish_prefill(self, reserve_blocks: int) -> None:
        if not self.decided:
            self._decide()
        t0 = time.perf_counter()
        lap = Laps(self.place_s).lap
        if reserve_blocks:
            self.store.compact(headroom=self.policy.recall_headroom, reserve_blocks=reserve_blocks)
        else:
            self.store.compact(headroom=self.policy.recall_headroom)
        lap("compact")
        self.policy.after_prefill()
        self.store.flush()  # decisions made at prefill are in force at decode step 0
        lap("start")
        bb = self.backbone
        self.logits = bb.lm_head(bb.final_norm(self._last_hidden))[0, -1].float()
        token = torch.argmax(self.logits)
        del self._last_hidden
        if bb.device.type == "cuda":  # the first token comes to pinned memory; it is read after the one wait below
            token = torch.empty((), dtype=token.dtype, pin_memory=True).copy_(token, non_blocking=True)
        self.cos, self.sin = bb.rope_table(bb.prompt_positions(self.prompt), self.max_new_tokens)
        lap("first")
        if bb.device.type == "cuda":  # waits for this stream's work only, not for decode steps on other streams
            torch.cuda.current_stream(bb.device).synchronize()
        self.next_token = int(token)
        lap("wait")
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
        queued, flushed here). A batch on the fused path does the same for all its streams at once (`step_streams`)."""
        self.policy.after_step(i)
        if self.path.fused:
            self.store.flush()
            self.store.record_step()
        else:
            self.store.end_step()

    def finish(self) -> None:
        """The stream has ended: start reading its records from the device (its store's and its method's, with no
        host wait: `result` takes them), before its memory goes back to the pool."""
        if self._reads is None:
            self._reads = (self.store.read_records(), self.policy.read_records())

    def result(self) -> DecodeResult:
        store, prompt = self.store, self.prompt
        self.finish()
        store_read, policy_read = self._reads
        steps = store.records(store_read)  # (read once: a packed store reads them from the device)
        trace = dict(gpu_audio_tokens=[s.n_gpu for s in steps], h2d_bytes=[s.h2d_bytes for s in steps],
                     n_audio=prompt.n_audio, n_full=store.n_full,
                     n_prompt_text=prompt.input_ids.shape[1] - prompt.n_audio, **self.policy.trace(policy_read))
        return DecodeResult(self.tokens, self.terminated, self.step_ms, self.prefill_ms, store.summary(steps), trace,
                            self.kept if self.keep_logits else None, self.policy.knobs())


class TokenRunner:
    """One token of a fused step (`FusedStep` for `generate`, `BatchedFusedStep` for a batch): the step's body, the
    methods' decisions and the stores' moves (`after(i)`) on the side stream `side` while the final norm and the LM
    head run, then the head. With `graph`, PyTorch's capture recipe: the first `warm_steps` tokens (WARM_STEPS) run
    eagerly on a warm-up stream, then the whole token (`after(None)`: the step index stays on the device) is captured
    in one CUDA graph and replayed. A batch whose kernels have compiled and whose tables `_prepare_after_all` built
    (a shape already warm) captures its first token (`warm_steps=0`); should that capture fail, it warms up as usual."""

    def __init__(self, step, dev: torch.device, side, warm_steps: int | None = None):
        self.step, self.dev, self.side = step, dev, side
        self.warm_steps = WARM_STEPS if warm_steps is None else warm_steps
        self.graph: CapturedStep | None = None
        self.graph_logits = None
        self.last = "eager"  # what the last token was: "eager", "capture" or "replay"
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
        captured = False
        if self.graph is None and graph and self.n >= self.warm_steps:
            if self.warm is not None:
                torch.cuda.current_stream(self.dev).wait_stream(self.warm)
            try:
                self.graph = CapturedStep(lambda: self._token(None, after))
                self.graph_logits = self.step.logits  # this graph's output (a step may serve several graphs)
                captured = True
            except Exception:  # noqa: BLE001 - a capture without warm-up steps: warm up instead (a real failure
                if self.n >= WARM_STEPS:  # after them raises)
                    raise
                self.warm_steps = WARM_STEPS
        self.last = "eager"
        if self.graph is not None:
            self.last = "capture" if captured else "replay"
            self.graph()  # (a capture records the token; the replay runs it)
            self.step.logits = self.graph_logits
        elif graph:
            self.warm = self.warm or torch.cuda.Stream(self.dev)
            self.warm.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(self.warm):
                self._token(i, after)
            torch.cuda.current_stream(self.dev).wait_stream(self.warm)
        else:
            self._token(i, after)
        self.n += 1


def step_streams(backbone: Backbone, active: list[Stream], batched: dict, side, keep_logits: bool,
              warmed: set | None = None):
    """Launch one decode step of every running stream; returns `collect()`, which waits for it and gives their next
    tokens (one host read) and, if kept, logits. Between the two the host is free for other work (the engine's
    admissions) while the GPU runs the step. `warmed`: the batch shapes (`_warm_key`) whose kernels have run, kept
    by the caller across compositions: a new composition of such a shape is captured at its first step (no eager
    warm-up step)."""
    if active[0].step is not None:  # each stream on its own step (reference path, or no pool): failures its own
        tokens = []
        for st in active:
            i = st.index
            try:
                if st.path.fused:  # its own runner: on CUDA the side stream and its own graph
                    if st.runner is None:
                        dev = backbone.device
                        st.runner = TokenRunner(st.step, dev, torch.cuda.Stream(dev) if dev.type == "cuda" else None)
                    # (a store may have fallen back to host copies: then no graph)
                    st.runner(i, st.after_step, graph=st.path.graph and st.store.graph_safe)
                else:
                    st.step(i)
                    st.after_step(i)
                tokens.append(int(st.step.tok))
            except Exception as e:  # noqa: BLE001
                tokens.append(e)
        logits = [st.step.logits for st in active] if keep_logits else None
        return lambda: (tokens, logits)
    graph = all(st.path.graph and st.store.graph_safe for st in active)
    if "runner" not in batched:  # a new composition of the batch
        t0 = time.perf_counter()
        batched["runner"] = _compose(backbone, active, batched, side, graph, warmed)
        batched["build_ms"] = (time.perf_counter() - t0) * 1e3  # host time, read by decode_batch's stats
    runner = batched["runner"]
    step, held = runner.step, batched["held"]

    def after_all(i: int | None) -> None:  # every decision, then every store's moves in one flush
        from wnw_exp.kv.packed import flush_stores, record_steps

        t0 = time.perf_counter()
        for cls, sts in _policy_groups(active):  # the policies of one class decide together
            cls.after_step_all([st.policy for st in sts], [None if i is None else st.index for st in sts],
                               _held(held, ("after_step", cls)))
        flush_stores([st.store for st in active], _held(held, "flush"))
        record_steps([st.store for st in active], _held(held, "record"))
        batched["after_ms"] = (time.perf_counter() - t0) * 1e3  # host time (not called by a graph's replay)

    runner(0, after_all, graph=graph)
    if warmed is not None and graph:  # this batch shape's kernels have run (eagerly or in a capture)
        warmed.add(batched["warm_key"])
    n = len(active)
    logits = list(step.logits[:n]) if keep_logits else None
    if backbone.device.type != "cuda":
        tokens = step.tok.view(-1)[:n].tolist()
        return lambda: (tokens, logits)
    # the tokens to pinned host memory behind the step, and an event: what the engine launches on the device
    # meanwhile (a prefill's placement, and a wait for it) does not delay reading them
    host = batched.get("host_tok")
    if host is None or host.numel() < step.tok.numel():
        host = batched["host_tok"] = torch.empty(max(step.tok.numel(), 64), dtype=torch.long, pin_memory=True)
    host[: step.tok.numel()].copy_(step.tok.view(-1), non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def collect():
        done.synchronize()
        return host[:n].tolist(), logits
    return collect


# Batch-size buckets: a batch of n streams on the reusable path runs in the smallest bucket >= n (then multiples
# of 64), its rows past n empty. One step, its tables and its CUDA graphs per bucket serve every composition that
# fits it.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64)


def bucket_for(n: int) -> int:
    """The bucket a batch of `n` streams runs in."""
    return next((b for b in BUCKETS if b >= n), -(-n // 64) * 64)


def _compose(backbone: Backbone, active: list[Stream], batched: dict, side, graph: bool, warmed: set | None):
    """The runner of a new composition `active`. Where the streams' methods allow it (`Policy.graph_reusable`, on
    the Triton kernels) the composition is seated in its bucket's step (`BatchedFusedStep.bind`), the bucket's
    tables are rewritten in place (`_prepare_after_all`), and a CUDA graph that bucket captured before with the same
    step generation, key bounds and tables replays at once: no capture, no eager step. Otherwise a step is made for
    this composition alone, captured after its warm-up (at its first step where a composition of the same shape,
    `_warm_key`, ran before)."""
    kernels = active[0].path.kernels
    groups = _policy_groups(active)
    reusable = kernels == "triton" and all(cls.graph_reusable([st.policy for st in sts]) for cls, sts in groups)
    if reusable:
        C = bucket_for(len(active))
        bk = batched.setdefault("buckets", {}).get(C)
        if bk is None:
            step = BatchedFusedStep(backbone, active, kernels, capacity=C)
            bk = batched["buckets"][C] = dict(step=step, held={"capacity": C}, runners={})
        else:
            bk["step"].bind(active)
        step = bk["step"]
        if not step.hooks_before and not any(step.observe):  # no per-stream launch in the step itself
            held = batched["held"] = bk["held"]
            _prepare_after_all(active, held)
            shape = (C, step.generation, tuple(step.max_keys), tuple(cls.__qualname__ for cls, _ in groups))
            tables = _tables(held)
            key = shape + tuple(sorted(id(t) for t in tables))
            batched["warm_key"] = ("bucket",) + shape
            runner = bk["runners"].get(key)
            if runner is None:
                stale = [k for k in bk["runners"] if k[1] != step.generation]  # graphs over buffers made anew
                for k in stale:
                    del bk["runners"][k]
                compiled = graph and warmed is not None and batched["warm_key"] in warmed
                runner = bk["runners"][key] = TokenRunner(step, backbone.device, side, 0 if compiled else None)
                runner.tables = tables  # (alive while its graph may replay: their identities stay unique)
            return runner
    step = BatchedFusedStep(backbone, active, kernels)
    batched["held"] = {}
    batched["warm_key"] = key = _warm_key(active)
    warm_steps = None
    if graph and warmed is not None and key in warmed:  # compiled: build the tables, capture the first token
        _prepare_after_all(active, batched["held"])
        warm_steps = 0
    return TokenRunner(step, backbone.device, side, warm_steps)


def _held(held: dict, key) -> dict:
    """held[key], made with the batch's capacity (if any) at its first use."""
    d = held.get(key)
    if d is None:
        d = held[key] = {"capacity": held["capacity"]} if "capacity" in held else {}
    return d


def _tables(held: dict) -> list:
    """The launch tables in a bucket's `held` (a graph captured over them replays only with the same tables)."""
    out = []
    for k, v in held.items():
        if isinstance(v, dict):
            out += _tables(v)
        elif k != "capacity" and hasattr(v, "bind"):
            out.append(v)
    return out


def place(policy, store, layer: int, scores: PrefillScores) -> None:
    """The method's placement of `layer` (`Policy.place`), set in the store."""
    placement = policy.place(layer, scores)
    if placement is not None:
        placement.apply(store, layer)


def _warm_key(active: list[Stream]) -> tuple:
    """What a batch's kernels are compiled for, besides the model: its size and its streams' audio lengths."""
    return len(active), tuple(sorted({st.store.n_audio for st in active}))


def _policy_groups(active: list[Stream]) -> list[tuple[type, list[Stream]]]:
    """The running streams by their policy's class, in order (`Policy.after_step_all` runs once per class)."""
    groups: dict = {}
    for st in active:
        groups.setdefault(type(st.policy), []).append(st)
    return list(groups.items())


def _prepare_after_all(active: list[Stream], held: dict) -> None:
    """The tables that a batch's decisions and moves launch from (`Policy.prepare_step_all`, `kv.packed`'s
    `flush_stores` and `record_steps` with `launch=False`), built before a capture that has no eager step first."""
    from wnw_exp.kv.packed import flush_stores, record_steps

    for cls, sts in _policy_groups(active):
        cls.prepare_step_all([st.policy for st in sts], _held(held, ("after_step", cls)))
    flush_stores([st.store for st in active], _held(held, "flush"), launch=False)
    record_steps([st.store for st in active], _held(held, "record"), launch=False)


OBSERVATION_WINDOW = 32  # SnapKV-style window: the last prompt rows, audio rows included


def prefill_scores(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float,
                   kernels: str = "torch") -> PrefillScores:
    """What every method's `place` gets for one layer: q (H_q, T, D), k (H_kv, T, D) after RoPE. The rows after the
    audio and the last `OBSERVATION_WINDOW` rows come out of one computation over their union (with `kernels`
    "triton", in one launch: `engine.triton_ops.prefill_probs`)."""
    T = q.shape[1]
    post, window = span[1], max(0, T - OBSERVATION_WINDOW)
    first = min(post, window)
    if kernels == "triton":
        from wnw_exp.engine.triton_ops import prefill_probs

        probs = prefill_probs(q, k, span, scale, first)
    else:
        probs = _probs_to_audio(q, k, span, scale, first)
    return PrefillScores(probs[:, post - first:], probs[:, window - first:], k[:, span[0]:span[1]])


def _probs_to_audio(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float,
                    first_row: int) -> torch.Tensor:
    """Softmax weights (H_q, T - first_row, n_audio) from prompt rows first_row.. to the audio positions.

    Each row's softmax runs over every key it can see (causal), exactly as in the prefill attention; in fp32, each
    KV head's query heads in one matmul against its keys (no copy of the keys per query head).
    """
    s, e = span
    n_q, T, D = q.shape
    n_kv = k.shape[0]
    rows = T - first_row
    if rows <= 0:
        return q.new_zeros(n_q, 0, e - s)
    qg = q[:, first_row:].float().reshape(n_kv, (n_q // n_kv) * rows, D)  # query head h reads KV head h // group
    scores = torch.matmul(qg, k.float().transpose(1, 2)).view(n_q, rows, T) * scale  # (H_q, rows, T)
    at = torch.arange(first_row, T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > at, float("-inf"))
    return torch.softmax(scores, dim=-1)[:, :, s:e]
