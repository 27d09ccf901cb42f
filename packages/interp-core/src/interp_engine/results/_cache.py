"""Cache: the batched result of the sync free functions."""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .._errors import InvalidActivations, InvalidAddress, InvalidFeatures, InvalidOption
from ..addresses._address import Address, AddressLike, as_address
from ..addresses._kinds import KINDS
from ..chat._spans import ChatTokens, select_positions
from ..sae._readouts import FeatureReadout, Features
from ._lens import LensResult

_LENGTHS_KEY = "__lengths__"
_FEATURES_KEY = "__features__"
_N_LAYERS_KEY = "__n_layers__"
_LENS_KEY = "__lens__"
_CHAT_KEY = "__chat__"
_POSITIONS_KEY = "__positions__"

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


def _check_n_layers(n_layers: Any) -> int | None:
    if n_layers is None:
        return None
    if isinstance(n_layers, bool) or not isinstance(n_layers, numbers.Integral) or n_layers < 1:
        raise InvalidOption(f"n_layers is the model's layer count, an int >= 1 (or None), got {n_layers!r}")
    return int(n_layers)


def _same(a: Value, b: Value) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a is b or (a.shape == b.shape and bool(torch.equal(a, b.to(a.device, a.dtype))))
    return a is b


def _pos_axes(key: Key) -> tuple[int, ...]:
    """The padded axes of a batched value: the key and query axes of attention scores and
    patterns ``[batch, heads, q, k]``, else the position axis ``[batch, pos, ...]``."""
    if isinstance(key, Address) and key.info.width == "heads x keys":
        return (2, 3)
    return (1,)


def _fill(key: Key) -> float:
    return float("-inf") if isinstance(key, Address) and key.kind == "attn_scores" else 0.0


