"""LoRA adapters on the eager backend, through PEFT: loaded once into the HF model's own modules,
chosen per forward and per batch row.

PEFT replaces each adapted linear layer by a LoRA layer that holds the base layer and every
loaded adapter's ``A``/``B``. Here no adapter is active by default (each LoRA layer's active set
is empty, so a forward that names none is the base model's), and a forward names one adapter per
batch row through PEFT's ``adapter_names`` (its mixed-batch path: rows under ``"__base__"`` get
the base layer's output, the others their own adapter's). Nothing is switched globally between
calls, so a request never sees another's adapter, whatever runs before, after or beside it.

After a load the :class:`~interp_eager._sites.Architecture` is built again, so every hook sits on
the LoRA layer (whose output includes the adapter's contribution), not the base layer inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from interp_engine import InvalidAdapter
from interp_engine.backend import Adapter

BASE = "__base__"
"""PEFT's name for the base model in a mixed batch."""


class PeftAdapters:
    """The adapters loaded into one HF model (:meth:`load`) and the per-row choice of a forward
    (:meth:`rows`)."""

    def __init__(self, hf_model: nn.Module) -> None:
        self._hf = hf_model
        self._peft: Any = None
        self._layers: list[Any] = []
        """PEFT's LoRA layers (``BaseTunerLayer`` modules) in the model."""

    def load(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights into the model's modules (PEFT), leaving every forward on
        the base model until one names it."""
        try:
            from peft import PeftModel
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError as exc:
            raise InvalidAdapter(
                "adapters on the eager backend need peft: pip install 'interp-eager[peft]'", name=adapter.name
            ) from exc
        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(
                    self._hf, adapter.path, adapter_name=adapter.name, is_trainable=False
                )
            else:
                self._peft.load_adapter(adapter.path, adapter_name=adapter.name, is_trainable=False)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise InvalidAdapter(f"PEFT could not load adapter {adapter.name!r} into this model: {exc}") from exc
        self._layers = [m for m in self._hf.modules() if isinstance(m, BaseTunerLayer)]
        for layer in self._layers:  # no adapter unless a forward names one
            layer.set_adapter([], inference_mode=True)

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """During the block, each forward's batch row ``i`` runs under adapter ``names[i]``
        (``None``: the base model). Call it where forwards are serialised (the model's lock)."""
        if not self._layers or all(name is None for name in names):
            yield
            return
        chosen = [BASE if name is None else name for name in names]

        def name_rows(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return args, {**kwargs, "adapter_names": chosen}

        handles = [layer.register_forward_pre_hook(name_rows, with_kwargs=True) for layer in self._layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
