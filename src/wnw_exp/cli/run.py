"""`wnw-run`: run one configuration (or a `-m` sweep) into run directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# The config groups live in the repository's conf/ (the package is installed in editable mode).
CONFIG_DIR = os.environ.get("WNW_CONF", str(Path(__file__).resolve().parents[3] / "conf"))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from wnw_exp.engine.runner import run, summary_table

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        metrics = run(plain, run_dir, progress=cfg.progress and not os.environ.get("WNW_NO_PROGRESS"))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # Bad input (config, weights, data root, a locked run directory): one clear line, no traceback.
        print(f"wnw-run: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(summary_table(plain, metrics, run_dir))


if __name__ == "__main__":
    main()
