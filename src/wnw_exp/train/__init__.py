"""Training of the embedded model: `whisper_smollm2`'s projector and LoRA (`projector.py`, `wnw-train-projector`)."""


def write_log(log_file, record: dict) -> None:
    """Append one training-log record (JSON line, flushed) and print it as `key=value` pairs."""
    import json

    log_file.write(json.dumps(record) + "\n")
    log_file.flush()
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()), flush=True)
