"""§2.1 / Figure 1 across samples: the `analysis=mismatch` traces of a run, averaged.

Per sample the engine's `MismatchRecorder` saved the prefill (first answer token) and decode-cumulative
attention per audio position (layer/head means), the per-KV-head top-100 Jaccard and the sample's
statistics. Here they are averaged over samples: the statistics by their mean, the distributions on a
common uniform grid of the audio's time axis (samples have different T_a), the per-head Jaccard per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wnw_exp.metrics.mismatch import resample_to_grid
from wnw_exp.report.collect import Run
from wnw_exp.report.tables import Out, Table

GRID_BINS = 50


@dataclass
class MismatchSummary:
    run: Run
    n_samples: int
    mean_t_audio: float
    stats: dict  # flat name -> mean over samples
    prefill_grid: np.ndarray  # (GRID_BINS,) mass per bin, mean over samples
    decode_grid: np.ndarray
    per_head_jaccard: np.ndarray | None  # per KV head (layer-major), mean over samples
    per_head_k: int | None

    def as_dict(self) -> dict:
        ph = self.per_head_jaccard
        return dict(run=self.run.label, run_dirs=[str(d) for d in self.run.run_dirs], n_samples=self.n_samples,
                    mean_t_audio=self.mean_t_audio, stats=self.stats,
                    per_head=None if ph is None else dict(k=self.per_head_k, n_heads=int(ph.size), min=float(ph.min()),
                                                          max=float(ph.max()), below_0_1=float((ph < 0.1).mean()),
                                                          values=ph.tolist()),
                    grid_bins=GRID_BINS, prefill_grid=self.prefill_grid.tolist(),
                    decode_grid=self.decode_grid.tolist())


def _flatten(stats: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def summarise(run: Run, bins: int = GRID_BINS) -> MismatchSummary | None:
    """Average the mismatch records of `run`'s samples; None when it has none."""
    flats, pre, dec, heads, ts, k = [], [], [], [], [], None
    for _, tr in run.traces():
        rec = tr.get("mismatch")
        if not rec or rec.get("stats") is None:
            continue
        flats.append(_flatten(rec["stats"]))
        pre.append(resample_to_grid(np.asarray(rec["prefill"]), bins))
        dec.append(resample_to_grid(np.asarray(rec["decode_cumulative"]), bins))
        ts.append(rec["n_audio"])
        if rec.get("per_head_jaccard") is not None:
            heads.append(np.asarray(rec["per_head_jaccard"], dtype=float))
            k = rec.get("per_head_k")
    if not flats:
        return None
    keys = sorted(set.intersection(*(set(f) for f in flats)))
    stats = {key: float(np.mean([f[key] for f in flats])) for key in keys}
    per_head = None
    if heads and all(h.shape == heads[0].shape for h in heads):
        per_head = np.mean(heads, axis=0)
    return MismatchSummary(run, len(flats), float(np.mean(ts)), stats, np.mean(pre, axis=0), np.mean(dec, axis=0),
                           per_head, k)


def analysis_runs(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.analysis == "mismatch"]


def mismatch_table(summaries: list[MismatchSummary]) -> Table:
    """§2.1's numbers, one row per analysis run (means over its samples)."""
    cols = ["Run", "n", "T_a", "Prefill first 10%", "Prefill first half", "Decode first 10%", "Decode first half",
            "Decode second half", "J@100", "J@500", "K/T_a (K=100)", "E[J] random (K=100)",
            "Per-head J@100 min-max", "Heads J<0.1"]
    t = Table("mismatch", "Prefill/decode attention mismatch (§2.1): mass shares (%) of prefill (first answer "
              "token) and decode-cumulative attention, top-K Jaccard of the two rankings with the random baseline "
              "K/T_a (and the exact expected Jaccard of two random K-sets), per-KV-head Jaccard at K=100. Means "
              "over samples.", cols)
    for s in summaries:
        st = s.stats
        t.n_cells += 1

        def pct(key):
            return f"{100 * st[key]:.1f}" if key in st else ""

        def num(key, f="{:.3f}"):
            return f.format(st[key]) if key in st else ""

        ph = s.per_head_jaccard
        row = [Out(s.run.label), Out(str(s.n_samples)), Out(f"{s.mean_t_audio:.0f}"),
               Out(pct("prefill.first10")), Out(pct("prefill.first_half")), Out(pct("decode.first10")),
               Out(pct("decode.first_half")), Out(pct("decode.second_half")), Out(num("jaccard.100")),
               Out(num("jaccard.500") + ("" if st.get("k_effective.500", 500) == 500
                                         else f" (K={st['k_effective.500']:.0f})")),
               Out(num("random_baseline.100")), Out(num("expected_random_jaccard.100")),
               Out("" if ph is None else f"{ph.min():.3f}-{ph.max():.3f} ({ph.size} heads)"),
               Out("" if ph is None else f"{100 * (ph < 0.1).mean():.0f}%")]
        t.rows.append(row)
    if not summaries:
        t.missing.append("no run with analysis=mismatch (e.g. `wnw-run method=full analysis=mismatch "
                         "dataset=librispeech_long dataset.split=dev-clean dataset.n=50`)")
        t.n_cells += 1
    t.notes.append("K is clipped to T_a when the audio is shorter (then J=1 by construction); the paper's "
                   "random baseline K/T_a is the expected overlap |A∩B|/K, the exact expected Jaccard is about "
                   "half of it.")
    return t
