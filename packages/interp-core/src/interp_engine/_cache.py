"""Cache: the batched result of the sync free functions."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._address import KINDS, Address, AddressLike, as_address
from ._errors import InvalidAddress

_LENGTHS_KEY = "__lengths__"


class Cache(Mapping[Address, torch.Tensor]):
    """A read-only mapping ``Address -> Tensor`` that keeps the batch axis.

    Residual-type values are ``[batch, pos, width]``; attention patterns are
    ``[batch, heads, q, k]``. Lookup accepts an :class:`Address` or its string form
    (``cache["resid_post.5"]``). When the batch held prompts of different lengths, they were
    right-padded: ``lengths[i]`` is row ``i``'s real token count and the padded positions hold
    zeros.
    """

    __slots__ = ("_data", "lengths")

    def __init__(
        self,
        data: Mapping[Address, torch.Tensor],
        *,
        lengths: torch.Tensor | None = None,
    ) -> None:
        items: dict[Address, torch.Tensor] = {}
        for key, value in data.items():
            address = as_address(key)
            items[address] = value
        self._data = dict(sorted(items.items(), key=lambda kv: kv[0].sort_key()))
        self.lengths = lengths

    def __getitem__(self, key: AddressLike) -> torch.Tensor:
        address = as_address(key)
        try:
            return self._data[address]
        except KeyError:
            held = ", ".join(str(a) for a in self._data) or "nothing"
            raise KeyError(f"{address} is not in this cache; it holds {held}") from None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, (Address, str)):
            return False
        try:
            return as_address(key) in self._data
        except InvalidAddress:
            return False

    def __iter__(self) -> Iterator[Address]:
        return iter(self._data)

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
        values = [t for a, t in self._data.items() if a.kind == kind]
        if not values:
            raise KeyError(f"this cache holds no {kind!r} values; it holds {', '.join(map(str, self))}")
        return torch.stack(values)

    def layers(self, kind: str) -> list[int]:
        """The layers held for ``kind``, in increasing order."""
        return [a.layer for a in self._data if a.kind == kind and a.layer is not None]

    def to(self, device: str | torch.device) -> Cache:
        """A copy with every tensor moved to ``device``."""
        return Cache({a: t.to(device) for a, t in self._data.items()}, lengths=self.lengths)

    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None) -> None:
        """Write the cache to a safetensors file (keys are address strings).

        ``metadata`` adds string entries to the file's header (``safe_open(path).metadata()``
        reads them back; :meth:`load` ignores them).
        """
        from safetensors.torch import save_file

        tensors = {str(a): t.detach().cpu().contiguous() for a, t in self._data.items()}
        header = {**(metadata or {}), "format": "interp-engine-cache"}
        if self.lengths is not None:
            header[_LENGTHS_KEY] = json.dumps([int(n) for n in self.lengths.tolist()])
        save_file(tensors, os.fspath(path), metadata=header)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> Cache:
        """Read a cache written by :meth:`save`."""
        from safetensors import safe_open

        data: dict[Address, torch.Tensor] = {}
        with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            metadata: dict[str, Any] = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                data[Address.parse(key)] = f.get_tensor(key)
        lengths = metadata.get(_LENGTHS_KEY)
        return cls(data, lengths=torch.tensor(json.loads(lengths)) if lengths else None)