class Cache(Mapping[Key, Value]):
    """A read-only mapping ``Address -> Tensor`` (and ``Features -> FeatureReadout``) that
    keeps the batch axis.

    Residual-type values are ``[batch, pos, width]``; attention patterns are
    ``[batch, heads, q, k]``; feature readouts hold ``[batch, pos, k]``. Lookup accepts an
    :class:`Address`, a :class:`Features` or their string forms (``cache["resid_post.5"]``,
    ``cache["features:res:top8"]``). When the batch held prompts of different lengths, they
    were right-padded: ``lengths[i]`` is row ``i``'s real token count and the padded positions
    hold zeros (readout ids ``-1``; attention scores ``-inf``).

    Layers are stored absolute. ``n_layers`` (the model's layer count; the free functions set
    it) lets a negative layer count from the end, on the way in and on lookup:
    ``cache["resid_post.-1"]`` is ``cache["resid_post.3"]`` on a 4-layer model, and the two
    given together are one point, stored once. Without ``n_layers`` a negative layer is refused.

    ``lens``: the logit lens read during the generation (``capture_generation(..., lens=...)``),
    a :class:`LensResult` (it has no batch axis: one generation's), else ``None``.

    ``chat``: each row's :class:`~interp_engine.ChatTokens` when the prompts were chats (``None``
    for a row given as plain ids; ``chat`` itself ``None`` when no row was), so positions can be
    named by span in :meth:`select`. ``positions``: when a capture kept only some positions
    (``run_with_cache(..., positions=...)``), the absolute positions held, ``[batch, n_kept]``
    (``-1`` where a row kept fewer; ``lengths`` then counts the kept ones); ``None``: every position.
    """

    __slots__ = ("_data", "chat", "lengths", "lens", "n_layers", "positions")

    def __init__(
        self,
        data: Mapping[Any, Any],
        *,
        lengths: torch.Tensor | None = None,
        n_layers: int | None = None,
        lens: LensResult | None = None,
        chat: Sequence[ChatTokens | None] | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        self.n_layers = _check_n_layers(n_layers)
        if chat is not None and not all(c is None or isinstance(c, ChatTokens) for c in chat):
            raise InvalidActivations("a cache's chat holds one ChatTokens (or None) per row")
        self.chat: tuple[ChatTokens | None, ...] | None = None if chat is None else tuple(chat)
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() != 2):
            raise InvalidActivations("a cache's positions are a [batch, n_kept] tensor of absolute positions")
        self.positions = positions
        if lens is not None and not isinstance(lens, LensResult):
            raise InvalidActivations(f"a cache's lens is a LensResult (or None), got {type(lens).__name__}")
        self.lens = lens
        items: dict[Key, Value] = {}
        for key, value in data.items():
            if isinstance(key, Address) and (key.layer is None or key.layer >= 0):
                found: Key = key  # as stored already
            else:
                found = self._absolute(_key(key), on_lookup=False)
            if found in items and not _same(items[found], value):
                raise InvalidAddress(
                    f"{key} and another key are the same point, {found}, on a {self.n_layers}-layer model, "
                    "but hold different values",
                    address=key,
                    valid=(str(found),),
                )
            items.setdefault(found, value)
        self._data = dict(sorted(items.items(), key=lambda kv: _order(kv[0])))
        self.lengths = lengths

    def _absolute(self, key: Key, *, on_lookup: bool) -> Key:
        """``key`` with a negative layer made absolute against :attr:`n_layers`."""
        if not isinstance(key, Address) or key.layer is None or key.layer >= 0:
            return key
        if self.n_layers is None:
            what = "look up" if on_lookup else "store"
            raise InvalidAddress(
                f"cannot {what} {key}: a negative layer counts from the end, and this cache does not know the "
                "model's layer count; use the absolute layer, or build the Cache with n_layers= "
                "(run_with_cache and the other free functions set it)",
                address=key,
                valid=("a layer >= 0",),
            )
        return key.resolve(self.n_layers)

    def __getitem__(self, key: AddressLike | Features) -> Any:
        found = self._absolute(_key(key), on_lookup=True)
        try:
            return self._data[found]
        except KeyError:
            held = ", ".join(str(a) for a in self._data) or "nothing"
            raise KeyError(f"{found} is not in this cache; it holds {held}") from None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, (Address, Features, str)):
            return False
        try:
            return self._absolute(_key(key), on_lookup=True) in self._data
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
        if self.lens is None:
            return f"Cache({{{body}}})"
        lens = f"layers {list(self.lens.layers)} x {len(self.lens.positions)} positions x top-{self.lens.ids.shape[-1]}"
        return f"Cache({{{body}}}, lens={lens})"

    def stack(self, kind: str, *, include_embed: bool = False) -> torch.Tensor:
        """The values of one per-layer kind stacked over layers: ``[n_layers_held, ...]``.

        Layers appear in increasing order; ``stack("resid_post")[i]`` is the i-th held layer.
        ``include_embed=True`` puts ``embed`` first (a ``d_model`` kind only; ``embed`` must be
        held): ``stack("resid_post", include_embed=True)`` is the residual stream after the
        embedding and after each layer, TransformerLens's ``accumulated_resid``, what the logit
        lens decodes. :meth:`stack_labels` names the rows.
        """
        return torch.stack([self._data[a] for a in self._stacked(kind, include_embed)])  # type: ignore[misc]

    def stack_labels(self, kind: str, *, include_embed: bool = False) -> list[str]:
        """The rows of :meth:`stack` with the same arguments, as address strings
        (``["embed", "resid_post.0", ...]``), e.g. for a plot's axis."""
        return [str(a) for a in self._stacked(kind, include_embed)]

    def _stacked(self, kind: str, include_embed: bool) -> list[Address]:
        if kind not in KINDS or not KINDS[kind].per_layer:
            per_layer = [k for k, info in KINDS.items() if info.per_layer]
            raise InvalidAddress(
                f"stack() takes a per-layer kind, one of {', '.join(per_layer)}; got {kind!r}",
                address=kind,
                valid=per_layer,
            )
        if include_embed and KINDS[kind].width != "d_model":
            raise InvalidAddress(
                f"include_embed=True stacks the embedding with a d_model kind (resid_pre, resid_mid, resid_post, "
                f"attn_out, mlp_out, ...); {kind} is {KINDS[kind].width} wide",
                address=kind,
                valid=[k for k, info in KINDS.items() if info.per_layer and info.width == "d_model"],
            )
        held = [
            a
            for a, t in self._data.items()
            if isinstance(a, Address) and a.kind == kind and isinstance(t, torch.Tensor)
        ]
        if not held:
            raise KeyError(f"this cache holds no {kind!r} values; it holds {', '.join(map(str, self))}")
        if not include_embed:
            return held
        embed = Address("embed")
        if embed not in self._data:
            raise KeyError(f"include_embed=True needs embed in the cache; it holds {', '.join(map(str, self))}")
        return [embed, *held]

    def layers(self, kind: str) -> list[int]:
        """The layers held for ``kind``, in increasing order."""
        return [a.layer for a in self._data if isinstance(a, Address) and a.kind == kind and a.layer is not None]

    def select(self, key: AddressLike | Features, positions: Any, row: int = 0) -> Any:
        """Row ``row`` of ``self[key]`` at ``positions``: a chat span name (``"user[-1].last"``,
        resolved against the row's :attr:`chat`), ``"all"``, ``"prompt"``, ``"generated"`` or
        indices (negative ones count back from the row's end). ``[n_selected, width]`` (attention:
        ``[heads, n_selected, k]``, the query axis selected; a feature readout likewise). When the
        cache kept only some positions, the positions asked must be among them."""
        value = self[key]
        tensor = value.values if isinstance(value, FeatureReadout) else value
        n_rows = int(tensor.shape[0])
        if isinstance(row, bool) or not isinstance(row, int) or not -n_rows <= row < n_rows:
            raise InvalidOption(f"row must be an int in {-n_rows}..{n_rows - 1} (the cache has {n_rows} rows)")
        row %= n_rows
        found = self._absolute(_key(key), on_lookup=True)
        axis = _pos_axes(found)[0] - 1  # the query axis of attention, else the position axis
        chat = self.chat[row] if self.chat is not None else None
        kept = None if self.positions is None else [int(p) for p in self.positions[row].tolist() if p >= 0]
        n_total = int(self.lengths[row]) if self.lengths is not None and kept is None else int(tensor.shape[axis + 1])
        if kept is not None:
            n_total = max(kept) + 1
            if not isinstance(positions, str) and any(int(p) < 0 for p in torch.as_tensor(positions).reshape(-1)):
                raise InvalidOption(f"this cache kept positions {kept} of row {row}; give absolute positions")
        if kept is not None and positions == "all":
            absolute = list(kept)
        else:
            absolute = select_positions(positions, chat, len(chat) if chat is not None else n_total, n_total)
        if kept is not None:
            missing = [p for p in absolute if p not in kept]
            if missing:
                raise InvalidOption(f"position {missing[0]} was not kept in this cache; row {row} holds {kept}")
            absolute = [kept.index(p) for p in absolute]
        index = torch.tensor(absolute, dtype=torch.long)
        if isinstance(value, FeatureReadout):
            return FeatureReadout(
                value.values[row].index_select(axis, index),
                None if value.ids is None else value.ids[row].index_select(axis, index),
                None if value.error_norm is None else value.error_norm[row].index_select(axis, index),
            )
        return value[row].index_select(axis, index.to(value.device))

    def to(self, device: str | torch.device) -> Cache:
        """A copy with every tensor moved to ``device``."""
        return Cache(
            {a: t.to(device) for a, t in self._data.items()},
            lengths=self.lengths,
            n_layers=self.n_layers,
            lens=self.lens,
            chat=self.chat,
            positions=self.positions,
        )

    @classmethod
    def concat(cls, caches: Iterable[Cache]) -> Cache:
        """One cache of the rows of ``caches``, in order, along the batch axis (e.g. the chunks
        of a long run).

        Every cache must hold the same points. Rows keep their real lengths: caches padded to
        different lengths are re-padded to the longest (zeros; attention scores ``-inf``,
        readout ids ``-1``), and ``lengths`` is joined (a cache without lengths counts each of
        its rows as full). Values are copied once into the joined tensors.
        """
        parts = list(caches)
        if not parts:
            raise InvalidActivations("Cache.concat needs at least one cache")
        for i, part in enumerate(parts):
            if not isinstance(part, Cache):
                raise InvalidActivations(f"Cache.concat joins Cache objects; item {i} is a {type(part).__name__}")
        keys = list(parts[0]._data)
        for i, part in enumerate(parts[1:], start=1):
            if part._data.keys() != parts[0]._data.keys():
                missing = [str(k) for k in keys if k not in part._data]
                extra = [str(k) for k in part._data if k not in parts[0]._data]
                what = "; ".join(
                    text
                    for text in (
                        f"it lacks {', '.join(missing)}" if missing else "",
                        f"it also holds {', '.join(extra)}" if extra else "",
                    )
                    if text
                )
                raise InvalidAddress(
                    f"Cache.concat joins caches of the same points; cache {i} differs from cache 0: {what}",
                    address=missing + extra,
                    valid=[str(k) for k in keys],
                )
        with_lens = [i for i, p in enumerate(parts) if p.lens is not None]
        if with_lens:
            raise InvalidActivations(
                f"Cache.concat joins activations along the batch axis and cache {with_lens[0]} holds a logit lens "
                "(cache.lens, one generation's, no batch axis); keep the lenses apart ([c.lens for c in caches]) and "
                "join the activations: Cache.concat(Cache(c, lengths=c.lengths, n_layers=c.n_layers) for c in caches)"
            )
        known = {p.n_layers for p in parts if p.n_layers is not None}
        if len(known) > 1:
            raise InvalidActivations(
                f"Cache.concat joins caches of one model; these know {sorted(known)} layers (n_layers)"
            )
        joined: dict[Key, Value] = {}
        for key in keys:
            values = [p._data[key] for p in parts]
            if isinstance(key, Features):
                joined[key] = _concat_readouts(key, values)
            else:
                joined[key] = _concat_tensors(key, values, _pos_axes(key), _fill(key))
        return cls(
            joined,
            lengths=_concat_lengths(parts),
            n_layers=known.pop() if known else None,
            chat=_concat_chat(parts),
            positions=_concat_positions(parts),
        )

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
        if self.n_layers is not None:
            header[_N_LAYERS_KEY] = str(self.n_layers)
        if self.chat is not None:
            header[_CHAT_KEY] = json.dumps([None if c is None else c.to_json() for c in self.chat])
        if self.positions is not None:
            tensors[_POSITIONS_KEY] = self.positions.detach().cpu().contiguous()
        if self.lens is not None:
            header[_LENS_KEY] = json.dumps({"layers": list(self.lens.layers), "positions": list(self.lens.positions)})
            tensors[f"{_LENS_KEY}.ids"] = self.lens.ids.detach().cpu().contiguous()
            tensors[f"{_LENS_KEY}.probs"] = self.lens.probs.detach().cpu().contiguous()
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
        lens = None
        if _LENS_KEY in metadata:
            held = json.loads(metadata[_LENS_KEY])
            lens = LensResult(
                tuple(held["layers"]),
                tuple(held["positions"]),
                tensors.pop(f"{_LENS_KEY}.ids"),
                tensors.pop(f"{_LENS_KEY}.probs"),
            )
        positions = tensors.pop(_POSITIONS_KEY, None)
        chat = metadata.get(_CHAT_KEY)
        for key, tensor in tensors.items():
            if not key.startswith("features:"):
                data[Address.parse(key)] = tensor
        lengths = metadata.get(_LENGTHS_KEY)
        n_layers = metadata.get(_N_LAYERS_KEY)
        return cls(
            data,
            lengths=torch.tensor(json.loads(lengths)) if lengths else None,
            n_layers=int(n_layers) if n_layers else None,
            lens=lens,
            chat=None if chat is None else [None if c is None else ChatTokens.from_json(c) for c in json.loads(chat)],
            positions=positions,
        )


