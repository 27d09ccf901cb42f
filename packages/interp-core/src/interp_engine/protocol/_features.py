"""The checks of SAE use in a request: an SAE fits the model, feature readouts apart from
addresses, feature writes made concrete. :class:`~interp_engine.protocol._base.ModelBase` runs them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from .._errors import (
    InvalidAddress,
    InvalidFeatures,
)
from ..addresses._address import Address, is_point_tuple
from ..sae._readouts import Features, as_features
from ..sae._sae import Sae
from ..steering._spec import AnyWrite, FeatureWrite, Write
from ._checks import (
    heads_of,
    requested_points,
    width_of,
)
from ._protocol import ModelInfo


def check_sae_fits(
    name: str,
    sae: Sae,
    info: ModelInfo,
    supported_points: Collection[str],
    check_served: Callable[[Iterable[Address]], None],
) -> None:
    """``InvalidFeatures`` unless ``sae`` reads (and writes) addresses a model with ``info`` serves
    (``check_served`` raises for one it does not), at their widths."""
    for role, address, width in (("reads", sae.address, sae.d_in), ("writes", sae.address_out, sae.d_out)):
        if role == "writes" and not (sae.has_decoder and sae.is_transcoder):
            continue
        resolved = address.resolve(info.n_layers)
        requested_points([resolved], info, supported_points)
        check_served([resolved])
        if address.info.width in ("heads x keys", "vocab"):
            raise InvalidFeatures(
                f"SAE {name!r} {role} {address}: an SAE reads or writes one vector per token "
                "(residual stream, sublayer outputs, MLP activations, heads concatenated), not "
                "attention patterns or logits"
            )
        expected = width_of(resolved, info)
        if address.info.per_head:  # hook_z SAEs: the heads concatenated
            expected *= heads_of(resolved, info)
        if width != expected:
            raise InvalidFeatures(
                f"SAE {name!r} {role} {address} with width {width}, but {address.kind} is {expected} wide "
                f"in this model (d_model {info.d_model}, d_mlp {info.d_mlp}): it was trained on "
                "another model"
            )


def split_points(points: Iterable[Any]) -> tuple[list[Any], tuple[Features, ...]]:
    """Addresses apart from feature readouts (``Features``, ``"features:..."``, ``{"sae": ...}``)."""
    if isinstance(points, (str, Address, Features)) or is_point_tuple(points):
        points = [points]
    try:
        listed = list(points)
    except TypeError:
        raise InvalidAddress(
            f"points must be a list of addresses (Address or strings such as 'resid_post.0') and feature "
            f"readouts, got {type(points).__name__}",
            address=points,
        ) from None
    addresses, readouts = [], []
    for item in listed:
        if isinstance(item, Address):
            addresses.append(item)
        elif Features.is_form(item) or (isinstance(item, Mapping) and "sae" in item):
            readouts.append(as_features(item))
        else:
            addresses.append(item)
    return addresses, tuple(dict.fromkeys(readouts))


def resolve_feature_writes(
    writes: Sequence[AnyWrite],
    sae_of: Callable[[str], Sae],
    info: ModelInfo,
    *,
    transcoder_clamps: bool = False,
    backend: str = "this",
) -> tuple[list[AnyWrite], dict[str, Sae]]:
    """Feature writes made concrete (``sae_of`` gives the SAE attached under a name): ``add``
    becomes a plain write of its scaled decoder direction at the SAE's output address;
    ``clamp``/``ablate`` are bound to its address (a transcoder's: its output address, where the
    backend serves them, ``transcoder_clamps``)."""
    out: list[AnyWrite] = []
    used: dict[str, Sae] = {}
    for write in writes:
        if not isinstance(write, FeatureWrite):
            out.append(write)
            continue
        sae = sae_of(write.sae)
        if not sae.has_decoder:
            raise InvalidFeatures(f"{write.sae!r} is a probe: it has no decoder directions to write")
        if write.feature >= sae.d_sae:
            raise InvalidFeatures(
                f"feature {write.feature} is out of range for {write.sae!r}: it has {sae.d_sae} features "
                f"(0..{sae.d_sae - 1})"
            )
        if write.op == "add":
            direction = sae.feature_direction(write.feature)
            if sae.address_out.info.per_head:  # a hook_z SAE: the heads concatenated, one row per head
                direction = direction.reshape(heads_of(sae.address_out, info), -1)
            out.append(Write(sae.address_out, write.value * direction, "add", positions=write.positions))
            continue
        if sae.is_transcoder:
            if not transcoder_clamps:
                raise InvalidFeatures(
                    f"{write.op} of a transcoder feature ({write.sae!r}) is not served by the {backend} backend "
                    f"(the feature is read at {sae.address} and written at {sae.address_out}); the eager, vllm "
                    "and vllm-static backends serve it, and here op='add' with the value to add, or "
                    "AttributionGraph.steering_spec(..., mode='constant'), writes the same change at the prompt's "
                    "own activations"
                )
            used[write.sae] = sae
            out.append(write.bound(sae.address_out.resolve(info.n_layers)))
            continue
        used[write.sae] = sae
        out.append(write.bound(sae.address.resolve(info.n_layers)))
    return out, used
