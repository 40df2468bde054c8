"""`wnw-align`: WhisperX word alignments of a calibration set, for `wnw-calibrate alignment=whisperx`.

    wnw-align dataset=librispeech_long dataset.split=dev-clean alignment=whisperx \
              alignment.python=~/.venvs/whisperx/bin/python

WhisperX runs in its own environment (it pins torch~=2.8): this command writes the samples' audio as
16 kHz WAVs and a manifest under `alignment.dir`, then runs `wnw_exp/calibration/whisperx_worker.py`
with `alignment.python` (or in this process when whisperx happens to be importable here). The
alignments land in `alignment.dir/<sample id>.json`, where wnw-calibrate reads them. Same config as
wnw-calibrate (conf/calibrate.yaml), so the same overrides select the same samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from wnw_exp.cli.run import CONFIG_DIR


def prepare(cfg: dict) -> tuple[Path, Path, int]:
    """Write the WAVs and the manifest of the samples still to align. Returns (manifest, out dir, n)."""
    import numpy as np
    import soundfile as sf

    from wnw_exp.calibration.alignment import alignment_filename
    from wnw_exp.data import build_dataset

    out_dir = Path(cfg["alignment"]["dir"]).expanduser()
    wav_dir = out_dir / "audio"
    wav_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for sample in build_dataset(cfg["dataset"]):
        name = alignment_filename(sample.id)
        if (out_dir / name).exists():
            continue
        wav = wav_dir / (name[:-5] + ".wav")
        if not wav.exists():
            sf.write(wav, np.clip(sample.audio(), -1, 1), 16000, subtype="PCM_16")
        lines.append(json.dumps(dict(id=sample.id, audio=str(wav.resolve()), reference=sample.reference,
                                     language=sample.language, duration=sample.duration, out=name)))
    manifest = out_dir / "manifest.jsonl"
    manifest.write_text("".join(line + "\n" for line in lines))
    return manifest, out_dir, len(lines)


def worker_command(python: str, manifest: Path, out_dir: Path, device: str, align_model: str | None) -> list[str]:
    from wnw_exp.calibration import whisperx_worker

    cmd = [python, whisperx_worker.__file__, str(manifest), str(out_dir), "--device", device]
    return cmd + (["--align-model", align_model] if align_model else [])


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="calibrate")
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    al = plain["alignment"]
    if al["name"] != "whisperx":
        print(f"alignment={al['name']} needs no alignment step (the data set carries its word timings)")
        return
    manifest, out_dir, n = prepare(plain)
    if n == 0:
        print(f"every sample is already aligned in {out_dir}")
        return
    device = al.get("device") or "auto"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    python = al.get("python")
    if python is None:
        try:
            import whisperx  # noqa: F401 - only to see whether it is here
        except ImportError:
            sys.exit("wnw-align: whisperx is not installed in this environment, and it must not be (it pins "
                     "torch~=2.8 and would downgrade torch and transformers). Install it in its own environment:\n"
                     "  python -m venv ~/.venvs/whisperx && ~/.venvs/whisperx/bin/pip install whisperx\n"
                     "then pass alignment.python=~/.venvs/whisperx/bin/python")
        python = sys.executable
    cmd = worker_command(os.path.expanduser(python), manifest, out_dir, device, al.get("align_model"))
    print(f"aligning {n} samples with WhisperX: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        sys.exit(f"wnw-align: the WhisperX worker failed (exit {rc})")
    print(f"alignments in {out_dir}; next: wnw-calibrate alignment=whisperx with the same dataset options")


if __name__ == "__main__":
    main()
