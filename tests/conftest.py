import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WNW_NO_PROGRESS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without CUDA, Triton (when installed) runs only in its interpreter, which must be chosen before anything
    # imports triton: importing a transformers model does, so the Triton tests' own setting would come too late.
    os.environ.setdefault("TRITON_INTERPRET", "1")
