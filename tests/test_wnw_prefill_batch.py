"""WnW's per-layer prefill placement against the per-head path it replaces.

`WnW.place` selects every placed head of a layer from one stable sort (`triage.select_masks`) and sets their tiers
in one store call (`set_tiers_block`). The per-head path (`triage.select_positions`, `triage.complement` and one
`set_tiers` per head, the packed store's as it was) is kept here as the reference: the kept positions, the
`offloaded` dict and every store tensor must be identical, for both selections, both quotas, mixed roles and
retentions (0, below 1 / n_s, fractional, 1), and scores full of ties.
"""

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from helpers import scores_for

from wnw_exp.engine.decode import place
from wnw_exp.kv.packed import PackedAudioKVStore
from wnw_exp.kv.reference import AudioKVStore
from wnw_exp.methods.base import PrefillScores, SampleContext
from wnw_exp.methods.wnw import WnW, triage

L, H, G, N_AUDIO = 4, 4, 2, 203  # segments of 10 tokens (0.8 s at 12.5 tokens/s), the last one 3 tokens
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def old_packed_set_tiers(store: PackedAudioKVStore, layer: int, head: int, gpu, cpu=None) -> None:
    """The packed store's `set_tiers` before `set_tiers_block` (one row, its own host reads)."""
    r = layer * store.n_kv_heads + head
    gpu = torch.sort(torch.as_tensor(gpu, device=store.device).long()).values
    if not bool((store.slot_of[r, gpu] >= 0).all()):
        raise ValueError("set_tiers: a position to keep is not GPU-resident")
    on_host = torch.zeros(store.n_audio, dtype=torch.bool, device=store.device)
    if cpu is not None and len(cpu):
        cpu = torch.as_tensor(cpu, device=store.device).long()
        if not bool((store.slot_of[r, cpu] >= 0).all()):
            raise ValueError("set_tiers: a position to offload is not GPU-resident")
        on_host[cpu] = True
    b, n = int(store.base[r]), len(gpu)
    src = b + store.slot_of[r, gpu].long()
    store.audio_k[b: b + n] = store.audio_k[src]
    store.audio_v[b: b + n] = store.audio_v[src]
    store.audio_pos[b: b + int(store.caps[r])] = -1
    store.audio_pos[b: b + n] = gpu.int()
    store.slot_of[r] = -1
    store.slot_of[r, gpu] = torch.arange(n, device=store.device, dtype=torch.int32)
    store.on_host[r] = on_host
    store.n_resident[r] = n
    store.audio_len[layer, head] = n
    store._union = None
    store._blocks = None


def old_place(policy: WnW, layer: int, scores: PrefillScores, set_tiers) -> dict:
    """`WnW.place` as it was: one selection and one `set_tiers` per head. Returns the layer's offloaded positions."""
    post = scores.post_audio
    per_head = post.float().sum(dim=1).view(H, G, -1).sum(dim=1)
    n_a = per_head.shape[-1]
    if policy.swap_start == "prefill" and policy.anchor_q.get(layer):
        policy.scores_acc += post[:, -1][policy.anchor_q[layer]].float().sum(dim=0)
    offloaded = {}
    for k in range(H):
        role = policy.roles[layer, k]
        if role == triage.ANCHOR or policy.retention[layer, k] >= 1.0:
            continue
        keep = triage.select_positions(per_head[k], float(policy.retention[layer, k]), policy.n_s, policy.selection,
                                       policy.quota)
        if role == triage.TIDAL:
            offloaded[(layer, k)] = torch.sort(triage.complement(keep, n_a).cpu()).values
            set_tiers(layer, k, keep, offloaded[(layer, k)])
        else:
            set_tiers(layer, k, keep)
    return offloaded


def make(store_cls, selection, quota, device="cpu"):
    """A WnW of 4 x 4 KV heads: 1 anchor, 5 tidal, 10 fixed; lam = 1.25 puts the top non-anchor heads at retention 1,
    a zero voice score keeps nothing, small ones keep less than one token per segment."""
    vs = np.array([[1.0, 0.9, 0.0, 0.3], [0.85, 0.02, 0.5, 0.6], [0.7, 0.05, 0.2, 0.01], [0.8, 0.4, 0.1, 0.65]])
    policy = WnW(scores=scores_for(vs, np.ones((L, H))), n_voice=6, n_anchor=1, lam=1.25, chunk_seconds=1.6,
                 stride_seconds=0.8, top_k=1, delta=3, selection=selection, quota=quota)
    ctx = SampleContext(n_layers=L, n_q_heads=H * G, n_kv_heads=H, head_dim=4, token_rate=12.5, n_audio=N_AUDIO,
                        retention=0.3, device=torch.device(device))
    store = store_cls(L, H, 4, N_AUDIO, torch.device(device), torch.float32, dense_capacity=8)
    policy.start(ctx, store)
    return policy, store


