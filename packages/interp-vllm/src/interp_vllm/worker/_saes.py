"""SAEs, transcoders and probes in the dynamic worker: held by key, batched readouts, batched
feature clamps (a transcoder's read at its input rows, kept earlier in the step)."""

from __future__ import annotations

import torch

from interp_engine import Address, BackendError, FeatureWrite, Sae

from .._wire import compact
from ..sae._math import SaeLayout, SaeMath, pick
from ..sae._transcoders import TranscoderMath
from ._request_taps import Slice, WriteTable, touched_rows
from ._state import TapState


class Saes:
    """The part of the taps that holds the SAEs the front end attached (in the shared state's
    ``saes``, where requests find them when admitted) and computes their readouts and clamps over
    a step's requests, with one batched encoder per SAE and device."""

    def __init__(self, state: TapState) -> None:
        self.state = state
        self._math_of: dict[tuple[int, str], tuple[Sae, SaeMath]] = {}  # batched encoders, per SAE

    def attach(self, key: str, blob: bytes) -> None:
        """Hold an SAE sent once by the front end (``Sae.to_bytes``) under ``key``, on the
        model's device."""
        param = next(self.state.model.parameters())
        self.state.saes[key] = Sae.from_bytes(blob).to(device=param.device)

    def detach(self, key: str) -> None:
        """Drop the SAE held under ``key`` (requests already admitted keep their reference)."""
        self.state.saes.pop(key, None)

    def _math(self, sae: Sae, device: torch.device) -> SaeMath:
        """``sae``'s batched encoder (:class:`~..sae._math.SaeMath`; a transcoder's with its decoder,
        :class:`~..sae._transcoders.TranscoderMath`) on ``device``, built once."""
        key = (id(sae), str(device))
        held = self._math_of.get(key)
        if held is None or held[0] is not sae:
            kind = TranscoderMath if sae.is_transcoder and sae.has_decoder else SaeMath
            held = self._math_of[key] = (sae, kind(sae, device, onednn=True))
        return held[1]

    def read_features_many(self, readers: list[Slice], value: torch.Tensor, address: Address) -> None:
        """The readouts of every reader at ``address`` this step: per SAE, one encode of all
        their kept rows (keeping what the widest readout asks for) and one copy to the CPU;
        only the readouts are kept."""
        keeps = [sl.positions >= sl.taps.first_readout for sl in readers]
        users: dict[int, tuple[Sae, list[int]]] = {}  # per SAE: it, and the readers reading it
        for index, sl in enumerate(readers):
            if not bool(keeps[index].any()):
                continue
            for spec in sl.taps.readouts_at[address]:
                sae = sl.taps.saes[spec.sae]
                entry = users.setdefault(id(sae), (sae, []))
                if not entry[1] or entry[1][-1] != index:
                    entry[1].append(index)
        for sae, indices in users.values():
            specs = [
                spec
                for index in indices
                for spec in readers[index].taps.readouts_at[address]
                if readers[index].taps.saes[spec.sae] is sae
            ]
            math = self._math(sae, value.device)
            width = max((spec.width(sae.d_sae) for spec in specs if spec.top_k is not None), default=1)
            dense = any(spec.top_k is None for spec in specs)
            rows = torch.cat([torch.nonzero(keeps[i]).flatten() + readers[i].start for i in indices])
            top, ids, error, features = math.read(value[rows.to(value.device)], width, dense=dense)
            kept = math.kept(width)
            layout = SaeLayout(kept, complete=kept >= width or kept == sae.k, dense=dense)
            top, ids = top.to("cpu"), ids.to("cpu")
            error = None if error is None else error.to("cpu")
            features = None if features is None else features.to("cpu")
            whole = {  # each distinct readout once over the batch, then each reader's rows of it
                spec: compact(
                    pick(spec, layout, sae.d_sae, math.sparse, top, ids, error, features), spec.dtype, sae.d_sae
                )
                for spec in dict.fromkeys(specs)
            }
            start = 0
            for index in indices:
                sl, keep = readers[index], keeps[index]
                count = int(keep.sum())
                part = slice(start, start + count)
                start += count
                positions = sl.positions if count == len(keep) else sl.positions[keep]
                for spec in sl.taps.readouts_at[address]:
                    if sl.taps.saes[spec.sae] is sae:
                        sl.taps.readout_values[spec].append((positions, whole[spec][part]))

    def apply_features(self, value: torch.Tensor, group: list[tuple[Slice, WriteTable]]) -> bool:
        """Feature clamps (or ablations) of one SAE for several requests, in one batched pass
        (:meth:`SaeMath.clamp_rows <._static_sae.SaeMath.clamp_rows>`: the clamped features'
        own pre-activations, and a TopK SAE's whole encode only of the rows that need it; whole
        rows: the SAE's address is never sharded). A transcoder's clamps are written here, at its
        output address, from the input rows each request kept earlier in the step
        (:meth:`TranscoderMath.clamp_output <._transcoders.TranscoderMath.clamp_output>`)."""
        rows, features, targets, sources = [], [], [], []
        for sl, table in group:
            local_rows = touched_rows(sl, table)
            if local_rows is None:
                continue
            write = table.write
            if not isinstance(write, FeatureWrite):
                raise BackendError(f"a plain write among feature clamps: {write!r}")
            rows.append(local_rows + sl.start)
            features.append(torch.full((len(local_rows), 1), write.feature, dtype=torch.long))
            targets.append(torch.full((len(local_rows), 1), write.value))
            source = sl.taps.sources.get(write.sae)
            if source is not None:  # a transcoder: the feature is read from its input rows
                kept = sl.sources.get(source)
                if kept is None:
                    raise BackendError(
                        f"the forward reached {write.address}, where {write.sae!r} writes, before {source}, "
                        "where it reads: its clamps need the input first"
                    )
                sources.append(kept[local_rows.to(kept.device)])
        if not rows:
            return False
        sl, table = group[0]
        if not isinstance(table.write, FeatureWrite):
            raise BackendError(f"a plain write among feature clamps: {table.write!r}")
        math = self._math(sl.taps.saes[table.write.sae], value.device)
        index = torch.cat(rows).to(value.device)
        current = value[index]
        feature, target = torch.cat(features).to(value.device), torch.cat(targets).to(value.device)
        if isinstance(math, TranscoderMath):
            out = math.clamp_output(current, torch.cat(sources), feature, target)
        else:
            out = math.clamp_rows(current, feature, target)
        value[index] = out.reshape(current.shape).to(value.dtype)
        return True
