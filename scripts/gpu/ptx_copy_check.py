"""Which global loads and stores the flush's copy kernel (`kv.triton_moves._copy_list_kernel`) compiles to for an
H100/H200 (sm_90), without a GPU: Triton compiles to PTX here and the PTX's ld/st instructions are counted.
ld.global.b16 are 2-byte host reads (the kernel on main); ld.global.v4.b32 are 16-byte ones
(the patch of commit ecb81cb, scripts/gpu/pending/vector-copy.patch, applied: measured on the H200 in the eighth
session and not merged, since the copy was no faster; docs/gpu.md).

    pip install --no-deps --target /tmp/tri triton      # the CPU machine has no triton in the venv
    PYTHONPATH=/tmp/tri:src python scripts/gpu/ptx_copy_check.py
"""

import collections
import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from wnw_exp.kv import triton_moves as m

params = list(inspect.signature(m._copy_list_kernel.fn).parameters)
for W, VEC in ((128, 8), (128, 1)):  # Voxtral's bf16 rows of 128 dims are 128 words; VEC = 1: no alignment hint
    sig = {p: "constexpr" if p in ("W", "COPY", "VEC") else ("*i64" if p == "tbl" else "*i32") for p in params}
    consts = {k: v for k, v in dict(W=W, COPY=m.COPY, VEC=VEC).items() if k in params}
    ptx = triton.compile(ASTSource(fn=m._copy_list_kernel, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(consts, dict(collections.Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))))
