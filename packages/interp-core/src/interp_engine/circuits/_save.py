"""Writing transcoders in circuit-tracer's and SAELens's layouts (``_formats`` reads them)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save

from .._errors import UnsupportedSae

if TYPE_CHECKING:
    from ._transcoders import CrossLayerTranscoder, TranscoderSet

CONFIG = "config.yaml"
OUTPUT_KIND = "mlp_out"
_TL_HOOKS = {"mlp_in": "mlp.hook_in", "resid_mid": "hook_resid_mid", "mlp_out": "hook_mlp_out"}


def _write_config(folder: pathlib.Path, kind: str, input_kind: str) -> None:
    lines = [
        f"model_kind: {kind}",
        f"feature_input_hook: {_TL_HOOKS[input_kind]}",
        f"feature_output_hook: {_TL_HOOKS[OUTPUT_KIND]}",
    ]
    (folder / CONFIG).write_text("\n".join(lines) + "\n")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def save_plt_circuit_tracer(tcs: TranscoderSet, folder: str | os.PathLike[str]) -> None:
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    if tcs.layers != tuple(range(len(tcs.layers))):
        raise UnsupportedSae(
            f"circuit-tracer's transcoder sets cover layers 0..n-1; this one covers {list(tcs.layers)}: "
            "save it with format='saelens'"
        )
    for layer, sae in tcs.transcoders.items():
        if sae.normalize_activations != "none":
            raise UnsupportedSae(
                f"circuit-tracer's format has no input normalisation; layer {layer}'s transcoder has one"
            )
        if sae.W_dec is None or sae.b_dec is None:  # pragma: no cover - a transcoder has a decoder
            raise UnsupportedSae(f"layer {layer}'s transcoder has no decoder")
        tensors = {
            "W_enc": _cpu(sae.W_enc.T),
            "W_dec": _cpu(sae.W_dec),
            "b_enc": _cpu(sae.b_enc),
            "b_dec": _cpu(sae.b_dec),
        }
        if sae.threshold is not None:
            tensors["activation_function.threshold"] = _cpu(sae.threshold)
        if sae.W_skip is not None:
            tensors["W_skip"] = _cpu(sae.W_skip)
        (path / f"layer_{layer}.safetensors").write_bytes(save(tensors))
    _write_config(path, "transcoder_set", tcs.input_kind)


def save_plt_saelens(tcs: TranscoderSet, folder: str | os.PathLike[str]) -> None:
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for layer, sae in tcs.transcoders.items():
        sae.save(path / f"layer_{layer:03d}")
    (path / "replacement.json").write_text(json.dumps({"layers": list(tcs.layers), "names": tcs.names}) + "\n")


def save_clt_circuit_tracer(clt: CrossLayerTranscoder, folder: str | os.PathLike[str]) -> None:
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for layer in clt.layers:
        enc = {
            f"W_enc_{layer}": _cpu(clt.W_enc[layer].T),
            f"b_enc_{layer}": _cpu(clt.b_enc[layer]),
            f"b_dec_{layer}": _cpu(clt.b_dec[layer]),
        }
        if clt.threshold is not None:
            enc[f"threshold_{layer}"] = _cpu(clt.threshold[layer])
        (path / f"W_enc_{layer}.safetensors").write_bytes(save(enc))
        (path / f"W_dec_{layer}.safetensors").write_bytes(save({f"W_dec_{layer}": _cpu(clt.W_dec[layer])}))
    _write_config(path, "cross_layer_transcoder", clt.input_kind)
