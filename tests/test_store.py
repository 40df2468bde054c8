"""The reference tier store against a dense masked-attention reference (fp32, relative error < 1e-5).

Moves address a (layer, KV head) by its row, layer * n_kv_heads + head (here layer 0: the row is the head)."""

import pytest
import torch

from wnw_exp.kv.reference import AudioKVStore


def dense_reference(q, k_dense, v_dense, k_audio, v_audio, resident, scale):
    """Plain softmax attention over [dense ; audio] with non-resident audio positions masked out.

    q: (H_q, D); k_dense: (H_kv, n_d, D); k_audio: (H_kv, T_a, D); resident: (H_kv, T_a) bool.
    """
    h_kv = k_dense.shape[0]
    g = q.shape[0] // h_kv
    k = torch.cat([k_dense, k_audio], 1).repeat_interleave(g, 0)
    v = torch.cat([v_dense, v_audio], 1).repeat_interleave(g, 0)
    mask = torch.cat([torch.ones(h_kv, k_dense.shape[1], dtype=torch.bool), resident], 1).repeat_interleave(g, 0)
    s = torch.einsum("hd,hnd->hn", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hn,hnd->hd", p, v), p[:, k_dense.shape[1]:]


def make_store(h_kv, d, t_a, n_pre, n_post, layers=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = n_pre + t_a + n_post
    k = torch.randn(layers, h_kv, T, d, generator=g)
    v = torch.randn(layers, h_kv, T, d, generator=g)
    store = AudioKVStore(layers, h_kv, d, t_a, torch.device("cpu"), torch.float32, dense_capacity=4)
    for layer in range(layers):
        store.write_prefill(layer, k[layer], v[layer], (n_pre, n_pre + t_a))
    return store, k, v


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("t_a", [1, 7, 64])
def test_attend_matches_dense_reference(group, t_a):
    h_kv, d, n_pre, n_post = 4, 16, 3, 2
    store, k, v = make_store(h_kv, d, t_a, n_pre, n_post, seed=group * 100 + t_a)
    g = torch.Generator().manual_seed(7)
    resident = torch.rand(h_kv, t_a, generator=g) < 0.4
    resident[0] = True  # a full head
    resident[1] = False  # a head with everything dropped
    offload = ~resident
    offload[1] = False
    for h in range(h_kv):
        store.set_tiers(0, h, resident[h].nonzero().flatten(), offload[h].nonzero().flatten())
    q = torch.randn(h_kv * group, d, generator=g)
    k_new, v_new = torch.randn(h_kv, d, generator=g), torch.randn(h_kv, d, generator=g)
    observe = list(range(0, h_kv * group, 3))
    out, probs = store.attend(0, q, k_new, v_new, scale=d ** -0.5, observe=observe)

    s, e = n_pre, n_pre + t_a
    k_dense = torch.cat([k[0, :, :s], k[0, :, e:], k_new[:, None]], 1)
    v_dense = torch.cat([v[0, :, :s], v[0, :, e:], v_new[:, None]], 1)
    ref_out, ref_p = dense_reference(q, k_dense, v_dense, k[0, :, s:e], v[0, :, s:e], resident, d ** -0.5)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    assert ((out - ref_out).norm() / ref_out.norm()) < 1e-5
    assert torch.allclose(probs, ref_p[observe], rtol=1e-5, atol=1e-7)


def test_recall_out_of_order_restores_exact_bytes_and_attention():
    h_kv, d, t_a = 2, 8, 40
    store, k, v = make_store(h_kv, d, t_a, 2, 1)
    keep = torch.arange(0, t_a, 4)
    off = torch.tensor([p for p in range(t_a) if p % 4])
    store.set_tiers(0, 0, keep, off)
    store.set_tiers(0, 1, keep, torch.empty(0, dtype=torch.long))  # fixed head: complement dropped
    recall = torch.tensor([33, 5, 18, 1])
    assert store.recall(0, recall) == 4
    t = store.heads[0][0]
    for p in recall.tolist():
        row = (t.gpu_pos == p).nonzero().item()
        assert torch.equal(t.gpu_k[row], k[0, 0, 2 + p]) and torch.equal(t.gpu_v[row], v[0, 0, 2 + p])
    assert store.recall(0, torch.tensor([5])) == 0  # already resident
    with pytest.raises(ValueError, match="no host copy"):
        store.recall(1, torch.tensor([1]))
    # released positions leave the device, keep their host copy, and come back bit-identical
    assert store.release(0, torch.tensor([18, 1])) == 2
    assert 18 not in store.heads[0][0].gpu_pos.tolist()
    store.recall(0, torch.tensor([18]))
    t = store.heads[0][0]
    row = (t.gpu_pos == 18).nonzero().item()
    assert torch.equal(t.gpu_k[row], k[0, 0, 20])
    # attention after out-of-order recall still equals the masked reference
    resident = torch.zeros(h_kv, t_a, dtype=torch.bool)
    for h in range(h_kv):
        resident[h, store.heads[0][h].gpu_pos] = True
    q, kn, vn = torch.randn(4, d), torch.randn(h_kv, d), torch.randn(h_kv, d)
    out, _ = store.attend(0, q, kn, vn, scale=0.3)
    ref, _ = dense_reference(q, torch.cat([k[0, :, :2], k[0, :, 42:], kn[:, None]], 1),
                             torch.cat([v[0, :, :2], v[0, :, 42:], vn[:, None]], 1),
                             k[0, :, 2:42], v[0, :, 2:42], resident, 0.3)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_release_refuses_positions_without_host_copy():
    store, _, _ = make_store(1, 4, 10, 1, 1)
    store.set_tiers(0, 0, torch.arange(5), torch.empty(0, dtype=torch.long))
    with pytest.raises(ValueError, match="host copy"):
        store.release(0, torch.tensor([2]))


def test_accounting_and_physical_bytes():
    layers, h_kv, d, t_a = 2, 4, 8, 100
    store, _, _ = make_store(h_kv, d, t_a, 1, 1, layers=layers)
    full_bytes = store.audio_bytes_on_device()
    assert full_bytes == layers * h_kv * t_a * d * 4 * 2
    for layer in range(layers):
        for h in range(h_kv):
            store.set_tiers(layer, h, torch.arange(20), torch.arange(20, 60) if h == 0 else None)
    # 20% of positions resident: storage really shrinks (packed, not masked)
    assert store.audio_bytes_on_device() <= 0.2 * full_bytes
    store.end_step()
    store.recall(0, torch.arange(20, 30))
    rec = store.end_step()
    assert rec.h2d_bytes == 10 * d * 4 * 2
    s = store.summary()
    n_full = layers * h_kv * t_a
    assert s["r_gpu_end"] == pytest.approx((layers * h_kv * 20 + 10) / n_full)
    assert s["r_gpu"] == pytest.approx((layers * h_kv * 20 + 5) / n_full)
    # union of device and host: layer 0 and 1 head 0 have 60 each, the others 20
    assert s["r_gpu_cpu_end"] == pytest.approx((2 * 60 + 6 * 20) / n_full)
    assert s["mb_per_step"] == pytest.approx(10 * d * 4 * 2 / 2 / 1e6)
