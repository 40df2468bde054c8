"""The scripted anchor signal of `decode_speed.scripted_wnw` for a batch seated in a bucket's step, in one launch
through an address table rewritten in place (`kv.triton_moves.AddressRows`), so that a CUDA graph captured over a
batch of scripted WnW streams replays for another set of them, as it does for the real method. Each stream's
scores_acc = (1 - beta) scores_acc + beta mass bumps[s], then s += 1 (what `ScriptedWnW._adjust_signal` does in
four PyTorch launches). Import only where triton is installed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wnw_exp.kv.triton_moves import AddressRows, table_field

NF = 5  # scores_acc, step counter, bumps (steps, N) float32, N, mass


@triton.jit
def _signal_kernel(tbl, beta, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    N = tl.load(tbl + r * 5 + 3)
    if N > 0:
        acc = table_field(tbl, r, 0, tl.float32, 5)
        s_ptr = table_field(tbl, r, 1, tl.int64, 5)
        bumps = table_field(tbl, r, 2, tl.float32, 5)
        mass = tl.load(tbl + r * 5 + 4).to(tl.float32)
        s = tl.load(s_ptr)
        for p0 in range(0, N, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            m = p < N
            a = tl.load(acc + p, mask=m, other=0.0)
            g = tl.load(bumps + s * N + p, mask=m, other=0.0)
            tl.store(acc + p, a * (1 - beta) + g * (beta * mass), mask=m)
        tl.store(s_ptr, s + 1)


class SignalTables:
    """The scripted signals of up to `capacity` policies (with `_bumps`, `_s`, `_mass`, `scores_acc`)."""

    def __init__(self, capacity: int, device: torch.device):
        self.table = AddressRows(capacity, NF, device)
        self.key = None

    def bind(self, policies: list) -> bool:
        if len(policies) > self.table.capacity:
            return False
        rows = [[p.scores_acc.data_ptr(), p._s.data_ptr(), p._bumps.data_ptr(), p.scores_acc.numel(), int(p._mass)]
                for p in policies]
        self.table.write(rows, [t for p in policies for t in (p.scores_acc, p._s, p._bumps)])
        self.key = [id(p) for p in policies]
        return True

    def __call__(self, beta: float) -> None:
        _signal_kernel[(self.table.capacity,)](self.table.ptrs, float(beta), BLOCK=1024)
