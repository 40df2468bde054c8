"""`analysis=mismatch` (§2.1): the recorder on a hand-made attention sequence, and inside the engine."""

import numpy as np
import pytest
import torch

from helpers import noise_audio, tiny_voxtral
from wnw_exp.methods.mismatch import MismatchRecorder
from wnw_exp.engine.serve import generate
from wnw_exp.methods.base import Policy, SampleContext

T = 10
# Decode steps over 10 audio positions: the first answer token attends the start (the "prefill"
# distribution); later tokens sweep through the clip.
STEPS = [{0: 0.8, 1: 0.2}, {4: 0.5, 5: 0.5}, {6: 0.5, 7: 0.5}, {8: 0.6, 9: 0.4}]


def dist(weights: dict) -> torch.Tensor:
    p = torch.zeros(T)
    for i, w in weights.items():
        p[i] = w
    return p


class Spy(Policy):
    """A wrapped method that watches query heads 3 and 1 of layer 1, in that order."""

    name = "spy"

    def start(self, ctx, store):
        super().start(ctx, store)
        self.seen, self.steps = [], []

    def observe_heads(self, layer):
        return [3, 1] if layer == 1 else []

    def observe(self, layer, probs):
        self.seen.append((layer, probs.clone()))

    def after_step(self, step):
        self.steps.append(step)

    def knobs(self):
        return {"lam": 0.5}

    def trace(self):
        return {"spy": True}


def feed(recorder: MismatchRecorder, per_step_layer_head) -> dict:
    """Drive the hooks as the engine does: observe_heads once, then per step every layer, then after_step."""
    ctx = SampleContext(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=8, token_rate=12.5, n_audio=T,
                        retention=1.0, device=torch.device("cpu"))
    recorder.start(ctx, store=None)
    heads = {li: recorder.observe_heads(li) for li in range(2)}
    assert heads == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # every query head, whatever the method asks
    for step, layers in enumerate(per_step_layer_head):
        for li in range(2):
            recorder.observe(li, torch.stack([layers[li][h] for h in heads[li]]))
        recorder.after_step(step)
    return recorder.trace()


def test_hand_made_sequence_statistics():
    """All heads identical: the numbers of §2.1 by hand."""
    rec = MismatchRecorder(Policy(), ks=(2, 5), per_head_k=2)
    tr = feed(rec, [[[dist(s)] * 4] * 2 for s in STEPS])["mismatch"]
    assert tr["n_steps"] == 4 and tr["n_audio"] == T and tr["layers_used"] == [0, 1]
    assert tr["prefill"] == pytest.approx([0.8, 0.2] + [0.0] * 8)
    decode = np.array([0.8, 0.2, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.6, 0.4]) / 4  # mean over the 4 answer tokens
    assert tr["decode_cumulative"] == pytest.approx(decode.tolist())
    st = tr["stats"]
    # prefill: position 0 is the first 10% of the clip; everything is in the first half
    assert st["prefill"] == pytest.approx({"first10": 0.8, "first_half": 1.0, "second_half": 0.0})
    # decode: 0.8/4 on the first 10%; (0.8 + 0.2 + 0.5)/4 on the first half
    assert st["decode"] == pytest.approx({"first10": 0.2, "first_half": 0.375, "second_half": 0.625})
    # top-2: {0, 1} vs {0, 8} -> 1/3; top-5: {0..4} vs {0, 8, 4, 5, 6} (ties to the earlier) -> 2/8
    assert st["jaccard"] == pytest.approx({"2": 1 / 3, "5": 0.25})
    assert st["random_baseline"] == pytest.approx({"2": 0.2, "5": 0.5})  # K / T_a
    assert tr["per_head_jaccard"] == pytest.approx([1 / 3] * 4)


def test_layers_heads_averaged_and_per_head_jaccard():
    """One KV head (layer 1, heads 2-3) keeps its prefill ranking all along: its Jaccard is 1, the others'
    1/3, and the averaged vectors are the plain means over layers and query heads."""
    steady = dist(STEPS[0])
    seq = []
    for s in STEPS:
        p = dist(s)
        seq.append([[p, p, p, p], [p, p, steady, steady]])
    tr = feed(MismatchRecorder(Policy(), ks=(2,), per_head_k=2), seq)["mismatch"]
    first = np.mean([h.numpy() for layer in seq[0] for h in layer], axis=0)
    cum = np.mean([np.mean([h.numpy() for layer in step for h in layer], axis=0) for step in seq], axis=0)
    assert tr["prefill"] == pytest.approx(first.tolist())
    assert tr["decode_cumulative"] == pytest.approx(cum.tolist())
    # KV heads layer-major: (0,0) (0,1) (1,0) (1,1)
    assert tr["per_head_jaccard"] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])


