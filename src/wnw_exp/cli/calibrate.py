"""`wnw-calibrate`: offline head scores (voice score, head sensitivity) -> head_scores.json.

    wnw-calibrate model=tiny_random dataset.n=4                       # oracle (espeak) word timings
    wnw-calibrate model=voxtral dataset=librispeech_long dataset.split=dev-clean alignment=whisperx
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from wnw_exp.cli.run import CONFIG_DIR, quiet_libraries


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="calibrate")
def main(cfg: DictConfig) -> None:
    from wnw_exp.calibration.run import OutputTaken, run_calibration

    plain = OmegaConf.to_container(cfg, resolve=True)
    output = Path(plain["output"]) if plain.get("output") else \
        Path(HydraConfig.get().runtime.output_dir) / "head_scores.json"
    progress = bool(cfg.progress) and not os.environ.get("WNW_NO_PROGRESS")
    if not progress:
        quiet_libraries()
    try:
        scores = run_calibration(plain, output, progress=progress)
    except OutputTaken as e:  # refused before any work
        print(f"wnw-calibrate: error: {e}", file=sys.stderr)
        sys.exit(2)
    c = scores.calibration
    print(f"{scores.model}: {scores.n_layers} layers x {scores.n_kv_heads} KV heads, {c['n_samples']} samples, "
          f"{c['n_vs_tokens']} voice-score tokens, {c['n_hs_tokens']} gradient tokens")
    print(f"wrote {output}")
    print(f"use it with: wnw-run method=wnw model={scores.model} method.head_scores={output.resolve()}")


if __name__ == "__main__":
    main()
