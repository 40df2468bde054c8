"""The sweeper of `wnw-run -m` (conf/hydra/sweeper/wnw.yaml): Hydra's basic sweeper plus two things.

- Full Cache runs once whatever the retentions swept (wnw_exp.cli.sweep.retention_free_runs_once), decided on each
  job's composed config before anything is launched.
- When every job has ended, one table with a row per job (wnw_exp.cli.summary), with each job's run directory.

Hydra loads sweepers only from the `hydra_plugins` namespace, hence this file; it imports nothing heavy (Hydra
imports every plugin module whenever any Hydra application starts).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override


class WnwSweeper(BasicSweeper):
    def split_arguments(self, overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        from wnw_exp.cli.sweep import SWEEP_AXES_ENV, SWEEP_SIZE_ENV, retention_free_runs_once, sweep_axes

        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        jobs, notes = retention_free_runs_once(jobs, self._method_and_retention)
        for note in notes:
            print(f"wnw-run: {note}", flush=True)
        # what each job's line says of the sweep (the jobs inherit the environment, in worker processes too)
        os.environ[SWEEP_SIZE_ENV] = str(len(jobs))
        os.environ[SWEEP_AXES_ENV] = ",".join(sweep_axes(jobs))
        return [jobs] if max_batch_size is None else list(self.split_overrides_to_chunks(jobs, max_batch_size))

    def _method_and_retention(self, job: List[str]) -> tuple:
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        method = cfg.get("method")
        return (None if method is None else method.get("name")), cfg.get("retention")

    def sweep(self, arguments: List[str]) -> Any:
        from wnw_exp.cli.summary import sweep_summary

        returns = super().sweep(arguments)
        rows = [r.return_value for batch in returns for r in batch if isinstance(r.return_value, dict)]
        if rows:
            print(sweep_summary(rows, str(self.config.get("runs_root")) if self.config is not None else None),
                  flush=True)
        return returns
