"""``attribution_graph``: direct effects between transcoder features in the frozen-linear
replacement model of one prompt (the eager backend).

The backend's :meth:`linearize` (``interp_eager``) runs the prompt once and freezes its attention
patterns and norm scales; the MLPs' outputs become constants and the replacement's features the
nodes. In that model every target -- a feature's pre-activation ``x_L[p] . enc_i + b_i``, or a
logit minus the mean logit (before any final soft-cap, Gemma 2's: the unembedding's output) --
is an affine function of what is written at the embeddings and the
MLP outputs, so one backward pass gives the gradient ``g`` there and each source's direct effect
is exact:

- a feature (layer ``L``, position ``p``, activation ``a``): ``a * sum_{L'} dec_{L->L'} . g_{L'}[p]``
  over the MLP outputs it writes (its own layer for a PLT; that and every later one for a CLT);
- an error node: ``(mlp_out_L[p] - reconstruction_L[p]) . g_L[p]``;
- an embedding: ``token_embedding[p] . g_embed[p]`` (the token's embedding; anything else the
  model adds before layer 0, such as GPT-2's position embeddings, is a constant term).

A skip transcoder's skip path (``x @ W_skip.T``, linear in its input) stays in the linear model:
gradient flows through it, so it is part of the edges, not a node.

Targets are batched: the prompt runs once as ``batch_size`` identical rows with its graph kept,
and each backward seeds a different target in each row. ``max_memory`` bounds what that forward
keeps (measured on one row, with the gradients the batch returns). Rows are computed for every
logit, then for features in order of their influence on the logits as known so far
(``max_feature_nodes`` caps how many; by default all). A feature whose row is never computed is
not a node; its contributions are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CaptureMemoryExceeded, InvalidOption, UnsupportedOperation, UnsupportedSae
from .._sync import SyncModel, sync_model
from ..protocol._protocol import InterpModel
from ._graph import AttributionGraph, Node, normalised
from ._transcoders import Replacement, as_replacement, reconstruct_from

_GATHER_ELEMENTS = 1 << 24
"""At most this many floats in one gathered [rows, features, d_model] block."""


@dataclass
class _Features:
    """The active features of the prompt, in (layer, position, feature) order."""

    layer: torch.Tensor
    position: torch.Tensor
    feature: torch.Tensor
    activation: torch.Tensor
    pre: torch.Tensor
    spans: dict[int, tuple[int, int]]
    """Per layer, its features' [start, end) in this order."""

    def __len__(self) -> int:
        return int(self.layer.numel())


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is an optional extra
                self.bar = None
            else:
                self.bar = tqdm(total=total, desc="attribution", unit="node")

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_fits(replacement: Replacement, n_layers: int, d_model: int) -> None:
    for layer in replacement.layers:
        if layer >= n_layers:
            raise UnsupportedSae(f"the transcoders replace layer {layer}, but the model has {n_layers} layers")
    if replacement.d_in != d_model or replacement.d_out != d_model:
        raise UnsupportedSae(
            f"the transcoders read width {replacement.d_in} and write width {replacement.d_out}, but this model's "
            f"d_model is {d_model}: they were trained on another model"
        )


def _active(
    replacement: Replacement, inputs: dict[int, torch.Tensor], skip_first: bool
) -> tuple[_Features, dict[int, torch.Tensor]]:
    layers, positions, features, acts, pres = [], [], [], [], []
    spans: dict[int, tuple[int, int]] = {}
    dense: dict[int, torch.Tensor] = {}
    start = 0
    for layer in replacement.layers:
        x = inputs[layer]
        pre = replacement.pre_acts(layer, x)
        a = replacement.encode(layer, x)
        if skip_first:
            a[0] = 0
        dense[layer] = a
        pos, feat = torch.nonzero(a, as_tuple=True)
        layers.append(torch.full_like(pos, layer))
        positions.append(pos)
        features.append(feat)
        acts.append(a[pos, feat])
        pres.append(pre[pos, feat])
        spans[layer] = (start, start + int(pos.numel()))
        start += int(pos.numel())
    cat = torch.cat
    return _Features(cat(layers), cat(positions), cat(features), cat(acts), cat(pres), spans), dense


