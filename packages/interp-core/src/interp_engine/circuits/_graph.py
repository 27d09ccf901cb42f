"""The attribution graph: nodes, direct-effect edges, influence, pruning, paths, export.

An :class:`AttributionGraph` holds the nodes of one prompt's replacement model, in the order

    features (layer, position, feature id; ascending) | errors (layer-major) | embeddings | logits

and ``adjacency[target, source]``: the direct effect of ``source`` on ``target`` in the
frozen-linear replacement model (a feature's pre-activation, or a logit minus the mean logit).
Rows are computed for every logit and for the features the attribution visited; error and
embedding nodes have no incoming edges.

*Influence* is how much each node reaches the logits through all paths: with ``Â`` the
adjacency's absolute values, each row normalised to sum 1, and ``w`` the logit nodes' weights (their
probabilities), a node's influence is ``(w Â + w Â² + ...)``. Pruning keeps the nodes holding a
``node_threshold`` share of the total influence, then the edges holding an ``edge_threshold``
share of the edge influence on the kept graph (an edge's influence: its normalised weight times
its target's influence plus weight), and drops nodes left with no outgoing edge (features, errors)
or no incoming one (features). Logits and embeddings are always kept.

:meth:`AttributionGraph.to_json` writes the JSON the Neuronpedia graph viewer reads: the schema of
circuit-tracer's ``frontend/graph_models.py`` (``metadata``, ``qParams``, ``nodes``, ``links``),
as of circuit-tracer 0.5.0 (:data:`NEURONPEDIA_SCHEMA`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._errors import InvalidOption

NodeKind = Literal["feature", "error", "embedding", "logit"]
NEURONPEDIA_SCHEMA = "circuit-tracer 0.5.0 frontend graph_models (Neuronpedia graph viewer)"
"""The schema :meth:`AttributionGraph.to_json` writes."""

_FEATURE_TYPES = {
    "feature": "cross layer transcoder",
    "error": "mlp reconstruction error",
    "embedding": "embedding",
    "logit": "logit",
}


@dataclass(frozen=True)
class Node:
    """One node of an attribution graph.

    ``kind``: ``"feature"`` (a transcoder feature active at ``layer``, ``position``; ``feature``
    its id, ``activation`` its value), ``"error"`` (layer ``layer``'s MLP reconstruction error at
    ``position``), ``"embedding"`` (the token at ``position``; ``token`` its id), ``"logit"`` (the
    output ``token`` at the last position, ``probability`` its probability; ``layer`` is the
    number of layers). ``index`` is its row and column in :attr:`AttributionGraph.adjacency`.

    ``id`` is its node id in the exported JSON: ``"{layer}_{feature}_{position}"`` for a feature,
    ``"E_{token}_{position}"`` for an embedding and ``"{n_layers + 1}_{token}_{position}"`` for a
    logit, as circuit-tracer writes them; ``"err_{layer}_{position}"`` for an error (circuit-tracer
    writes ``0_{layer}_{position}``, which can equal a layer-0 feature's id)."""

    index: int
    kind: NodeKind
    layer: int | None
    position: int
    feature: int | None = None
    token: int | None = None
    activation: float | None = None
    probability: float | None = None
    label: str = ""

    @property
    def id(self) -> str:
        if self.kind == "feature":
            return f"{self.layer}_{self.feature}_{self.position}"
        if self.kind == "error":
            return f"err_{self.layer}_{self.position}"
        if self.kind == "embedding":
            return f"E_{self.token}_{self.position}"
        return f"{int(self.layer or 0) + 1}_{self.token}_{self.position}"

    def __str__(self) -> str:
        if self.kind == "feature":
            return f"feature {self.feature} @ layer {self.layer}, pos {self.position} (act {self.activation:.3g})"
        if self.kind == "error":
            return f"error @ layer {self.layer}, pos {self.position}"
        if self.kind == "embedding":
            return f"embedding {self.label!r} @ pos {self.position}"
        return f"logit {self.label!r} (p={self.probability:.3f})"


@dataclass(frozen=True)
class Path:
    """A path through the graph, source first, and its score: the product of the normalised
    absolute edge weights along it times the final logit's probability (its share of the logit
    node's influence)."""

    nodes: tuple[Node, ...]
    score: float
    weights: tuple[float, ...]
    """The raw edge weights along the path."""

    def __str__(self) -> str:
        return " -> ".join(str(n) for n in self.nodes) + f"  [score {self.score:.3g}]"


def normalised(adjacency: torch.Tensor) -> torch.Tensor:
    """``|A|`` with each row divided by its sum (rows of zeros stay zero)."""
    a = adjacency.abs()
    return a / a.sum(dim=1, keepdim=True).clamp(min=1e-12)


def influence(adjacency: torch.Tensor, weights: torch.Tensor, *, max_iter: int = 10_000) -> torch.Tensor:
    """``w Â + w Â² + ...`` over the (acyclic) graph: the series stops once a term is all zero."""
    a = normalised(adjacency)
    term = weights @ a
    total = term.clone()
    for _ in range(max_iter):
        if not bool(term.any()):
            return total
        term = term @ a
        total += term
    raise InvalidOption("the adjacency matrix is not acyclic: influence does not converge")


def _threshold(scores: torch.Tensor, share: float) -> float:
    """The smallest score kept when keeping the largest scores that hold ``share`` of their sum."""
    ordered = torch.sort(scores.flatten(), descending=True).values
    total = float(ordered.sum())
    if total <= 0:
        return math.inf
    cumulative = torch.cumsum(ordered, 0) / total
    index = min(int(torch.searchsorted(cumulative, torch.tensor(share, dtype=cumulative.dtype))), len(ordered) - 1)
    return float(ordered[index])


@dataclass
class AttributionGraph:
    """One prompt's attribution graph (module docstring for the node order and influence).

    ``tokens``/``token_strings``: the prompt; ``n_layers``; ``nodes``; ``adjacency [N, N]`` (target,
    source); ``values [N]``: each node's target value on the prompt (a feature's pre-activation, a
    logit minus the mean logit; 0 for errors and embeddings), so ``values - adjacency.sum(1)`` is
    each row's constant term (biases); ``visited``: the rows that were computed (every logit, the
    features attributed); ``edge_mask``: edges kept by pruning (all ``True`` unpruned);
    ``transcoder_names``: the names the transcoders are attached under (for
    :meth:`steering_spec`); ``meta``: how it was computed.
    """

    tokens: list[int]
    token_strings: list[str]
    n_layers: int
    nodes: list[Node]
    adjacency: torch.Tensor
    values: torch.Tensor
    visited: torch.Tensor
    replacement: Any = None
    """The :class:`~interp_engine.circuits.TranscoderSet` or :class:`CrossLayerTranscoder` used."""
    decoders: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict, repr=False)
    """Per feature node index: ``(output layer, activation x decoder row)`` for each MLP output it writes."""
    errors: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    """Per error node index: the error vector ``[d_model]``."""
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    edge_mask: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.edge_mask is None:
            self.edge_mask = self.adjacency != 0
        self._by_id = {n.id: n for n in self.nodes}

    def __repr__(self) -> str:
        counts = {k: sum(1 for n in self.nodes if n.kind == k) for k in ("feature", "error", "embedding", "logit")}
        return (
            f"AttributionGraph({len(self.tokens)} tokens, {counts['feature']} features, {counts['error']} errors, "
            f"{counts['embedding']} embeddings, {counts['logit']} logits, {int(self._kept().sum())} edges)"
        )

    def _kept(self) -> torch.Tensor:
        """The kept edges: ``edge_mask`` (set at construction), else every nonzero one."""
        return self.adjacency != 0 if self.edge_mask is None else self.edge_mask

    # -- nodes -------------------------------------------------------------------------------------
    def node(self, key: str | int | tuple[Any, ...]) -> Node:
        """A node by its id (``"2_17_5"``: layer 2, feature 17, position 5; ``"err_2_5"``: error;
        ``"E_464_0"``: embedding; ``"5_7_5"``: logit of token 7 in a 4-layer model), its index,
        or ``("feature", layer, position, feature)`` / ``("error", layer, position)`` /
        ``("embedding", position)`` / ``("logit", token)``."""
        if isinstance(key, bool):
            raise InvalidOption(f"a node key is an id, an index or a tuple, got {key!r}")
        if isinstance(key, int):
            if not 0 <= key < len(self.nodes):
                raise InvalidOption(f"node index {key} out of range: the graph has {len(self.nodes)} nodes")
            return self.nodes[key]
        if isinstance(key, str):
            found = self._by_id.get(key)
            if found is None:
                raise InvalidOption(f"no node with id {key!r}; ids look like {', '.join(n.id for n in self.nodes[:3])}")
            return found
        if isinstance(key, tuple) and key:
            kind, rest = key[0], tuple(key[1:])
            for n in self.nodes:
                if n.kind != kind:
                    continue
                fields = {
                    "feature": (n.layer, n.position, n.feature),
                    "error": (n.layer, n.position),
                    "embedding": (n.position,),
                    "logit": (n.token,),
                }.get(kind)
                if fields == rest:
                    return n
            raise InvalidOption(f"no node {key!r} in this graph")
        raise InvalidOption(f"a node key is an id, an index or a tuple, got {type(key).__name__}")

    def nodes_of(self, kind: NodeKind) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    def logit_weights(self) -> torch.Tensor:
        w = torch.zeros(len(self.nodes))
        for n in self.nodes:
            if n.kind == "logit":
                w[n.index] = float(n.probability or 0.0)
        return w

    def _masked(self) -> torch.Tensor:
        return self.adjacency * self._kept()

    def influence(self) -> torch.Tensor:
        """Each node's influence on the logits ``[N]`` (module docstring)."""
        return influence(self._masked(), self.logit_weights())

    def edges(
        self, node: str | int | tuple[Any, ...], direction: Literal["in", "out"] = "in"
    ) -> list[tuple[Node, float]]:
        """The kept edges into (``"in"``) or out of (``"out"``) a node: ``(other node, weight)``,
        largest absolute weight first."""
        n = self.node(node)
        a = self._masked()
        row = a[n.index] if direction == "in" else a[:, n.index]
        idx = torch.nonzero(row).flatten().tolist()
        pairs = [(self.nodes[i], float(row[i])) for i in idx]
        return sorted(pairs, key=lambda p: -abs(p[1]))

    # -- pruning -----------------------------------------------------------------------------------
    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """The subgraph of the most influential nodes and edges (module docstring); thresholds are
        shares of the total influence in ``[0, 1]``."""
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise InvalidOption(f"{name} is a share of the total influence in [0, 1], got {value!r}")
        a = self._masked()
        w = self.logit_weights()
        node_scores = influence(a, w)
        keep = node_scores >= _threshold(node_scores, node_threshold)
        always = torch.tensor([n.kind in ("logit", "embedding") for n in self.nodes])
        keep |= always
        pruned = a.clone()
        pruned[~keep] = 0
        pruned[:, ~keep] = 0
        norm = normalised(pruned)
        target_scores = influence(pruned, w) + w
        edge_scores = norm * target_scores[:, None]
        edges = (edge_scores >= _threshold(edge_scores, edge_threshold)) & (pruned != 0)
        needs_out = torch.tensor([n.kind in ("feature", "error") for n in self.nodes])
        needs_in = torch.tensor([n.kind == "feature" for n in self.nodes])
        while True:
            before = keep.clone()
            keep &= ~needs_out | edges.any(0)
            keep &= ~needs_in | edges.any(1) | ~self.visited
            keep |= always
            edges[~keep] = False
            edges[:, ~keep] = False
            if bool((keep == before).all()):
                break
        return self.subgraph(
            [n.index for n in self.nodes if keep[n.index]], edge_mask=edges, note=(node_threshold, edge_threshold)
        )

    def subgraph(
        self,
        nodes: Iterable[str | int | tuple[Any, ...] | Node],
        *,
        edge_mask: torch.Tensor | None = None,
        note: tuple[float, float] | None = None,
    ) -> AttributionGraph:
        """The graph restricted to ``nodes`` (ids, indices, tuples or :class:`Node`), edges among
        them kept (and, with ``edge_mask [N, N]`` over this graph's nodes, only those)."""
        picked = sorted({(n.index if isinstance(n, Node) else self.node(n).index) for n in nodes})
        index = torch.tensor(picked, dtype=torch.long)
        mask = self._masked() != 0 if edge_mask is None else edge_mask & (self._masked() != 0)
        remap = {old: new for new, old in enumerate(picked)}
        new_nodes = [_reindexed(self.nodes[old], remap[old]) for old in picked]
        meta = dict(self.meta)
        if note is not None:
            meta["node_threshold"], meta["edge_threshold"] = note
        return AttributionGraph(
            tokens=self.tokens,
            token_strings=self.token_strings,
            n_layers=self.n_layers,
            nodes=new_nodes,
            adjacency=self.adjacency[index][:, index],
            values=self.values[index],
            visited=self.visited[index],
            replacement=self.replacement,
            decoders={remap[k]: v for k, v in self.decoders.items() if k in remap},
            errors={remap[k]: v for k, v in self.errors.items() if k in remap},
            embeddings={remap[k]: v for k, v in self.embeddings.items() if k in remap},
            edge_mask=mask[index][:, index],
            meta=meta,
        )

    # -- paths -------------------------------------------------------------------------------------
    def top_paths(self, k: int = 5, *, target: str | int | tuple[Any, ...] | None = None, beam: int = 64) -> list[Path]:
        """The ``k`` highest-scoring paths ending at a logit (``target``; default every logit),
        each starting at a node with no incoming edge (an embedding or an error, or a feature whose
        row was not computed), found by a beam search of width ``beam`` backwards from the logits.
        A path's score is its share of the logit's influence (:class:`Path`)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidOption(f"k is a number of paths >= 1, got {k!r}")
        a = self._masked()
        norm = normalised(a)
        ends = [self.node(target)] if target is not None else self.nodes_of("logit")
        frontier: list[tuple[tuple[int, ...], float]] = [((e.index,), float(e.probability or 1.0)) for e in ends]
        done: list[tuple[tuple[int, ...], float]] = []
        while frontier:
            grown: list[tuple[tuple[int, ...], float]] = []
            for path, score in frontier:
                head = path[0]
                sources = torch.nonzero(a[head]).flatten().tolist()
                if not sources:
                    if len(path) > 1:
                        done.append((path, score))
                    continue
                for s in sources:
                    grown.append(((s, *path), score * float(norm[head, s])))
            grown.sort(key=lambda p: -p[1])
            frontier = grown[:beam]
            done.sort(key=lambda p: -p[1])
            done = done[: max(k, beam)]
            if frontier and done and len(done) >= k and frontier[0][1] < done[k - 1][1]:
                break
        done.sort(key=lambda p: -p[1])
        out = []
        for path, score in done[:k]:
            weights = tuple(float(a[path[i + 1], path[i]]) for i in range(len(path) - 1))
            out.append(Path(tuple(self.nodes[i] for i in path), score, weights))
        return out

    # -- interventions -----------------------------------------------------------------------------
    def steering_spec(
        self,
        nodes: Iterable[str | int | tuple[Any, ...] | Node],
        *,
        op: Literal["ablate", "clamp", "scale"] = "ablate",
        value: float = 0.0,
        mode: Literal["constant", "features"] = "constant",
    ) -> Any:
        """A steering spec that intervenes on ``nodes`` at their positions, for any backend.

        ``op``: ``"ablate"`` (the node's contribution removed), ``"clamp"`` (a feature set to
        ``value``), ``"scale"`` (a feature or error times ``value``).

        ``mode="constant"`` (default; every backend): plain :class:`~interp_engine.Write` adds at
        each MLP output the node writes (``mlp_out.L``, a CLT feature's every output layer), at its
        position: ``(v - a) * decoder row`` for a feature of activation ``a`` on this prompt, ``-e``
        (``(value - 1) e`` for ``scale``) for an error ``e``, and ``-token embedding`` at ``embed`` for an
        embedding -- exactly the intervention in the graph's model (activations as on the prompt).
        ``mode="features"``: :class:`~interp_engine.FeatureWrite` clamps on the per-layer transcoders
        attached under their names (``TranscoderSet.attach``), which re-read the feature in the
        steered forward (so an earlier clamp moves later features); served where the backend serves
        transcoder clamps (eager). Logit nodes cannot be written."""
        from ..steering._spec import FeatureWrite, SteeringSpec, Write
        from ._transcoders import TranscoderSet

        if op not in ("ablate", "clamp", "scale"):
            raise InvalidOption(f"op is 'ablate', 'clamp' or 'scale', got {op!r}")
        if mode not in ("constant", "features"):
            raise InvalidOption(f"mode is 'constant' or 'features', got {mode!r}")
        writes: list[Any] = []
        for key in nodes:
            n = key if isinstance(key, Node) else self.node(key)
            n = self.nodes[n.index] if n.index < len(self.nodes) and self.nodes[n.index].id == n.id else self.node(n.id)
            if n.kind == "logit":
                raise InvalidOption(f"{n} is an output: a steering spec writes features, errors and embeddings")
            if op == "clamp" and n.kind != "feature":
                raise InvalidOption(f"clamp sets a feature's activation; {n} is an {n.kind} (use 'ablate' or 'scale')")
            if mode == "features":
                if n.kind != "feature" or not isinstance(self.replacement, TranscoderSet):
                    raise InvalidOption(
                        "mode='features' writes per-layer transcoder features by name; "
                        f"{n} is not one (use mode='constant')"
                    )
                target = 0.0 if op == "ablate" else (value if op == "clamp" else value * float(n.activation or 0.0))
                name = self.replacement.names[int(n.layer)]  # type: ignore[arg-type]
                feature = int(n.feature)  # type: ignore[arg-type]  # a feature node has its feature
                writes.append(FeatureWrite(name, feature, "clamp", target, positions=[n.position]))
                continue
            if n.kind == "feature":
                act = float(n.activation or 0.0)
                target = 0.0 if op == "ablate" else (value if op == "clamp" else value * act)
                for out_layer, scaled in self.decoders[n.index]:
                    row = scaled / act if act else scaled
                    writes.append(Write(f"mlp_out.{out_layer}", (target - act) * row, "add", positions=[n.position]))
            elif n.kind == "error":
                factor = -1.0 if op == "ablate" else value - 1.0
                writes.append(Write(f"mlp_out.{n.layer}", factor * self.errors[n.index], "add", positions=[n.position]))
            else:
                factor = -1.0 if op == "ablate" else value - 1.0
                writes.append(Write("embed", factor * self.embeddings[n.index], "add", positions=[n.position]))
        return SteeringSpec(writes)

    # -- export ------------------------------------------------------------------------------------
    def to_dict(self, *, slug: str = "interp-engine-graph", scan: str | None = None) -> dict[str, Any]:
        """The graph in the Neuronpedia graph viewer's schema (:data:`NEURONPEDIA_SCHEMA`): every
        node with a kept edge (and every embedding and logit), every kept edge."""
        a = self._masked()
        scores = self.influence()
        ordered = torch.sort(scores, descending=True)
        total = float(scores.sum()) or 1.0
        cumulative = torch.zeros_like(scores)
        cumulative[ordered.indices] = torch.cumsum(ordered.values, 0) / total
        targets, sources = torch.nonzero(a, as_tuple=True)
        links = [
            {"source": self.nodes[s].id, "target": self.nodes[t].id, "weight": float(a[t, s])}
            for t, s in zip(targets.tolist(), sources.tolist(), strict=True)
        ]
        used = {link["source"] for link in links} | {link["target"] for link in links}
        top_logit = max((n for n in self.nodes if n.kind == "logit"), key=lambda n: n.probability or 0.0, default=None)
        nodes = []
        for n in self.nodes:
            if n.id not in used and n.kind not in ("embedding", "logit"):
                continue
            layer = str(self.n_layers + 1) if n.kind == "logit" else ("E" if n.kind == "embedding" else str(n.layer))
            feature = {"feature": n.feature, "error": -1, "embedding": n.position, "logit": n.token}[n.kind]
            js = {
                "feature": f"{n.layer}_{n.feature}-0",
                "error": f"{n.layer}_{n.position}-0",
                "embedding": f"E_{n.token}-{n.position}",
                "logit": f"L_{n.token}-{n.position}",
            }[n.kind]
            clerp = f'Output "{n.label}" (p={n.probability:.3f})' if n.kind == "logit" else n.label
            nodes.append(
                {
                    "node_id": n.id,
                    "feature": feature,
                    "layer": layer,
                    "ctx_idx": n.position,
                    "feature_type": _FEATURE_TYPES[n.kind],
                    "token_prob": float(n.probability or 0.0),
                    "is_target_logit": top_logit is not None and n.index == top_logit.index,
                    "run_idx": 0,
                    "reverse_ctx_idx": 0,
                    "jsNodeId": js,
                    "clerp": clerp,
                    "influence": float(cumulative[n.index]),
                    "activation": n.activation,
                }
            )
        prompt = "".join(self.token_strings)
        names = getattr(self.replacement, "names", None)
        transcoders = [names[layer] for layer in sorted(names)] if isinstance(names, dict) else []
        return {
            "metadata": {
                "slug": slug,
                "scan": scan or self.meta.get("scan", "interp-engine"),
                "transcoder_list": transcoders,
                "prompt_tokens": list(self.token_strings),
                "prompt": prompt,
                "node_threshold": self.meta.get("node_threshold"),
                "schema": NEURONPEDIA_SCHEMA,
            },
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": nodes,
            "links": links,
        }

    def to_json(self, path: str | None = None, *, slug: str = "interp-engine-graph", scan: str | None = None) -> str:
        """:meth:`to_dict` as JSON text (written to ``path`` too, if given)."""
        text = json.dumps(self.to_dict(slug=slug, scan=scan))
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_html(self, path: str | None = None, *, title: str | None = None) -> str:
        """A self-contained HTML page drawing the graph (no network access needed): nodes by layer
        and position, edges coloured by sign; clicking a node lists its edges. Written to ``path``
        too, if given."""
        from ._views import graph_html

        page = graph_html(self.to_dict(), title=title or "".join(self.token_strings))
        if path is not None:
            with open(path, "w") as f:
                f.write(page)
        return page

    def plot(self, ax: Any = None, *, max_edges: int = 200) -> Any:
        """A static matplotlib drawing of the graph (the ``max_edges`` strongest edges); returns the axes."""
        from ._views import plot_graph

        return plot_graph(self, ax=ax, max_edges=max_edges)


def _reindexed(node: Node, index: int) -> Node:
    return Node(
        index,
        node.kind,
        node.layer,
        node.position,
        node.feature,
        node.token,
        node.activation,
        node.probability,
        node.label,
    )
