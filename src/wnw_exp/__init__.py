"""wnw-exp: audio KV-cache management experiments for long-form speech LLMs."""

__version__ = "0.1.0"


def _register_config_resolvers() -> None:
    """The interpolations conf/ uses, registered on import so that every reader of the config has them:
    `${wnw.identity:}` (the run identity's hash, in the run directory's name) and `${wnw.stem:PATH}` (a
    file's stem: a manifest's default split)."""
    from pathlib import Path

    try:
        from omegaconf import OmegaConf
    except ImportError:  # the engine alone, without the config layer (the decode benchmark on a bare GPU machine)
        return

    def run_identity(*, _root_) -> str:
        from wnw_exp.rundir import identity_hash

        # the job's config without the hydra node (which holds the run directory being resolved)
        return identity_hash({k: OmegaConf.to_container(_root_[k], resolve=True) if OmegaConf.is_config(_root_[k])
                              else _root_[k] for k in _root_ if k != "hydra"})

    OmegaConf.register_new_resolver("wnw.identity", run_identity, replace=True)
    OmegaConf.register_new_resolver("wnw.stem", lambda path: None if path in (None, "") else Path(str(path)).stem,
                                    replace=True)


_register_config_resolvers()
