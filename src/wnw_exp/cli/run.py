"""`wnw-run`: run one configuration (or a `-m` sweep) into run directories."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from wnw_exp.paths import conf_dir

CONFIG_DIR = str(conf_dir())  # the conf/ inside the package, or $WNW_CONF


def fail(message: str) -> None:
    """Bad input or a bad place to write: one line on stderr, exit code 2."""
    print(f"wnw-run: error: {message}", file=sys.stderr)
    sys.exit(2)


def describe_os_error(e: OSError, where: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the disk of {where} ({e.strerror}): free some, or set runs_root to another disk; "
                "finished samples are kept, rerun the same command to resume")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {e.filename or where} ({e.strerror}): set runs_root to a folder you can write"
    return str(e)


class CheckRunsRoot(Callback):
    """An unwritable or full runs_root gets one line and exit 2 before Hydra creates the run directory there
    (Hydra would print its own traceback)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(Path(config.runs_root))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(Path(config.runs_root))

    @staticmethod
    def _check(root: Path) -> None:
        probe = root / f".wnw-write-probe-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:  # a little more than the .hydra files Hydra writes next
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            fail(describe_os_error(e, root))
        finally:
            probe.unlink(missing_ok=True)


class RetentionFreeRunsAtOne(Callback):
    """A method that keeps every audio position (its policy's `uses_retention = False`: Full Cache) runs a single
    run at retention=1.0, in the run directory a sweep gives it (a sweep's jobs are set so by its sweeper,
    wnw_exp.cli.sweep)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        from wnw_exp.cli.sweep import ignores_retention

        method = config.method.name
        if config.retention != 1.0 and ignores_retention(method):
            asked = any(o.split("=", 1)[0].lstrip("+~") == "retention" for o in config.hydra.overrides.task)
            if asked:  # a note only for a retention typed on the command line
                print(f"wnw-run: method={method} keeps every audio position: run at retention=1.0 (not "
                      f"{config.retention})", file=sys.stderr)
            with read_write(config):
                config.retention = 1.0


def quiet_libraries() -> None:
    """progress=false: no progress bar from transformers (loading weights) or the hub either."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def run_main(cfg: DictConfig) -> dict:
    from wnw_exp.cli.summary import job_line, result_row, run_summary, swept_values
    from wnw_exp.cli.sweep import SWEEP_AXES_ENV, SWEEP_SIZE_ENV
    from wnw_exp.engine.runner import Interrupted, run

    start = time.perf_counter()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    plain = OmegaConf.to_container(cfg, resolve=True)
    progress = bool(cfg.progress) and not os.environ.get("WNW_NO_PROGRESS")
    if not progress:
        quiet_libraries()
    try:
        metrics = run(plain, run_dir, progress=progress)
    except Interrupted as e:  # metrics.json is written and the line saying so printed
        sys.exit(128 + e.signum)
    except OSError as e:
        # Bad input (weights, data root, manifest) and a run directory that cannot be written (full, read-only)
        fail(describe_os_error(e, run_dir))
    except (ValueError, RuntimeError) as e:
        # Bad input (config, weights, data, a locked run directory or one of another configuration)
        fail(str(e))
    row = result_row(plain, metrics, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # one line per job; the sweeper prints the table of all at the end
        axes = [k for k in os.environ.get(SWEEP_AXES_ENV, "").split(",") if k]
        row["swept"] = swept_values(list(hydra_cfg.overrides.task), axes)
        total = os.environ.get(SWEEP_SIZE_ENV)
        print(job_line(row, hydra_cfg.job.num + 1, int(total) if total else None, time.perf_counter() - start),
              flush=True)
    else:
        print(run_summary(row))
    return row


def main() -> None:
    try:
        run_main()
    except KeyboardInterrupt:  # Ctrl-C before a run started (while importing, composing the config)
        print("wnw-run: interrupted before the run started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
