"""What a killed-and-resumed run of ``benchmarks/faults.py`` is judged by, for the single-process and the
2-process modes alike: the SHA-256 of every file of its export and of every final tensor, and the staging or
temporary files it should not have left behind."""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest(out: Path) -> dict[str, str]:
    """SHA-256 of every export file (``export/...``), and of the final tensors (``tensor:NAME``)."""
    from safetensors.torch import load_file

    files = sorted((out / "export").rglob("*")) if (out / "export").is_dir() else []
    found = {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()
    }
    if (out / "final.safetensors").is_file():
        for name, t in load_file(str(out / "final.safetensors")).items():
            found[f"tensor:{name}"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return found


def leftovers(out: Path) -> list[str]:
    """Staging or temporary files a finished run should not leave."""
    return [str(p.relative_to(out)) for p in out.rglob("*") if ".tmp" in p.name or "staging" in p.name]
