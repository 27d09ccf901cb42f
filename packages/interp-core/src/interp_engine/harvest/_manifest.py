"""A harvest's manifest (``harvest.json``): the settings that define the harvest, what is written
so far, and the atomic file operations every writer uses.

The manifest is rewritten (to a temporary name, then renamed over the old one) after each shard
is in place, so at every instant it names only shards that are whole on disk. A rerun reads it,
refuses a folder whose settings differ from the ones asked for (:class:`HarvestMismatch` names
each difference), and resumes after the last shard it lists; a shard written after it was last
saved is written again (the same rows: packing is deterministic).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._errors import HarvestMismatch, InsufficientDiskSpace

MANIFEST = "harvest.json"
FORMAT_VERSION = 1

SETTING_NAMES = {
    "model": "the model (its source and a hash of its config and weight files)",
    "corpus": "the corpus (its files, their sizes and first MiB)",
    "addresses": "the addresses harvested",
    "readouts": "the SAE readouts",
    "context_size": "the context size",
    "packing": "the packing",
    "prepend_bos": "prepend_bos",
    "bos_id": "the BOS token",
    "separator_id": "the separator token",
    "dtype": "the dtype",
    "formats": "the output formats",
    "rows_per_shard": "the rows per shard",
    "max_rows": "the number of rows asked for",
    "top_contexts": "the number of top contexts per feature",
}
DERIVED = frozenset({"rows_per_shard"})
"""Settings computed from others (the rows per shard from ``shard_bytes``, the context size and
the values per token): named as a difference only when nothing they derive from differs."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (:func:`atomic_write`)."""
    atomic_write(path, [data])


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` one after the other to ``path``, whole or not at all: a temporary file in
    the same folder, flushed to disk, then renamed over ``path``."""
    temporary = path.with_name(f".{path.name}.partial")
    try:
        with open(temporary, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    atomic_write_bytes(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def check_folder(folder: Path, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest of the harvest in ``folder`` to resume (``None``: an empty or new folder);
    ``HarvestMismatch`` for a folder that holds another harvest, or files and no manifest."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        raise HarvestMismatch(f"the output {folder} is a file, not a folder", path=folder)
    manifest = read_manifest(folder)
    if manifest is None:
        others = sorted(p.name for p in folder.iterdir())
        if others:
            raise HarvestMismatch(
                f"the output folder {folder} holds files and no {MANIFEST} ({', '.join(others[:5])}"
                f"{', ...' if len(others) > 5 else ''}): it is no harvest's, and nothing is written into it; "
                "name an empty or new folder",
                path=folder,
            )
        return None
    differences = {
        key: (manifest["settings"].get(key), value)
        for key, value in settings.items()
        if _plain(manifest["settings"].get(key)) != _plain(value)
    }
    if set(differences) - DERIVED:  # a derived setting differs because another one does
        differences = {key: value for key, value in differences.items() if key not in DERIVED}
    if differences:
        named = "; ".join(
            f"{SETTING_NAMES.get(key, key)}: {_short(old)} there, {_short(new)} asked"
            for key, (old, new) in differences.items()
        )
        raise HarvestMismatch(
            f"the output folder {folder} holds another harvest ({named}); rerun with its settings to resume it, "
            "or name another folder",
            path=folder,
            differences=differences,
        )
    return manifest


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def model_identity(model: Any) -> dict[str, Any]:
    """The model's source (hub id or folder), the revision a Hugging Face cache path names, and a
    hash of its config and its weight files' names and sizes."""
    source = getattr(model, "hf_model_id", None)
    folder_of = getattr(model, "_model_folder", None)
    folder = folder_of() if callable(folder_of) else None
    identity: dict[str, Any] = {"source": str(source or folder or type(model).__name__)}
    if folder is not None:
        path = Path(folder)
        digest = hashlib.sha256()
        config = path / "config.json"
        if config.exists():
            digest.update(config.read_bytes())
        for weight in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
        identity["hash"] = digest.hexdigest()
        parts = path.resolve().parts
        if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
            identity["revision"] = parts[parts.index("snapshots") + 1]
    return identity


def versions() -> dict[str, str]:
    """The versions of the packages that made the harvest."""
    from importlib import metadata

    out = {}
    for name in ("interp-core", "torch", "safetensors", "datasets", "pyarrow", "vllm", "interp-vllm", "interp-eager"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def check_disk(folder: Path, needed: int, *, what: str) -> None:
    """``InsufficientDiskSpace`` unless ``folder``'s file system has ``needed`` bytes free."""
    probe = folder if folder.exists() else folder.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise InsufficientDiskSpace(
            f"{what} needs about {_size(needed)} and {probe} has {_size(free)} free: free space, name a folder on "
            "another disk, or harvest fewer tokens (max_tokens=) or values (fewer addresses, dtype='float16')",
            needed=needed,
            free=free,
        )


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"
