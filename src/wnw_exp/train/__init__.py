"""Training of the embedded models: `tiny` from scratch (`tiny.py`), `whisper_smollm2`'s projector and LoRA (`projector.py`)."""
