"""A LoRA adapter folder as PEFT saves it, read and checked against a model before any compute.

An adapter folder holds ``adapter_config.json`` (``peft_type`` ``LORA``, ``r``, ``lora_alpha``,
``target_modules``) and ``adapter_model.safetensors`` (per adapted module, ``lora_A.weight [r,
in]`` and ``lora_B.weight [out, r]``). :func:`check_adapter` reads the config and the safetensors
header (the shapes only: no tensor is loaded, no torch imported) and refuses, with
``InvalidAdapter``, a folder that is not one, an adapter whose layers or widths are another
model's, or one whose rank is over the backend's limit (vLLM's ``max_lora_rank``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import InvalidAdapter, UnsupportedOperation
from .._shipped import resolve_adapter

if TYPE_CHECKING:
    from ..protocol._protocol import ModelInfo

CONFIG_FILENAME = "adapter_config.json"
WEIGHTS_FILENAME = "adapter_model.safetensors"
BASE = "__base__"
"""Not an adapter name: PEFT's own name of the base model in a mixed batch."""

_LAYER = re.compile(r"\.(?:layers|h|layer|blocks|block)\.(\d+)\.")
_LORA = re.compile(
    r"^(?P<module>.+)\.lora_(?P<part>A|B|embedding_A|embedding_B)(?:\.[^.]+)?\.weight$"
    r"|^(?P<module2>.+)\.lora_(?P<part2>embedding_A|embedding_B)$"
)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter registered on a model under ``name`` (``model.adapters[name]``)."""

    name: str
    path: str
    """The adapter's folder (``adapter_config.json``, ``adapter_model.safetensors``)."""
    rank: int
    """The largest LoRA rank of its modules."""
    alpha: float
    targets: tuple[str, ...]
    """The names of the modules it adapts (``("q_proj", "o_proj")``), as its weights name them."""
    layers: tuple[int, ...]
    """The decoder layers with an adapted module."""
    base_model: str | None = None
    """The base model its config names (informational: local paths differ between machines)."""


