"""The SAELens output of a harvest: the cached-activations folder ``CacheActivationsRunner``
writes, which SAELens trains from with ``use_cached_activations=True`` and
``cached_activations_path=<output>/saelens``.

Its layout is a Hugging Face ``datasets`` folder (``datasets.load_from_disk`` reads it):
``dataset_info.json``, ``state.json`` (with the dataset's fingerprint) and Arrow files
``data-NNNNN-of-MMMMM.arrow``; one row per packed row of ``context_size`` tokens, with one column
per address named by its TransformerLens hook (``blocks.2.hook_resid_post``), typed
``Array2D(shape=(context_size, d_in), dtype)``, and ``token_ids`` typed
``Sequence(Value("int32"), length=context_size)`` -- the columns, dtypes and metadata
``CacheActivationsRunner`` gives its own cache (it writes one hook; SAELens's loader reads the
column of the hook it trains on, so one harvest serves an SAE per address).

Shards are written as SAELens writes them (``Dataset.save_to_disk`` of each, under
``saelens/.tmp_shards/shard_NNNNN``, each renamed into place whole); when the harvest ends they
are moved into the folder and ``state.json`` is written last, so the folder loads only once it
is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

SAELENS_FOLDER = "saelens"
SAELENS_DTYPES = ("float32", "float16")


def _features(columns: Mapping[str, int], context_size: int, dtype: str) -> object:
    from datasets import Array2D, Features, Sequence, Value

    spec: dict[str, object] = {
        name: Array2D(shape=(context_size, width), dtype=dtype) for name, width in columns.items()
    }
    spec["token_ids"] = Sequence(Value(dtype="int32"), length=context_size)
    return Features(spec)


def write_saelens_shard(
    folder: Path, index: int, columns: Mapping[str, np.ndarray], token_ids: np.ndarray, dtype: str
) -> None:
    """One shard: ``columns`` by hook name ``[rows, context_size, width]``, ``token_ids``
    ``[rows, context_size]``; saved under a temporary name, then renamed into place."""
    from datasets import Dataset
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    context_size = token_ids.shape[1]
    features = _features({name: value.shape[2] for name, value in columns.items()}, context_size, dtype)
    data: dict[str, object] = {name: value for name, value in columns.items()}
    data["token_ids"] = token_ids.astype(np.int32)
    shards = folder / SAELENS_FOLDER / ".tmp_shards"
    shards.mkdir(parents=True, exist_ok=True)
    final = shards / f"shard_{index:05d}"
    partial = shards / f"shard_{index:05d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    quiet = not are_progress_bars_disabled()
    if quiet:  # datasets' own bar per shard would interleave with the harvest's
        disable_progress_bars()
    try:
        Dataset.from_dict(data, features=features).save_to_disk(str(partial), num_shards=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        if quiet:
            enable_progress_bars()


def finish_saelens(folder: Path, n_shards: int) -> None:
    """Move the shards' Arrow files into ``saelens/`` and write its ``state.json`` (last): safe to
    run again after a kill part way."""
    from datasets import Dataset
    from datasets.fingerprint import generate_fingerprint

    root = folder / SAELENS_FOLDER
    shards = root / ".tmp_shards"
    if (root / "state.json").exists() and not shards.exists():
        return
    if n_shards == 0:
        raise ValueError("no shard to finish")
    first = shards / "shard_00000"
    if (first / "dataset_info.json").exists():
        shutil.copy2(first / "dataset_info.json", root / "dataset_info.json")
    files = []
    for index in range(n_shards):
        name = f"data-{index:05d}-of-{n_shards:05d}.arrow"
        source = shards / f"shard_{index:05d}"
        if not (root / name).exists():  # not moved before a kill part way
            state = json.loads((source / "state.json").read_text())
            (arrow,) = [entry["filename"] for entry in state["_data_files"]]
            os.replace(source / arrow, root / name)
        files.append({"filename": name})
    state = {
        "_data_files": files,
        "_fingerprint": None,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    partial = root / ".state.json.partial"
    partial.write_text(json.dumps(state, indent=2))
    os.replace(partial, root / "state.json")
    state["_fingerprint"] = generate_fingerprint(Dataset.load_from_disk(str(root)))
    partial.write_text(json.dumps(state, indent=2))
    os.replace(partial, root / "state.json")
    shutil.rmtree(shards)
