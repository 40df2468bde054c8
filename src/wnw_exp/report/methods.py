"""How the report shows each method: label, colour, marker, role, from the method registry.

The methods are those of `wnw_exp.methods.REGISTRY` (a policy file in src/wnw_exp/methods/ plus its
conf/method/<name>.yaml). A policy class may declare its own `label`, `color`, `marker` and `role` as class
attributes; otherwise the names the paper prints are used (`KNOWN`), and a method the report has never heard
of shows under its class name with the next free colour and marker, as a deployable method, in every table and
figure that lists methods (tables 2, 5, 6 and figures 3, 4; see `specs.table_methods`).

Roles:
- `reference`: Full Cache, every audio position kept (a dashed line, a row spanning the r_GPU columns);
- `method`: a deployable audio-KV policy; `ours`: WnW, the paper's method (deployable);
- `bound`: not deployable, the upper bound any eviction policy can reach at that r_GPU (method=oracle, which
  needs every step's true attention): a dotted grey line and its own rows at the foot of Table 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

ROLES = ("reference", "method", "ours", "bound")


@dataclass(frozen=True)
class Variant:
    """One row or curve of a method: the knobs it fixes (e.g. the oracle's granularity) and how it is drawn."""

    label: str
    knobs: tuple[tuple[str, Any], ...] = ()
    linestyle: str = "-"


@dataclass(frozen=True)
class MethodStyle:
    name: str
    label: str
    color: str
    marker: str
    role: str = "method"
    variants: tuple[Variant, ...] = field(default=())

    @property
    def deployable(self) -> bool:
        return self.role in ("method", "ours")

    def rows(self) -> tuple[Variant, ...]:
        """The variants, or the method itself as one variant."""
        return self.variants or (Variant(self.label, (), ":" if self.role == "bound" else "-"),)


# The paper's methods as the paper prints them (§3.3, Tables 1-8), and the oracle bound.
KNOWN: dict[str, dict] = {
    "full": dict(label="Full Cache", color="black", marker="", role="reference"),
    "adakv": dict(label="Ada-KV", color="tab:red", marker="v"),
    "audiokv": dict(label="AudioKV", color="tab:orange", marker="^"),
    "arkvale": dict(label="ArkVale", color="tab:blue", marker="s"),
    "affpool": dict(label="AffPool", color="tab:purple", marker="D"),
    "wnw": dict(label="WnW (ours)", color="tab:green", marker="o", role="ours"),
    "oracle": dict(label="Oracle (bound)", color="0.45", marker="x", role="bound",
                   variants=(Variant("Oracle, top tokens (bound)", (("granularity", "token"),), ":"),
                             Variant("Oracle, top 4 s blocks (bound)", (("granularity", "chunk"),), "-."))),
}
PAPER_METHODS = ("full", "adakv", "audiokv", "arkvale", "affpool", "wnw")  # the paper's order
FREE_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "darkgoldenrod", "teal", "navy")
FREE_MARKERS = ("P", "X", "*", "h", "<", ">", "p", "d")


def _own(cls: type, attr: str) -> Any:
    """A class attribute the policy class declares (itself or a parent), not one every method inherits from the
    Full base class."""
    from wnw_exp.methods.base import Policy

    for klass in cls.__mro__:
        if klass is Policy and cls is not Policy:
            return None
        if attr in vars(klass):
            return vars(klass)[attr]
    return None


def styles_for(registry: dict[str, type]) -> dict[str, MethodStyle]:
    """Every registered method's style, in the report's order: the paper's methods in the paper's order, then
    the others by name, bounds last."""
    names = [n for n in PAPER_METHODS if n in registry] + sorted(n for n in registry if n not in PAPER_METHODS)
    out: dict[str, MethodStyle] = {}
    free = 0
    for name in names:
        cls = registry[name]
        known = KNOWN.get(name, {})
        label = _own(cls, "label") or known.get("label") or cls.__name__
        color, marker = _own(cls, "color") or known.get("color"), _own(cls, "marker") or known.get("marker")
        if color is None or marker is None:
            color = color or FREE_COLORS[free % len(FREE_COLORS)]
            marker = marker if marker is not None else FREE_MARKERS[free % len(FREE_MARKERS)]
            free += 1
        role = _own(cls, "role") or known.get("role") or ("reference" if name == "full" else "method")
        if role not in ROLES:
            raise ValueError(f"method {name}: role {role!r} is not one of {', '.join(ROLES)}")
        out[name] = MethodStyle(name, str(label), str(color), str(marker), role, tuple(known.get("variants", ())))
    bounds = [n for n in out if out[n].role == "bound"]
    return {n: out[n] for n in [n for n in out if n not in bounds] + bounds}


@lru_cache(maxsize=1)
def _registered() -> dict[str, MethodStyle]:
    from wnw_exp.methods import REGISTRY, _import_all  # the policies import torch; only the report's callers pay

    _import_all()
    return styles_for(REGISTRY)


def method_styles() -> list[MethodStyle]:
    """Every registered method, in the report's order."""
    return list(_registered().values())


def style(name: str) -> MethodStyle:
    """The style of `name`; a method no longer registered (an old run directory) shows under its name."""
    return _registered().get(name) or MethodStyle(name, name, FREE_COLORS[-1], FREE_MARKERS[-1])


def label(name: str) -> str:
    return style(name).label


def table_methods(paper: tuple[str, ...], bounds: bool = False) -> list[MethodStyle]:
    """A table's method rows: the paper's, in that table's order, then every registered deployable method the
    paper does not have (a new method shows up without an edit here), then the bounds when `bounds`."""
    styles = _registered()
    rows = [style(n) for n in paper]
    rows += [s for s in styles.values() if s.name not in PAPER_METHODS and s.deployable]
    if bounds:
        rows += [s for s in styles.values() if s.role == "bound"]
    return rows
