"""The on-disk formats of transcoders that replace MLPs.

- circuit-tracer's per-layer set: a folder of ``layer_L.safetensors`` (``W_enc [d_sae, d_in]``,
  ``W_dec [d_sae, d_out]``, ``b_enc``, ``b_dec``, optionally ``activation_function.threshold``
  (JumpReLU) and ``W_skip [d_out, d_in]``), usually beside a ``config.yaml`` with
  ``model_kind: transcoder_set`` and the TransformerLens hook names the features read and write
  (``feature_input_hook``, ``feature_output_hook``, relative to ``blocks.L``);
- circuit-tracer's cross-layer transcoder: ``W_enc_L.safetensors`` (``W_enc_L [d_sae, d_in]``,
  ``b_enc_L``, ``b_dec_L``, optionally ``threshold_L``) and ``W_dec_L.safetensors`` (``W_dec_L
  [d_sae, n_layers - L, d_out]``) per layer, ``model_kind: cross_layer_transcoder``;
- SAELens: one SAELens transcoder folder (``cfg.json`` + ``sae_weights.safetensors``) per layer,
  in subfolders. SAELens has no cross-layer format of its own (it reads one layer of a CLT as a
  single-layer transcoder by summing its decoders, which does not reconstruct the MLPs).

``config.yaml`` is read and written as the flat ``key: value`` lines circuit-tracer's configs use
(no YAML library needed); an absent one means circuit-tracer's defaults for the hooks.
"""

from __future__ import annotations

import os
import pathlib
import re

import torch
from safetensors.torch import load_file

from .._errors import InvalidAddress, UnsupportedSae
from ..addresses._address import as_address
from ..sae._format import CFG_FILENAME
from ..sae._sae import Sae, load_sae
from ._save import CONFIG
from ._transcoders import INPUT_KINDS, OUTPUT_KIND, CrossLayerTranscoder, TranscoderSet

_DEFAULT_HOOKS = {
    "transcoder_set": ("mlp.hook_in", "hook_mlp_out"),
    "cross_layer_transcoder": ("hook_resid_mid", "hook_mlp_out"),
}
_LAYER_FILE = re.compile(r"^layer_(\d+)\.safetensors$")
_ENC_FILE = re.compile(r"^W_enc_(\d+)\.safetensors$")


def _read_config(path: pathlib.Path) -> dict[str, str]:
    config = path / CONFIG
    if not config.is_file():
        return {}
    out: dict[str, str] = {}
    for line in config.read_text().splitlines():
        match = re.match(r"^([A-Za-z_][\w]*)\s*:\s*(.*?)\s*$", line)
        if match and match.group(2):
            out[match.group(1)] = match.group(2).strip("'\"")
    return out


_MLP_HOOKS = {"mlp.hook_in": "mlp_in", "mlp.hook_out": "mlp_out"}
"""TransformerLens's hooks on the MLP module's own input and output (what the MLP receives and
returns), which the address vocabulary knows as ``mlp_in`` (``ln2.hook_normalized``) and ``mlp_out``."""


def _kind_of(hook: str, role: str, allowed: tuple[str, ...]) -> str:
    if hook in _MLP_HOOKS and _MLP_HOOKS[hook] in allowed:
        return _MLP_HOOKS[hook]
    try:
        address = as_address(f"blocks.0.{hook}")
    except InvalidAddress as exc:
        raise UnsupportedSae(
            f"the {role} hook {hook!r} of this transcoder is not a point interp-engine serves: {exc}"
        ) from None
    if address.kind not in allowed:
        raise UnsupportedSae(
            f"the {role} hook {hook!r} is {address.kind}; a transcoder replacing MLPs reads "
            f"{' or '.join(INPUT_KINDS)} and writes {OUTPUT_KIND}"
        )
    return address.kind


def _safetensors(path: pathlib.Path, device: str | torch.device | None) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(torch.device(device or "cpu")))
    except Exception as exc:  # safetensors raises its own error types
        raise UnsupportedSae(f"cannot read {path}: {exc}") from None


def _numbered(path: pathlib.Path, pattern: re.Pattern[str]) -> dict[int, pathlib.Path]:
    found = {int(m.group(1)): p for p in path.iterdir() if (m := pattern.match(p.name))}
    if found and sorted(found) != list(range(len(found))):
        raise UnsupportedSae(
            f"{path} holds {pattern.pattern} files for layers {sorted(found)}: expected 0..{len(found) - 1}"
        )
    return found


SHIPPED: dict[str, pathlib.Path] = {
    "interp:tiny-transcoders": pathlib.Path(__file__).resolve().parent.parent / "models" / "tiny-transcoders"
}
"""The transcoder sets that ship with interp-core, by name: ``interp:tiny-transcoders``, one ReLU
transcoder per layer of ``interp:tiny`` (``mlp_in.L -> mlp_out.L``, 512 features each), trained by
``packages/interp-core/scripts/train_tiny_transcoders.py`` (``transcoders.json`` beside the weights
records their held-out figures)."""


def resolve_transcoders(source: str | os.PathLike[str]) -> str:
    """``source`` as a folder: a shipped set's name becomes its folder (``UnsupportedSae`` for an
    ``interp:`` name that is not shipped)."""
    name = os.fspath(source)
    if not name.startswith("interp:"):
        return name
    path = SHIPPED.get(name)
    if path is None or not (path / CONFIG).is_file():
        raise UnsupportedSae(f"no transcoder set named {name!r} ships with interp-core; shipped: {', '.join(SHIPPED)}")
    return os.fspath(path)


