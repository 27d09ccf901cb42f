"""What leaves the worker: a request's values once it is done (``fetch``), a stream's readouts and
lens so far (``drain``), releases, the bookkeeping counters and the decode of residuals."""

from __future__ import annotations

import time

import torch

from interp_engine import Address

from .. import _compat
from .._transport import covered
from .._wire import Fetched, merge_lens
from ..hooks import attr_path
from ._request_taps import merged_readouts
from ._state import TapState


class Fetch:
    """The part of the taps that answers the front end's fetch, drain, release, stats and decode
    from the shared state."""

    def __init__(self, state: TapState) -> None:
        self.state = state

    # -- after the request ------------------------------------------------------------------
    def fetch(self, rid: str) -> Fetched:
        """A request's values, ordered by position (a recomputed position keeps its last
        value); then forget it."""
        began = time.perf_counter_ns()
        try:
            error = self.state.failed.pop(rid, None)
            if error is not None:
                self.release(rid)
                return Fetched(error=error)
            return self._collect(rid)
        finally:
            self.state.timing["fetches"] += 1
            self.state.timing["fetch_ns"] += time.perf_counter_ns() - began

    def _collect(self, rid: str) -> Fetched:
        taps = self.state.requests.pop(rid, None)
        self._retire(rid)
        if taps is None:
            return Fetched()
        out: dict[Address, tuple[torch.Tensor, torch.Tensor]] = {}
        for address, chunks in taps.values.items():
            positions = torch.cat([p for p, _ in chunks])
            if address.info.width == "heads x keys":  # pad the key axis: probabilities 0, scores -inf
                fill = float("-inf") if address.kind == "attn_scores" else 0.0
                width = max(v.shape[-1] for _, v in chunks)
                values = torch.cat(
                    [torch.nn.functional.pad(v, (0, width - v.shape[-1]), value=fill) for _, v in chunks]
                )
            else:
                values = torch.cat([v for _, v in chunks])
            order = torch.argsort(positions, stable=True)
            positions, values = positions[order], values[order]
            last = torch.ones_like(positions, dtype=torch.bool)
            last[:-1] = positions[1:] != positions[:-1]
            out[address] = (positions[last], values[last])
        written = {address: covered(spans) for address, spans in taps.spans.items()}
        return Fetched(out, readouts=merged_readouts(taps), lens=merge_lens(taps.lens_values), written=written)

    def drain(self, rid: str) -> Fetched:
        """A streaming request's readouts so far (then dropped here); the request lives on."""
        error = self.state.failed.get(rid)
        if error is not None:
            return Fetched(error=error)
        taps = self.state.requests.get(rid)
        if taps is None:
            return Fetched()
        merged = merged_readouts(taps)
        taps.readout_values.clear()
        lens = merge_lens(taps.lens_values)
        taps.lens_values.clear()
        return Fetched(readouts=merged, lens=lens)

    def release(self, rid: str) -> None:
        self.state.failed.pop(rid, None)
        self.state.requests.pop(rid, None)
        self._retire(rid)

    def _retire(self, rid: str) -> None:
        self.state.retired[rid] = None
        while len(self.state.retired) > 4096:
            self.state.retired.popitem(last=False)

    def stats(self) -> dict[str, int]:
        """How many requests hold state in this worker and how many SAEs it holds (for leak
        checks), and vLLM's and Dynamo's compilation counters (for recompilation checks)."""
        out = {"live_requests": len(self.state.requests), "saes": len(self.state.saes), **self.state.timing}
        try:
            from vllm.compilation.counter import compilation_counter

            out.update({f"vllm_{k}": int(v) for k, v in vars(compilation_counter).items() if isinstance(v, int)})
        except ImportError:  # pragma: no cover - vLLM without the compilation package
            pass
        out.update(_compat.dynamo_counters())
        return out

    def decode(self, residuals: torch.Tensor) -> torch.Tensor | None:
        """Final norm + the served unembedding (gathered over tensor-parallel ranks); ``None`` on
        a pipeline stage before the last, which holds neither."""
        if not self.state.last_stage:
            return None
        param = next(self.state.model.parameters())
        norm = attr_path(self.state.model, self.state.family.final_norm)
        with torch.inference_mode():
            x = residuals.to(device=param.device, dtype=param.dtype)
            logits: torch.Tensor = self.state.model.compute_logits(norm(x))  # type: ignore[operator]
        return logits.to("cpu", torch.float32)