def layer_inputs(layer: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + layer)
    k = torch.randn(H, N_AUDIO + 5, 4, generator=g)
    post = torch.randint(0, 3, (H * G, 2, N_AUDIO), generator=g).float()  # many ties: the earlier position wins
    return k.to(device), post.to(device)


def assert_same_store(a, b) -> None:
    if isinstance(a, PackedAudioKVStore):
        for name in ("audio_k", "audio_v", "audio_pos", "slot_of", "on_host", "n_resident", "audio_len"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert a._union is None and b._union is None and a._blocks is None and b._blocks is None
        return
    for la, lb in zip(a.heads, b.heads):
        for ta, tb in zip(la, lb):
            for name in ("gpu_pos", "gpu_k", "gpu_v", "cpu_pos", "cpu_k", "cpu_v"):
                x, y = getattr(ta, name), getattr(tb, name)
                assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store_cls", [PackedAudioKVStore, AudioKVStore])
@pytest.mark.parametrize("quota", ["floor", "spread"])
@pytest.mark.parametrize("selection", ["segment", "global"])
def test_place_per_layer_matches_per_head(selection, quota, store_cls, device):
    policy, store = make(store_cls, selection, quota, device)
    old_policy, old_store = make(store_cls, selection, quota, device)
    roles, ret = policy.roles, policy.retention
    assert {triage.ANCHOR, triage.TIDAL, triage.FIXED} == set(roles.ravel())
    non_anchor = ret[roles != triage.ANCHOR]
    assert (non_anchor >= 1).any() and (non_anchor == 0).any() and ((non_anchor > 0) & (non_anchor < 0.1)).any()
    assert ((roles == triage.TIDAL) & (ret >= 1)).any() and ((non_anchor > 0.1) & (non_anchor < 1)).any()
    set_tiers = (lambda *a: old_packed_set_tiers(old_store, *a)) if store_cls is PackedAudioKVStore \
        else old_store.set_tiers
    offloaded = {}
    for layer in range(L):
        k, post = layer_inputs(layer, device)
        for s in (store, old_store):
            s.write_prefill(layer, k, k + 1, (2, 2 + N_AUDIO))
        place(policy, store, layer, PrefillScores(post.clone()))
        offloaded.update(old_place(old_policy, layer, PrefillScores(post.clone()), set_tiers))
    assert_same_store(store, old_store)
    assert torch.equal(policy.scores_acc, old_policy.scores_acc) and policy.scores_acc.any()  # the anchors' last row
    got = policy.offloaded
    assert list(got) == list(offloaded) == [(li, k) for li, k in policy.tidal if ret[li, k] < 1]
    for key, pos in offloaded.items():
        assert got[key].device.type == "cpu" and got[key].dtype == torch.long and torch.equal(got[key], pos), key
    assert policy.offloaded is got  # read once
    if store_cls is PackedAudioKVStore:  # what compaction sizes from them is the same too
        store.compact(headroom=policy.recall_headroom)
        old_store.compact(headroom=policy.recall_headroom)
        assert np.array_equal(store.caps, old_store.caps)
        for name in ("audio_k", "audio_pos", "slot_of", "on_host"):
            assert torch.equal(getattr(store, name), getattr(old_store, name)), name


class Calls(TorchFunctionMode):
    """Counts the tensor functions called inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [list(range(L)), [0, 2, 3]])
@pytest.mark.parametrize("selection", ["segment", "global"])
def test_place_all_makes_the_per_layer_decisions_in_one_sort(selection, layers):
    """The deferred placement (`WnW.place_all`, every held layer at once) against `place` layer by layer: the same
    masks, host tiers and selected heads, the same anchor signal and `offloaded`, the same store once applied; its
    selections come from one stable sort over every placed head of every layer instead of one a layer."""
    from wnw_exp.methods.base import apply_placements

    policy, store = make(PackedAudioKVStore, selection, "spread")
    ref_policy, ref_store = make(PackedAudioKVStore, selection, "spread")
    scored = []
    for layer in range(L):  # every layer's K/V; the scores of `layers` held
        k, post = layer_inputs(layer)
        for s in (store, ref_store):
            s.write_prefill(layer, k, k + 1, (2, 2 + N_AUDIO))
        if layer in layers:
            scored.append((layer, PrefillScores(post)))
    ref = [(li, p) for li, sc in scored if (p := ref_policy.place(li, sc)) is not None]
    with Calls() as calls:
        got = policy.place_all(scored)
    assert calls.names.count("argsort") == 1
    assert [li for li, _ in got] == [li for li, _ in ref] and len(got) >= 2
    for (_, a), (_, b) in zip(got, ref):
        assert torch.equal(a.gpu, b.gpu) and torch.equal(a.select, b.select)
        assert (a.cpu is None) == (b.cpu is None) and (a.cpu is None or torch.equal(a.cpu, b.cpu))
    assert torch.equal(policy.scores_acc, ref_policy.scores_acc)
    apply_placements(store, got)
    apply_placements(ref_store, ref)
    assert_same_store(store, ref_store)
    got_off, ref_off = policy.offloaded, ref_policy.offloaded
    assert list(got_off) == list(ref_off) and all(torch.equal(got_off[h], ref_off[h]) for h in ref_off)
    assert np.array_equal(policy.recall_headroom, ref_policy.recall_headroom)


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that read values on the host (on a GPU: a synchronisation) made inside it."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("selection", ["segment", "global"])
def test_place_reads_the_host_once_per_layer(selection):
    """One host read per layer, the store's residency check; the tidal heads' positions in one copy, when read."""
    policy, store = make(PackedAudioKVStore, selection, "spread")
    for layer in range(L):
        k, post = layer_inputs(layer)
        store.write_prefill(layer, k, k + 1, (2, 2 + N_AUDIO))
        with HostReads() as mode:
            place(policy, store, layer, PrefillScores(post))
        assert mode.reads == ["tolist"], layer
    with HostReads() as mode:
        offloaded = policy.offloaded
    assert mode.reads.count("cpu") == 1 and len(offloaded) == 2  # (nonzero runs on the host copy)


@pytest.mark.parametrize("quota", ["floor", "spread"])
@pytest.mark.parametrize("selection", ["segment", "global"])
def test_select_masks_match_select_positions(selection, quota):
    g = torch.Generator().manual_seed(3)
    rets = np.array([0.0, 0.05, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.77, 0.999, 1.0, 1.5])
    for n, n_s in [(0, 10), (1, 10), (7, 10), (10, 10), (23, 5), (203, 10), (100, 25)]:
        scores = torch.randint(0, 4, (len(rets), n), generator=g).float()
        quotas, block = triage.block_quotas(rets, n, n_s, selection, quota)
        masks = triage.select_masks(scores, torch.as_tensor(quotas), block)
        assert masks.shape == (len(rets), n) and masks.dtype == torch.bool
        for h, r in enumerate(rets):
            want = triage.select_positions(scores[h], float(r), n_s, selection, quota)
            assert masks[h].nonzero().flatten().tolist() == want.tolist(), (n, n_s, r)
            assert int(quotas[h].sum()) == (n if r >= 1 else triage.kept_per_head(r, n, n_s, quota=quota))


def test_block_quotas_keep_any_leading_shape():
    ret = np.array([[0.2, 1.0], [0.0, 0.45]])
    quotas, block = triage.block_quotas(ret, 23, 5, "segment", "floor")
    assert block == 5 and quotas.shape == (2, 2, 5)
    assert quotas[0, 0].tolist() == [1, 1, 1, 1, 0] and quotas[0, 1].tolist() == [5, 5, 5, 5, 3]
    quotas, block = triage.block_quotas(ret, 23, 5, "global", "spread")
    assert block == 23 and quotas[..., 0].tolist() == [[4, 23], [0, 10]]
    with pytest.raises(ValueError, match="unknown quota"):
        triage.block_quotas(ret, 23, 5, "segment", "ceil")


def _packed(n_audio=30, layers=2, heads=3, seed=0):
    store = PackedAudioKVStore(layers, heads, 4, n_audio, torch.device("cpu"), torch.float32, dense_capacity=4)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        k = torch.randn(heads, n_audio + 2, 4, generator=g)
        store.write_prefill(layer, k, -k, (1, 1 + n_audio))
    return store


def test_set_tiers_block_is_set_tiers_per_row_and_checks_once():
    new, old = _packed(), _packed()
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(3, 30, generator=g) < 0.4
    host = (torch.rand(3, 30, generator=g) < 0.5) & torch.tensor([True, False, True])[:, None]
    select = torch.tensor([True, False, True])
    new.set_tiers_block(3, keep, host, select=select)  # layer 1, heads 0 and 2; head 1 untouched
    for h in (0, 2):
        old_packed_set_tiers(old, 1, h, keep[h].nonzero().flatten(), host[h].nonzero().flatten())
    assert_same_store(new, old)
    # a position that is not resident any more: the same errors as per head, and nothing changes
    before = {k: getattr(new, k).clone() for k in ("audio_k", "audio_pos", "slot_of", "on_host", "n_resident")}
    dropped = int((~keep[0]).nonzero()[0])
    for gpu, cpu, message in [(torch.ones(3, 30, dtype=torch.bool), None, "a position to keep"),
                              (torch.zeros(3, 30, dtype=torch.bool), torch.ones(3, 30, dtype=torch.bool),
                               "a position to offload")]:
        with pytest.raises(ValueError, match=f"set_tiers: {message} is not GPU-resident"):
            new.set_tiers_block(3, gpu, cpu)
        with pytest.raises(ValueError, match=f"set_tiers: {message} is not GPU-resident"):
            new.set_tiers(1, 0, [dropped] if cpu is None else [], [dropped] if cpu is not None else None)
    for k, x in before.items():
        assert torch.equal(getattr(new, k), x), k


def test_deferred_checks_raise_at_compact_and_change_nothing_when_clean():
    """`defer_checks`: the residency checks of the placement's calls are read at the next compact (one read for
    every layer): a clean placement ends as with the checks made at each call; a bad one raises there, with the
    same message as at the call."""
    new, old = _packed(), _packed()
    g = torch.Generator().manual_seed(3)
    new.defer_checks()
    for row0 in (0, 3):
        keep = torch.rand(3, 30, generator=g) < 0.4
        new.set_tiers_block(row0, keep)
        old.set_tiers_block(row0, keep)
    assert_same_store(new, old)
    new.compact()
    old.compact()
    assert np.array_equal(new.caps, old.caps) and torch.equal(new.audio_k, old.audio_k)
    # compact's one host read: the resident counts (caps without headroom) and the positions held anywhere
    assert np.array_equal(new.caps, new.n_resident.numpy())
    assert new._union == int(((new.slot_of >= 0) | new.on_host).sum()) > 0
    for gpu, cpu, message in [(torch.ones(3, 30, dtype=torch.bool), None, "a position to keep"),
                              (torch.zeros(3, 30, dtype=torch.bool), torch.ones(3, 30, dtype=torch.bool),
                               "a position to offload")]:
        bad = _packed()
        bad.defer_checks()
        bad.set_tiers_block(0, torch.rand(3, 30, generator=g) < 0.4)
        bad.set_tiers_block(0, gpu, cpu)  # (row 0's dropped positions are asked for again: no error yet)
        with pytest.raises(ValueError, match=f"set_tiers: {message} is not GPU-resident"):
            bad.compact()


def test_set_tiers_after_compact_matches_the_per_head_store():
    """Rows of unequal (and zero) capacity after `compact`: the block's slot arithmetic follows each row's region."""
    new, old = _packed(), _packed()
    g = torch.Generator().manual_seed(2)
    plan = []
    for r in range(6):
        keep = (torch.rand(30, generator=g) < 0.5).nonzero().flatten() if r != 5 else torch.zeros(0, dtype=torch.long)
        host = (torch.rand(30, generator=g) < 0.3).nonzero().flatten() if r % 2 == 0 else None
        plan.append((r // 3, r % 3, keep, host))
    for layer, head, keep, host in plan:
        new.set_tiers(layer, head, keep, host)
        old_packed_set_tiers(old, layer, head, keep, host)
    assert_same_store(new, old)
    for s in (new, old):
        s.compact(headroom=np.array([3, 0, 1, 5, 2, 0]))
    assert new.caps[5] == 0  # head (1, 2) keeps nothing and has no host tier: no region at all
    for layer, head, keep, _ in plan:  # keep a subset of what is resident, offload nothing
        sub = keep[::2]
        new.set_tiers(layer, head, sub)
        old_packed_set_tiers(old, layer, head, sub)
    assert_same_store(new, old)
    new.set_tiers_block(0, torch.zeros(3, 30, dtype=torch.bool), select=torch.tensor([False, True, False]))
    old_packed_set_tiers(old, 0, 1, torch.zeros(0, dtype=torch.long))
    assert_same_store(new, old)
