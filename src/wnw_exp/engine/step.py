"""One decode step (one token, batch 1) in two implementations with one interface, and its CUDA-graph capture.

- `TorchStep`, the reference: the backbone's HF modules layer by layer (`backbones.layer.decoder_layer`, the body
  prefill and calibration run too) over any KV store's `attend`, with the method's `before_attention` and
  `observe` hooks around it. It is what the CPU runs, and the specification the fused step is tested against.
- `FusedStep`: the same arithmetic in ~10 kernels a layer over the packed store (the HF layer spends about 30
  small kernels a layer on one token: fp32 casts in RMSNorm, `rotate_half` with `cat`, three q/k/v GEMVs, two MLP
  GEMVs, residual adds; inside one CUDA graph they, not the weight reads, bound the step):

      add+RMSNorm -> one q|k|v GEMM -> RoPE + KV append -> attention (2 Triton kernels)
      -> o GEMM -> add+RMSNorm -> one gate|up GEMM -> SiLU*mul -> down GEMM   (the residual add of the
      down projection is fused into the next layer's add+RMSNorm)

  on the backbone's fused weights (`Backbone.fused_layers`) and its RoPE table (`Backbone.rope_table`: every
  position the run can reach, M-RoPE included). `kernels="triton"` uses `engine/triton_ops.py` and the packed
  store's Triton attention (CUDA, or Triton's interpreter on a CPU); `kernels="torch"` the PyTorch equivalents
  below, which round exactly where the HF modules round: the specification the kernels are tested against.
  Nothing in it reads the host, and the method's hooks it calls must not either (`Policy.graph_safe`).

Both take the step's token from `tok` (device long) and leave the next one there (the argmax of `logits`); the
step index selects the RoPE row (`FusedStep` keeps it on the device, `t`). Speed is a wrapper around the same step,
gpt-fast's way: `CapturedStep` records one call of a function (the engine's step plus the method's decision and
the store's moves) in a CUDA graph and replays it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from wnw_exp.backbones.layer import decoder_layer, rotate_half
from wnw_exp.kv.base import upload
from wnw_exp.kv.packed import BatchLayout
from wnw_exp.methods.base import Policy


class TorchStep:
    """The reference decode step over any KV store (eager)."""

    def __init__(self, backbone, store, policy, cos: torch.Tensor, sin: torch.Tensor):
        self.backbone, self.store, self.policy = backbone, store, policy
        self.dims = (backbone.n_q_heads, backbone.n_kv_heads, backbone.head_dim)
        self.cos, self.sin = cos, sin  # (n_steps, D)
        self.observers = {li: policy.observe_heads(li) for li in range(backbone.n_layers)}
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=backbone.device)
        self.logits: torch.Tensor | None = None

    def __call__(self, step: int) -> None:
        bb = self.backbone
        hidden = bb.embed_tokens(self.tok)
        cos, sin = self.cos[None, step:step + 1], self.sin[None, step:step + 1]
        for li, layer in enumerate(bb.layers):
            hidden = decoder_layer(layer, hidden, cos, sin, partial(self._attend, li), self.dims)
        self.logits = bb.lm_head(bb.final_norm(hidden))[0, -1].float()
        self.tok = torch.argmax(self.logits).view(1, 1)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        q = q[0, :, 0]
        self.policy.before_attention(layer, q)
        out, probs = self.store.attend(layer, q, k[0, :, 0], v[0, :, 0], scale, self.observers[layer])
        if probs is not None:
            self.policy.observe(layer, probs)
        return out.view(1, q.shape[0], 1, -1)


def _after_attention(step, w, out: torch.Tensor) -> torch.Tensor:
    """A fused layer after its attention `out` ((H_q, D), or (B, H_q, D) in a batch), for `FusedStep` and
    `BatchedFusedStep` alike: o GEMM, add+RMSNorm, gate|up GEMM, SiLU*mul, down GEMM; returns the down projection,
    the residual delta the next layer's add+RMSNorm adds."""
    delta = F.linear(out.flatten(-2), w.w_o, w.b_o)
    step.add_rmsnorm(step.hidden, delta, w.ln2, w.eps, step.normed)
    step.silu_mul(F.linear(step.normed, w.w_gate_up), step.act)
    return F.linear(step.act, w.w_down)