def read_adapter_folder(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """``(config, {weight name: shape})`` of an adapter folder; ``InvalidAdapter`` if it is none."""
    folder = pathlib.Path(path)
    config_file, weights_file = folder / CONFIG_FILENAME, folder / WEIGHTS_FILENAME
    if not config_file.is_file():
        raise InvalidAdapter(
            f"{os.fspath(path)!r} is not a PEFT adapter folder (no {CONFIG_FILENAME})", name=os.fspath(path)
        )
    if not weights_file.is_file():
        legacy = " (it has adapter_model.bin: save it again with safe_serialization=True)"
        raise InvalidAdapter(
            f"the adapter in {os.fspath(path)!r} has no {WEIGHTS_FILENAME}"
            + (legacy if (folder / "adapter_model.bin").is_file() else ""),
            name=os.fspath(path),
        )
    try:
        config = json.loads(config_file.read_text())
        with weights_file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"a safetensors header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidAdapter(f"cannot read the adapter in {os.fspath(path)!r}: {exc}", name=os.fspath(path)) from exc
    if not isinstance(config, dict) or not isinstance(header, dict):
        raise InvalidAdapter(f"the adapter in {os.fspath(path)!r} is malformed", name=os.fspath(path))
    shapes = {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__" and isinstance(v, Mapping)}
    return config, shapes


def model_widths(info: ModelInfo) -> set[int]:
    """The widths a linear layer of this model reads or writes (a LoRA's ``in`` and ``out``)."""
    q, kv = info.n_heads * info.d_head, info.n_kv_heads * info.d_head
    return {
        info.d_model,
        info.d_mlp,
        2 * info.d_mlp,
        q,
        kv,
        q + 2 * kv,
        2 * kv,
        3 * info.d_model,
        info.vocab_size,
    }


def check_adapter(name: str, path: str | os.PathLike[str], info: ModelInfo, *, max_rank: int | None = None) -> Adapter:
    """The adapter in ``path`` (a folder, or a shipped name such as ``interp:tiny-lora``) checked
    against a model of ``info``, to be registered under ``name``."""
    folder = resolve_adapter(path)
    config, shapes = read_adapter_folder(folder)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(
            f"adapter {name!r} is a {peft_type or 'untyped'} adapter; only LoRA adapters are served",
            name=name,
            valid=("LORA",),
        )
    if config.get("use_dora"):
        raise InvalidAdapter(f"adapter {name!r} is a DoRA adapter; only plain LoRA is served", name=name)
    widths = model_widths(info)
    ranks: list[int] = []
    targets: dict[str, None] = {}
    layers: set[int] = set()
    for key, shape in shapes.items():
        match = _LORA.match(key)
        if match is None:
            continue
        module = match.group("module") or match.group("module2")
        part = match.group("part") or match.group("part2")
        targets[module.rsplit(".", 1)[-1]] = None
        found = _LAYER.search(key)
        if found is not None:
            layers.add(int(found.group(1)))
        if len(shape) != 2:
            raise InvalidAdapter(f"adapter {name!r}: {key} has shape {shape}, not a matrix", name=name)
        rank, width = (shape[0], shape[1]) if part in ("A", "embedding_A") else (shape[1], shape[0])
        ranks.append(rank)
        if width not in widths:
            raise InvalidAdapter(
                f"adapter {name!r} was made for another model: {key} has shape {shape}, and no layer of this "
                f"{info.architecture} model (d_model {info.d_model}, d_mlp {info.d_mlp}, {info.n_heads} heads of "
                f"{info.d_head}, vocabulary {info.vocab_size}) reads or writes width {width}",
                name=name,
            )
    if not ranks:
        raise InvalidAdapter(f"adapter {name!r} in {folder!r} holds no LoRA weights", name=name)
    too_deep = sorted(layer for layer in layers if layer >= info.n_layers)
    if too_deep:
        raise InvalidAdapter(
            f"adapter {name!r} was made for another model: it adapts layer {too_deep[0]}, and this model has "
            f"{info.n_layers} layers",
            name=name,
        )
    rank = max(ranks)
    if max_rank is not None and rank > max_rank:
        raise InvalidAdapter(
            f"adapter {name!r} has rank {rank}, over this engine's max_lora_rank={max_rank}; load the model with "
            f"max_lora_rank={rank} or more",
            name=name,
            valid=f"rank <= {max_rank}",
        )
    base = config.get("base_model_name_or_path")
    return Adapter(
        name,
        os.fspath(folder),
        rank,
        float(config.get("lora_alpha", rank)),
        tuple(targets),
        tuple(sorted(layers)),
        base if isinstance(base, str) else None,
    )


UNEMBEDDINGS = ("lm_head", "embed_out")
"""The names of the unembedding a LoRA can adapt (GPT-NeoX's: ``embed_out``)."""


def refuse_adapted_unembedding(adapter: Adapter | None, view: str) -> None:
    """``UnsupportedOperation`` naming the adapter when it adapts the unembedding and ``view``
    (what the caller computes) decodes with the base model's ``W_U``, which leaves the LoRA out."""
    adapted = [target for target in (adapter.targets if adapter is not None else ()) if target in UNEMBEDDINGS]
    if adapter is not None and adapted:
        raise UnsupportedOperation(
            f"adapter {adapter.name!r} adapts the unembedding ({', '.join(adapted)}), and {view} reads the base "
            "model's W_U, without the LoRA; merge the adapter into the weights (PEFT's merge_and_unload) and "
            "load that model, or use an adapter that leaves the unembedding as it is"
        )


def is_adapter_folder(path: str) -> bool:
    """Whether ``path`` names an adapter folder (or a shipped adapter) rather than a registered name."""
    if path.startswith("interp:"):
        return True
    return (pathlib.Path(path) / CONFIG_FILENAME).is_file()
