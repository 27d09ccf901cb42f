"""A circuit found on eager, tested on vLLM: the steering spec an attribution graph writes for a
set of its nodes (``mode="constant"``: plain writes at the MLP outputs and embeddings) gives the
same logits on the vllm backend as on the eager backend over the same checkpoint; and a
transcoder clamp, which vLLM does not serve, is refused before any compute."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import Address, FeatureWrite, InvalidFeatures, Sae, SteeringSpec
from interp_engine.circuits import TranscoderSet, attribution_graph
from interp_testkit.suite import rel_diff

from ..support.readouts import TOL, eager_twin

LOGITS = Address("logits")
PROMPT = "The capital of France is"


def _plt(d_model: int, n_layers: int, d_sae: int = 64) -> TranscoderSet:
    g = torch.Generator().manual_seed(11)
    saes = []
    for layer in range(n_layers):
        saes.append(
            Sae(
                "transcoder",
                torch.randn(d_model, d_sae, generator=g) * 0.2,
                torch.randn(d_sae, generator=g) * 0.2 - 0.2,
                torch.randn(d_sae, d_model, generator=g) * 0.1,
                torch.zeros(d_model),
                f"mlp_in.{layer}",
                hook_name_out=f"mlp_out.{layer}",
                cfg={},
            )
        )
    return TranscoderSet(saes, names={layer: f"circuits-tc.{layer}" for layer in range(n_layers)})


def test_a_graphs_steering_spec_runs_on_vllm_as_on_eager(vllm_engines: Any) -> None:
    facade = vllm_engines("gpt2")
    eager = eager_twin("gpt2")
    plt = _plt(eager.info.d_model, eager.info.n_layers)
    graph = attribution_graph(eager, PROMPT, plt, batch_size=32)
    tokens = graph.tokens
    top = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)
    strongest = [source for source, _ in graph.edges(top.id, "in")]
    nodes = [n for n in strongest if n.kind == "feature"][:3] + [n for n in strongest if n.kind == "error"][:1]
    assert len(nodes) == 4
    for op, value in (("ablate", 0.0), ("clamp", 2.0)):
        chosen = nodes if op == "ablate" else nodes[:3]
        spec = graph.steering_spec(chosen, op=op, value=value)  # type: ignore[arg-type]
        spec = SteeringSpec.from_json(spec.to_json())  # as it would arrive over HTTP
        on_vllm = facade.capture(tokens, [LOGITS], steering_spec=spec)[LOGITS]
        on_eager = eager.capture(tokens, [LOGITS], steering_spec=spec)[LOGITS]
        assert rel_diff(on_vllm, on_eager) <= TOL, op
        assert float((on_eager - eager.capture(tokens, [LOGITS])[LOGITS]).abs().max()) > 1e-3
    # a transcoder clamp reads the feature in the same forward: eager serves it, vLLM refuses it
    plt.attach(facade)
    try:
        clamp = SteeringSpec([FeatureWrite("circuits-tc.1", 0, "clamp", 1.0)])
        with pytest.raises(InvalidFeatures, match="not served by the vllm backend"):
            facade.capture(tokens, [LOGITS], steering_spec=clamp)
        assert facade.capture(tokens, [LOGITS])[LOGITS].shape[0] == len(tokens)  # serves on
    finally:
        for name in plt.names.values():
            facade.detach_sae(name)
