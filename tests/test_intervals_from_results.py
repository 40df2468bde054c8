"""scripts/intervals_from_results.py: per-clip WERs of a results JSON back to edit counts, paired intervals."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import intervals_from_results  # noqa: E402

from wnw_exp.metrics.bootstrap import paired_bootstrap_wer  # noqa: E402

REFS = ["a b c d", "e f g h i j k l", "m n o"]  # 4, 8, 3 words; ids s0, s1, s2 (written out of order below)


def write(tmp_path: Path, rows: list[dict]) -> tuple[Path, Path]:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(dict(rows=rows)))
    preds = tmp_path / "predictions.jsonl"
    order = [2, 0, 1]  # the script sorts by the sample id's number, as the JSON's per-clip order is
    preds.write_text("".join(json.dumps(dict(id=f"s{i}", reference=REFS[i], hypothesis="")) + "\n" for i in order))
    return results, preds


def test_counts_come_back_and_pairs_are_bootstrapped(tmp_path, capsys):
    # full: 0, 1, 0 errors; wnw: 1, 2, 3 errors; oracle: 0, 0, 1 errors -> WER = 100 * e / words, two decimals
    rows = [dict(method="full", retention=1.0, overrides={}, per_clip=[0.0, 12.5, 0.0]),
            dict(method="wnw", retention=0.2, overrides={}, per_clip=[25.0, 25.0, 100.0]),
            dict(method="oracle", retention=0.2, overrides={"method.granularity": "chunk"},
                 per_clip=[0.0, 0.0, 33.33])]
    results, preds = write(tmp_path, rows)
    intervals_from_results.main([str(results), "--references", str(preds)])
    out = capsys.readouterr().out.splitlines()
    want = paired_bootstrap_wer([1, 2, 3], [0, 1, 0], [4, 8, 3])
    assert f"wnw r=0.2 - full r=1: {want.diff:+.2f} [{want.low:+.2f}, {want.high:+.2f}] (3 clips)" in out[0]
    assert want.diff == pytest.approx(100 * 5 / 15)
    pair = paired_bootstrap_wer([1, 2, 3], [0, 0, 1], [4, 8, 3])
    assert any(line.startswith(f"wnw r=0.2 - oracle r=0.2 [granularity=chunk]: {pair.diff:+.2f}") for line in out)
    assert len(out) == 3  # two rows minus Full, one pair at r=0.2


def test_references_of_other_clips_are_refused(tmp_path):
    rows = [dict(method="full", retention=1.0, overrides={}, per_clip=[10.0, 12.5, 0.0])]  # 0.4 errors on clip 0
    results, preds = write(tmp_path, rows)
    with pytest.raises(SystemExit, match="not the clips of these WERs"):
        intervals_from_results.main([str(results), "--references", str(preds)])


def test_rows_of_another_clip_set_are_left_out_and_named(tmp_path, capsys):
    rows = [dict(method="full", retention=1.0, overrides={"dataset.n": "50"}, per_clip=[1.0] * 50),
            dict(method="wnw", retention=0.2, overrides={}, per_clip=[25.0, 25.0, 100.0]),
            dict(method="wnw", retention=0.2, overrides={"method.n_voice": "4"}, per_clip=[0.0, 12.5, 0.0])]
    results, preds = write(tmp_path, rows)
    intervals_from_results.main([str(results), "--references", str(preds)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "left out (not the references' 3 clips): full r=1 [dataset.n=50] (50 per-clip WERs)"
    want = paired_bootstrap_wer([1, 2, 3], [0, 1, 0], [4, 8, 3])
    assert out[1:] == [f"wnw r=0.2 - wnw r=0.2 [n_voice=4]: {want.diff:+.2f} [{want.low:+.2f}, {want.high:+.2f}] "
                       f"(3 clips)" + (" *" if want.excludes_zero else "")]


def test_no_row_of_the_references_clips_is_refused(tmp_path):
    rows = [dict(method="full", retention=1.0, overrides={}, per_clip=[1.0] * 50)]
    results, preds = write(tmp_path, rows)
    with pytest.raises(SystemExit, match="no row has 3 per-clip WERs"):
        intervals_from_results.main([str(results), "--references", str(preds)])


def test_rows_alike_in_two_files_are_told_apart(tmp_path, capsys):
    results, preds = write(tmp_path, [dict(method="full", retention=1.0, overrides={}, per_clip=[0.0, 12.5, 0.0]),
                                      dict(method="wnw", retention=0.2, overrides={}, per_clip=[25.0, 25.0, 100.0])])
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(rows=[dict(method="wnw", retention=0.2, per_clip=[0.0, 12.5, 0.0])])))
    intervals_from_results.main([str(results), str(other), "--references", str(preds)])
    out = capsys.readouterr().out.splitlines()
    names = [line.split(":")[0] for line in out]
    assert names == ["wnw r=0.2 (results.json row 1) - full r=1", "wnw r=0.2 (other.json row 0) - full r=1",
                     "wnw r=0.2 (results.json row 1) - wnw r=0.2 (other.json row 0)"]
    assert out[1].endswith("+0.00 [+0.00, +0.00] (3 clips)")  # the second file's row is Full's errors
