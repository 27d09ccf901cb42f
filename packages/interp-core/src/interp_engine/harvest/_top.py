"""Each feature's top-activating contexts, kept while a harvest streams: the ``n`` highest values
every feature reached (in the top-k readout of its token), with the token's row and position and
the ``window`` tokens either side. Memory is ``n_features x n x (2 * window + 4)`` numbers,
whatever the corpus size.

Ties keep the earlier token (the order is deterministic for a given corpus and settings). Each
shard keeps its own top contexts, merged in shard order by :class:`TopStore`, which saves the
state with each shard, so a resumed harvest continues from the state of the shards the manifest
lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ._manifest import atomic_write_bytes

TOP_FOLDER = "top"


class TopContexts:
    """The running top-``n`` of every feature of one SAE (``n_features``)."""

    def __init__(self, n_features: int, n: int, window: int) -> None:
        self.n_features, self.n, self.window = n_features, n, window
        self.values = torch.full((n_features, n), float("-inf"))
        self.rows = torch.full((n_features, n), -1, dtype=torch.int64)
        self.positions = torch.full((n_features, n), -1, dtype=torch.int64)
        self.contexts = torch.full((n_features, n, 2 * window + 1), -1, dtype=torch.int64)

    def update(self, ids: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, first_row: int) -> None:
        """Fold in one batch: readout ``ids`` / ``values`` ``[rows, n_tok, k]`` (ids ``-1``: none),
        the rows' ``tokens`` ``[rows, n_tok]`` (``-1`` past a row's end), the batch's first row."""
        rows, n_tok, k = ids.shape
        flat_ids = ids.reshape(-1)
        flat_values = values.reshape(-1).float()
        token_index = torch.arange(rows * n_tok).repeat_interleave(k)
        keep = flat_ids >= 0
        flat_ids, flat_values, token_index = flat_ids[keep], flat_values[keep], token_index[keep]
        if flat_ids.numel() == 0:
            return
        # the batch's own top-n per feature: sort by (feature, value descending, token) and rank
        order = torch.argsort(token_index, stable=True)
        order = order[torch.argsort(-flat_values[order], stable=True)]
        order = order[torch.argsort(flat_ids[order], stable=True)]
        features, batch_values, batch_tokens = flat_ids[order], flat_values[order], token_index[order]
        starts = torch.searchsorted(features, features, right=False)
        rank = torch.arange(features.numel()) - starts
        chosen = rank < self.n
        features, batch_values, batch_tokens, rank = (
            features[chosen],
            batch_values[chosen],
            batch_tokens[chosen],
            rank[chosen],
        )
        candidate_values = torch.full((self.n_features, self.n), float("-inf"))
        candidate_rows = torch.full((self.n_features, self.n), -1, dtype=torch.int64)
        candidate_positions = torch.full((self.n_features, self.n), -1, dtype=torch.int64)
        candidate_contexts = torch.full((self.n_features, self.n, 2 * self.window + 1), -1, dtype=torch.int64)
        row, position = batch_tokens // n_tok, batch_tokens % n_tok
        candidate_values[features, rank] = batch_values
        candidate_rows[features, rank] = row + first_row
        candidate_positions[features, rank] = position
        padded = torch.nn.functional.pad(tokens.long(), (self.window, self.window), value=-1)
        offsets = torch.arange(2 * self.window + 1)
        candidate_contexts[features, rank] = padded[row.unsqueeze(1), position.unsqueeze(1) + offsets]
        candidates = TopContexts(self.n_features, self.n, self.window)
        candidates.values, candidates.rows = candidate_values, candidate_rows
        candidates.positions, candidates.contexts = candidate_positions, candidate_contexts
        self.merge(candidates)

    def merge(self, later: TopContexts) -> None:
        """Fold in the top contexts of tokens that come after all of this one's (a later batch,
        or a later shard's own state): the kept ones first, so a tie keeps the earlier token."""
        merged_values = torch.cat([self.values, later.values], dim=1)
        best = torch.sort(merged_values, dim=1, descending=True, stable=True).indices[:, : self.n]
        self.values = merged_values.gather(1, best)
        self.rows = torch.cat([self.rows, later.rows], dim=1).gather(1, best)
        self.positions = torch.cat([self.positions, later.positions], dim=1).gather(1, best)
        contexts = torch.cat([self.contexts, later.contexts], dim=1)
        self.contexts = contexts.gather(1, best.unsqueeze(2).expand(-1, -1, contexts.shape[2]))

    def state(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "rows": self.rows, "positions": self.positions, "contexts": self.contexts}

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        self.values, self.rows = state["values"].clone(), state["rows"].clone()
        self.positions, self.contexts = state["positions"].clone(), state["contexts"].clone()

    def feature(self, feature: int) -> list[dict[str, object]]:
        """Feature ``feature``'s top contexts, highest first: ``value``, ``row``, ``position`` and
        ``tokens`` (``window`` either side; the activating token is the middle one; ``-1``: past
        a row's edge)."""
        out: list[dict[str, object]] = []
        for slot in range(self.n):
            value = float(self.values[feature, slot])
            if value == float("-inf"):
                break
            out.append(
                {
                    "value": value,
                    "row": int(self.rows[feature, slot]),
                    "position": int(self.positions[feature, slot]),
                    "tokens": self.contexts[feature, slot].tolist(),
                }
            )
        return out


