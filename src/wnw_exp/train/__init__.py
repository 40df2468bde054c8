"""Training of the embedded default model (`model=whisper_smollm2`): its projector (and optional LoRA) on synthetic speech."""