def _logit_targets(
    logits: torch.Tensor, targets: Sequence[int] | None, max_n_logits: int, desired_logit_prob: float
) -> tuple[list[int], list[float]]:
    probs = torch.softmax(logits.double(), -1).float()
    if targets is not None:
        ids = [int(t) for t in targets]
        for t in ids:
            if not 0 <= t < logits.numel():
                raise InvalidOption(f"target token {t} is outside the vocabulary (0..{logits.numel() - 1})")
        return ids, [float(probs[t]) for t in ids]
    order = torch.argsort(probs, descending=True)
    ids, total = [], 0.0
    for t in order.tolist():
        ids.append(int(t))
        total += float(probs[t])
        if total >= desired_logit_prob or len(ids) >= max_n_logits:
            break
    return ids, [float(probs[t]) for t in ids]


class _Rows:
    """Turns the gradients at the probes into rows of direct effects over every source column:
    ``[features | errors (layer-major) | embeddings]``."""

    def __init__(
        self,
        replacement: Replacement,
        feats: _Features,
        errors: dict[int, torch.Tensor],
        embed: torch.Tensor,
        n_layers: int,
    ) -> None:
        self.rep = replacement
        self.feats = feats
        self.errors = errors
        self.embed = embed
        self.n_layers = n_layers
        self.n_pos = int(embed.shape[0])
        self.n_feat = len(feats)
        self.columns = self.n_feat + (n_layers + 1) * self.n_pos
        # activation-scaled decoder rows per (source layer, output layer): [m, d_model]
        self.scaled: dict[tuple[int, int], torch.Tensor] = {}
        for layer, (s, e) in feats.spans.items():
            if e == s:
                continue
            for out in replacement.out_layers(layer):
                rows = replacement.decoder(layer, out).to(embed.device)[feats.feature[s:e]]
                self.scaled[(layer, out)] = rows * feats.activation[s:e, None]

    def __call__(self, g_embed: torch.Tensor, g_out: dict[int, torch.Tensor]) -> torch.Tensor:
        rows = g_embed.shape[0]
        out = torch.zeros(rows, self.columns, device=g_embed.device)
        for (layer, target), scaled in self.scaled.items():
            s, e = self.feats.spans[layer]
            pos = self.feats.position[s:e]
            g = g_out[target]
            chunk = max(1, _GATHER_ELEMENTS // max(1, rows * g.shape[-1]))
            for i in range(0, e - s, chunk):
                gathered = g[:, pos[i : i + chunk]]  # [rows, m, d]
                out[:, s + i : s + i + gathered.shape[1]] += torch.einsum("bmd,md->bm", gathered, scaled[i : i + chunk])
        base = self.n_feat
        for layer in range(self.n_layers):
            out[:, base : base + self.n_pos] = (g_out[layer] * self.errors[layer]).sum(-1)
            base += self.n_pos
        out[:, base : base + self.n_pos] = (g_embed * self.embed).sum(-1)
        return out


def attribution_graph(
    model: InterpModel | SyncModel,
    prompt: str | Sequence[int] | torch.Tensor,
    transcoders: Any,
    *,
    targets: Sequence[int | str] | None = None,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_feature_nodes: int | None = None,
    batch_size: int = 32,
    max_memory: int | None = None,
    exclude_first_position: bool = True,
    node_threshold: float | None = None,
    edge_threshold: float | None = None,
    progress: bool = False,
    update_interval: int = 4,
) -> AttributionGraph:
    """The attribution graph of ``prompt`` over the replacement model that ``transcoders`` make of
    ``model`` (eager backend; module docstring for the maths).

    - ``transcoders``: a :class:`~interp_engine.circuits.TranscoderSet` (per-layer transcoders), a
      :class:`~interp_engine.circuits.CrossLayerTranscoder`, a list of transcoder SAEs, or what
      :func:`~interp_engine.circuits.load_transcoders` read.
    - logit nodes: ``targets`` (token ids, or strings that are one token each), else the most
      likely next tokens until their probabilities sum to ``desired_logit_prob``, at most
      ``max_n_logits``. A logit node's value is its logit minus the mean logit.
    - ``max_feature_nodes``: compute rows for at most this many features (the most influential
      first); default every active feature.
    - ``batch_size``: targets per backward pass (the prompt's rows in the one forward);
      ``max_memory`` (bytes) lowers it so that what the forward keeps, measured on one row, and the
      gradients of a batch fit; ``CaptureMemoryExceeded`` when one row does not.
    - ``exclude_first_position``: features at position 0 (the BOS token's, often very large) are
      no nodes; their output stays in the position-0 error nodes.
    - ``node_threshold``/``edge_threshold``: prune the result (:meth:`AttributionGraph.prune`).
    - ``progress``: a tqdm progress bar over the rows computed.
    """
    started = time.perf_counter()
    facade = sync_model(model)
    base = facade.model
    linearize: Callable[..., Any] | None = getattr(base, "linearize", None)
    if linearize is None:
        raise UnsupportedOperation(
            f"attribution graphs need gradients (the {getattr(base, 'backend', type(base).__name__)} backend runs no "
            "backward pass): load_model(path, backend='eager'); a steering spec made from the graph "
            "(graph.steering_spec) runs on every backend"
        )
    replacement = as_replacement(transcoders)
    info = base.info
    _check_fits(replacement, info.n_layers, info.d_model)
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("max_n_logits", max_n_logits, 1),
        ("update_interval", update_interval, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidOption(f"{name} must be an int >= {low}, got {value!r}")
    if not 0.0 < float(desired_logit_prob) <= 1.0:
        raise InvalidOption(f"desired_logit_prob is a probability in (0, 1], got {desired_logit_prob!r}")
    if isinstance(prompt, str):
        tokens = [int(t) for t in base.to_tokens(prompt)[0].tolist()]
    elif isinstance(prompt, torch.Tensor):
        tokens = [int(t) for t in prompt.flatten().tolist()]
    else:
        tokens = [int(t) for t in prompt]
    target_ids = None
    if targets is not None:
        target_ids = [_target_id(base, tokens, t) for t in targets]

    frozen = linearize(tokens, replacement.input_kind)
    clean = frozen.clean
    n_layers, n_pos = info.n_layers, len(tokens)
    device = clean.embed.device
    feats, dense = _active(replacement, clean.inputs, exclude_first_position)
    recon = reconstruct_from(replacement, dense, clean.inputs)
    skips = {layer: w for layer in replacement.layers if (w := replacement.skip(layer)) is not None}
    errors = {
        layer: clean.mlp_out[layer] - (recon[layer].to(device) if layer in recon else 0.0) for layer in range(n_layers)
    }
    logit_ids, logit_probs = _logit_targets(clean.logits, target_ids, max_n_logits, desired_logit_prob)
    make_rows = _Rows(replacement, feats, errors, clean.token_embed, n_layers)
    n_feat = len(feats)
    limit = n_feat if max_feature_nodes is None else max(0, min(int(max_feature_nodes), n_feat))

    per_row = None
    rows = batch_size
    if max_memory is not None:
        per_row = frozen.saved_bytes_per_row() + 4 * (n_layers + 1) * n_pos * info.d_model + 4 * make_rows.columns
        rows = min(batch_size, int(max_memory) // per_row)
        if rows < 1:
            raise CaptureMemoryExceeded(
                f"one row of the frozen-linear forward keeps {per_row} bytes for the backward, over max_memory="
                f"{max_memory}; raise max_memory or shorten the prompt",
                needed=per_row,
                limit=int(max_memory),
                option="max_memory",
            )
    run = frozen.run(rows, skips=skips)
    probes = [run.embed_probe] + [run.mlp_out_probes[layer] for layer in range(n_layers)]
    backward_passes = 0

    def backward(outputs: list[torch.Tensor], seeds: list[torch.Tensor], last: bool) -> torch.Tensor:
        nonlocal backward_passes
        backward_passes += 1
        grads = torch.autograd.grad(outputs, probes, seeds, retain_graph=not last, allow_unused=True)
        filled = [torch.zeros_like(p) if g is None else g for p, g in zip(probes, grads, strict=True)]
        return make_rows(filled[0].float(), {layer: filled[layer + 1].float() for layer in range(n_layers)})

    vocab = clean.logits.numel()
    bar = _Progress(len(logit_ids) + limit, progress)
    logit_rows = []
    for i in range(0, len(logit_ids), rows):
        chunk = logit_ids[i : i + rows]
        seed = torch.zeros(rows, vocab, device=run.logits.device)
        seed[: len(chunk)] -= 1.0 / vocab
        seed[torch.arange(len(chunk)), torch.tensor(chunk)] += 1.0
        logit_rows.append(backward([run.logits], [seed], last=limit == 0 and i + rows >= len(logit_ids))[: len(chunk)])
        bar.update(len(chunk))
    logit_matrix = torch.cat(logit_rows).cpu()

    feature_rows = torch.zeros(limit, make_rows.columns)
    order: list[int] = []
    visited = torch.zeros(n_feat, dtype=torch.bool)
    encoders = {layer: replacement.encoder(layer).to(device) for layer in replacement.layers}
    while len(order) < limit:
        if limit == n_feat:
            pending = [i for i in range(n_feat) if not visited[i]]
        else:
            scores = _partial_influence(
                logit_matrix, torch.tensor(logit_probs), feature_rows[: len(order)], order, n_feat
            )
            ranked = torch.argsort(scores, descending=True).tolist()
            pending = [i for i in ranked if not visited[i]][: min(update_interval * rows, limit - len(order))]
        for start in range(0, len(pending), rows):
            batch = pending[start : start + rows]
            outputs, seeds = [], []
            for layer in replacement.layers:
                picked = [(b, i) for b, i in enumerate(batch) if int(feats.layer[i]) == layer]
                if not picked:
                    continue
                seed = torch.zeros_like(run.inputs[layer])
                for b, i in picked:
                    seed[b, int(feats.position[i])] = encoders[layer][:, int(feats.feature[i])]
                outputs.append(run.inputs[layer])
                seeds.append(seed)
            done = len(order) + len(batch) >= limit
            computed = backward(outputs, seeds, last=done)[: len(batch)].cpu()
            feature_rows[len(order) : len(order) + len(batch)] = computed
            order += batch
            visited[torch.tensor(batch)] = True
            bar.update(len(batch))
    bar.close()
    probes.clear()  # the forward's graph goes with its probes
    del run

    graph = _assemble(
        base,
        tokens,
        replacement,
        feats,
        order,
        feature_rows,
        logit_matrix,
        logit_ids,
        logit_probs,
        clean,
        errors,
        make_rows,
        n_layers,
    )
    graph.meta.update(
        method="attribution graph (frozen-linear replacement model)",
        replacement=repr(replacement),
        batch_size=rows,
        backward_passes=backward_passes,
        saved_bytes_per_row=per_row,
        active_features=n_feat,
        seconds=time.perf_counter() - started,
    )
    if node_threshold is not None or edge_threshold is not None:
        graph = graph.prune(
            0.8 if node_threshold is None else node_threshold, 0.98 if edge_threshold is None else edge_threshold
        )
    return graph


def _target_id(base: Any, tokens: list[int], target: int | str) -> int:
    """A logit target's id: an int as is; a string, the one token it adds after the prompt."""
    if not isinstance(target, str):
        return int(target)
    text = str(base.to_string(tokens))
    before = base.to_tokens(text)[0].tolist()
    after = base.to_tokens(text + target)[0].tolist()
    if len(after) != len(before) + 1 or after[: len(before)] != before:
        raise InvalidOption(
            f"target {target!r} is not one token after the prompt ({len(after) - len(before)} tokens); "
            "a logit target is one token: pass its id"
        )
    return int(after[-1])


def _partial_influence(
    logit_rows: torch.Tensor, probs: torch.Tensor, feature_rows: torch.Tensor, order: list[int], n_feat: int
) -> torch.Tensor:
    """Each feature's influence on the logits through the rows computed so far."""
    norm_logits = normalised(logit_rows)
    norm_feats = normalised(feature_rows) if len(order) else feature_rows
    current = probs @ norm_logits
    total = current.clone()
    index = torch.tensor(order, dtype=torch.long)
    for _ in range(10_000):
        if not len(order):
            break
        current = current[index] @ norm_feats
        if not bool(current.any()):
            break
        total += current
    return total[:n_feat]


def _assemble(
    base: Any,
    tokens: list[int],
    replacement: Replacement,
    feats: _Features,
    order: list[int],
    feature_rows: torch.Tensor,
    logit_matrix: torch.Tensor,
    logit_ids: list[int],
    logit_probs: list[float],
    clean: Any,
    errors: dict[int, torch.Tensor],
    make_rows: _Rows,
    n_layers: int,
) -> AttributionGraph:
    n_pos = len(tokens)
    selected = sorted(order)
    position_in_order = {f: i for i, f in enumerate(order)}
    n_sel = len(selected)
    n_feat = len(feats)
    columns = torch.cat([torch.tensor(selected, dtype=torch.long), torch.arange(n_feat, make_rows.columns)])
    n_nodes = n_sel + (n_layers + 1) * n_pos + len(logit_ids)
    adjacency = torch.zeros(n_nodes, n_nodes)
    values = torch.zeros(n_nodes)
    for row, f in enumerate(selected):
        adjacency[row, : columns.numel()] = feature_rows[position_in_order[f], columns]
        values[row] = float(feats.pre[f])
    logit_start = n_nodes - len(logit_ids)
    adjacency[logit_start:, : columns.numel()] = logit_matrix[:, columns]
    raw = clean.logits_raw
    for k, t in enumerate(logit_ids):
        values[logit_start + k] = float(raw[t]) - float(raw.mean())
    strings = [_piece(base, t) for t in tokens]
    nodes: list[Node] = []
    decoders: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for row, f in enumerate(selected):
        layer = int(feats.layer[f])
        nodes.append(
            Node(
                row,
                "feature",
                layer,
                int(feats.position[f]),
                int(feats.feature[f]),
                activation=float(feats.activation[f]),
            )
        )
        s, _ = feats.spans[layer]
        decoders[row] = [
            (out, make_rows.scaled[(layer, out)][f - s].detach().cpu()) for out in replacement.out_layers(layer)
        ]
    error_nodes: dict[int, torch.Tensor] = {}
    for layer in range(n_layers):
        for p in range(n_pos):
            index = len(nodes)
            nodes.append(Node(index, "error", layer, p))
            error_nodes[index] = errors[layer][p].detach().cpu()
    embeds: dict[int, torch.Tensor] = {}
    for p in range(n_pos):
        index = len(nodes)
        nodes.append(Node(index, "embedding", None, p, token=tokens[p], label=strings[p]))
        embeds[index] = clean.token_embed[p].detach().cpu()
    for k, t in enumerate(logit_ids):
        nodes.append(
            Node(len(nodes), "logit", n_layers, n_pos - 1, token=t, probability=logit_probs[k], label=_piece(base, t))
        )
    visited = torch.zeros(n_nodes, dtype=torch.bool)
    visited[:n_sel] = True
    visited[logit_start:] = True
    return AttributionGraph(
        tokens=tokens,
        token_strings=strings,
        n_layers=n_layers,
        nodes=nodes,
        adjacency=adjacency,
        values=values,
        visited=visited,
        replacement=replacement,
        decoders=decoders,
        errors=error_nodes,
        embeddings=embeds,
        meta={},
    )


def _piece(base: Any, token: int) -> str:
    try:
        return str(base.to_string([token]))
    except Exception:  # a tokenizer that cannot decode one id alone
        return f"<{token}>"
