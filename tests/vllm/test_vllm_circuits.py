"""Circuits on the vllm backend: transcoders attached to the session's gpt2 engine replace its MLPs
(reconstruction + error: the logits stay the model's until a clamp), and a transcoder feature
clamp -- read in the worker at the transcoder's input address, written at its output address --
equals the eager backend's on the same checkpoint and the hand-written add of ``(v - f_i) d_i`` at
the output address; clamps of several requests batched together each equal their solo run. A
circuit found on eager (an attribution graph's steering spec, plain writes or transcoder clamps,
of per-layer and cross-layer transcoders) runs on vLLM as on eager."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    FeatureWrite,
    InvalidFeatures,
    Sae,
    SteeringSpec,
    UnsupportedSae,
    Write,
)
from interp_engine.circuits import CrossLayerTranscoder, TranscoderSet, attribution_graph
from interp_testkit.suite import rel_diff

from ..support.circuits import scaled_plt
from ..support.readouts import TOL, eager_twin

LOGITS = Address("logits")
PROMPT = "The capital of France is"
SAME = 1e-5  # one engine, the same forward (float32 rounding of the add)
KINDS = ("mlp_in", "resid_mid")


@pytest.fixture(scope="module")
def gpt2(vllm_engines: Any) -> Iterator[tuple[Any, Any, dict[str, TranscoderSet]]]:
    """(the session's gpt2 engine, its eager twin, a transcoder set per input kind attached to both
    as ``tvtc-KIND.L``: ReLU transcoders at ``mlp_in``, JumpReLU ones at ``resid_mid``)."""
    facade = vllm_engines("gpt2")
    eager = eager_twin("gpt2")
    sets = {
        kind: scaled_plt(eager, kind=kind, prefix=f"tvtc-{kind}", seed=20 + i, jumprelu=kind == "resid_mid")
        for i, kind in enumerate(KINDS)
    }
    try:
        for plt in sets.values():
            plt.attach(facade)
            plt.attach(eager)
        yield facade, eager, sets
    finally:
        for plt in sets.values():
            for name in plt.names.values():
                for model in (facade, eager):
                    if name in model.saes:
                        model.detach_sae(name)


def _ids(model: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = model.to_tokens(text)[0].tolist()
    return ids


def _strongest(plt: TranscoderSet, inputs: torch.Tensor, layer: int, position: int) -> tuple[int, float]:
    """The feature of ``layer`` most active at ``position`` (read from ``inputs`` on the host), and its value."""
    f = plt[layer].encode(inputs)[position]
    i = int(f.argmax())
    assert float(f[i]) > 0
    return i, float(f[i])


def test_the_replacement_model_keeps_the_logits_until_a_clamp(gpt2: Any) -> None:
    """With the transcoders attached, every MLP output is reconstruction + error: the features read
    in the worker equal eager's, and clamping each layer's strongest features at every position to
    the values they have leaves the logits the model's (<= 1e-5); a clamp to another value moves them."""
    facade, eager, sets = gpt2
    ids = _ids(facade)
    n_layers = facade.model.info.n_layers
    plain = facade.capture(ids, [LOGITS])[LOGITS]
    for kind, plt in sets.items():
        readouts = [Features(plt.names[layer], dense=True) for layer in plt.layers]
        got = facade.capture(ids, [LOGITS, *readouts])
        want = eager.capture(ids, [LOGITS, *readouts])
        assert torch.equal(got[LOGITS], plain)
        for spec in readouts:
            assert rel_diff(got[spec].values, want[spec].values) <= TOL, spec
        writes = []
        for layer in range(n_layers):
            values = got[readouts[layer]].values
            for position in range(len(ids)):
                for i in values[position].topk(3).indices.tolist():
                    value = float(values[position, i])
                    writes.append(FeatureWrite(plt.names[layer], i, "clamp", value, positions=[position]))
        assert len(writes) == 3 * n_layers * len(ids)
        same = facade.capture(ids, [LOGITS], steering_spec=SteeringSpec(writes))[LOGITS]
        assert rel_diff(same, plain) <= SAME, kind
        moved = [FeatureWrite(w.sae, w.feature, "clamp", w.value + 2.0, positions=w.positions) for w in writes]
        assert rel_diff(facade.capture(ids, [LOGITS], steering_spec=SteeringSpec(moved))[LOGITS], plain) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_transcoder_clamps_equal_eager_and_the_hand_written_add(gpt2: Any, kind: str) -> None:
    facade, eager, sets = gpt2
    plt = sets[kind]
    ids = _ids(facade)
    n = len(ids)
    points = [Address("mlp_out", 1), Address("resid_post", 2), LOGITS]
    inputs = facade.capture(ids, [Address(kind, 1)])[Address(kind, 1)]
    i, _ = _strongest(plt, inputs, 1, n - 1)
    plain = facade.capture(ids, points)
    for op, value, positions in (("clamp", 3.0, [n - 1]), ("ablate", 0.0, "all"), ("clamp", -1.5, [1, 3])):
        clamp = SteeringSpec([FeatureWrite(plt.names[1], i, op, value, positions=positions)])
        got = facade.capture(ids, points, steering_spec=clamp)
        on_eager = eager.capture(ids, points, steering_spec=clamp)
        rows = list(range(n)) if positions == "all" else positions
        current = plt[1].encode(inputs)[rows, i]
        delta = (value - current)[:, None] * plt[1].feature_direction(i)[None, :]
        by_hand = SteeringSpec([Write("mlp_out.1", delta, "add", positions=rows)])
        hand = facade.capture(ids, points, steering_spec=by_hand)
        for point in points:
            assert rel_diff(got[point], on_eager[point]) <= TOL, (op, point)
            assert rel_diff(got[point], hand[point]) <= SAME, (op, point)
        assert rel_diff(got[LOGITS], plain[LOGITS]) > 1e-3, op
        assert torch.equal(got[Address("mlp_out", 1)][: rows[0]], plain[Address("mlp_out", 1)][: rows[0]])
    # clamps at two layers: the later one reads its feature after the earlier clamp moved it
    j, _ = _strongest(plt, facade.capture(ids, [Address(kind, 2)])[Address(kind, 2)], 2, n - 1)
    both = SteeringSpec(
        [FeatureWrite(plt.names[0], 5, "clamp", 4.0, positions=[2]), FeatureWrite(plt.names[2], j, "clamp", 0.5)]
    )
    got = facade.capture(ids, points, steering_spec=both)
    on_eager = eager.capture(ids, points, steering_spec=both)
    for point in points:
        assert rel_diff(got[point], on_eager[point]) <= TOL, point
    # generated tokens are clamped too (positions "all" over the generation)
    generated = facade.generate(ids, max_tokens=5, steering_spec=both, ignore_eos=True)
    assert generated.token_ids == eager.generate(ids, max_tokens=5, steering_spec=both, ignore_eos=True).token_ids


