"""Method registry: `method.name` -> policy class. A method is one file (or package) here that registers its
class with `@register`, plus its YAML in conf/method/ (src/wnw_exp/conf); nothing else needs to know it."""

from __future__ import annotations

from functools import lru_cache

from wnw_exp.methods.base import FullCache, Policy, PrefillScores, SampleContext

REGISTRY: dict[str, type[Policy]] = {"full": FullCache}
NOT_METHODS = ("base", "mismatch", "placement_trace")  # the protocol, and the analysis wrappers around a method


def register(cls: type[Policy]) -> type[Policy]:
    REGISTRY[cls.name] = cls
    return cls


def build_policy(cfg: dict, backbone_info: dict | None = None) -> Policy:
    """Instantiate the policy named by `cfg['name']` with the other keys as keyword arguments."""
    _import_all()
    name = cfg["name"]
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(REGISTRY)}")
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return REGISTRY[name](**kwargs, backbone_info=backbone_info or {})


def registered_methods() -> dict[str, type[Policy]]:
    """Every method, by name: the policy classes of every module here (imported, so that each registers)."""
    _import_all()
    return dict(REGISTRY)


@lru_cache(maxsize=1)  # the modules register once; a class registered later (a test's) is in REGISTRY all the same
def _import_all() -> None:
    import importlib
    import pkgutil

    import wnw_exp.methods as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in NOT_METHODS:
            importlib.import_module(f"wnw_exp.methods.{mod.name}")


__all__ = ["FullCache", "Policy", "PrefillScores", "SampleContext", "REGISTRY", "register", "build_policy",
           "registered_methods"]
