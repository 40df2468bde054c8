"""How the report shows each method: label, colour, marker, role, from the method registry.

The methods are those of `wnw_exp.methods.registered_methods()` (a policy file in src/wnw_exp/methods/ plus its
src/wnw_exp/conf/method/<name>.yaml). Each policy class declares its `label`, `color`, `marker`, `role` and `variants` as class
attributes (read from the class: no policy, and no model, is built); a method that declares none shows under its
class name with the next free colour and marker, as a deployable method, in every table and figure that lists
methods (tables 2, 5, 6 and figures 3, 4; see `specs.table_methods`).

Roles:
- `reference`: Full Cache, every audio position kept (a dashed line, a row spanning the r_GPU columns);
- `method`: a deployable audio-KV policy; `ours`: WnW, the paper's method (deployable);
- `bound`: not deployable, the upper bound any eviction policy can reach at that r_GPU (method=oracle, which
  needs every step's true attention): a dotted grey line and its own rows at the foot of Table 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


PAPER_METHODS = ("full", "adakv", "audiokv", "arkvale", "affpool", "wnw")  # the paper's order
FREE_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "darkgoldenrod", "teal", "navy")
FREE_MARKERS = ("P", "X", "*", "h", "<", ">", "p", "d")


def styles_for(registry: dict[str, type]) -> dict[str, MethodStyle]:
    """Every registered method's style, in the report's order: the paper's methods in the paper's order, then
    the others by name, bounds last."""
    names = [n for n in PAPER_METHODS if n in registry] + sorted(n for n in registry if n not in PAPER_METHODS)
    out: dict[str, MethodStyle] = {}
    free = 0
    for name in names:
        cls = registry[name]
        label, color, marker, role = cls.label or cls.__name__, cls.color, cls.marker, cls.role
        if color is None or marker is None:
            color = color or FREE_COLORS[free % len(FREE_COLORS)]
            marker = marker if marker is not None else FREE_MARKERS[free % len(FREE_MARKERS)]
            free += 1
        if role not in ROLES:
            raise ValueError(f"method {name}: role {role!r} is not one of {', '.join(ROLES)}")
        variants = tuple(Variant(text, tuple(knobs), style) for text, knobs, style in cls.variants)
        out[name] = MethodStyle(name, str(label), str(color), str(marker), role, variants)
    bounds = [n for n in out if out[n].role == "bound"]
    return {n: out[n] for n in [n for n in out if n not in bounds] + bounds}


def _registered() -> dict[str, MethodStyle]:
    """The styles of the methods registered now (made each time: a handful of class attributes)."""
    from wnw_exp.methods import registered_methods  # the policies import torch; only the report's callers pay

    return styles_for(registered_methods())


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
