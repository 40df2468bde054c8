"""Training of the embedded default model (`model=tiny`): a small Voxtral trained on synthetic speech."""
