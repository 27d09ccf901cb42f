"""The checks an :class:`~interp_engine.sae._sae.Sae` runs on its parts as it is built: each tensor
floating point and of the shape its architecture gives it, each hook name a point interp-engine
serves, the input normalisation one SAELens applies at run time (with the factor it needs). Each
failure is an ``UnsupportedSae`` naming the field."""

from __future__ import annotations

import math

import torch

from .._errors import InvalidAddress, UnsupportedSae
from ..addresses._address import Address, as_address
from ..addresses._tl_names import TL_MODEL_LEVEL, TL_PER_LAYER, is_tl_name
from ._format import NORM_WHY_NOT, NORMALIZATIONS, SCALER_FILENAME


def hook_address(name: object, field: str) -> Address:
    """Our address for a cfg's hook name, or ``UnsupportedSae`` saying which names are served."""
    if not isinstance(name, str) or not name:
        raise UnsupportedSae(
            f"the SAE names no {field} (a TransformerLens hook name such as 'blocks.3.hook_resid_post')"
        )
    try:
        return as_address(name)
    except InvalidAddress as exc:
        served = (
            ""
            if is_tl_name(name)
            else f"; served hook names: blocks.L.{{{', '.join(TL_PER_LAYER)}}}, {', '.join(TL_MODEL_LEVEL)}"
        )
        raise UnsupportedSae(
            f"the SAE's {field} {name!r} is not a point interp-engine serves: {exc}{served} "
            "(interp-engine addresses such as 'resid_post.3' are read too)"
        ) from None


def float_tensor(value: object, name: str, architecture: str) -> torch.Tensor:
    """``value`` detached, or ``UnsupportedSae`` unless it is a floating-point tensor."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = f"dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UnsupportedSae(f"{name} of a {architecture!r} SAE must be a floating-point tensor, got {kind}")
    return value.detach()


def check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, architecture: str, meaning: str) -> None:
    """``UnsupportedSae`` unless ``tensor`` has ``shape`` (``meaning``: why it must)."""
    if tuple(tensor.shape) != shape:
        raise UnsupportedSae(
            f"{name} of this {architecture!r} SAE has shape {list(tensor.shape)}, expected {list(shape)} ({meaning})"
        )


def check_normalisation(architecture: str, mode: object, factor: float | None) -> None:
    """``UnsupportedSae`` unless ``mode`` is a served SAELens normalisation, with the scaling
    factor it needs (and none it does not)."""
    if not isinstance(mode, str) or mode not in NORMALIZATIONS:
        why = NORM_WHY_NOT.get(mode, "it is not a SAELens mode") if isinstance(mode, str) else "not a string"
        raise UnsupportedSae(
            f"normalize_activations={mode!r} is not supported ({why}); supported: {', '.join(NORMALIZATIONS)}"
        )
    if architecture == "probe" and mode != "none":
        raise UnsupportedSae(f"a probe takes no input normalisation, got normalize_activations={mode!r}")
    if mode == "expected_average_only_in":
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise UnsupportedSae(
                "normalize_activations='expected_average_only_in' scales inputs by a factor SAELens keeps "
                "outside the SAE (it folds it into the weights when it has it); give it as norm_scaling_factor "
                f"(in cfg.json, or the scaling_factor of an {SCALER_FILENAME} beside it); got {factor!r}"
            )
    elif factor is not None:
        raise UnsupportedSae(f"norm_scaling_factor is only for 'expected_average_only_in', not {mode!r}")