def test_clamped_requests_batched_together_equal_their_solo_runs(gpt2: Any) -> None:
    """Requests clamping transcoder features (of one set, of both, or none) in one batch: each
    request's clamps read its own input rows."""
    facade, _, sets = gpt2
    a, b = sets["mlp_in"], sets["resid_mid"]
    prompts = [_ids(facade), _ids(facade, "Once upon a time there was a"), _ids(facade, "One two three")]
    specs = [
        None,
        SteeringSpec([FeatureWrite(a.names[1], 3, "clamp", 5.0)]),
        SteeringSpec([FeatureWrite(a.names[1], 7, "ablate"), FeatureWrite(b.names[2], 4, "clamp", 2.0)]),
        SteeringSpec([FeatureWrite(b.names[0], 1, "clamp", 6.0, positions=[-1])]),
    ]
    jobs = [(p, s) for p in prompts for s in specs]
    model = facade.model

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(p, [LOGITS], steering_spec=s) for p, s in jobs))

    batched = facade.run(together)
    for (p, s), result in zip(jobs, batched, strict=True):
        alone = facade.capture(p, [LOGITS], steering_spec=s)[LOGITS]
        assert rel_diff(result[LOGITS], alone) <= TOL


def test_what_is_not_served_is_refused_before_any_compute(gpt2: Any) -> None:
    """A transcoder reading after it writes, and a cross-layer transcoder attached by name (its
    features are intervened on with plain writes, ``mode="constant"``), are typed errors that say
    what works; the engine serves on."""
    facade, _, sets = gpt2
    info = facade.model.info
    with pytest.raises(UnsupportedSae, match="mode='constant'"):
        facade.attach_sae("tvtc-clt", _clt(info.d_model, info.n_layers))
    with pytest.raises(UnsupportedSae, match=r"transcoders.attach\(model\)"):
        facade.attach_sae("tvtc-set", sets["mlp_in"])
    good = sets["mlp_in"][2]
    backwards = Sae("transcoder", good.W_enc, good.b_enc, good.W_dec, good.b_dec, "mlp_in.2", hook_name_out="mlp_out.1")
    facade.attach_sae("tvtc-backwards", backwards)
    try:
        ids = _ids(facade)
        with pytest.raises(InvalidFeatures, match="input address before its output address"):
            facade.capture(ids, [LOGITS], steering_spec=SteeringSpec([FeatureWrite("tvtc-backwards", 0, "ablate")]))
        assert facade.capture(ids, [LOGITS])[LOGITS].shape[0] == len(ids)  # serves on
    finally:
        facade.detach_sae("tvtc-backwards")


