"""SAELens's on-disk format of sparse dictionaries (SAEs, transcoders) and probes.

An SAE folder is what SAELens's ``save_model`` writes: ``cfg.json`` and ``sae_weights.safetensors``
(``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_out]``, ``b_dec``, plus ``threshold`` for
JumpReLU kinds and ``W_skip [d_out, d_in]`` for skip transcoders). This module reads such a folder
(:func:`read_folder`) without SAELens installed, turns a cfg of any SAELens version into the
arguments of :class:`~interp_engine.Sae` (:func:`sae_arguments`), brings a cfg's fields up to date
from an SAE (:func:`synced_cfg`) and writes the folder back (:func:`write_folder`), plus the
one-buffer form SAEs travel in to worker processes (:func:`to_bytes`, :func:`read_bytes`).
It knows the architectures' names, not their maths (``_sae``).
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import struct
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from safetensors.torch import load as _load_bytes
from safetensors.torch import load_file, save

from .._errors import UnsupportedSae
from .._shipped import resolve_sae

ARCHITECTURES: tuple[str, ...] = (
    "standard",
    "jumprelu",
    "topk",
    "transcoder",
    "jumprelu_transcoder",
    "skip_transcoder",
    "jumprelu_skip_transcoder",
    "probe",
)
"""The architectures :class:`Sae` implements (SAELens's names, and ``probe``)."""

NORMALIZATIONS: tuple[str, ...] = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
"""The ``normalize_activations`` modes served, each as SAELens applies it at inference."""

PROBE_ACTIVATIONS: tuple[str, ...] = ("relu", "sigmoid", "tanh")
"""A probe's optional activation (``None``: the bare projection)."""

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
SCALER_FILENAME = "activation_scaler.json"

TRANSCODERS = frozenset({"transcoder", "jumprelu_transcoder", "skip_transcoder", "jumprelu_skip_transcoder"})
JUMPRELU = frozenset({"jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder"})
SKIP = frozenset({"skip_transcoder", "jumprelu_skip_transcoder"})

_WHY_NOT: dict[str, str] = {
    "gated": "its gated encoder (r_mag, b_gate, b_mag) is not implemented",
    "abstopk": "its absolute-value top-k is not implemented",
    "batchtopk": "it is a SAELens training architecture; SAELens saves it for inference as 'jumprelu' "
    "(TrainingSAE.save_inference_model), which is read",
    "matryoshka_batchtopk": "it is a SAELens training architecture; SAELens saves it for inference as "
    "'jumprelu' (TrainingSAE.save_inference_model), which is read",
    "temporal": "its attention over earlier positions is not implemented",
    "matching_pursuit": "its iterative matching-pursuit encoder is not implemented",
}
"""SAELens architectures that are not read, and why."""

NORM_WHY_NOT: dict[str, str] = {
    "covariance_whitening": "SAELens folds the whitening into the weights when training ends "
    "(SAE.fold_activation_whitening); this checkpoint was saved before that and expects whitened inputs",
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_CFG_LAYOUT_VERSION = "6.0.0"
"""The SAELens version written into a new cfg's metadata: the cfg layout it follows (SAELens reads a
cfg without a version as a pre-6 one)."""

_OTHER_FORMATS: dict[str, str] = {
    "sae.safetensors": "EleutherAI sparsify's format",
    "params.npz": "Gemma Scope's raw npz format",
}


def unsupported_architecture(architecture: object) -> UnsupportedSae:
    why = _WHY_NOT.get(architecture, "it is not a known SAELens architecture") if isinstance(architecture, str) else ""
    return UnsupportedSae(
        f"SAE architecture {architecture!r} is not supported ({why or 'it is not a string'}); "
        f"supported architectures: {', '.join(ARCHITECTURES)}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise UnsupportedSae(f"SAE tensors must be float32, float64, float16 or bfloat16 (SAELens's dtypes), got {dtype}")


class SaeFields(Protocol):
    """The fields of an SAE that its cfg.json records, as :func:`synced_cfg` reads them;
    :class:`~interp_engine.Sae` declares them by subclassing this."""

    architecture: str
    W_enc: torch.Tensor
    k: int | None
    hook_name: str
    hook_name_out: str | None
    apply_b_dec_to_input: bool
    normalize_activations: str
    norm_scaling_factor: float | None
    rescale_acts_by_decoder_norm: bool
    reshape_activations: str
    activation: str | None

    @property
    def d_in(self) -> int: ...

    @property
    def d_sae(self) -> int: ...

    @property
    def d_out(self) -> int: ...

    @property
    def is_transcoder(self) -> bool: ...


def synced_cfg(sae: SaeFields, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """``given`` (a copy) with the fields SAELens reads set from ``sae``; a new cfg in SAELens 6's
    layout when none is given."""
    cfg: dict[str, Any] = copy.deepcopy(dict(given)) if given is not None else {}
    if sae.architecture == "probe":
        cfg.update(architecture="probe", hook_name=sae.hook_name, d_in=sae.d_in, d_sae=sae.d_sae)
        cfg["activation"] = sae.activation
        return cfg
    cfg["d_in"] = sae.d_in
    cfg["d_sae"] = sae.d_sae
    cfg["dtype"] = dtype_name(sae.W_enc.dtype)
    cfg.setdefault("device", "cpu")
    cfg["apply_b_dec_to_input"] = sae.apply_b_dec_to_input
    cfg["normalize_activations"] = sae.normalize_activations
    if sae.norm_scaling_factor is not None:
        cfg["norm_scaling_factor"] = sae.norm_scaling_factor
    cfg["reshape_activations"] = sae.reshape_activations
    raw_metadata = cfg.get("metadata")
    metadata: dict[str, Any] = raw_metadata if isinstance(raw_metadata, dict) else {}
    legacy = any(key in cfg for key in ("sae_lens_version", "hook_name", "hook_point"))
    if not legacy and "sae_lens_version" not in metadata:
        # mark the layout, or SAELens would read this cfg as a pre-6 one (and drop its metadata)
        cfg["metadata"] = {"sae_lens_version": _CFG_LAYOUT_VERSION, **metadata}
    _place(cfg, "hook_name", sae.hook_name, ("hook_name", "hook_point"))
    if sae.hook_name_out is not None:
        _place(cfg, "hook_name_out", sae.hook_name_out, ("hook_name_out",))
    cfg["architecture"] = sae.architecture
    if sae.k is not None:
        cfg["k"] = sae.k
        kwargs = cfg.get("activation_fn_kwargs")
        if isinstance(kwargs, dict) and "k" in kwargs:
            kwargs["k"] = sae.k
        cfg["rescale_acts_by_decoder_norm"] = sae.rescale_acts_by_decoder_norm
    if sae.is_transcoder:
        cfg["d_out"] = sae.d_out
    return cfg


def _place(cfg: dict[str, Any], key: str, value: str, legacy: tuple[str, ...]) -> None:
    """Set a hook name where this cfg keeps it: ``metadata.<key>`` (SAELens 6), an older top-level
    key, or (neither present) ``metadata.<key>``."""
    metadata = cfg.get("metadata")
    if isinstance(metadata, dict) and key in metadata:
        metadata[key] = value
        return
    for name in legacy:
        if name in cfg:
            cfg[name] = value
            return
    if not isinstance(metadata, dict):
        metadata = cfg["metadata"] = {}
    metadata[key] = value


def _is_pre_6(cfg: Mapping[str, Any], metadata: Mapping[str, Any]) -> bool:
    """Whether SAELens reads this cfg as one written before 6.0 (no version, or an older one)."""
    version = cfg.get("sae_lens_version") or metadata.get("sae_lens_version")
    match = re.match(r"\s*(\d+)", version) if isinstance(version, str) else None
    return match is None or int(match.group(1)) < 6


def sae_arguments(cfg: object, tensors: dict[str, torch.Tensor], *, scaler_factor: object = None) -> dict[str, Any]:
    """The arguments of ``Sae(...)`` for the SAE a cfg.json and its tensors describe, read as
    SAELens 6 reads them (pre-6 cfgs included); a probe's when ``architecture`` is ``"probe"``."""
    if not isinstance(cfg, dict):
        raise UnsupportedSae(f"{CFG_FILENAME} must hold a JSON object, got {type(cfg).__name__}")
    raw_metadata = cfg.get("metadata")
    metadata: dict[str, Any] = raw_metadata if isinstance(raw_metadata, dict) else {}
    pre_6 = _is_pre_6(cfg, metadata)
    arch = cfg.get("architecture", "standard")
    raw_kwargs = cfg.get("activation_fn_kwargs")
    activation_kwargs: dict[str, Any] = raw_kwargs if isinstance(raw_kwargs, dict) else {}
    activation_fn = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    if pre_6 and activation_fn == "topk" and activation_kwargs.get("k") is not None:
        arch = "topk"
    if arch not in ARCHITECTURES:
        raise unsupported_architecture(arch)
    hook_name = metadata.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if not isinstance(hook_name, str):
        raise UnsupportedSae(
            f"{CFG_FILENAME} names no hook (metadata.hook_name in SAELens 6, hook_name or hook_point before): "
            "interp-engine needs it to know where the SAE reads"
        )
    if arch == "probe":
        _expect_tensors(tensors, {"W_enc", "b_enc"}, arch)
        return {
            "architecture": "probe",
            "W_enc": tensors["W_enc"],
            "b_enc": tensors["b_enc"],
            "W_dec": None,
            "b_dec": None,
            "hook_name": hook_name,
            "cfg": cfg,
            "activation": cfg.get("activation"),
        }

    head_index = metadata.get("hook_head_index", cfg.get("hook_head_index"))
    if head_index is not None:
        raise UnsupportedSae(
            f"this SAE reads one attention head ({hook_name} head {head_index}); per-head SAEs are not supported"
        )
    dtype_name = cfg.get("dtype", "float32")
    dtype = DTYPES.get(dtype_name.removeprefix("torch.")) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise UnsupportedSae(f"unknown SAE dtype {dtype_name!r}; SAELens's dtypes: {', '.join(DTYPES)}")
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    if "log_threshold" in tensors and "threshold" not in tensors:  # older JumpReLU checkpoints
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
    if "scaling_factor" in tensors:  # a finetuning scale SAELens <6 wrote; all ones means none
        scale = tensors.pop("scaling_factor")
        if not torch.allclose(scale, torch.ones_like(scale)):
            raise UnsupportedSae("this SAE has a finetuning scaling_factor (SAELens < 6), which is not supported")
    expected = {"W_enc", "b_enc", "W_dec", "b_dec"}
    expected |= {"threshold"} if arch in JUMPRELU else set()
    expected |= {"W_skip"} if arch in SKIP else set()
    _expect_tensors(tensors, expected, arch)

    for field, width in (("d_in", 0), ("d_sae", 1)):
        if field in cfg and cfg[field] != tensors["W_enc"].shape[width]:
            raise UnsupportedSae(
                f"{CFG_FILENAME} says {field}={cfg[field]!r} but W_enc has shape {list(tensors['W_enc'].shape)}"
            )
    transcoder = arch in TRANSCODERS
    if transcoder and "d_out" in cfg and cfg["d_out"] != tensors["W_dec"].shape[-1]:
        raise UnsupportedSae(
            f"{CFG_FILENAME} says d_out={cfg['d_out']!r} but W_dec has shape {list(tensors['W_dec'].shape)}"
        )

    normalize = cfg.get("normalize_activations")
    if isinstance(normalize, bool):  # SAELens < 6
        normalize = "expected_average_only_in" if normalize else "none"
    normalize = "none" if normalize is None else normalize
    factor = cfg.get("norm_scaling_factor")
    if normalize == "expected_average_only_in" and factor is None:
        factor = scaler_factor
    reshape = cfg.get("reshape_activations")
    if reshape is None:
        reshape = "hook_z" if pre_6 and isinstance(hook_name, str) and "hook_z" in hook_name else "none"
    k = None
    if arch == "topk":
        k = activation_kwargs.get("k") if pre_6 and activation_kwargs.get("k") is not None else cfg.get("k")
        if isinstance(k, float) and k.is_integer():
            k = int(k)
    return {
        "architecture": arch,
        "W_enc": tensors["W_enc"],
        "b_enc": tensors["b_enc"],
        "W_dec": tensors["W_dec"],
        "b_dec": tensors["b_dec"],
        "hook_name": hook_name,
        "threshold": tensors.get("threshold"),
        "k": k,
        "W_skip": tensors.get("W_skip"),
        "hook_name_out": (metadata.get("hook_name_out") or cfg.get("hook_name_out")) if transcoder else None,
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", not transcoder)),
        "normalize_activations": normalize,
        "cfg": cfg,
        "rescale_acts_by_decoder_norm": arch == "topk" and bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "norm_scaling_factor": factor if normalize == "expected_average_only_in" else None,
        "reshape_activations": reshape,
    }


def _expect_tensors(tensors: Mapping[str, torch.Tensor], expected: set[str], arch: str) -> None:
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise UnsupportedSae(
            f"a {arch!r} SAE's {WEIGHTS_FILENAME} holds {', '.join(sorted(expected))}; "
            f"this one is missing {missing or 'nothing'} and has unexpected {extra or 'nothing'}"
        )


def read_folder(
    source: str | os.PathLike[str], device: str | torch.device | None
) -> tuple[object, dict[str, torch.Tensor], object]:
    """The cfg.json, the tensors (on ``device``, default CPU) and the ``activation_scaler.json``
    factor (or None) of an SAE folder, a shipped SAE's name, or a path to either file in one."""
    path = pathlib.Path(resolve_sae(source))  # a shipped name ("interp:tiny-sae") is its folder
    if path.is_file() and path.name in (CFG_FILENAME, WEIGHTS_FILENAME):
        path = path.parent
    wanted = f"a folder with {CFG_FILENAME} and {WEIGHTS_FILENAME} (SAELens's save_model format)"
    if not path.is_dir():
        raise UnsupportedSae(f"no SAE folder at {str(path)!r}: load_sae reads {wanted}")
    missing = [name for name in (CFG_FILENAME, WEIGHTS_FILENAME) if not (path / name).is_file()]
    if missing:
        hints = [f"{name} looks like {what}" for name, what in _OTHER_FORMATS.items() if (path / name).exists()]
        hint = f" ({'; '.join(hints)}: convert it with SAELens and save_model)" if hints else ""
        raise UnsupportedSae(f"{str(path)!r} has no {' or '.join(missing)}: load_sae reads {wanted}{hint}")
    try:
        cfg = json.loads((path / CFG_FILENAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnsupportedSae(f"cannot read {path / CFG_FILENAME}: {exc}") from None
    try:
        tensors = load_file(str(path / WEIGHTS_FILENAME), device=str(torch.device(device or "cpu")))
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, RuntimeError
        raise UnsupportedSae(f"cannot read {path / WEIGHTS_FILENAME}: {exc}") from None
    return cfg, tensors, _scaler_factor(path)


def _scaler_factor(path: pathlib.Path) -> object:
    """The scaling factor of a SAELens checkpoint's ``activation_scaler.json``, if there is one."""
    scaler = path / SCALER_FILENAME
    if not scaler.is_file():
        return None
    try:
        data = json.loads(scaler.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnsupportedSae(f"cannot read {scaler}: {exc}") from None
    return data.get("scaling_factor") if isinstance(data, dict) else None


def write_folder(folder: str | os.PathLike[str], tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any]) -> None:
    """Write ``cfg.json`` and ``sae_weights.safetensors`` into ``folder`` (created if needed)."""
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    # bytes written like any file (safetensors' save_file leaves it readable by its owner only)
    (path / WEIGHTS_FILENAME).write_bytes(save(tensors))
    (path / CFG_FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")


def to_bytes(tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any]) -> bytes:
    """The tensors as safetensors bytes with ``cfg`` in the header's metadata."""
    return save(tensors, metadata={"cfg": json.dumps(cfg)})


def read_bytes(data: bytes) -> tuple[object, dict[str, torch.Tensor]]:
    """The cfg and tensors :func:`to_bytes` wrote."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        cfg = json.loads(metadata["cfg"])
        tensors = _load_bytes(data)
    except Exception as exc:  # struct, JSON and safetensors errors alike
        raise UnsupportedSae(f"these bytes are not an SAE written by Sae.to_bytes: {exc}") from None
    return cfg, tensors