def prefill_layer(w, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention, dims: tuple[int, int, int],
                  kernels: str = "triton") -> torch.Tensor:
    """`backbones.layer.decoder_layer` over a whole prompt on a layer's fused weights (`Backbone.fused_layers`), in
    the fused step's kernels: RMSNorm in one launch, one q|k|v GEMM, RoPE and the head-major split in one
    (`rope_split`), one gate|up GEMM and SiLU*mul in one. Same arguments and rounding points as `decoder_layer`
    (hidden (1, T, hidden_size), cos/sin (1, T, D); `attention(q, k, v, scale)`); about a third of its launches."""
    n_q, n_kv, d = dims
    add_rmsnorm, _, silu_mul, rope_split = _ops(kernels)
    x = hidden[0].contiguous()  # the kernels read rows at a stride of hidden_size
    T = x.shape[0]
    normed = add_rmsnorm(x, None, w.ln1, w.eps, torch.empty_like(x))
    qkv = F.linear(normed, w.w_qkv, w.b_qkv)
    q = x.new_empty(n_q, T, d)
    k, v = x.new_empty(n_kv, T, d), x.new_empty(n_kv, T, d)
    rope_split(qkv, cos[0].contiguous(), sin[0].contiguous(), q, k, v, n_q, n_kv, d)
    out = attention(q[None], k[None], v[None], w.scale)
    x = x + F.linear(out[0].transpose(0, 1).reshape(T, -1), w.w_o, w.b_o)
    add_rmsnorm(x, None, w.ln2, w.eps, normed)
    act = silu_mul(F.linear(normed, w.w_gate_up), x.new_empty(T, w.w_down.shape[1]))
    return (x + F.linear(act, w.w_down))[None]


def _final_logits(step) -> torch.Tensor:
    """The last layer's residual add, the final RMSNorm and the LM head (both fused steps)."""
    step.add_rmsnorm(step.hidden, step._delta, step.norm_f, step.eps_f, step.normed)
    return F.linear(step.normed, step.lm_w, step.lm_b)


class FusedStep:
    """The fused decode step over a `PackedAudioKVStore`, in static buffers (graph-safe).

    `observe_heads` of the method decide, per layer, which query heads' softmax weights at audio positions the
    attention writes into a static buffer for `policy.observe(layer, probs)`; `policy.before_attention(layer, q)`
    gets the step's RoPE'd query (H_q, D) right after it is computed. `body()` runs the embedding and the layers,
    `head()` the final norm, the LM head, the argmax and the step counters: the engine runs the method's decision
    and the store's moves between the two, on a side stream on CUDA.
    """

    def __init__(self, backbone, store, policy, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "triton"):
        self.store, self.policy = store, policy
        if store.pool is not None:
            raise ValueError("FusedStep runs on a store with its own dense buffers; a pooled store's is BatchedFusedStep")
        self.n_q, self.n_kv, self.d = backbone.n_q_heads, backbone.n_kv_heads, backbone.head_dim
        self.layers = backbone.fused_layers()
        self.add_rmsnorm, self.rope_append, self.silu_mul, _ = _ops(kernels)
        self.embed = backbone.embed_tokens.weight
        self.norm_f, self.eps_f = backbone.final_norm.weight, float(backbone.final_norm.variance_epsilon)
        self.lm_w, self.lm_b = backbone.lm_head.weight, backbone.lm_head.bias
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        dev, dt = store.device, self.embed.dtype
        hid, inter = self.embed.shape[1], self.layers[0].w_down.shape[1]
        self.hidden = torch.zeros(hid, device=dev, dtype=dt)
        self.normed = torch.empty(hid, device=dev, dtype=dt)
        self.q = torch.empty(self.n_q, self.d, device=dev, dtype=dt)
        self.act = torch.empty(inter, device=dev, dtype=dt)
        self.tok = torch.zeros(1, 1, device=dev, dtype=torch.long)
        self.t = torch.zeros(1, device=dev, dtype=torch.long)  # the step index: the RoPE table's row
        self.logits: torch.Tensor | None = None
        self.observe: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for li in range(len(self.layers)):
            heads = policy.observe_heads(li)
            if heads:
                self.observe[li] = (torch.tensor(heads, dtype=torch.int32, device=dev),
                                    torch.zeros(len(heads), store.n_audio, device=dev))

    def __call__(self, step: int | None = None) -> None:
        self.body()
        self.head()

    def body(self) -> None:
        s = self.store
        torch.index_select(self.embed, 0, self.tok.view(1), out=self.hidden.view(1, -1))
        delta = None
        for li, w in enumerate(self.layers):
            self.add_rmsnorm(self.hidden, delta, w.ln1, w.eps, self.normed)
            qkv = F.linear(self.normed, w.w_qkv, w.b_qkv)
            self.rope_append(qkv, self.cos, self.sin, self.t, s.dense_len, self.q, s.dense_k[li], s.dense_v[li],
                             self.n_q, self.n_kv, self.d)
            self.policy.before_attention(li, self.q)
            obs, probs = self.observe.get(li, (None, None))
            acc = self.policy.observe_sum(li) if obs is not None else None
            out = s.attend_device(li, self.q, w.scale, obs, probs, accumulate=acc)
            if obs is not None and acc is None:
                self.policy.observe(li, probs)
            delta = _after_attention(self, w, out)
        self._delta = delta

    def head(self) -> None:
        self.logits = _final_logits(self)  # inside a graph: its static output
        torch.argmax(self.logits, dim=-1, keepdim=True, out=self.tok.view(1))
        self.t += 1
        self.store.advance()