def test_wrapped_policy_gets_its_rows_and_hooks():
    spy = Spy()
    rec = MismatchRecorder(spy, ks=(2,), per_head_k=2)
    seq = [[[dist(s) * (h + 1) for h in range(4)] for _ in range(2)] for s in STEPS]
    tr = feed(rec, seq)
    assert rec.name == "spy" and rec.knobs() == {"lam": 0.5}
    assert tr["spy"] is True and "mismatch" in tr
    assert spy.steps == [0, 1, 2, 3]
    assert [layer for layer, _ in spy.seen] == [1] * 4
    for step, (_, probs) in enumerate(spy.seen):  # rows 3 and 1, in the order it asked for
        assert torch.equal(probs, torch.stack([seq[step][1][3], seq[step][1][1]]))


def test_no_decode_step_gives_no_statistics():
    tr = feed(MismatchRecorder(Policy()), [])["mismatch"]
    assert tr["n_steps"] == 0 and tr["stats"] is None and tr["prefill"] is None


def test_recorder_in_the_engine_does_not_change_decoding():
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(4.0))
    plain = generate(backbone, prompt, Policy(), retention=1.0, max_new_tokens=12)
    rec = generate(backbone, prompt, MismatchRecorder(Policy()), retention=1.0, max_new_tokens=12)
    assert rec.tokens == plain.tokens
    m = rec.trace["mismatch"]
    assert m["n_steps"] == 11 and len(m["prefill"]) == len(m["decode_cumulative"]) == prompt.n_audio
    assert len(m["per_head_jaccard"]) == backbone.n_layers * backbone.n_kv_heads
    # weights at audio positions: part of each head's softmax, so between 0 and 1 in total
    assert 0 < sum(m["prefill"]) <= 1 + 1e-6 and 0 < sum(m["decode_cumulative"]) <= 1 + 1e-6
    assert 0 <= m["stats"]["jaccard"]["100"] <= 1


def test_the_recorder_forwards_every_policy_attribute():
    """What the recorder does not record in is the wrapped method's: class attributes too (`packed_store` and
    `recall_headroom` once stayed the recorder's own Policy defaults)."""

    class Moving(Policy):
        name = "moving"
        packed_store = False
        recall_headroom = 7

    inner = Moving()
    rec = MismatchRecorder(inner)
    own = {"start", "observe_heads", "observe", "observe_sum", "after_step", "trace", "graph_safe", "fork"}
    public = [a for a in dir(Policy) if not a.startswith("_")]
    assert {"packed_store", "recall_headroom", "place", "before_attention", "knobs"} <= set(public)
    for attr in set(public) - own:
        assert getattr(rec, attr) == getattr(inner, attr), attr
    assert rec.packed_store is False and rec.recall_headroom == 7 and rec.name == "moving"
    assert rec.graph_safe is False  # its recording keeps host state per step
    assert rec.observe_sum(0) is None  # it reads every head's weights, never only their sum
    twin = rec.fork()  # a batch's next sample: a recorder of its own around a fork of the method
    assert isinstance(twin, MismatchRecorder) and twin.inner is not inner and type(twin.inner) is Moving


def test_recorder_with_arkvale_on_the_packed_store():
    """`analysis=mismatch` with a recalling method on the packed store: the recall room is the method's (with the
    recorder's default 0 it failed "a head's region is full"), and decoding is the method's own."""
    from wnw_exp.methods import build_policy

    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(20.0))
    runs = {}
    for wrap in (False, True):
        policy = build_policy({"name": "arkvale"}, backbone.describe())
        runs[wrap] = generate(backbone, prompt, MismatchRecorder(policy) if wrap else policy, retention=0.2,
                              max_new_tokens=8, store="packed")
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].store_summary == runs[False].store_summary and runs[True].store_summary["mb_per_step"] > 0
    assert runs[True].trace["mismatch"]["n_steps"] == 7
