"""Print the throughput rows of serving.py JSON files in one line each (to read a run's result
at a glance): file, method, streams at peak, tokens/s at peak and x the file's Full of the same length, step p50
at peak, and the steps at peak by kind (replay / capture / eager: count and mean ms; of the last two, the host ms
making the composition's step and running the decisions and moves after its layers).
    python3 scripts/gpu/serving_summary.py OUT/*.json"""
import json
import sys

for path in sys.argv[1:]:
    try:
        rows = [r for r in json.load(open(path)) if r.get("kind") in ("throughput", "profile")]
    except (OSError, ValueError) as e:
        print(path, "unreadable:", e)
        continue
    full = {r["audio_tokens"]: (r["tokens_per_s_at_peak"], r["tokens_per_s"]) for r in rows
            if r.get("method") == "full" and r.get("kind") == "throughput" and "tokens_per_s" in r}  # each length's
    for r in rows:
        if "error" in r or "skipped" in r:
            print(path, r.get("kind"), r.get("method"), r.get("audio_tokens"), r.get("error") or r.get("skipped"))
            continue
        if r["kind"] == "profile":
            print(path, "profile", r.get("method"), r.get("streams"), r.get("ablate"), "p50",
                  round(r.get("step_ms_p50") or 0, 3), "device_us", r.get("device_us_per_step"), r.get("error", ""))
            continue
        kinds = " ".join(f"{k}={r.get(f'steps_at_peak_{k}')}@{(r.get(f'step_ms_mean_at_peak_{k}') or 0):.2f}"
                         for k in ("replay", "capture", "eager"))
        parts = " ".join(f"{k}:build={r.get(f'step_build_ms_mean_at_peak_{k}') or 0:.1f},after="
                         f"{r.get(f'step_after_ms_mean_at_peak_{k}') or 0:.1f}" for k in ("capture", "eager"))
        kinds += " " + parts
        f_peak, f_whole = full.get(r["audio_tokens"], (float("nan"), float("nan")))
        print(path, r["method"], r["audio_tokens"], r["max_concurrent"], f"{r['tokens_per_s_at_peak']:.0f}",
              f"x{r['tokens_per_s_at_peak'] / f_peak:.3f}", f"whole {r['tokens_per_s']:.0f}",
              f"x{r['tokens_per_s'] / f_whole:.3f}", f"p50 {r['step_ms_p50_at_peak']:.3f}",
              f"lat p50/p95 {r['p50_ms']:.2f}/{r['p95_ms']:.1f}", f"prefill {r['prefill_ms_mean']:.0f}", kinds,
              r.get("engine"))