class BatchedFusedStep:
    """The fused step for a batch of streams whose packed stores live in one `KVPool`: one token of each stream per
    call, in static buffers (graph-safe, like `FusedStep`).

    Every GEMM runs once for the batch (B rows: the weights are read once per step, which is what batching buys),
    RoPE and the KV append run in one launch, and each layer's attention is one launch over every (stream, KV
    head) ragged region of the pool (`decode_attention_batched`), from the attention metadata the stores give in one
    launch (`kv.packed.BatchLayout`). The methods stay per stream: each stream's policy gets its own query row in
    `before_attention` and its own observer weights in `observe` (or, summing them, one `ObserverSum` launch for
    all), and the engine runs each stream's decision and moves between `body()` and `head()`.

    With `capacity` (Triton kernels) the buffers have that many rows and `bind(streams)` seats another set of up
    to that many streams in place (rows past theirs run on nothing): every launch reads the streams through
    buffers and address tables rewritten in place, so a CUDA graph captured over the step replays for any set of
    streams it can seat, as long as `generation` (bumped where a buffer had to be made anew) and `max_keys` are
    those it was captured with and the methods' hooks allow it (`Policy.graph_reusable`). Without, it is made for
    one set of streams (a composition of the batch).
    """

    KEY_ROUND = 1024  # with a capacity, each layer's key bound is rounded up to this (fewer distinct graphs)

    def __init__(self, backbone, streams, kernels: str = "triton", capacity: int | None = None):
        streams = list(streams)
        C = len(streams) if capacity is None else int(capacity)
        if capacity is not None and kernels != "triton":
            raise ValueError("a batched step with a capacity runs on the Triton kernels")
        self.capacity = capacity
        L = backbone.n_layers
        self.n_q, self.n_kv, self.d = backbone.n_q_heads, backbone.n_kv_heads, backbone.head_dim
        self.layers = backbone.fused_layers()
        self.add_rmsnorm, _, self.silu_mul, _ = _ops(kernels)
        self.rope_append, self.attention, self.probs = _batched_ops(kernels)
        self.kernels = kernels
        self.embed = backbone.embed_tokens.weight
        self.norm_f, self.eps_f = backbone.final_norm.weight, float(backbone.final_norm.variance_epsilon)
        self.lm_w, self.lm_b = backbone.lm_head.weight, backbone.lm_head.bias
        self.pool = streams[0].store.pool
        if self.pool is None:
            raise ValueError("a batched step needs every stream's store placed in one KV pool")
        dev, dt = self.pool.device, self.embed.dtype
        self.dev, self.dt = dev, dt
        hid, inter = self.embed.shape[1], self.layers[0].w_down.shape[1]
        self.hidden = torch.zeros(C, hid, device=dev, dtype=dt)
        self.normed = torch.empty(C, hid, device=dev, dtype=dt)
        self.q = torch.empty(C, self.n_q, self.d, device=dev, dtype=dt)
        self.act = torch.empty(C, inter, device=dev, dtype=dt)
        self.tok = torch.zeros(C, 1, device=dev, dtype=torch.long)
        self.t = torch.zeros(C, device=dev, dtype=torch.long)
        self.cos = self.sin = None  # (C, T, D): each row's RoPE table (`bind`)
        self.layout = BatchLayout(L, self.n_kv, C, dev, kernels)
        self.page = self.pool.block
        self._scratch: dict = {}  # (layer, key bound) -> the attention's split buffers (a graph keeps its own)
        self.observer_sums: list = [None] * L
        self.generation = 0
        self.logits: torch.Tensor | None = None
        self.bind(streams)

    def bind(self, streams) -> None:
        """Seat `streams` (placed in this step's pool) in rows 0.., the rest empty (outside a graph capture)."""
        streams = list(streams)
        C, L = self.layout.capacity, len(self.layers)
        stores = [st.store for st in streams]
        if not streams or len(streams) > C:
            raise ValueError(f"{len(streams)} streams for a batched step of {C}")
        if any(s.pool is not self.pool or s.extent is None for s in stores):
            raise ValueError("a batched step needs every stream's store placed in one KV pool")
        self.streams = streams
        grown = self.layout.bind(stores, self.KEY_ROUND if self.capacity is not None else 1)
        self.max_keys = self.layout.max_keys
        T = max(st.cos.shape[0] for st in streams)
        if self.cos is None or T > self.cos.shape[1]:
            T = T if self.capacity is None else -(-T // 1024) * 1024
            self.cos = torch.zeros(C, T, self.d, device=self.dev, dtype=self.dt)
            self.sin = torch.zeros(C, T, self.d, device=self.dev, dtype=self.dt)
            grown = True
        for b, st in enumerate(streams):
            self.cos[b, : st.cos.shape[0]], self.sin[b, : st.sin.shape[0]] = st.cos, st.sin
        pad = C - len(streams)
        upload(self.tok, torch.tensor([[st.tokens[-1]] for st in streams] + [[0]] * pad))  # (no host wait)
        upload(self.t, torch.tensor([st.index for st in streams] + [0] * pad))
        # per-stream hooks (their launches name each stream's tensors: such a step is made for one composition)
        self.hooks_before = [st for st in streams if type(st.policy).before_attention is not Policy.before_attention]
        self.observe: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in range(L)]
        summing: list[list] = [[] for _ in range(L)]
        for b, st in enumerate(streams):
            for li, heads, acc, slot_rows in st.observers():
                if acc is not None and self.kernels == "triton":
                    summing[li].append((b, acc, slot_rows, heads))
                else:
                    self.observe[li].append((b, torch.tensor(heads, dtype=torch.int32, device=self.dev),
                                             torch.zeros(len(heads), st.store.n_audio, device=self.dev)))
        if self.kernels == "triton":  # per layer: one ObserverSum over the streams whose methods only sum
            from wnw_exp.kv.triton_attention import ObserverSum

            for li in range(L):
                held, entries = self.observer_sums[li], summing[li]
                if held is not None and held.bind(entries):
                    continue
                if entries or held is not None:
                    self.observer_sums[li] = ObserverSum(entries, self.dev, self.capacity) if entries else None
                    grown = True
        self.generation += grown

    def body(self) -> None:
        lay, pool, delta = self.layout, self.pool, None
        lay.gather()  # where each stream's new key goes, its heads' scan lengths and page tables as they are now
        torch.index_select(self.embed, 0, self.tok.view(-1), out=self.hidden)
        dense_next = lay.dense_len + 1
        for li, w in enumerate(self.layers):
            self.add_rmsnorm(self.hidden, delta, w.ln1, w.eps, self.normed)
            qkv = F.linear(self.normed, w.w_qkv, w.b_qkv)
            self.rope_append(qkv, self.cos, self.sin, self.t, lay.dense_len, lay.table[li], self.q, pool.k,
                             pool.v, self.n_q, self.n_kv, self.d, page_rows=self.page)
            alen = lay.audio_len[li]
            if self.hooks_before:
                for b, st in enumerate(self.streams):
                    st.policy.before_attention(li, self.q[b])
                for b, st in enumerate(self.streams):  # after any move a method made for this layer
                    alen[b].copy_(st.store.audio_len[li])
            mk = self.max_keys[li]
            out, lse = self.attention(self.q, pool.k, pool.v, pool.pos, lay.table[li], dense_next,
                                      lay.audio_off[li], alen, w.scale, max_keys=mk, page_rows=self.page,
                                      scratch=self._scratch.setdefault((li, mk), {}))
            if self.observer_sums[li] is not None:  # every summing stream's observers in one launch
                self.observer_sums[li](self.q, pool.k, lay.audio_off[li], lse, w.scale)
            for b, heads, probs in self.observe[li]:
                self.probs(self.q[b], pool.k, pool.pos, lay.audio_off[li, b], alen[b], lse[b], w.scale, heads,
                           probs, lay.layouts[b].max_audio_per_head)
                acc = self.streams[b].policy.observe_sum(li)
                if acc is not None:
                    acc += probs.sum(dim=0)
                else:
                    self.streams[b].policy.observe(li, probs)
            delta = _after_attention(self, w, out)
        self._delta = delta

    def head(self) -> None:
        self.logits = _final_logits(self)  # (C, vocab)
        torch.argmax(self.logits, dim=-1, keepdim=True, out=self.tok)
        self.t += 1
        self.layout.advance()


