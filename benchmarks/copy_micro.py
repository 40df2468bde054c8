"""What bounds the recall copy (`kv.triton_moves._copy_list_kernel`) on a GPU: one kernel timed alone.

In the serving benchmark at 33 WnW streams the copy takes ~930 us a step for ~5,500 (token, head) rows of K and V
(2.8 MB, ~3 GB/s), where ArkVale's bs-1 copy moves ~15 GB/s (docs/gpu.md). 16-byte reads did not change it, so the
width of the reads is not the bound. This times the same kernel on made-up pair lists, one factor at a time:
- `--pairs`: how many (host row, device slot) pairs a launch copies (5,500 is the serving step's);
- `--footprint-gb`: the size of the pinned host mirror the rows are read from (one bs-1 stream of the Voxtral shape
  holds ~0.37 GB of audio K+V; 33 streams ~12 GB): if a large footprint alone slows the same pairs down, the bound
  is address translation (the GPU's TLB over pinned host memory), not PCIe bandwidth;
- `--run`: consecutive host rows per group (50: WnW's 4 s chunk of one head; 1: scattered rows);
- `--hugepage-gb`: the same rows from a mirror of that size in transparent huge pages (an aligned anonymous mapping
  with madvise(MADV_HUGEPAGE), pinned with cudaHostRegister) instead of `pin_memory`'s: whether the GPU's
  translation gets cheaper with larger host pages (the machine's THP setting is in each row);
- `--lists`: the same pairs at every launch (the GPU's translations of their pages stay cached from one launch to the
  next) or a fresh pair list for each launch (new pages each time, as each decode step recalls other chunks). The
  first run on the H200 (2026-12-02 12:11 UTC) had `same` only: 5,500 pairs took 96-129 us at any footprint, where
  the serving step's copy takes ~930 us;
- the same pairs read from device memory (`source=device`): the kernel's floor without PCIe;
and, as the link's ceiling, one contiguous `copy_` of the same bytes from pinned memory.

    PYTHONPATH=src python3 benchmarks/copy_micro.py --out $OUT/copy_micro.json          # on the GPU machine
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/copy_micro.py --smoke          # CPU: the harness runs

Rows: {"kind": "copy_micro", "source", "footprint_gb", "pairs", "run", "lists", "us", "gb_per_s"} (us: median of --reps
launches timed with CUDA events; gb_per_s: K+V bytes moved over that time), plus the GPU, date and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HEAD_DIM = 128  # the Voxtral shape's head: 256 bytes of bf16 a row of K (and of V)


def pair_list(n_pairs: int, n_host_rows: int, n_slots: int, run: int, gen: torch.Generator) -> tuple:
    """(src, dst) int32: `n_pairs` pairs in groups of `run` consecutive host rows (a chunk of one head), the groups'
    starts spread uniformly over the mirror; destinations distinct slots in a random order (free slots are
    scattered)."""
    n_groups = -(-n_pairs // run)
    starts = torch.randint(0, max(1, n_host_rows - run), (n_groups,), generator=gen)
    src = (starts[:, None] + torch.arange(run)[None, :]).flatten()[:n_pairs]
    dst = torch.randperm(n_slots, generator=gen)[:n_pairs]
    return src.to(torch.int32), dst.to(torch.int32)


def hugepage_tensor(n_rows: int) -> tuple[torch.Tensor, object]:
    """(n_rows, HEAD_DIM) bf16 in a 2 MiB-aligned anonymous mapping advised into transparent huge pages, touched and
    registered with CUDA (cudaHostRegister: pinned, and mapped at the same address for the GPU); the mapping is
    returned too (it must outlive the tensor)."""
    import ctypes
    import mmap

    huge = 2 << 20
    size = n_rows * HEAD_DIM * 2
    buf = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = (-addr) % huge
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(addr + offset), ctypes.c_size_t(size), 14)  # MADV_HUGEPAGE
    t = torch.frombuffer(buf, dtype=torch.bfloat16, count=n_rows * HEAD_DIM, offset=offset).view(n_rows, HEAD_DIM)
    t.view(torch.int16).fill_(1)  # fault the pages in (huge where the kernel can) before pinning
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return t, buf


def thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def median_us(launch, reps: int, device) -> float:
    """Median microseconds of `launch()` over `reps` calls after two warm-up calls (compilation, first touch): CUDA
    events on a GPU, the wall clock elsewhere."""
    times = []
    for i in range(reps + 2):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch()
            b.record()
            b.synchronize()
            us = a.elapsed_time(b) * 1e3
        else:
            t0 = time.perf_counter()
            launch()
            us = (time.perf_counter() - t0) * 1e6
        if i >= 2:
            times.append(us)
    return statistics.median(times)


def time_copy(tm, host_k, host_v, dev_k, dev_v, lists, reps: int, device) -> float:
    """Median microseconds of one `_copy_list_kernel` launch over a list of pairs (src, dst), through a table of one
    store laid out as `FlushTables.ptrs` (only the four K/V addresses are read by the copy). `lists`: the pair lists
    the launches take in turn (one list: every launch copies the same rows, so the GPU's address translations stay
    cached; one per launch: new rows each time, as in a decode step)."""
    ptrs = torch.zeros((1, tm.NF), dtype=torch.int64)
    for name, t in (("host_k", host_k), ("host_v", host_v), ("audio_k", dev_k), ("audio_v", dev_v)):
        ptrs[0, tm.FIELDS.index(name)] = t.data_ptr()
    ptrs = ptrs.to(device)
    lists = [(src.to(device), dst.to(device)) for src, dst in lists]
    n = lists[0][0].numel()
    pair_st = torch.zeros(n, dtype=torch.int32, device=device)
    count = torch.zeros(2, dtype=torch.int32, device=device)  # the pairs listed, the programs done
    W = host_k.shape[1] * host_k.element_size() // 2
    grid = (min(tm.COPY_PROGRAMS, -(-n // tm.COPY)),)
    turn = iter(range(1 << 30))

    def launch():
        src, dst = lists[next(turn) % len(lists)]
        count[0] = n  # the kernel's last program empties the list
        tm._copy_list_kernel[grid](ptrs, pair_st, src, dst, count, W=W, COPY=tm.COPY)

    return median_us(launch, reps, device)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="1000,5500,22000")
    ap.add_argument("--footprint-gb", default="0.4,4,12")
    ap.add_argument("--runs", default="50,1")
    ap.add_argument("--hugepage-gb", default="12", help="mirror sizes in huge pages ('' for none; CUDA only)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lists", default="same,fresh",
                    help="same: every launch copies the same pairs; fresh: a new pair list each launch")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1): the harness runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from wnw_exp.kv import triton_moves as tm

    if a.smoke:
        a.pairs, a.footprint_gb, a.runs, a.reps = "40", "0.0001", "5,1", 2
    row_bytes = HEAD_DIM * 2
    meta = dict(gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)",
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command=" ".join(["benchmarks/copy_micro.py", *(sys.argv[1:] if argv is None else argv)]),
                copy_grid=f"{tm.COPY_PROGRAMS}x{tm.COPY}", thp=thp_setting())
    rows: list[dict] = []
    out = Path(a.out) if a.out else None

    def emit(row: dict) -> None:
        rows.append(dict(row, **meta))
        print(json.dumps(row), flush=True)
        if out is not None:
            out.write_text(json.dumps(rows, indent=1))

    gen = torch.Generator().manual_seed(0)
    pairs = [int(x) for x in a.pairs.split(",")]
    n_slots = max(pairs) * 2
    dev_k = torch.zeros(n_slots, HEAD_DIM, dtype=torch.bfloat16, device=device)
    dev_v = torch.zeros_like(dev_k)

    modes = a.lists.split(",")

    def measure(source: str, host_k, host_v, gb, n: int, run: int) -> None:
        """Time the copy of n pairs (groups of `run` consecutive rows) from host_k/host_v, with the same or fresh
        lists, emit the rows, and check the last copied rows against their source."""
        for mode in modes:
            k = 1 if mode == "same" else a.reps + 2
            lists = [pair_list(n, host_k.shape[0], n_slots, run, gen) for _ in range(k)]
            us = time_copy(tm, host_k, host_v, dev_k, dev_v, lists, a.reps, device)
            emit(dict(kind="copy_micro", source=source, footprint_gb=gb, pairs=n, run=run, lists=mode,
                      us=round(us, 1), gb_per_s=round(n * 2 * row_bytes / us / 1e3, 2)))
            src, dst = lists[(a.reps + 1) % len(lists)]  # the last launch's
            if not torch.equal(dev_k[dst.long().to(device)].cpu(), host_k[src.long().to(host_k.device)].cpu()):
                emit(dict(kind="copy_micro", source=source, footprint_gb=gb, pairs=n, run=run, lists=mode,
                          error="copied rows differ"))

    def host_rows(gb: float) -> int:  # K and V each half the footprint, never fewer rows than the slots
        return max(n_slots, int(gb * 1e9 / 2 / row_bytes))

    for gb in (float(x) for x in a.footprint_gb.split(",")):
        n_host_rows = host_rows(gb)
        try:
            pin = device.type == "cuda"
            host_k = torch.empty(n_host_rows, HEAD_DIM, dtype=torch.bfloat16, pin_memory=pin)
            host_v = torch.empty(n_host_rows, HEAD_DIM, dtype=torch.bfloat16, pin_memory=pin)
            host_k.view(torch.int16).fill_(1)  # touch every page
            host_v.view(torch.int16).fill_(2)
        except RuntimeError as e:
            emit(dict(kind="copy_micro", footprint_gb=gb, error=f"{type(e).__name__}: {e}"))
            continue
        for run in (int(x) for x in a.runs.split(",")):
            for n in pairs:
                measure("pinned host", host_k, host_v, gb, n, run)
        del host_k, host_v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for gb in (float(x) for x in a.hugepage_gb.split(",") if x and device.type == "cuda"):
        n_host_rows = host_rows(gb)
        try:
            (host_k, buf_k), (host_v, buf_v) = hugepage_tensor(n_host_rows), hugepage_tensor(n_host_rows)
        except (RuntimeError, OSError, ValueError) as e:
            emit(dict(kind="copy_micro", source="huge pages", footprint_gb=gb, error=f"{type(e).__name__}: {e}"))
            continue
        for run in (int(x) for x in a.runs.split(",")):
            for n in pairs:
                measure("huge pages", host_k, host_v, gb, n, run)
        for t in (host_k, host_v):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        del host_k, host_v, buf_k, buf_v
    # the kernel's floor (device source) and the link's ceiling (one contiguous copy of the same bytes)
    src_k, src_v = dev_k.clone(), dev_v.clone()
    for n in pairs:
        measure("device", src_k, src_v, None, n, 1)
        if device.type == "cuda":
            host = torch.empty(n * 2, HEAD_DIM, dtype=torch.bfloat16, pin_memory=True)
            buf = torch.empty_like(host, device=device)
            us = median_us(lambda: buf.copy_(host, non_blocking=True), a.reps, device)
            emit(dict(kind="copy_micro", source="one contiguous copy_ (the link)", pairs=n, us=round(us, 1),
                      gb_per_s=round(n * 2 * row_bytes / us / 1e3, 2)))
    return rows


if __name__ == "__main__":
    main()
