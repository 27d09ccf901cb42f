"""Cache: the batched result of the sync free functions."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._address import KINDS, Address, AddressLike, as_address
from ._errors import InvalidAddress, InvalidFeatures
from ._readouts import FeatureReadout, Features

_LENGTHS_KEY = "__lengths__"
_FEATURES_KEY = "__features__"

Key = Address | Features
Value = torch.Tensor | FeatureReadout


def _key(key: AddressLike | Features) -> Key:
    if Features.is_form(key):
        return Features.parse(key)  # type: ignore[arg-type]  # narrowed by is_form
    return as_address(key)  # type: ignore[arg-type]  # a Features was handled above


def _order(key: Key) -> tuple[int, int, int, str]:
    if isinstance(key, Features):
        return (1, 0, 0, str(key))
    return (0, *key.sort_key(), "")


class Cache(Mapping[Key, Value]):
    """A read-only mapping ``Address -> Tensor`` (and ``Features -> FeatureReadout``) that
    keeps the batch axis.

    Residual-type values are ``[batch, pos, width]``; attention patterns are
    ``[batch, heads, q, k]``; feature readouts hold ``[batch, pos, k]``. Lookup accepts an
    :class:`Address`, a :class:`Features` or their string forms (``cache["resid_post.5"]``,
    ``cache["features:res:top8"]``). When the batch held prompts of different lengths, they
    were right-padded: ``lengths[i]`` is row ``i``'s real token count and the padded positions
    hold zeros (readout ids ``-1``).
    """

    __slots__ = ("_data", "lengths")

    def __init__(
        self,
        data: Mapping[Any, Any],
        *,
        lengths: torch.Tensor | None = None,
    ) -> None:
        items: dict[Key, Value] = {}
        for key, value in data.items():
            items[_key(key)] = value
        self._data = dict(sorted(items.items(), key=lambda kv: _order(kv[0])))
        self.lengths = lengths

    def __getitem__(self, key: AddressLike | Features) -> Any:
        found = _key(key)
        try:
            return self._data[found]
        except KeyError:
            held = ", ".join(str(a) for a in self._data) or "nothing"
            raise KeyError(f"{found} is not in this cache; it holds {held}") from None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, (Address, Features, str)):
            return False
        try:
            return _key(key) in self._data
        except (InvalidAddress, InvalidFeatures):
            return False

    def __iter__(self) -> Iterator[Key]:
        return iter(self._data)

    def features(self) -> dict[Features, FeatureReadout]:
        """The feature readouts this cache holds."""
        return {k: v for k, v in self._data.items() if isinstance(k, Features) and isinstance(v, FeatureReadout)}

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        body = ", ".join(f"{a}: {list(t.shape)}" for a, t in self._data.items())
        return f"Cache({{{body}}})"

    def stack(self, kind: str) -> torch.Tensor:
        """The values of one per-layer kind stacked over layers: ``[n_layers_held, ...]``.

        Layers appear in increasing order; ``stack("resid_post")[i]`` is the i-th held layer.
        """
        if kind not in KINDS or not KINDS[kind].per_layer:
            per_layer = [k for k, info in KINDS.items() if info.per_layer]
            raise InvalidAddress(
                f"stack() takes a per-layer kind, one of {', '.join(per_layer)}; got {kind!r}",
                address=kind,
                valid=per_layer,
            )
        values = [
            t
            for a, t in self._data.items()
            if isinstance(a, Address) and a.kind == kind and isinstance(t, torch.Tensor)
        ]
        if not values:
            raise KeyError(f"this cache holds no {kind!r} values; it holds {', '.join(map(str, self))}")
        return torch.stack(values)

    def layers(self, kind: str) -> list[int]:
        """The layers held for ``kind``, in increasing order."""
        return [a.layer for a in self._data if isinstance(a, Address) and a.kind == kind and a.layer is not None]

    def to(self, device: str | torch.device) -> Cache:
        """A copy with every tensor moved to ``device``."""
        return Cache({a: t.to(device) for a, t in self._data.items()}, lengths=self.lengths)

    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None) -> None:
        """Write the cache to a safetensors file (keys are address strings).

        ``metadata`` adds string entries to the file's header (``safe_open(path).metadata()``
        reads them back; :meth:`load` ignores them).
        """
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        readouts = []
        for key, value in self._data.items():
            if isinstance(value, FeatureReadout):
                readouts.append(str(key))
                tensors.update(value.tensors(str(key)))
            else:
                tensors[str(key)] = value
        tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        header = {**(metadata or {}), "format": "interp-engine-cache"}
        if readouts:
            header[_FEATURES_KEY] = json.dumps(readouts)
        if self.lengths is not None:
            header[_LENGTHS_KEY] = json.dumps([int(n) for n in self.lengths.tolist()])
        save_file(tensors, os.fspath(path), metadata=header)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> Cache:
        """Read a cache written by :meth:`save`."""
        from safetensors import safe_open

        data: dict[Key, Value] = {}
        with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            metadata: dict[str, Any] = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        for name in json.loads(metadata.get(_FEATURES_KEY, "[]")):
            data[Features.parse(name)] = FeatureReadout.from_tensors(tensors, name)
        for key, tensor in tensors.items():
            if not key.startswith("features:"):
                data[Address.parse(key)] = tensor
        lengths = metadata.get(_LENGTHS_KEY)
        return cls(data, lengths=torch.tensor(json.loads(lengths)) if lengths else None)
