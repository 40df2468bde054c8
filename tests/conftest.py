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

import pytest  # noqa: E402

# `make test` hands whole modules to its two workers (`--dist loadscope`), by default the modules with the most
# tests first. The longest modules are those that start real `wnw-run` processes or load whisper_smollm2, most of
# them with few tests, so they came last and one worker ran the longest of them alone at the end (2026-12-02 on the
# 2-core machine: test_console_processes.py's 90 s from 251 s to 345 s, the other worker idle from 308 s). Given
# out longest first instead (each between 30 and 165 worker-seconds there, varying with what runs beside it; the
# rest under 12 s), the short modules fill in at the end: both workers finished within 5 s of each other. Only the
# order changes; a module still runs whole, in its own order, on one worker.
LONGEST_FIRST = ("test_console_processes.py", "test_clean_failure.py", "test_whisper_smollm2.py", "test_report.py",
                 "test_batch.py", "test_console.py", "test_runner.py", "test_run_identity.py", "test_install.py",
                 "test_fused_decode.py", "test_data_librispeech_long.py", "test_reliability.py", "test_input_hygiene.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest as collected


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadscope":
        config.option.loadscopereorder = False  # hand out the modules in the order above
    return None  # xdist's own scheduler