class CapturedStep:
    """`fn` recorded once in a CUDA graph (run it eagerly at least once before, so that kernels are compiled and
    buffers allocated), replayed by each call: the same work, launched as one graph."""

    def __init__(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def __call__(self) -> None:
        self.graph.replay()


# --- the torch equivalents of the Triton kernels (the specification) ----------------------------------
def add_rmsnorm_torch(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      out: torch.Tensor) -> torch.Tensor:
    if delta is not None:
        hidden.add_(delta)  # a bf16 add rounds once, as `hidden + out` in the HF layer
    x = hidden.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(hidden.dtype)
    torch.mul(weight, y, out=out)
    return out


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the last dim, cos/sin broadcast; each product and the sum round to the model dtype, as HF's
    apply_rotary_pos_emb (`backbones.layer.apply_rope`, whose head layout differs)."""
    return x * cos + rotate_half(x) * sin


def rope_append_torch(qkv, cos_table, sin_table, pos, dense_len, q_out, dense_k, dense_v, n_q, n_kv, head_dim):
    x = qkv.view(n_q + 2 * n_kv, head_dim)
    qk = x[: n_q + n_kv]
    cos, sin = cos_table.index_select(0, pos.view(1)), sin_table.index_select(0, pos.view(1))  # (1, D)
    y = _rope_torch(qk, cos, sin)
    q_out.copy_(y[:n_q])
    dense_k.index_copy_(1, dense_len.view(1), y[n_q:, None])
    dense_v.index_copy_(1, dense_len.view(1), x[n_q + n_kv:, None])
    return q_out


def rope_split_torch(qkv, cos, sin, q, k, v, n_q, n_kv, head_dim):
    x = qkv.view(-1, n_q + 2 * n_kv, head_dim)
    y = _rope_torch(x[:, : n_q + n_kv], cos[:, None], sin[:, None])
    q.copy_(y[:, :n_q].transpose(0, 1))
    k.copy_(y[:, n_q:].transpose(0, 1))
    v.copy_(x[:, n_q + n_kv:].transpose(0, 1))


def silu_mul_torch(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = out.shape[-1]
    torch.mul(F.silu(gate_up[..., :n]), gate_up[..., n:], out=out)
    return out


def rope_append_batched_torch(qkv, cos_table, sin_table, t, dense_len, dense_table, q_out, pool_k, pool_v, n_q, n_kv,
                              head_dim, *, page_rows):
    """`triton_ops.rope_append_batched` in PyTorch: each stream's RoPE row t[b], its k/v written into the pool at
    its dense token dense_len[b], through its page table dense_table (B, H_kv, pages) of `page_rows`-row pages."""
    B = qkv.shape[0]
    x = qkv.view(B, n_q + 2 * n_kv, head_dim)
    qk = x[:, : n_q + n_kv]
    b = torch.arange(B, device=qkv.device)
    y = _rope_torch(qk, cos_table[b, t][:, None], sin_table[b, t][:, None])  # cos/sin (B, 1, D)
    q_out.copy_(y[:, :n_q])
    n = dense_len.view(B, 1, 1)
    rows = (torch.gather(dense_table.long(), 2, (n // page_rows).expand(B, n_kv, 1))[..., 0]
            + (n % page_rows).view(B, 1)).reshape(-1)
    pool_k.index_copy_(0, rows, y[:, n_q:].reshape(-1, head_dim))
    pool_v.index_copy_(0, rows, x[:, n_q + n_kv:].reshape(-1, head_dim))
    return q_out


def _batched_ops(kernels: str):
    """(rope_append_batched, attention_batched, observed_probs) of an implementation."""
    if kernels == "triton":
        from wnw_exp.engine import triton_ops as t
        from wnw_exp.kv import triton_attention as a
        return t.rope_append_batched, a.decode_attention_batched, a.observed_probs
    from wnw_exp.kv.packed import attention_batched_torch, observed_probs_torch
    return rope_append_batched_torch, attention_batched_torch, observed_probs_torch


def _ops(kernels: str):
    """(add_rmsnorm, rope_append, silu_mul, rope_split) of an implementation."""
    if kernels == "triton":
        from wnw_exp.engine import triton_ops as t
        return t.add_rmsnorm, t.rope_append, t.silu_mul, t.rope_split
    if kernels == "torch":
        return add_rmsnorm_torch, rope_append_torch, silu_mul_torch, rope_split_torch
    raise ValueError(f"unknown kernels {kernels!r}: triton or torch")
