"""WnW (§2.2-2.3), one method in two files: `triage` (the pure rules: head roles, lambda, per-segment prefill
selection, the chunk swap's state machine, on the host and as device tensors) and `policy` (the `Policy` that
applies them to the KV store)."""

from wnw_exp.methods.wnw import triage
from wnw_exp.methods.wnw.policy import DEFAULT_MOBILITY, WnW

__all__ = ["DEFAULT_MOBILITY", "WnW", "triage"]
