"""``interp demo``'s circuits section: the attribution graph of the prompt through transcoders that
replace the MLPs (computed on the eager backend), which features carry the prompt's subject token
to the last position and into the answer, and what ablating them does to the answer's probability,
measured on the demo's own backend through the transcoders attached there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._errors import InterpError
from .._sync import SyncModel
from ..addresses._address import Address
from ..circuits._attribute import attribution_graph
from ..circuits._graph import AttributionGraph, Node
from ..circuits._transcoders import CrossLayerTranscoder, TranscoderSet
from ..steering._spec import SteeringSpec
from ._common import show_token, table

CARRIERS = 4
"""At most this many features are shown as carrying the subject to the answer."""


@dataclass
class DemoTranscoders:
    """The transcoders of the circuits section: where they came from, and whether their features
    can be clamped on the demo's model (a per-layer set attached under its names)."""

    source: str
    replacement: TranscoderSet | CrossLayerTranscoder
    attached: bool


def attach_demo_transcoders(
    sync: SyncModel, source: str, replacement: TranscoderSet | CrossLayerTranscoder
) -> DemoTranscoders | str:
    """Attach a per-layer set to the demo's model before its first request (as ``vllm-static``
    needs); a cross-layer transcoder is not attached (its interventions are plain writes). The
    reason the section cannot run on this model otherwise (another model's widths or layers)."""
    info = sync.model.info
    if max(replacement.layers) >= info.n_layers or replacement.d_in != info.d_model:
        return (
            f"{source} replaces the MLPs of {max(replacement.layers) + 1}+ layers of width {replacement.d_in}; this "
            f"model has {info.n_layers} layers of width {info.d_model}"
        )
    if isinstance(replacement, CrossLayerTranscoder):
        return DemoTranscoders(source, replacement, attached=False)
    if getattr(sync.model, "attach_sae", None) is None:
        return f"the {sync.model.backend} backend's models take no transcoders (no attach_sae)"
    try:
        replacement.attach(sync.model)
    except (InterpError, ValueError, KeyError) as exc:
        return " ".join(str(exc).split())
    return DemoTranscoders(source, replacement, attached=True)


@dataclass
class Carrier:
    """A feature at the last position fed by the subject token and feeding the answer."""

    node: Node
    from_subject: float
    into_answer: float
    ablated: float
    """The answer's probability with this feature ablated at the last position."""


def _probability(sync: SyncModel, ids: list[int], token: int, spec: SteeringSpec | None = None) -> float:
    logits = Address("logits")
    row = sync.capture(ids, [logits], steering_spec=spec)[logits][-1].float()
    return float(torch.softmax(row, -1)[token])


def _edge(graph: AttributionGraph, source: Node, target: Node) -> float:
    return float(graph.adjacency[target.index, source.index])


def section_circuits(sync: SyncModel, demo: DemoTranscoders, ids: list[int], graph_model: Any) -> AttributionGraph:
    """Print the section: the graph of ``ids`` computed on ``graph_model`` (an eager model of the
    same checkpoint), its answer, the subject token carried into it, the features that carry it
    and what ablating them does, measured on ``sync`` (the demo's backend). Returns the graph."""
    backend = sync.model.backend
    where = "the same model" if graph_model is sync.model else "the same checkpoint on the eager backend"
    print(
        f"\n8. circuits: the attribution graph through {demo.source} (transcoders replacing the MLPs, "
        f"attention and norms frozen; computed on {where}), and ablations through the transcoders on {backend}\n"
    )
    graph = attribution_graph(graph_model, ids, demo.replacement)
    counts = {kind: len(graph.nodes_of(kind)) for kind in ("feature", "error")}
    answer = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)
    shown = show_token(answer.label or "")
    last = len(ids) - 1
    print(
        f"   {len(ids)} tokens, {counts['feature']} active features, {counts['error']} error nodes, "
        f"{int((graph.adjacency != 0).sum())} edges; the answer: {shown} (p={answer.probability:.3f})"
    )
    inputs = graph.edges(answer.id, "in")
    embeddings = [(n, w) for n, w in inputs if n.kind == "embedding" and n.position < last]
    if not embeddings:
        print("   (the prompt has one token: no earlier token to carry to the last position)")
        return graph
    subject, direct = max(embeddings, key=lambda e: e[1])
    subject_token = show_token(subject.label or "")
    print(
        f"   {subject_token} (position {subject.position}) is the earlier token whose embedding feeds {shown} most "
        f"directly ({direct:+.2f}, through attention)"
    )

    def spec(nodes: list[Node]) -> SteeringSpec:
        result: SteeringSpec = graph.steering_spec(nodes, op="ablate", mode="features" if demo.attached else "constant")
        return result

    plain = _probability(sync, ids, int(answer.token or 0))
    candidates = [
        (n, _edge(graph, subject, n), w)
        for n, w in inputs
        if n.kind == "feature" and n.position == last and w > 0 and _edge(graph, subject, n) > 0
    ]
    candidates.sort(key=lambda c: -min(c[1], c[2]))
    token = int(answer.token or 0)
    carriers = [Carrier(n, a, b, _probability(sync, ids, token, spec([n]))) for n, a, b in candidates[:CARRIERS]]
    if not carriers:
        print(f"\n   no feature at the last position has an edge both from {subject_token} and into {shown}")
        return graph
    print(
        f"\n   the features at the last position with an edge from {subject_token} and an edge into {shown} "
        f"(the strongest {len(carriers)} of {len(candidates)}), each ablated alone:\n"
    )
    rows = [
        [
            f"layer {c.node.layer} #{c.node.feature}",
            f"{c.node.activation:.2f}",
            f"{c.from_subject:+.2f}",
            f"{c.into_answer:+.2f}",
            f"{c.ablated:.3f}",
        ]
        for c in carriers
    ]
    print(table(["feature", "activation", f"from {subject_token}", f"into {shown}", f"P({shown}) ablated"], rows))
    together = _probability(sync, ids, token, spec([c.node for c in carriers]))
    try:  # a plain write at ``embed`` (which a vllm-static engine serves only where it declared it)
        without = f"{_probability(sync, ids, token, graph.steering_spec([subject], op='ablate')):.3f}"
    except InterpError as exc:
        without = f"(not measured here: {' '.join(str(exc).split())})"
    how = "clamped to 0 through the attached transcoders" if demo.attached else "their decoder writes removed"
    print(
        f"\n   P({shown}): {plain:.3f} as is; {together:.3f} with these {len(carriers)} features ablated together "
        f"({how}, the MLPs' error terms kept); {without} without the {subject_token} embedding"
    )
    return graph
