"""Model diffing: a base model and its LoRA adapters run on the same prompts, their activations
aligned, and the differences researchers look at first.

```python
from interp_engine import compare, load_model

model = load_model("interp:tiny")
diff = compare(model, "The capital of France is", ["resid_post.1"], adapters=[None, "interp:tiny-lora"])
diff.norms()                      # per layer: |adapted - base|, that relative to |base|, their cosine
diff.lens(top_k=3)                # the logit lens of each layer's difference: tokens promoted and demoted
diff.dla(" Rome", " Paris")       # direct logit attribution of the change in logit(" Rome") - logit(" Paris")
```

:func:`compare` captures ``points`` under each adapter (``None``: the base model) in one batched
call per adapter, keeping the prompts' tokens identical, and returns a :class:`ModelDiff`: the
aligned :class:`~interp_engine.Cache` of each (``diff[adapter]``) and helpers that compare the
first adapter (the reference, usually ``None``) with another (``adapter=``, default the second).
Helpers capture what else they need (every layer's ``resid_post``, the components of the residual)
on first use, under the same prompts, and keep it.

- :meth:`ModelDiff.norms`: per layer at one position per prompt (default each prompt's last
  token), ``norm`` ``‖a - b‖``, ``relative`` ``‖a - b‖ / ‖b‖`` and ``cosine`` ``cos(a, b)``,
  averaged over the prompts;
- :meth:`ModelDiff.lens`: each layer's residual through the final norm and unembedding on both
  sides (the logit lens), the difference of the log-probabilities, for the tokens whose final
  log-probability changed most (or the tokens given);
- :meth:`ModelDiff.dla`: each component's direct logit attribution under the adapter minus under
  the reference (:func:`~interp_engine.logit_attribution` on both): the rows sum to the change of
  the model's own logit difference;
- :meth:`ModelDiff.features`: an SAE's feature activations on both sides (encoded here from the
  captured activations) and the features whose mean activation changed most.

Each returns a :class:`~interp_engine.Labelled`; :mod:`interp_engine.plot` draws each
(``plot.diff_norms``, ``plot.diff_lens``, ``plot.dla``, ``plot.diff_features``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._api import Tokens, model_points, run_with_cache, token_rows
from .._errors import InvalidAdapter, InvalidOption
from .._sync import SyncModel, sync_model
from ..adapters._adapter import refuse_adapted_unembedding
from ..addresses._address import Address
from ..protocol._protocol import InterpModel, Points
from ..results._cache import Cache
from ..results._labelled import Labelled
from ..sae._sae import Sae, load_sae
from ..steering._spec import RowSpecs
from ._dla import logit_attribution


def compare(
    model: InterpModel | SyncModel,
    prompts: Tokens,
    points: Points = (),
    *,
    adapters: Sequence[str | None] = (None,),
    steering_spec: RowSpecs = None,
) -> ModelDiff:
    """Run ``prompts`` under each of ``adapters`` (registered names, adapter folders or shipped
    names; ``None``: the base model) and capture ``points`` under each: the aligned caches and
    the diffing helpers of :class:`ModelDiff`. The first adapter is the reference the others are
    compared with. ``steering_spec`` applies on every side (one spec, or one per prompt)."""
    facade = sync_model(model)
    sides = list(adapters)
    if len(sides) < 2:
        raise InvalidAdapter(
            f"compare needs at least two sides to compare (e.g. adapters=[None, 'ft']), got {sides!r}",
            valid="a list of two or more adapter names, folders or None",
        )
    if len(set(sides)) != len(sides):
        raise InvalidAdapter(f"compare got an adapter twice: {sides!r}")
    rows = token_rows(facade.model, prompts)
    diff = ModelDiff(facade, rows, sides, steering_spec)
    diff.capture(points)
    return diff


class ModelDiff:
    """The aligned captures of one set of prompts under several adapters (:func:`compare`)."""

    def __init__(self, facade: SyncModel, rows: list[Any], adapters: list[str | None], steering_spec: RowSpecs) -> None:
        self.facade = facade
        self.rows = rows
        self.adapters: tuple[str | None, ...] = tuple(adapters)
        """The sides compared: the reference first (usually ``None``, the base model)."""
        self._spec = steering_spec
        self._caches: dict[str | None, dict[Address, Any]] = {a: {} for a in adapters}
        self._lengths = torch.tensor([len(r) for r in rows])
        self._n_layers = facade.model.info.n_layers

    def __repr__(self) -> str:
        points = ", ".join(str(a) for a in self._caches[self.reference])
        return f"<ModelDiff {len(self.rows)} prompt(s) under {list(self.adapters)}: {points or 'no points yet'}>"

    @property
    def reference(self) -> str | None:
        """The side every helper compares against (the first adapter given)."""
        return self.adapters[0]

    def capture(self, points: Points) -> None:
        """Capture ``points`` on every side (those not held yet), one batched call per side."""
        resolved = [p for p in model_points(self.facade.model, points) if isinstance(p, Address)]
        missing = [p for p in resolved if p not in self._caches[self.reference]]
        if not missing:
            return
        for adapter in self.adapters:
            cache = run_with_cache(self.facade, self.rows, missing, steering_spec=self._spec, adapter=adapter)
            for point in missing:
                self._caches[adapter][point] = cache[point]

    def __getitem__(self, adapter: str | None) -> Cache:
        """The aligned :class:`Cache` of one side (every point captured so far)."""
        if adapter not in self._caches:
            raise InvalidAdapter(f"{adapter!r} is not a side of this diff; sides: {list(self.adapters)}")
        return Cache(dict(self._caches[adapter]), lengths=self._lengths, n_layers=self._n_layers)

    def delta(self, point: Any, adapter: Any = ...) -> torch.Tensor:
        """``adapted - reference`` at ``point``: ``[batch, pos, ...]`` (zero at padded positions)."""
        address = self._address(point)
        self.capture([address])
        reference: torch.Tensor = self._caches[self.reference][address]
        return self._side(adapter, address) - reference

    # -- helpers ----------------------------------------------------------------------------------
    def norms(self, kind: str = "resid_post", *, position: int = -1, adapter: Any = ...) -> Labelled:
        """Per layer, at ``position`` of each prompt (negative: from its end): ``norm`` of the
        difference, ``relative`` (that over the reference's norm) and ``cosine`` of the two
        sides, averaged over the prompts. Dims ``("layer", "stat")``."""
        chosen = self._chosen(adapter)
        points = [Address(kind, layer) for layer in range(self._n_layers)]
        self.capture(points)
        positions = self._positions(position)
        stats = []
        for point in points:
            a = self._at(self._caches[chosen][point], positions)
            b = self._at(self._caches[self.reference][point], positions)
            d = a - b
            norm = d.norm(dim=-1)
            relative = norm / b.norm(dim=-1).clamp_min(1e-12)
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            stats.append(torch.stack([norm.mean(), relative.mean(), cosine.mean()]))
        return Labelled(
            torch.stack(stats).float(),
            ("layer", "stat"),
            {"layer": list(range(self._n_layers)), "stat": ["norm", "relative", "cosine"]},
            {"kind": kind, "adapter": chosen, "reference": self.reference, "positions": positions},
        )

    def lens(
        self,
        *,
        tokens: Sequence[int | str] | None = None,
        top_k: int = 5,
        position: int = -1,
        row: int = 0,
        adapter: Any = ...,
    ) -> Labelled:
        """The logit lens of each layer's ``resid_post`` on both sides at ``position`` of prompt
        ``row``: the adapted side's log-probabilities minus the reference's, for ``tokens`` (ids or
        one-token texts), or else the ``top_k`` tokens promoted most and the ``top_k`` demoted most
        at the last layer. Dims ``("layer", "token")``; ``meta["ids"]`` holds the token ids. A side
        whose adapter adapts the unembedding is refused (``UnsupportedOperation``): the lens
        decodes with the base model's ``W_U``."""
        chosen = self._chosen(adapter)
        registered = getattr(self.facade.model, "adapters", {})
        for side in (chosen, self.reference):
            refuse_adapted_unembedding(registered.get(side) if side is not None else None, "the logit lens")
        if not 0 <= row < len(self.rows):
            raise InvalidOption(f"row must be in 0..{len(self.rows) - 1}, got {row}")
        points = [Address("resid_post", layer) for layer in range(self._n_layers)]
        self.capture(points)
        p = self._positions(position)[row]
        stacked = {
            side: torch.stack([self._caches[side][point][row, p] for point in points])
            for side in (chosen, self.reference)
        }
        logits = {side: torch.as_tensor(self.facade.decode_residuals(value)).float() for side, value in stacked.items()}
        change = torch.log_softmax(logits[chosen], -1) - torch.log_softmax(logits[self.reference], -1)
        if tokens is None:
            k = max(1, min(int(top_k), change.shape[-1] // 2))
            up = change[-1].topk(k).indices.tolist()
            down = [i for i in change[-1].topk(k, largest=False).indices.tolist() if i not in up]
            ids = up + down
        else:
            ids = [self._token_id(t) for t in tokens]
        pieces = [repr(self.facade.to_string([i])) for i in ids]
        return Labelled(
            change[:, ids].contiguous(),
            ("layer", "token"),
            {"layer": list(range(self._n_layers)), "token": pieces},
            {"ids": ids, "adapter": chosen, "reference": self.reference, "position": p, "row": row},
        )

    def dla(
        self,
        answer: int | str,
        wrong: int | str | None = None,
        *,
        position: int = -1,
        heads: bool = False,
        adapter: Any = ...,
    ) -> Labelled:
        """Direct logit attribution of the difference: each component's contribution to
        ``logit[answer] - logit[wrong]`` under the adapter minus under the reference (each side's
        own final-norm scale), so a row sums to the change of the model's logit difference
        (``meta["logit_diff"]``: adapted, ``meta["reference_logit_diff"]``). Dims as
        :func:`~interp_engine.logit_attribution`'s."""
        chosen = self._chosen(adapter)
        if self._spec is not None:
            raise InvalidOption("dla of a diff under a steering spec is not served; compare without steering_spec")
        adapted, base = (
            logit_attribution(self.facade, self.rows, answer, wrong, heads=heads, position=position, adapter=side)
            for side in (chosen, self.reference)
        )
        meta = dict(adapted.meta)
        meta.update(
            reference_logit_diff=base.meta["logit_diff"],
            adapter=chosen,
            reference=self.reference,
        )
        return Labelled(adapted.values - base.values, adapted.dims, dict(adapted.coords), meta)

    def features(
        self,
        sae: str | Sae,
        *,
        top_k: int = 10,
        position: int | None = None,
        adapter: Any = ...,
    ) -> Labelled:
        """An SAE's features on both sides: its encoder applied to the activations captured at its
        address (an SAE attached to the model by name, an :class:`~interp_engine.Sae` or a
        folder), each feature's mean activation over every real position of every prompt (or at
        ``position`` of each), and the ``top_k`` features whose mean changed most. Dims
        ``("feature", "side")`` with sides ``reference``, ``adapted`` and ``change``; the feature
        labels are the SAE's feature ids."""
        chosen = self._chosen(adapter)
        held = getattr(self.facade.model, "saes", {})
        dictionary = held[sae] if isinstance(sae, str) and sae in held else load_sae(sae)
        address = dictionary.address.resolve(self._n_layers)
        self.capture([address])
        means = {}
        for side in (self.reference, chosen):
            value = self._caches[side][address]
            if position is None:
                rows = torch.cat([value[r, :n] for r, n in enumerate(self._lengths.tolist())])
            else:
                rows = self._at(value, self._positions(position)).float()
            if rows.dim() > 2:  # a head address: [rows, heads, d_head]
                rows = rows.flatten(1)
            means[side] = dictionary.encode(rows.float()).float().mean(0)
        change = means[chosen] - means[self.reference]
        k = max(1, min(int(top_k), change.shape[0]))
        ids = change.abs().topk(k).indices.tolist()
        values = torch.stack([means[self.reference][ids], means[chosen][ids], change[ids]], dim=1)
        return Labelled(
            values,
            ("feature", "side"),
            {"feature": ids, "side": ["reference", "adapted", "change"]},
            {"sae": sae if isinstance(sae, str) else str(address), "adapter": chosen, "reference": self.reference},
        )

    # -- internals --------------------------------------------------------------------------------
    def _chosen(self, adapter: Any) -> str | None:
        if adapter is ...:
            return self.adapters[1]
        if adapter not in self.adapters or adapter == self.reference:
            raise InvalidAdapter(
                f"{adapter!r} is not a side to compare with the reference {self.reference!r}; "
                f"sides: {list(self.adapters[1:])}",
                valid=[str(a) for a in self.adapters[1:]],
            )
        return adapter  # type: ignore[no-any-return]

    def _side(self, adapter: Any, address: Address) -> torch.Tensor:
        value: torch.Tensor = self._caches[self._chosen(adapter)][address]
        return value

    def _address(self, point: Any) -> Address:
        resolved = [p for p in model_points(self.facade.model, [point]) if isinstance(p, Address)]
        if len(resolved) != 1:
            raise InvalidOption(f"delta takes one address, got {point!r}")
        return resolved[0]

    def _positions(self, position: int) -> list[int]:
        lengths = [len(r) for r in self.rows]
        out = []
        for n in lengths:
            p = position + n if position < 0 else position
            if not 0 <= p < n:
                raise InvalidOption(f"position {position} is outside a prompt of {n} tokens")
            out.append(p)
        return out

    @staticmethod
    def _at(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        return torch.stack([value[row, p] for row, p in enumerate(positions)]).double()

    def _token_id(self, token: int | str) -> int:
        if isinstance(token, int):
            return token
        ids = self.facade.to_tokens(token)[0].tolist()
        if len(ids) != 1:
            raise InvalidOption(f"{token!r} is {len(ids)} tokens; give one-token texts or ids")
        return int(ids[0])