def keep_positions(values: Mapping[Any, Any], rows: Sequence[Sequence[int]]) -> tuple[dict[Any, Any], torch.Tensor]:
    """Batched ``values`` cut to each row's ``rows[i]`` positions (absolute, in order), right-padded
    to the longest selection (zeros; attention scores ``-inf``, readout ids ``-1``), and the kept
    positions ``[batch, n_kept]`` (``-1`` as padding). Attention keeps its query axis' rows."""
    longest = max(len(r) for r in rows)
    kept = torch.full((len(rows), longest), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        kept[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
    out: dict[Any, Any] = {}
    for key, value in values.items():
        found = _key(key)
        axis = _pos_axes(found)[0]
        if isinstance(value, FeatureReadout):
            out[key] = FeatureReadout(
                _gather(value.values, rows, axis, longest, 0.0),
                None if value.ids is None else _gather(value.ids, rows, axis, longest, -1),
                None if value.error_norm is None else _gather(value.error_norm, rows, axis, longest, 0.0),
            )
        else:
            out[key] = _gather(value, rows, axis, longest, _fill(found))
    return out, kept


def _gather(value: torch.Tensor, rows: Sequence[Sequence[int]], axis: int, longest: int, fill: float) -> torch.Tensor:
    shape = list(value.shape)
    shape[axis] = longest
    out = torch.full(shape, fill, dtype=value.dtype, device=value.device)
    for i, row in enumerate(rows):
        index = torch.tensor(list(row), dtype=torch.long, device=value.device)
        out[i].narrow(axis - 1, 0, len(row)).copy_(value[i].index_select(axis - 1, index))
    return out


def _concat_chat(parts: list[Cache]) -> list[ChatTokens | None] | None:
    """Each row's ChatTokens across ``parts`` (``None`` for rows of a cache without chats)."""
    if all(p.chat is None for p in parts):
        return None
    out: list[ChatTokens | None] = []
    for part in parts:
        out += list(part.chat) if part.chat is not None else [None] * _batch(next(iter(part._data.values())))
    return out


def _concat_positions(parts: list[Cache]) -> torch.Tensor | None:
    """The kept positions joined (``-1`` padded); every cache must have kept positions, or none."""
    kept = [p.positions for p in parts]
    if all(k is None for k in kept):
        return None
    if any(k is None for k in kept):
        raise InvalidActivations(
            "Cache.concat joins caches that all kept every position or all kept a selection (cache.positions); "
            "these mix both"
        )
    return _concat_tensors(Address("embed"), kept, (1,), -1)


def _batch(value: Value) -> int:
    return int(value.values.shape[0] if isinstance(value, FeatureReadout) else value.shape[0])


def _concat_lengths(parts: list[Cache]) -> torch.Tensor | None:
    """The joined lengths; ``None`` when no cache had lengths and none needed padding."""
    full = []
    for part in parts:
        first = next(iter(part._data.items()), None)
        if first is None:
            return None
        key, value = first
        tensor = value.values if isinstance(value, FeatureReadout) else value
        full.append(int(tensor.shape[_pos_axes(key)[-1]]))
    if all(p.lengths is None for p in parts) and len(set(full)) == 1:
        return None
    return torch.cat(
        [
            torch.as_tensor(p.lengths).reshape(-1).long()
            if p.lengths is not None
            else torch.full((_batch(next(iter(p._data.values()))),), n, dtype=torch.long)
            for p, n in zip(parts, full, strict=True)
        ]
    )


def _concat_tensors(key: Key, values: list[Any], axes: tuple[int, ...], fill: float) -> torch.Tensor:
    """``values`` joined on axis 0, each right-padded along ``axes`` to the longest."""
    first = values[0]
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise InvalidActivations(f"{key}: Cache.concat joins tensors, got a {type(value).__name__}")
        same = [d for d in range(1, first.dim()) if d not in axes]
        if value.dim() != first.dim() or any(value.shape[d] != first.shape[d] for d in same):
            raise InvalidActivations(
                f"{key}: Cache.concat joins values of one shape but for the batch and position axes; "
                f"got {list(first.shape)} and {list(value.shape)}"
            )
    shape = list(first.shape)
    shape[0] = sum(int(v.shape[0]) for v in values)
    for axis in axes:
        shape[axis] = max(int(v.shape[axis]) for v in values)
    dtype = first.dtype
    for value in values[1:]:
        dtype = torch.promote_types(dtype, value.dtype)
    if all(v.shape[1:] == first.shape[1:] for v in values):  # no padding: one cat
        return torch.cat([v.to(first.device, dtype) for v in values])
    out = torch.full(shape, fill, dtype=dtype, device=first.device)
    start = 0
    for value in values:
        index: list[slice] = [slice(start, start + int(value.shape[0]))]
        index += [slice(0, int(value.shape[d])) for d in range(1, value.dim())]
        out[tuple(index)] = value
        start += int(value.shape[0])
    return out


def _concat_readouts(key: Features, values: list[Any]) -> FeatureReadout:
    for value in values:
        if not isinstance(value, FeatureReadout):
            raise InvalidActivations(f"{key}: Cache.concat joins feature readouts, got a {type(value).__name__}")
    readouts: list[FeatureReadout] = values
    if len({r.ids is None for r in readouts}) > 1 or len({r.error_norm is None for r in readouts}) > 1:
        raise InvalidActivations(
            f"{key}: Cache.concat joins readouts of one kind; some have ids or error norms and some not"
        )
    joined_values = _concat_tensors(key, [r.values for r in readouts], (1,), 0.0)
    ids = None if readouts[0].ids is None else _concat_tensors(key, [r.ids for r in readouts], (1,), -1)
    errors = (
        None if readouts[0].error_norm is None else _concat_tensors(key, [r.error_norm for r in readouts], (1,), 0.0)
    )
    return FeatureReadout(joined_values, ids, errors)