def _clt(d_model: int, n_layers: int, d_sae: int = 48) -> CrossLayerTranscoder:
    g = torch.Generator().manual_seed(12)
    return CrossLayerTranscoder(
        torch.randn(n_layers, d_model, d_sae, generator=g) * 0.2,
        torch.randn(n_layers, d_sae, generator=g) * 0.2 - 0.2,
        [torch.randn(d_sae, n_layers - i, d_model, generator=g) * 0.1 for i in range(n_layers)],
        torch.zeros(n_layers, d_model),
        input_kind="resid_mid",
    )


@pytest.mark.parametrize("which", ["plt", "clt"])
def test_a_graphs_steering_spec_runs_on_vllm_as_on_eager(gpt2: Any, which: str) -> None:
    """The spec a graph writes for some of its nodes (``mode="constant"``: plain writes at the MLP
    outputs -- every output a CLT feature decodes into -- and the embeddings; for per-layer
    transcoders also ``mode="features"``: transcoder clamps) gives the same logits on vLLM as on eager."""
    facade, eager, sets = gpt2
    info = eager.model.info
    replacement = sets["mlp_in"] if which == "plt" else _clt(info.d_model, info.n_layers)
    graph = attribution_graph(eager, PROMPT, replacement, batch_size=32)
    tokens = graph.tokens
    top = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)
    strongest = [source for source, _ in graph.edges(top.id, "in")]
    features = [n for n in strongest if n.kind == "feature"][:3]
    nodes = features + [n for n in strongest if n.kind == "error"][:1]
    assert len(nodes) == 4
    if which == "clt":
        assert any(len(graph.decoders[n.index]) > 1 for n in features), "no feature writes into a later layer"
    modes = ("constant", "features") if which == "plt" else ("constant",)
    plain = eager.capture(tokens, [LOGITS])[LOGITS]
    for mode in modes:
        for op, value in (("ablate", 0.0), ("clamp", 2.0)):
            chosen = nodes if op == "ablate" and mode == "constant" else features
            spec = graph.steering_spec(chosen, op=op, value=value, mode=mode)  # type: ignore[arg-type]
            spec = SteeringSpec.from_json(spec.to_json())  # as it would arrive over HTTP
            on_vllm = facade.capture(tokens, [LOGITS], steering_spec=spec)[LOGITS]
            on_eager = eager.capture(tokens, [LOGITS], steering_spec=spec)[LOGITS]
            assert rel_diff(on_vllm, on_eager) <= TOL, (mode, op)
            assert float((on_eager - plain).abs().max()) > 1e-3, (mode, op)


def test_the_demos_circuits_section_measures_on_vllm(gpt2: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``interp demo``'s section 8 with the demo's model on vLLM: the graph comes from the eager
    twin, each probability it prints is measured on vLLM through the attached transcoders and
    equals the eager backend's under the same clamps."""
    from interp_engine.cli._demo_circuits import DemoTranscoders, section_circuits

    facade, eager, sets = gpt2
    plt = sets["mlp_in"]
    ids = _ids(facade)
    graph = section_circuits(facade, DemoTranscoders("tvtc", plt, attached=True), ids, eager.model)
    out = capsys.readouterr().out
    assert "ablations through the transcoders on vllm" in out
    answer = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)

    def p(model: Any, spec: SteeringSpec | None = None) -> float:
        row = model.capture(ids, [LOGITS], steering_spec=spec)[LOGITS][-1]
        return float(torch.softmax(row, -1)[int(answer.token or 0)])

    rows = [line.split() for line in out.splitlines() if line.startswith("layer ")]
    assert rows, out
    nodes = []
    for cells in rows:
        node = graph.node(("feature", int(cells[1]), len(ids) - 1, int(cells[2].lstrip("#"))))
        nodes.append(node)
        spec = graph.steering_spec([node], mode="features")
        assert abs(float(cells[-1]) - p(eager, spec)) <= 1.5e-3, cells
        assert abs(p(facade, spec) - p(eager, spec)) <= TOL
    together = graph.steering_spec(nodes, mode="features")
    (plain, both) = re.findall(rf"([\d.]+) as is; ([\d.]+) with these {len(nodes)} features ablated together", out)[0]
    assert abs(float(plain) - p(eager)) <= 1.5e-3 and abs(float(both) - p(eager, together)) <= 1.5e-3
