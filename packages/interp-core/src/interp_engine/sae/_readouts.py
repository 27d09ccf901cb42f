"""Feature readouts: what an attached SAE (or probe) reports per token, asked for next to points.

A :class:`Features` value names an attached dictionary and what to read from it per token: its
top-k features (``top_k``), the values of chosen feature ids (``ids``), or every feature
(``dense``). Captures return a :class:`FeatureReadout` under it, next to the ordinary points::

    acts = await model.capture(ids, ["resid_post.2", Features("res2", top_k=8)])
    acts[Features("res2", top_k=8)].ids       # [n_tokens, 8] feature ids (-1: fewer fired)
    acts[Features("res2", top_k=8)].values    # [n_tokens, 8]
    cache["features:res2:top8"]               # a Cache (run_with_cache) also takes the string form

:func:`read_features` is the one definition of a readout: the eager backend calls it on the rows
of the activation it captured; the vLLM workers batch the same computation over each step's rows
(``interp_vllm._static_sae.SaeMath``, tested equal to it), so only the readout leaves them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._errors import InvalidFeatures

if TYPE_CHECKING:
    from ._sae import Sae

DEFAULT_TOP_K = 16
"""How many features a readout reports per token when it names no mode."""

Mode = Literal["top_k", "ids", "dense"]
WireDtype = Literal["float32", "float16"]
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")
_FORM = re.compile(r"^features:(?P<sae>[^:]+)(?::(?P<mode>top\d+|dense|ids=[\d,]+))?(?::(?P<dtype>float16|float32))?$")


def check_sae_name(name: Any) -> str:
    """A valid attachment name (letters, digits, ``_ . -``; at most 64 characters)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidFeatures(
            f"an SAE name is 1-64 letters, digits, '_', '.' or '-' (not starting with '.' or '-'), got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Features:
    """A per-token readout of the SAE (or probe) attached as ``sae``.

    Exactly one mode: ``top_k=k`` (the ``k`` largest features per token: ids and values; ids are
    ``-1`` where fewer than ``k`` fire), ``ids=[...]`` (the values of these features), or
    ``dense=True`` (every feature; for small dictionaries and probes). With none given the
    readout is the top :data:`DEFAULT_TOP_K`. ``dtype="float16"`` sends the values out of a
    vLLM worker at half precision (half the bytes; readouts are float32 on the caller's side
    either way). Every readout also carries the SAE's reconstruction error norm per token
    (``|x - reconstruct(x)|``; ``None`` for probes and transcoders).

    The string form, accepted wherever points are: ``"features:NAME"``,
    ``"features:NAME:top8"``, ``"features:NAME:ids=3,17"``, ``"features:NAME:dense"``, each
    optionally followed by ``":float16"``.
    """

    sae: str
    top_k: int | None = None
    ids: tuple[int, ...] | None = None
    dense: bool = False
    dtype: WireDtype = "float32"

    def __init__(
        self,
        sae: str,
        top_k: int | None = None,
        *,
        ids: Iterable[int] | None = None,
        dense: bool = False,
        dtype: str = "float32",
    ) -> None:
        check_sae_name(sae)
        given = sum((top_k is not None, ids is not None, bool(dense)))
        if given > 1:
            raise InvalidFeatures("a feature readout takes one of top_k, ids or dense, not several")
        if not isinstance(dense, bool):
            raise InvalidFeatures(f"dense must be True or False, got {dense!r}")
        chosen: tuple[int, ...] | None = None
        if ids is not None:
            if isinstance(ids, torch.Tensor):
                ids = ids.tolist()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise InvalidFeatures(f"ids must be a list of feature ids, got {ids!r}")
            chosen = tuple(ids)
            if not chosen or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in chosen):
                raise InvalidFeatures(f"ids must be a non-empty list of feature ids >= 0, got {list(chosen)!r}")
            if len(set(chosen)) != len(chosen):
                raise InvalidFeatures(f"ids repeat a feature: {list(chosen)}")
        if top_k is None and chosen is None and not dense:
            top_k = DEFAULT_TOP_K
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise InvalidFeatures(f"top_k must be a positive int, got {top_k!r}")
        if dtype not in ("float32", "float16"):
            raise InvalidFeatures(f"dtype is 'float32' or 'float16' (the values' precision out of vLLM), got {dtype!r}")
        object.__setattr__(self, "sae", sae)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "ids", chosen)
        object.__setattr__(self, "dense", bool(dense))
        object.__setattr__(self, "dtype", dtype)

    @property
    def mode(self) -> Mode:
        if self.top_k is not None:
            return "top_k"
        return "ids" if self.ids is not None else "dense"

    def width(self, d_sae: int) -> int:
        """Values per token for a dictionary of ``d_sae`` features."""
        if self.top_k is not None:
            return min(self.top_k, d_sae)
        return len(self.ids) if self.ids is not None else d_sae

    def __str__(self) -> str:
        if self.top_k is not None:
            mode = f"top{self.top_k}"
        elif self.ids is not None:
            mode = "ids=" + ",".join(map(str, self.ids))
        else:
            mode = "dense"
        suffix = ":float16" if self.dtype == "float16" else ""
        return f"features:{self.sae}:{mode}{suffix}"

    def __repr__(self) -> str:
        return f"Features({str(self)!r})"

    @classmethod
    def parse(cls, text: str | Features) -> Features:
        """A readout from its string form (or returned as is)."""
        if isinstance(text, Features):
            return text
        match = _FORM.match(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidFeatures(
                f"not a feature readout: {text!r}; write 'features:NAME', 'features:NAME:top8', "
                "'features:NAME:ids=3,17' or 'features:NAME:dense' (optionally ':float16' after)"
            )
        mode = match["mode"] or ""
        dtype = match["dtype"] or "float32"
        if mode.startswith("top"):
            return cls(match["sae"], int(mode[3:]), dtype=dtype)
        if mode.startswith("ids="):
            parts = [p for p in mode[4:].split(",") if p]
            return cls(match["sae"], ids=[int(p) for p in parts], dtype=dtype)
        return cls(match["sae"], dense=mode == "dense", dtype=dtype)

    @staticmethod
    def is_form(value: Any) -> bool:
        """Whether ``value`` is a readout or a string in readout form (``"features:..."``)."""
        return isinstance(value, Features) or (isinstance(value, str) and value.startswith("features:"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): ``{"sae": name, "top_k": k}`` / ``"ids"`` / ``"dense"``."""
        data: dict[str, Any] = {"sae": self.sae}
        if self.top_k is not None:
            data["top_k"] = self.top_k
        elif self.ids is not None:
            data["ids"] = list(self.ids)
        else:
            data["dense"] = True
        if self.dtype != "float32":
            data["dtype"] = self.dtype
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Features:
        """Read :meth:`to_dict`'s form (validated like the constructor)."""
        if not isinstance(data, Mapping) or "sae" not in data:
            raise InvalidFeatures(f"a feature readout needs 'sae' (the attached name), got {data!r:.200}")
        unknown = set(data) - {"sae", "top_k", "ids", "dense", "dtype"}
        if unknown:
            raise InvalidFeatures(
                f"unknown feature readout fields: {sorted(unknown)}; valid: sae, top_k, ids, dense, dtype"
            )
        return cls(
            data["sae"],
            data.get("top_k"),
            ids=data.get("ids"),
            dense=bool(data.get("dense", False)),
            dtype=data.get("dtype", "float32"),
        )


FeaturesLike = Features | str | Mapping[str, Any]


def as_features(value: FeaturesLike) -> Features:
    if isinstance(value, Mapping):
        return Features.from_dict(value)
    return Features.parse(value)


@dataclass(frozen=True)
class FeatureReadout:
    """Per-token feature values of one :class:`Features` request.

    ``values`` is ``[..., n_tokens, k]`` float32; ``ids`` the feature id of each value
    (``[..., n_tokens, k]`` int64; top-k: ``-1`` with value 0 where fewer than ``k`` features
    fire; ``None`` for a dense readout, whose column ``j`` is feature ``j``); ``error_norm`` is
    ``|x - reconstruct(x)|`` per token (``[..., n_tokens]``), ``None`` for probes and
    transcoders. A batched readout (a :class:`~interp_engine.Cache`) has a leading batch axis,
    right-padded like activations (padding: ids ``-1``, values and norms 0).
    """

    values: torch.Tensor
    ids: torch.Tensor | None
    error_norm: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The shape of :attr:`values`."""
        return self.values.shape

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def __getitem__(self, index: Any) -> FeatureReadout:
        """Index the leading axes (``readout[0]``: the first row or token; slices keep the axis)."""
        return FeatureReadout(
            self.values[index],
            None if self.ids is None else self.ids[index],
            None if self.error_norm is None else self.error_norm[index],
        )

    def to_dense(self, d_sae: int) -> torch.Tensor:
        """Values scattered into ``[..., n_tokens, d_sae]`` (zeros where nothing was read)."""
        if self.ids is None:
            if self.values.shape[-1] != d_sae:
                raise InvalidFeatures(f"this dense readout has {self.values.shape[-1]} features, not {d_sae}")
            return self.values.clone()
        out = torch.zeros(*self.values.shape[:-1], d_sae + 1, dtype=self.values.dtype)
        index = torch.where(self.ids < 0, d_sae, self.ids)
        out.scatter_(-1, index, self.values)
        return out[..., :d_sae]

    def to(self, device: str | torch.device) -> FeatureReadout:
        return FeatureReadout(
            self.values.to(device),
            None if self.ids is None else self.ids.to(device),
            None if self.error_norm is None else self.error_norm.to(device),
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors (``prefix + "/values"`` ...), for safetensors files and the wire."""
        out = {f"{prefix}/values": self.values}
        if self.ids is not None:
            out[f"{prefix}/ids"] = self.ids
        if self.error_norm is not None:
            out[f"{prefix}/error_norm"] = self.error_norm
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> FeatureReadout:
        ids = tensors.get(f"{prefix}/ids")
        return cls(
            tensors[f"{prefix}/values"].float(),
            None if ids is None else ids.long(),
            tensors.get(f"{prefix}/error_norm"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): nested lists."""
        data: dict[str, Any] = {"values": self.values.tolist()}
        data["ids"] = None if self.ids is None else self.ids.tolist()
        data["error_norm"] = None if self.error_norm is None else self.error_norm.tolist()
        return data

    def __repr__(self) -> str:
        ids = "dense" if self.ids is None else "ids"
        err = "" if self.error_norm is None else ", error_norm"
        return f"FeatureReadout(values={list(self.values.shape)}, {ids}{err})"


def read_features(sae: Sae, x: torch.Tensor, spec: Features) -> FeatureReadout:
    """The readout ``spec`` of activations ``x`` (``[n, d_in]``) through ``sae``: float32 on
    ``x``'s device (a caller moves it). The one definition every backend uses."""
    features = sae.encode(x)
    error = None
    if sae.has_decoder and not sae.is_transcoder:
        recon = sae.decode(features, x=x)
        error = (x.to(recon.dtype).reshape(recon.shape) - recon).norm(dim=-1).float()
    return select_features(features, spec, sparse=sae.architecture != "probe", error_norm=error)


def select_features(
    features: torch.Tensor, spec: Features, *, sparse: bool = True, error_norm: torch.Tensor | None = None
) -> FeatureReadout:
    """The readout ``spec`` of encoded features ``[n, d_sae]``. ``sparse``: values of 0 or
    below in a top-k are features that did not fire (id ``-1``, value 0)."""
    features = features.float()
    if spec.top_k is not None:
        k = min(spec.top_k, features.shape[-1])
        values, ids = features.topk(k, dim=-1)
        if sparse:
            fired = values > 0
            ids = torch.where(fired, ids, torch.full_like(ids, -1))
            values = torch.where(fired, values, torch.zeros_like(values))
        return FeatureReadout(values, ids, error_norm)
    if spec.ids is not None:
        chosen = torch.tensor(spec.ids, device=features.device)
        values = features.index_select(-1, chosen)
        return FeatureReadout(values, chosen.expand(values.shape).clone(), error_norm)
    return FeatureReadout(features, None, error_norm)


def check_readout(spec: Features, sae: Sae) -> None:
    """``InvalidFeatures`` if ``spec`` asks ``sae`` for a feature it does not have."""
    if spec.ids is not None:
        bad = [i for i in spec.ids if i >= sae.d_sae]
        if bad:
            raise InvalidFeatures(
                f"feature {bad[0]} is out of range for {spec.sae!r}: it has {sae.d_sae} features (0..{sae.d_sae - 1})"
            )


def stack_readouts(rows: Sequence[FeatureReadout], lengths: Sequence[int]) -> FeatureReadout:
    """Per-prompt readouts ``[n_i, k]`` as one ``[batch, n_max, k]``, right-padded (ids ``-1``)."""
    longest = max(lengths)

    def pad(tensor: torch.Tensor, fill: float) -> torch.Tensor:
        extra = longest - tensor.shape[0]
        widths = (0, 0) * (tensor.dim() - 1) + (0, extra)
        return torch.nn.functional.pad(tensor, widths, value=fill)

    values = torch.stack([pad(r.values, 0.0) for r in rows])
    ids = None if rows[0].ids is None else torch.stack([pad(r.ids, -1) for r in rows if r.ids is not None])
    errors = [r.error_norm for r in rows]
    error = None if any(e is None for e in errors) else torch.stack([pad(e, 0.0) for e in errors if e is not None])
    return FeatureReadout(values, ids, error)
