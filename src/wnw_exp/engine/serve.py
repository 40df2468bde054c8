"""Serving many requests with the one decode engine (`engine.decode`): continuous batching, admission by the KV
pool's room, recompute preemption, prefill scheduled beside the decode steps, and where the wall time went.

`decode_batch` is the one decode loop: it makes each request's `Stream`, runs its prefill (on a CUDA stream of its
own while others decode, `overlap_prefill`), admits it when the pool has room, and steps every running stream at
once (`engine.decode.step_streams`); `wnw-run batch_size=` and `benchmarks/serving.py` run it, and `generate` is
it with one request.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from wnw_exp.backbones.base import Backbone, Prompt
from wnw_exp.engine.decode import DecodeResult, Laps, Stream, decode_path, step_streams
from wnw_exp.methods.base import Policy


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
    # the admissions' placements: host seconds by part (`engine.decode.PLACE_PARTS`), summed over the streams
    place_s: dict = field(default_factory=dict)
    # the garbage collector's passes while `decode_batch` ran (within whichever part of `wall_s` they fell in)
    gc_s: float = 0.0
    gc_passes: int = 0
    gc_max_ms: float = 0.0


class GcWatch:
    """While `decode_batch` runs (a context): each pass of Python's garbage collector timed into a `BatchStats`
    (`gc_s`, `gc_passes`, `gc_max_ms`: a full pass over every object of a process that holds a model can stall the
    loop longer than a decode step), and with `freeze` the objects alive at the start (the model, the imported
    modules: most of them) left out of the passes (`gc.freeze`, as vLLM does after its warm-up; undone at the exit
    of the last of nested calls: nothing is kept from being collected after it)."""

    frozen = 0  # calls running with the collector's objects frozen

    def __init__(self, stats: BatchStats, freeze: bool):
        self.stats, self.freeze, self.t0 = stats, freeze, None

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self)
        if self.freeze:
            if GcWatch.frozen == 0:
                gc.freeze()
            GcWatch.frozen += 1
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)
        if self.freeze:
            GcWatch.frozen -= 1
            if GcWatch.frozen == 0:
                gc.unfreeze()

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            dt, self.t0 = time.perf_counter() - self.t0, None
            self.stats.gc_s += dt
            self.stats.gc_passes += 1
            self.stats.gc_max_ms = max(self.stats.gc_max_ms, dt * 1e3)


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


@torch.no_grad()
def decode_batch(backbone: Backbone, requests: Iterable[Request], make_policy: Callable[[], Policy], *,
                 retention: float, max_concurrent: int | None = None, pool=None, keep_logits: bool = False,
                 store: str = "auto", fused: bool | None = None, graph: bool | None = None, kernels: str = "auto",
                 prefill_chunk_layers: int | None = None, stats: BatchStats | None = None,
                 reserve_tokens: int | float | None = None,
                 overlap_prefill: bool | None = None,
                 freeze_gc: bool = True,
                 decode_priority: bool = False) -> Iterator[tuple[object, DecodeResult | Exception]]:
    """Continuous batching: decode `requests` several at a time, yielding (key, result) as each stream finishes
    (or (key, exception) for one that failed), in the order they finish.

    A request joins when fewer than `max_concurrent` streams run (None: no limit but the pool's) and, with a
    `pool` (`kv.pool.KVPool`, the packed store's), when the pool has room for its placed KV (one extent for each
    head's resident audio and recall room, dense pages for its prompt's text) and its expected growth, besides the
    expected growth still to come of the running streams: the dense pages of `expected_new_tokens(request,
    reserve_tokens)` tokens (by default its `expected_new_tokens`, else 0.6 of its cap). Otherwise it waits, its
    prefill done, until a stream leaves; alone, it joins when its placed KV fits. One that cannot fit an empty pool
    is refused (`PoolFull` as its result). A running stream's dense part grows a page (one pool block per layer and
    KV head) whenever its last page is full (taken while the step before runs where the pool has it, `_grow_ahead`);
    where the pool has no free block for it, the most recently admitted stream is preempted (vLLM's recompute
    preemption: all its memory freed, its request back at the head of the queue, restarted from scratch later;
    decoding is deterministic, so its result is the same): a newer stream than the one asking when there is one,
    the one asking itself when it is the newest, so the oldest stream always goes on. A stream that needs a page when it runs alone fails (`PoolFull`: the pool cannot hold its answer),
    alone. `stats.preempted` records the preemptions. Prefill runs `prefill_chunk_layers` layers between two
    decode steps (None: a whole prefill at once), so an admission does not stall the running streams for a whole
    prefill. With `overlap_prefill` (None: on CUDA) a request that arrives while streams run is prefilled on a
    CUDA stream of its own: its layers are launched (`prefill_chunk_layers` at a time) between decode steps and
    run on the GPU beside them; its placement and admission wait until its forward pass is done
    (`Stream.prefill_ready`), the running streams decoding meanwhile; the placement's decisions are launched in
    one turn of the loop (`Stream.decide`) and its compaction and first token come in the next, so the
    compaction's host read finds that work done and no turn holds the whole placement's host time.

    Each stream has its own policy (`make_policy()`, e.g. `Policy.fork`), store, positions and tokens, so its
    result does not depend on the others: on the reference path each stream steps on its own (`TorchStep`, as
    `generate`: the same arithmetic, byte for byte); on the fused path with a pool one `BatchedFusedStep` steps
    every running stream at once (GEMMs over the batch, one attention launch over every stream's ragged regions).
    On CUDA its steps run as CUDA graphs: where the methods allow it (`Policy.graph_reusable`), one step per
    batch-size bucket seats each new composition in place and replays the graph the bucket captured before
    (`engine.decode.step_streams`); otherwise one graph per composition is captured after `WARM_STEPS` eager steps
    (at its first step where a composition of the same shape, `_warm_key`, ran before: its kernels are compiled).
    With `freeze_gc` the objects alive when it starts stay out of the garbage collector's passes until it ends
    (`GcWatch`); `stats.gc_s` times the passes either way. With `decode_priority` (CUDA) the loop's own work, the
    decode steps and their graphs included, runs on a CUDA stream of the device's highest priority, so that the
    GPU's block scheduler runs a step's kernels before the pending blocks of an overlapped prefill (whose stream
    keeps the lowest priority); the caller's code between two results runs on its own stream.
    """
    loop = _decode_loop(backbone, requests, make_policy, retention, max_concurrent, pool, keep_logits, store, fused,
                        graph, kernels, prefill_chunk_layers, stats, reserve_tokens, overlap_prefill, freeze_gc)
    dev = backbone.device
    if not decode_priority or dev.type != "cuda":
        yield from loop
        return
    high = torch.cuda.Stream(dev, priority=-100)  # (mapped to the device's highest)
    caller = torch.cuda.current_stream(dev)
    try:
        while True:
            high.wait_stream(caller)
            with torch.cuda.stream(high):
                item = next(loop, None)
            caller.wait_stream(high)
            if item is None:
                return
            yield item
    finally:
        loop.close()


@torch.no_grad()
def _decode_loop(backbone, requests, make_policy, retention, max_concurrent, pool, keep_logits, store, fused, graph,
                 kernels, prefill_chunk_layers, stats, reserve_tokens, overlap_prefill, freeze_gc):
    """`decode_batch`'s loop, on the current CUDA stream."""
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
    finished: deque = deque()  # (stream, its error or None) that ended at the last step, their results to yield
    batched: dict = {}  # the fused path's runner for the current composition, and each bucket's step and graphs
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    if overlap_prefill and dev.type != "cuda":
        raise ValueError("overlap_prefill runs a prefill on its own CUDA stream: it needs a CUDA device")
    overlap = torch.cuda.Stream(dev) if dev.type == "cuda" and overlap_prefill is not False else None
    # the placements of overlapped prefills at the device's highest priority (`Stream.place_stream`)
    place_stream = torch.cuda.Stream(dev, priority=-100) if overlap is not None else None
    waiting_for_room = False  # a prefilled stream the pool could not take yet
    warmed: set = set()  # batch shapes whose kernels have run: a new composition of one is captured at once
    laps = Laps(stats.wall_s)
    stats.started_at = laps.t
    with GcWatch(stats, freeze_gc):
        while True:
            # 1. The running streams' next step, launched: the admission work below runs on the host meanwhile.
            collect = None
            if active:
                laps.lap("loop")
                preempted, failed_growth = _grow_dense(active)
                # newest first (their memory is free already): the oldest ends up first in the queue
                for st in preempted:
                    stats.preempted.append(st.key)
                    queue.appendleft(st.request)
                laps.lap("grow")
                for st, e in failed_growth:
                    _leave(st)
                    laps.lap("finish")
                    yield st.key, e
                    laps.lap("caller")
                if preempted or failed_growth:
                    _recompose(batched)
                    waiting_for_room = False
                if active:
                    laps.lap("loop")
                    try:
                        collect = step_streams(backbone, active, batched, side, keep_logits, warmed)
                    except Exception as e:  # noqa: BLE001 - a failed step fails the streams it ran
                        laps.lap("step")
                        for st in active:
                            _leave(st)
                            laps.lap("finish")
                            yield st.key, e
                            laps.lap("caller")
                        active, batched, waiting_for_room = [], {}, False
                        continue
                    launch_s = laps.lap("step")
            # The streams that ended at the last step: their results, from reads queued before this step's launch
            # (`Stream.finish`), made while it runs.
            while finished:
                st, result = finished.popleft()
                laps.lap("loop")
                if result is None:
                    try:
                        result = st.result()
                    except Exception as e:  # noqa: BLE001 - a check that failed at the end fails its stream
                        result = e
                laps.lap("finish")
                yield st.key, result
                laps.lap("caller")
            if collect is not None:  # the running streams' pages for the step after this one, where the pool has them
                laps.lap("loop")
                _grow_ahead(active)
                laps.lap("grow")
            # 2. Admission: the next request's set-up, a chunk of its prefill, its placement; it joins after the step.
            joining = None
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
                        st = Stream(backbone, req.prompt, policy, retention=retention,
                                    max_new_tokens=req.max_new_tokens,
                                    path=path, keep_logits=keep_logits, pool=pool if path.store == "packed" else None,
                                    key=req.key, expected_new_tokens=expected_new_tokens(req, reserve_tokens),
                                    overlap=overlap if active else None, place_stream=place_stream)
                        st.request = req
                        admitting = (st, st.prefill_layers())
                        laps.lap("setup")
                    except Exception as e:  # noqa: BLE001 - one request's failure is its own
                        laps.lap("setup")
                        yield req.key, e
                        laps.lap("caller")
                        req = None
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
                    if done_layers and active and st.overlap is not None and not st.decided and st.prefill_ready():
                        st.decide()  # the placement's decisions this turn; compaction and first token at the next
                        laps.lap("place")
                    elif done_layers and not waiting_for_room and st.prefill_ready():
                        joined = _admit(st, active, stats)
                        laps.lap("place")
                        waiting_for_room = joined is None  # retried once a stream has left
                        stats.room_waits += waiting_for_room
                        if joined is not None:
                            admitting = None
                            stats.first_token_at.setdefault(st.key, st.emitted_at[0])
                            if joined:
                                joining = st
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
            # 3. The step's tokens: emitted; finished streams leave (their results are made while the next step runs);
            #    then the admitted stream joins.
            if collect is not None:
                laps.lap("loop")
                tokens, logits = collect()
                ms = (launch_s + laps.lap("step")) * 1e3  # its launch and the wait for it (the host work between apart)
                stats.step_at.append(laps.t)
                stats.batch_sizes.append(len(active))
                stats.step_ms.append(ms)
                stats.step_kinds.append(batched["runner"].last if "runner" in batched else "eager")
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
                        if id(st) not in failed:
                            st.finish()
                        _leave(st)  # its memory is free for the next step (its store keeps what it held for the result)
                        finished.append((st, failed.get(id(st))))
                    laps.lap("finish")
                    active = [st for st in active if not st.done]
                    _recompose(batched)
                    waiting_for_room = False
            if joining is not None:
                stats.joined_at[joining.key] = len(stats.batch_sizes)
                active.append(joining)
                _recompose(batched)
            if not active and admitting is None and arriving is None and exhausted and not queue and not finished:
                break
    laps.lap("loop")  # (after the collector's watch has ended: its exit is part of the wall too)


def _recompose(batched: dict) -> None:
    """The batch's composition changed: its next step seats the new one (`step_streams`), keeping each bucket's
    step, tables and graphs."""
    for k in ("runner", "held", "warm_key"):
        batched.pop(k, None)


def default_pool(backbone: Backbone, gb: float | None = None, fraction: float = 0.8, host_gb: float | None = None,
                 cpu_tier: bool = False):
    """On CUDA, a `KVPool` of `gb` GB, or (None) `fraction` of the device memory free now: the budget batched
    streams share; None on other devices (streams then allocate their own). Its pinned host arena for the streams'
    host mirrors: `host_gb` GB, or (None) for a method with a CPU tier (`cpu_tier`) twice the device pool, at most a
    quarter of the machine's memory (0 without one); a mirror the arena cannot hold is pinned on its own."""
    if backbone.device.type != "cuda":
        return None
    from wnw_exp.kv.pool import KVPool

    budget = gb * 1e9 if gb is not None else torch.cuda.mem_get_info(backbone.device)[0] * fraction
    if host_gb is not None:
        host = host_gb * 1e9
    elif cpu_tier:
        host = min(2 * budget, 0.25 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    else:
        host = 0
    return KVPool.of_bytes(budget, backbone.head_dim, backbone.dtype, backbone.device, host_bytes=int(host))


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
    if active and st.store.pool is not None:  # alone, it joins when its placed KV fits
        reserve = st.store.growth_blocks() + sum(o.store.outstanding_blocks() for o in active
                                                 if o.store.pool is not None)
    try:
        st.finish_prefill(reserve)
    except PoolFull:
        _add_parts(stats.place_s, st.place_s)
        if not active:
            stats.refused.append(st.key)
            raise
        return None
    _add_parts(stats.place_s, st.place_s)
    if st.path.store != "packed" or st.store.pool is None or not st.path.fused:
        st.make_step()
    return st.emit(st.next_token, st.logits)


def _add_parts(total: dict, parts: dict) -> None:
    """Add a stream's placement parts to the batch's, and clear them (a retried placement adds only its own)."""
    for k, v in parts.items():
        total[k] = total.get(k, 0.0) + v
    parts.clear()


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
        if store.pool is None or store.ensure_dense(store.n_text + st.index + 1):
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


def _grow_ahead(active: list[Stream]) -> None:
    """While a step runs: the dense page each pooled stream's next step will need, if that step comes (its length
    cap allows it) and the pool has the blocks; where it has not, nothing is taken and `_grow_dense` asks again
    before that step (preempting there if it must). The page tables are written after the running step in stream
    order, so the step reads them as they were."""
    for st in active:
        store = st.store
        if store.pool is not None and st.index + 2 < st.max_new_tokens:
            store.ensure_dense(store.n_text + st.index + 2)


def _leave(st: Stream) -> None:
    st.store.release_memory()


@torch.no_grad()
def generate(backbone: Backbone, prompt: Prompt, policy: Policy, *, retention: float, max_new_tokens: int,
             keep_logits: bool = False, store: str = "auto", fused: bool | None = None, graph: bool | None = None,
             kernels: str = "auto") -> DecodeResult:
    """Greedy decoding of one prompt with `policy` managing the audio KV: `decode_batch` with this one request
    (the same loop as a batch: prefill layer by layer, the backbone's modules, `backbones.layer.decoder_layer`,
    then one decode step per token, `engine.step`), its store on its own (no pool).

    `store`: "reference" (kv.reference, the specification), "packed" (kv.packed) or "auto" (packed on CUDA with
    Triton when the method runs on it, `policy.packed_store`). `fused`: the fused step (`FusedStep`, packed store)
    instead of the reference step (`TorchStep`); None: on CUDA with Triton kernels. `graph`: capture the step,
    the method's per-step decision and the store's moves in one CUDA graph, replayed per token (the first
    `WARM_STEPS` run eagerly); None: whenever the fused step runs on CUDA and `policy.graph_safe`. `kernels`: the
    fused step's and the packed store's kernels, "triton", "torch" (their PyTorch equivalents) or "auto" (triton
    on CUDA when installed). The CPU default (reference store and step) is what every other path is tested
    against; on CUDA every backbone family gets the fused graph path by default. Raises what the request failed
    with.
    """
    decode_path(backbone.device, policy, store, fused, graph, kernels)  # a bad choice raises here, before any work
    for _, result in decode_batch(backbone, [Request(None, prompt, max_new_tokens)], lambda: policy,
                                  retention=retention, max_concurrent=1, keep_logits=keep_logits, store=store,
                                  fused=fused, graph=graph, kernels=kernels, overlap_prefill=False):
        if isinstance(result, Exception):
            raise result
        return result
    raise AssertionError("decode_batch ended without a result for its one request")
