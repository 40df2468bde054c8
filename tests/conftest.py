import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WNW_NO_PROGRESS", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # `make test`'s pytest-xdist workers share the cores: each gets its share of threads (CI: 2 cores, 2 workers,
    # 1 thread each), passed on to the processes the tests start. With torch's default (a thread per core in every
    # worker) their thread pools spin against each other: on the 2-core machine (two other jobs running), test_wnw.py
    # beside the two whisper_smollm2 logits checks took 46 s instead of 8 s (its longest test 22 s instead of 0.5 s),
    # the logits checks 88 s instead of 34 s.
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import torch  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    # Without CUDA, Triton (when installed) runs only in its interpreter, which must be chosen before anything
    # imports triton: importing a transformers model does, so the Triton tests' own setting would come too late.
    os.environ.setdefault("TRITON_INTERPRET", "1")