class TopStore:
    """The top contexts of each SAE (``widths``: its features) over the shards done so far,
    merged in shard order whatever order the shards finish in (Ray replicas finish them out of
    order). ``top/<sae>/after_NNNNN.safetensors`` holds the merged state of the first ``prefix``
    shards; a shard done past a shard not yet done waits, its own state in
    ``top/<sae>/shard_NNNNN.safetensors``, until the shards before it are in. Built from the
    shards the manifest lists (``done``), it continues exactly where the run stopped."""

    def __init__(self, folder: Path, widths: Mapping[str, int], n: int, window: int, done: set[int]) -> None:
        self.folder, self.widths, self.n, self.window = folder, dict(widths), n, window
        self.prefix = 0
        while self.prefix in done:
            self.prefix += 1
        self.merged = {sae: self._load(sae, _after(self.prefix)) if self.prefix else self._new(sae) for sae in widths}
        self.waiting: dict[int, dict[str, TopContexts]] = {}
        for index in sorted(done):
            if index > self.prefix:
                self.waiting[index] = {sae: self._load(sae, _alone(index)) for sae in widths}

    def _new(self, sae: str) -> TopContexts:
        return TopContexts(self.widths[sae], self.n, self.window)

    def _load(self, sae: str, name: str) -> TopContexts:
        from safetensors.torch import load_file

        top = self._new(sae)
        top.load(load_file(str(self.folder / TOP_FOLDER / sae / name)))
        return top

    def _save(self, sae: str, name: str, top: TopContexts) -> None:
        from safetensors.torch import save

        path = self.folder / TOP_FOLDER / sae / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, save({k: v.contiguous() for k, v in top.state().items()}))

    def add(self, index: int, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Shard ``index``'s own states (by SAE), saved before the manifest lists the shard."""
        tops = {}
        for sae in self.widths:
            tops[sae] = self._new(sae)
            tops[sae].load(states[sae])
        if index != self.prefix:
            for sae, top in tops.items():
                self._save(sae, _alone(index), top)
            self.waiting[index] = tops
            return
        while True:
            for sae, top in tops.items():
                self.merged[sae].merge(top)
            self.prefix += 1
            if self.prefix not in self.waiting:
                break
            tops = self.waiting.pop(self.prefix)
        for sae, top in self.merged.items():
            self._save(sae, _after(self.prefix), top)

    def prune(self) -> None:
        """Remove the states the manifest no longer needs (run after it lists the shards added)."""
        for sae in self.widths:
            for path in (self.folder / TOP_FOLDER / sae).glob("*.safetensors"):
                kind, _, number = path.stem.partition("_")
                if (kind == "after" and int(number) != self.prefix) or (kind == "shard" and int(number) < self.prefix):
                    path.unlink(missing_ok=True)


def _after(n_shards: int) -> str:
    return f"after_{n_shards:05d}.safetensors"


def _alone(index: int) -> str:
    return f"shard_{index:05d}.safetensors"
