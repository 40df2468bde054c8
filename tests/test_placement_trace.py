"""PlacementTrace (methods/placement_trace.py): it leaves WnW's decode untouched, its true attention is the full
cache's (checked against the engine's own attention under Full Cache), and its per-step records are consistent."""

import numpy as np
import pytest
import torch

from helpers import noise_audio, scores_for, tiny_voxtral
from wnw_exp.engine.serve import generate
from wnw_exp.methods.base import Policy
from wnw_exp.methods.mismatch import MismatchRecorder
from wnw_exp.methods.placement_trace import PlacementTrace, _argmax_chunk
from wnw_exp.methods.wnw import WnW, triage

N_NEW = 10


@pytest.fixture(scope="module")
def setup():
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]  # never stop early: every run makes N_NEW tokens
    prompt = backbone.build_prompt(noise_audio(20.0))
    vs = np.random.RandomState(2).rand(backbone.n_layers, backbone.n_kv_heads)
    scores = scores_for(vs, np.ones_like(vs), name="tiny_test", n_q_heads=backbone.n_q_heads)

    def wnw():
        return WnW(scores=scores, n_voice=4, n_anchor=1, backbone_info=backbone.describe())

    plain = generate(backbone, prompt, wnw(), retention=0.3, max_new_tokens=N_NEW, keep_logits=True,
                     store="reference")
    tracer = PlacementTrace(wnw())
    traced = generate(backbone, prompt, tracer, retention=0.3, max_new_tokens=N_NEW, keep_logits=True,
                      store="reference")
    full = MismatchRecorder(Policy())
    generate(backbone, prompt, full, retention=1.0, max_new_tokens=N_NEW, store="reference")
    return backbone, tracer, plain, traced, full


def test_the_trace_leaves_the_decode_unchanged(setup):
    _, tracer, plain, traced, _ = setup
    assert traced.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(traced.logits, plain.logits))
    assert traced.trace["wnw"] == plain.trace["wnw"]  # the same chunk-swap decisions


def test_first_step_true_attention_is_the_full_caches(setup):
    """At decode step 0 the first layer's query is the same under WnW and Full Cache (prefill is dense, so the first
    token and its embedding agree): the trace's audio share there must be Full Cache's attention as the engine
    computes it (MismatchRecorder's first-step weights, the reference store's softmax)."""
    backbone, tracer, _, _, full = setup
    g = backbone.n_q_heads // backbone.n_kv_heads
    first = full._first[0]  # (H_q, n_audio) step 0, layer 0
    want = first.view(backbone.n_kv_heads, g, -1).sum(dim=(1, 2)).numpy() / g
    got = np.asarray(tracer.record()["audio_share"][0][0])
    assert got == pytest.approx(want, rel=1e-4)


def test_per_step_records_are_consistent(setup):
    backbone, tracer, _, traced, _ = setup
    rec = traced.trace["placement"]
    n = N_NEW - 1  # the first token comes from prefill; each later one from a decode step
    assert rec["n_steps"] == n and len(rec["hit"]) == n
    kept = np.asarray(rec["mass_kept"])
    assert kept.shape == (n, backbone.n_layers, backbone.n_kv_heads)
    assert ((kept >= 0) & (kept <= 1 + 1e-9)).all()
    roles = tracer.inner.roles
    assert np.allclose(kept[:, roles == triage.ANCHOR], 1.0)  # anchors keep every audio position
    assert (kept[:, roles != triage.ANCHOR] < 1).any()  # at r = 0.3 the others do not
    tidal = {tuple(h) for h in rec["tidal_heads"]}
    assert tidal == {(int(a), int(b)) for a, b in zip(*np.nonzero(roles == triage.TIDAL))}
    # per segment, the tidal heads' true mass and its non-resident part add up to their mass kept per head
    share = np.asarray(rec["audio_share"])
    g = backbone.n_q_heads // backbone.n_kv_heads
    mass, lost = np.asarray(rec["segment_mass"]), np.asarray(rec["segment_lost"])
    assert (lost <= mass + 1e-6).all()
    tidal_mask = roles == triage.TIDAL
    assert (mass - lost).sum(axis=1) == pytest.approx((kept * share * g)[:, tidal_mask].sum(axis=1), rel=1e-3)
    assert mass.sum(axis=1) == pytest.approx((share * g)[:, tidal_mask].sum(axis=1), rel=1e-3)
    for s in range(n):
        assert rec["hit"][s] == (rec["true_segment"][s] in rec["recalled"][s])
        assert rec["true_segment"][s] == int(np.argmax(mass[s]))
        assert len(rec["tidal_segment"][s]) == len(tidal)
    # the swap's own choice after step s (its records start with the prefill decision) holds the anchors' argmax chunk
    assert all(rec["anchor_chunk"][s] in rec["selected_chunks"][s] for s in range(n))


def test_argmax_chunk_is_the_swaps_top_one():
    rng = np.random.default_rng(0)
    swap = triage.ChunkSwap(97, 8, 16, top_k=1)
    for _ in range(20):
        a = rng.random(97) ** 4
        assert [_argmax_chunk(a, swap.chunks)] == swap.select(a)
    a = np.zeros(97)
    assert _argmax_chunk(a, swap.chunks) == 0  # ties: the earlier chunk, as the swap


def test_only_wnw_is_traced():
    with pytest.raises(ValueError, match="traces WnW"):
        PlacementTrace(Policy())
