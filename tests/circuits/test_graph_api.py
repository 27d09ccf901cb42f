"""The attribution graph's Python API: nodes, pruning, paths, the Neuronpedia JSON, the memory
bound and feature budget, the steering specs read off it, and the errors of bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    CaptureMemoryExceeded,
    FeatureWrite,
    InvalidOption,
    SteeringSpec,
    UnsupportedOperation,
    UnsupportedSae,
    Write,
    load_model,
)
from interp_engine.circuits import NEURONPEDIA_SCHEMA, AttributionGraph, attribution_graph

from ..support.circuits import N_LAYERS, PROMPT, random_plt

LOGITS = Address("logits")


def test_nodes_are_in_order_and_found_by_id_index_and_tuple(plt_graph: AttributionGraph) -> None:
    g = plt_graph
    kinds = [n.kind for n in g.nodes]
    n_feat = kinds.count("feature")
    n_pos = len(g.tokens)
    assert kinds == ["feature"] * n_feat + ["error"] * N_LAYERS * n_pos + ["embedding"] * n_pos + ["logit"] * (
        len(kinds) - n_feat - (N_LAYERS + 1) * n_pos
    )
    features = g.nodes_of("feature")
    assert [(n.layer, n.position, n.feature) for n in features] == sorted(
        (n.layer, n.position, n.feature) for n in features
    )
    assert all(n.position > 0 for n in features)  # position 0 excluded by default
    f = features[len(features) // 2]
    assert g.node(f.id) is f and g.node(f.index) is f and g.node(("feature", f.layer, f.position, f.feature)) is f
    assert g.node(("error", 2, 3)).id == "err_2_3"
    assert g.node(("embedding", 0)).token == g.tokens[0]
    top = max(g.nodes_of("logit"), key=lambda n: n.probability or 0)
    assert top.label == " Paris" and g.node(("logit", top.token)) is top
    assert sum(n.probability or 0 for n in g.nodes_of("logit")) >= 0.95 or len(g.nodes_of("logit")) == 10
    for bad in ("nope", 10**6, ("feature", 99, 0, 0), 1.5):
        with pytest.raises(InvalidOption):
            g.node(bad)  # type: ignore[arg-type]
    # errors and embeddings have no incoming edges; nothing points to a logit from a logit
    assert not bool(g.adjacency[[n.index for n in g.nodes if n.kind in ("error", "embedding")]].any())


def test_pruning_keeps_the_influential_part(plt_graph: AttributionGraph) -> None:
    g = plt_graph
    pruned = g.prune(0.8, 0.98)
    assert len(pruned.nodes) < len(g.nodes)
    assert len(pruned.nodes_of("logit")) == len(g.nodes_of("logit"))
    assert len(pruned.nodes_of("embedding")) == len(g.tokens)
    influence = g.influence()
    kept = {n.id for n in pruned.nodes_of("feature")}
    dropped = [float(influence[n.index]) for n in g.nodes_of("feature") if n.id not in kept]
    kept_scores = [float(influence[g.node(i).index]) for i in kept]
    assert min(kept_scores) >= max(dropped) or len(kept) == 0
    assert pruned.edge_mask is not None
    for n in pruned.nodes_of("feature"):  # every kept feature has an edge in and an edge out
        assert pruned.edges(n.id, "in") and pruned.edges(n.id, "out")
    # the edges kept keep their weights
    for n in pruned.nodes_of("logit"):
        for source, weight in pruned.edges(n.id, "in")[:5]:
            assert weight == float(g.adjacency[g.node(n.id).index, g.node(source.id).index])
    assert pruned.meta["node_threshold"] == 0.8
    tighter = g.prune(0.5, 0.9)
    assert len(tighter.nodes) <= len(pruned.nodes)
    with pytest.raises(InvalidOption, match="node_threshold"):
        g.prune(1.5)


def test_top_paths_end_at_a_logit_and_start_without_inputs(plt_graph: AttributionGraph) -> None:
    g = plt_graph
    paths = g.top_paths(5)
    assert len(paths) == 5
    assert [p.score for p in paths] == sorted((p.score for p in paths), reverse=True)
    for p in paths:
        assert p.nodes[-1].kind == "logit" and p.nodes[0].kind in ("embedding", "error", "feature")
        assert not bool(g.adjacency[p.nodes[0].index].any())
        for (a, b), w in zip(zip(p.nodes, p.nodes[1:], strict=False), p.weights, strict=True):
            assert w == float(g.adjacency[b.index, a.index]) != 0
    paris = max(g.nodes_of("logit"), key=lambda n: n.probability or 0)
    assert all(p.nodes[-1] is paris for p in g.top_paths(3, target=paris.id))
    with pytest.raises(InvalidOption):
        g.top_paths(0)


def test_json_is_the_neuronpedia_schema(plt_graph: AttributionGraph, tmp_path: Any) -> None:
    g = plt_graph.prune(0.6, 0.95)
    text = g.to_json(str(tmp_path / "g.json"), slug="france")
    data = json.loads(text)
    assert json.loads((tmp_path / "g.json").read_text()) == data
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    meta = data["metadata"]
    assert (
        meta["slug"] == "france" and meta["prompt_tokens"] == g.token_strings and meta["schema"] == NEURONPEDIA_SCHEMA
    )
    assert meta["transcoder_list"] == [f"tc.{layer}" for layer in range(N_LAYERS)]
    node_keys = {
        "node_id",
        "feature",
        "layer",
        "ctx_idx",
        "feature_type",
        "token_prob",
        "is_target_logit",
        "run_idx",
        "reverse_ctx_idx",
        "jsNodeId",
        "clerp",
        "influence",
        "activation",
    }
    ids = set()
    for node in data["nodes"]:
        assert set(node) == node_keys
        assert node["feature_type"] in ("cross layer transcoder", "mlp reconstruction error", "embedding", "logit")
        ids.add(node["node_id"])
    assert len(ids) == len(data["nodes"])
    assert sum(n["is_target_logit"] for n in data["nodes"]) == 1
    logit = next(n for n in data["nodes"] if n["is_target_logit"])
    assert logit["layer"] == str(N_LAYERS + 1) and logit["clerp"].startswith('Output " Paris"')
    for link in data["links"]:
        assert link["source"] in ids and link["target"] in ids
        assert link["weight"] == float(g.adjacency[g.node(link["target"]).index, g.node(link["source"]).index])


def test_memory_bound_and_feature_budget(tiny: Any, plt_graph: AttributionGraph) -> None:
    plt = plt_graph.replacement
    with pytest.raises(CaptureMemoryExceeded) as info:
        attribution_graph(tiny, PROMPT, plt, max_memory=1000)
    assert info.value.option == "max_memory" and info.value.needed > 1000
    bounded = attribution_graph(tiny, PROMPT, plt, batch_size=64, max_memory=info.value.needed * 3)
    per_row = bounded.meta["saved_bytes_per_row"]
    assert bounded.meta["batch_size"] == min(64, info.value.needed * 3 // per_row) < plt_graph.meta["batch_size"]
    assert bounded.meta["backward_passes"] > plt_graph.meta["backward_passes"]
    torch.testing.assert_close(bounded.adjacency, plt_graph.adjacency, atol=1e-5, rtol=0)
    budget = attribution_graph(tiny, PROMPT, plt, max_feature_nodes=40, batch_size=8)
    features = budget.nodes_of("feature")
    assert len(features) == 40
    # the rows of the features it kept are the full graph's, on the columns both have
    full = {n.id: n.index for n in plt_graph.nodes}
    cols = torch.tensor([full[n.id] for n in budget.nodes])
    for n in features[:10] + budget.nodes_of("logit"):
        torch.testing.assert_close(budget.adjacency[n.index], plt_graph.adjacency[full[n.id], cols], atol=1e-5, rtol=0)
    # the most influential features of the full graph are among the ones visited first
    influence = plt_graph.influence()
    best = max(plt_graph.nodes_of("feature"), key=lambda n: float(influence[n.index]))
    assert best.id in {n.id for n in features}


def test_explicit_targets_and_thresholds(tiny: Any, plt_graph: AttributionGraph) -> None:
    g = attribution_graph(tiny, PROMPT, plt_graph.replacement, targets=[" Paris", " Rome"], node_threshold=0.7)
    assert [n.label for n in g.nodes_of("logit")] == [" Paris", " Rome"]
    assert g.meta["node_threshold"] == 0.7
    with pytest.raises(InvalidOption, match="one token"):
        attribution_graph(tiny, PROMPT, plt_graph.replacement, targets=[" Paris Rome"])


def test_steering_specs_from_nodes(tiny: Any, plt_graph: AttributionGraph) -> None:
    """``mode="constant"`` writes exactly the graph's intervention; for one feature it equals the
    transcoder clamp (``mode="features"``) served on eager."""
    g = plt_graph
    plt = g.replacement
    tokens = g.tokens
    logits = tiny.capture(tokens, [LOGITS])[LOGITS]
    strongest = max(
        g.nodes_of("feature"), key=lambda n: abs(float(g.adjacency[-len(g.nodes_of("logit")) :, n.index].sum()))
    )
    constant = g.steering_spec([strongest.id], op="ablate")
    (write,) = constant.writes
    assert isinstance(write, Write) and write.address == Address("mlp_out", strongest.layer)
    assert write.positions == (strongest.position,)
    torch.testing.assert_close(write.vector, -strongest.activation * plt[strongest.layer].W_dec[strongest.feature])
    by_feature = g.steering_spec([strongest], op="ablate", mode="features")
    assert by_feature.writes == (
        FeatureWrite(f"tc.{strongest.layer}", strongest.feature, "clamp", 0.0, positions=[strongest.position]),
    )
    plt.attach(tiny)
    try:
        a = tiny.capture(tokens, [LOGITS], steering_spec=constant)[LOGITS]
        b = tiny.capture(tokens, [LOGITS], steering_spec=by_feature)[LOGITS]
    finally:
        for layer in plt.layers:
            tiny.detach_sae(plt.names[layer])
    assert float((a - b).abs().max()) <= 1e-5
    assert float((a - logits).abs().max()) > 1e-4
    # clamp and scale; errors and embeddings
    clamp = g.steering_spec([strongest.id], op="clamp", value=2.0).writes[0]
    assert isinstance(clamp, Write)
    torch.testing.assert_close(
        clamp.vector, (2.0 - strongest.activation) * plt[strongest.layer].W_dec[strongest.feature]
    )
    err = g.node(("error", 1, len(tokens) - 1))
    (ew,) = g.steering_spec([err.id]).writes
    assert isinstance(ew, Write) and torch.equal(ew.vector, -g.errors[err.index])
    emb = g.node(("embedding", 2))
    (mw,) = g.steering_spec([emb.id], op="scale", value=0.5).writes
    assert (
        isinstance(mw, Write)
        and mw.address == Address("embed")
        and torch.equal(mw.vector, -0.5 * g.embeddings[emb.index])
    )
    assert SteeringSpec.from_json(constant.to_json()) == constant
    with pytest.raises(InvalidOption, match="output"):
        g.steering_spec([g.nodes_of("logit")[0].id])
    with pytest.raises(InvalidOption, match="clamp"):
        g.steering_spec([err.id], op="clamp", value=1.0)


def test_bad_input_is_a_typed_error(tiny: Any) -> None:
    plt = random_plt()
    with pytest.raises(InvalidOption, match="batch_size"):
        attribution_graph(tiny, PROMPT, plt, batch_size=0)
    with pytest.raises(UnsupportedSae, match="transcoder"):
        attribution_graph(tiny, PROMPT, "not transcoders")
    wide = random_plt()
    from interp_engine import Sae
    from interp_engine.circuits import TranscoderSet

    narrow = TranscoderSet(
        [
            Sae(
                "transcoder",
                torch.zeros(64, 4),
                torch.zeros(4),
                torch.zeros(4, 64),
                torch.zeros(64),
                "mlp_in.0",
                hook_name_out="mlp_out.0",
            )
        ]
    )
    with pytest.raises(UnsupportedSae, match="d_model"):
        attribution_graph(tiny, PROMPT, narrow)
    assert wide is not None
    toy = load_model("interp:tiny", backend="toy")
    try:
        with pytest.raises(UnsupportedOperation, match="eager"):
            attribution_graph(toy, PROMPT, plt)
    finally:
        from interp_engine import sync_model

        sync_model(toy).shutdown()


def test_progress_bar_counts_the_rows(
    tiny: Any, plt_graph: AttributionGraph, capsys: pytest.CaptureFixture[str]
) -> None:
    g = attribution_graph(tiny, PROMPT, plt_graph.replacement, max_feature_nodes=20, batch_size=8, progress=True)
    err = capsys.readouterr().err
    rows = len(g.nodes_of("logit")) + 20
    assert "attribution" in err and f"{rows}/{rows}" in err