def load_transcoders(
    source: str | os.PathLike[str], *, device: str | torch.device | None = None
) -> TranscoderSet | CrossLayerTranscoder:
    """Transcoders that replace the MLPs, from ``source``: a folder in circuit-tracer's layout (a
    per-layer set of ``layer_L.safetensors``, or a CLT's ``W_enc_L``/``W_dec_L`` files, with or
    without its ``config.yaml``), or a folder of SAELens transcoder folders (one per layer), or the
    name of a shipped set (``"interp:tiny-transcoders"``). Tensors load onto ``device``
    (default CPU) in the dtype they were saved in."""
    path = pathlib.Path(resolve_transcoders(source))
    if not path.is_dir():
        raise UnsupportedSae(f"no transcoder folder at {str(path)!r}")
    config = _read_config(path)
    kind = config.get("model_kind")
    encoders = _numbered(path, _ENC_FILE)
    layers = _numbered(path, _LAYER_FILE)
    if kind == "cross_layer_transcoder" or (kind is None and encoders):
        return _load_clt(path, config, encoders, device)
    if kind == "transcoder_set" or (kind is None and layers):
        return _load_plt(path, config, layers, device)
    subfolders = sorted(p for p in path.iterdir() if p.is_dir() and (p / CFG_FILENAME).is_file())
    if kind is None and subfolders:
        return TranscoderSet([load_sae(p, device=device) for p in subfolders])
    raise UnsupportedSae(
        f"{str(path)!r} is not a transcoder folder: load_transcoders reads circuit-tracer's layouts "
        "(layer_L.safetensors, or W_enc_L/W_dec_L.safetensors, beside an optional config.yaml) or a folder "
        "of SAELens transcoder folders" + (f" (config.yaml says model_kind: {kind})" if kind else "")
    )


def _load_plt(
    path: pathlib.Path, config: dict[str, str], files: dict[int, pathlib.Path], device: str | torch.device | None
) -> TranscoderSet:
    if not files:
        raise UnsupportedSae(f"{path} has no layer_L.safetensors files")
    hook_in, hook_out = _DEFAULT_HOOKS["transcoder_set"]
    in_kind = _kind_of(config.get("feature_input_hook", hook_in), "input", INPUT_KINDS)
    _kind_of(config.get("feature_output_hook", hook_out), "output", (OUTPUT_KIND,))
    saes = []
    for layer, file in sorted(files.items()):
        t = _safetensors(file, device)
        missing = sorted({"W_enc", "W_dec", "b_enc", "b_dec"} - set(t))
        if missing:
            raise UnsupportedSae(f"{file} lacks {', '.join(missing)}: not a circuit-tracer transcoder")
        threshold = t.get("activation_function.threshold")
        skip = t.get("W_skip")
        arch = ("jumprelu_" if threshold is not None else "") + (
            "skip_transcoder" if skip is not None else "transcoder"
        )
        saes.append(
            Sae(
                arch,
                t["W_enc"].T.contiguous(),
                t["b_enc"],
                t["W_dec"],
                t["b_dec"],
                f"{in_kind}.{layer}",
                threshold=None if threshold is None else threshold.reshape(-1),
                W_skip=skip,
                hook_name_out=f"{OUTPUT_KIND}.{layer}",
            )
        )
    return TranscoderSet(saes)


def _load_clt(
    path: pathlib.Path, config: dict[str, str], files: dict[int, pathlib.Path], device: str | torch.device | None
) -> CrossLayerTranscoder:
    if not files:
        raise UnsupportedSae(f"{path} has no W_enc_L.safetensors files")
    hook_in, hook_out = _DEFAULT_HOOKS["cross_layer_transcoder"]
    in_kind = _kind_of(config.get("feature_input_hook", hook_in), "input", INPUT_KINDS)
    _kind_of(config.get("feature_output_hook", hook_out), "output", (OUTPUT_KIND,))
    W_enc, b_enc, b_dec, thresholds, W_dec = [], [], [], [], []
    for layer in range(len(files)):
        enc = _safetensors(files[layer], device)
        dec_file = path / f"W_dec_{layer}.safetensors"
        if not dec_file.is_file():
            raise UnsupportedSae(f"{path} has W_enc_{layer}.safetensors but no W_dec_{layer}.safetensors")
        dec = _safetensors(dec_file, device)
        needed = [f"W_enc_{layer}", f"b_enc_{layer}", f"b_dec_{layer}"]
        missing = [k for k in needed if k not in enc] + ([f"W_dec_{layer}"] if f"W_dec_{layer}" not in dec else [])
        if missing:
            raise UnsupportedSae(f"{path} layer {layer} lacks {', '.join(missing)}: not a circuit-tracer CLT")
        W_enc.append(enc[f"W_enc_{layer}"].T)
        b_enc.append(enc[f"b_enc_{layer}"])
        b_dec.append(enc[f"b_dec_{layer}"])
        thresholds.append(enc.get(f"threshold_{layer}"))
        W_dec.append(dec[f"W_dec_{layer}"])
    have = [t is not None for t in thresholds]
    if any(have) and not all(have):
        raise UnsupportedSae(f"{path}: some layers of this CLT have JumpReLU thresholds and some do not")
    threshold = torch.stack([t.reshape(-1) for t in thresholds if t is not None]) if all(have) else None
    return CrossLayerTranscoder(
        torch.stack(W_enc), torch.stack(b_enc), W_dec, torch.stack(b_dec), threshold, input_kind=in_kind
    )
