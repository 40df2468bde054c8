"""scripts/diagnose_wnw.py's `events` on a hand-made trace: the text's own skips and where the tidal mass lies."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import diagnose_wnw  # noqa: E402


def _record():
    # 4 steps, 12 segments of 2 s (n_s 25 tokens at 12.5 tokens/s), one KV head that is tidal.
    n_seg = 12
    mass = [[0.0] * n_seg for _ in range(4)]
    lost = [[0.0] * n_seg for _ in range(4)]
    # step 0 reads segment 2: 1.0 on the sink, 3.0 on segment 2 (all kept), 1.0 on segment 10 (half lost)
    mass[0][0], mass[0][2], mass[0][10] = 1.0, 3.0, 1.0
    lost[0][10] = 0.5
    # step 1 emits no word; step 2 reads segment 3: 2.0 on segment 1 (all lost), 2.0 on segment 4
    mass[2][1], mass[2][4] = 2.0, 2.0
    lost[2][1] = 2.0
    # step 3 jumps to segment 9 (the text's skip): 4.0 on segment 9
    mass[3][9] = 4.0
    placement = dict(mass_kept=[[[1.0]]] * 4, audio_share=[[[0.5]]] * 4, tidal_heads=[[0, 0]], n_s=25,
                     token_rate=12.5, hit=[True] * 4, true_segment=[2, 2, 4, 9], anchor_chunk=[2, 2, 3, 9],
                     segment_mass=mass, segment_lost=lost)
    return dict(placement=placement, step_time=[4.5, None, 6.1, 18.2])  # segments 2, -, 3, 9


def test_skips_and_offsets_are_computed_from_the_trace():
    ev = diagnose_wnw.events(_record())
    assert ev["skips"] == [dict(step=3, from_segment=3, to_segment=9)]  # 3 -> 9 is more than 3 segments on
    assert ev["jumps"] == []  # the true focus moved with the text
    off = ev["by_offset"]
    total = 1.0 + 3.0 + 1.0 + 2.0 + 2.0 + 4.0  # the emitting steps' mass (step 1 emits nothing)
    assert off["sink"] == dict(share=round(1.0 / total, 3), kept=1.0)
    assert off["0"] == dict(share=round(7.0 / total, 3), kept=1.0)  # segment 2 at step 0, segment 9 at step 3
    assert off["+1"] == dict(share=round(2.0 / total, 3), kept=1.0)  # segment 4 while reading 3
    assert off["-2..-1"] == dict(share=round(2.0 / total, 3), kept=0.0)  # segment 1 while reading 3: lost
    assert off["ahead, 7+"] == dict(share=round(1.0 / total, 3), kept=0.5)  # segment 10 while reading 2
    assert off["behind, 3+"]["kept"] is None and off["+2..+6"]["kept"] is None
    assert sum(v["share"] for v in off.values()) == pytest.approx(1.0, abs=2e-3)
