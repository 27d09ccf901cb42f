"""The logit lens in the dynamic worker: the rows its hooks kept, decoded once per step."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from interp_engine.backend import lens_top_k

from .._wire import compact_ids
from ..hooks import attr_path
from ._request_taps import Slice
from ._state import TapState


class Lens:
    """The part of the taps that decodes each step's logit lens for the requests that read it
    (from the rows their lens layers' hooks kept in ``Slice.lens_rows``)."""

    def __init__(self, state: TapState) -> None:
        self.state = state

    def run(self, slices: list[Slice]) -> None:
        """The step's logit lens for every request that reads it: the rows its lens layers'
        hooks kept, all requests and layers together through ONE final norm and served
        unembedding (under tensor parallelism a collective: every rank of this stage joins with
        the same rows, a row whose hook failed as zeros), then :func:`lens_top_k` per top-k on
        rank 0, which keeps only the ids and probabilities."""
        readers = [sl for sl in slices if sl.lens_keep is not None]
        if not readers:
            return
        began = time.perf_counter_ns()
        param = next(self.state.model.parameters())
        width = int(self.state.runner.model_config.hf_config.hidden_size)
        blocks: list[torch.Tensor] = []
        spans: list[tuple[Slice, int, int]] = []  # per reader: its first row in the batch, its rows per layer
        start = 0
        for sl in readers:
            keep = sl.lens_keep
            if keep is None:  # pragma: no cover - filtered above
                continue
            count = int(keep.sum())
            for index in range(len(sl.taps.lens_at)):
                rows = sl.lens_rows.get(index)
                if rows is None or rows.shape[0] != count:  # its hook failed: zeros keep the ranks' shapes equal
                    rows = torch.zeros(count, width, dtype=param.dtype, device=param.device)
                blocks.append(rows)
            spans.append((sl, start, count))
            start += count * len(sl.taps.lens_at)
        try:
            logits = self._lens_logits(torch.cat(blocks))
            if logits is not None:  # rank 0 (and every rank where vLLM all-gathers) records
                self._record_lens(spans, logits)
        except Exception as exc:
            self.state.fail(readers, exc)
        finally:
            for sl in readers:
                sl.lens_rows.clear()
            self.state.timing["lens_ns"] += time.perf_counter_ns() - began

    def _lens_logits(self, residuals: torch.Tensor) -> torch.Tensor | None:
        """The served final norm and logits of ``residuals`` (``None`` on a rank that vLLM's
        gather leaves without them)."""
        norm = attr_path(self.state.model, self.state.family.final_norm)
        with torch.inference_mode():
            logits: torch.Tensor | None = self.state.model.compute_logits(norm(residuals))  # type: ignore[operator]
        return logits

    def _record_lens(self, spans: list[tuple[Slice, int, int]], logits: torch.Tensor) -> None:
        if self.state.rank != 0:
            return
        vocab = int(logits.shape[-1])
        by_k: dict[int, list[tuple[Slice, int, int]]] = defaultdict(list)
        for span in spans:
            by_k[span[0].taps.lens_k].append(span)
        for k, group in by_k.items():  # one softmax and top-k per distinct k
            index = torch.cat(
                [torch.arange(start, start + count * len(sl.taps.lens_at)) for sl, start, count in group]
            ).to(logits.device)
            try:
                ids, probs = lens_top_k(logits[index], k)
            except Exception as exc:  # these requests fail alone (rank 0's own work: no collective)
                self.state.fail([sl for sl, _, _ in group], exc)
                continue
            ids, probs = compact_ids(ids, vocab).to("cpu"), probs.to("cpu", torch.float32)
            offset = 0
            for sl, _, count in group:
                n_layers = len(sl.taps.lens_at)
                part = slice(offset, offset + count * n_layers)
                offset += count * n_layers
                keep = sl.lens_keep if sl.lens_keep is not None else torch.ones_like(sl.positions, dtype=torch.bool)
                # [layers * count, k] -> [count, layers, k]
                mine_ids = ids[part].view(n_layers, count, k).transpose(0, 1).contiguous()
                mine_probs = probs[part].view(n_layers, count, k).transpose(0, 1).contiguous()
                sl.taps.lens_values.append((sl.positions[keep], mine_ids, mine_probs))
