"""The attribution graph is exact in the frozen-linear replacement model.

The oracle is a hand-written forward of ``interp:tiny`` (GPT-2 shaped) from its HF weights, with
the attention patterns and the layer-norm scales of the prompt's own run (captured through the
ordinary capture path) and each MLP's output a given constant: the frozen-linear model written out,
independent of the eager backend's hooks. In it:

- completeness: each node's value (a feature's pre-activation, a logit minus the mean logit)
  equals the sum of its incoming edges plus its constant term -- the value with every source
  (features, errors, token embeddings) removed;
- each sampled edge's weight equals the change of its target when its source's contribution is
  removed (a feature's activation times its decoder rows, an error vector, an embedding).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from interp_engine import Address
from interp_engine.circuits import AttributionGraph, Replacement

from ..support.circuits import N_LAYERS, PROMPT

TOL = 1e-4


def _scale(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return torch.sqrt((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + eps)


class FrozenGpt2:
    """interp:tiny's frozen-linear model written out (module docstring)."""

    def __init__(self, tiny: Any) -> None:
        self.hf = tiny.model.hf_model
        tokens = tiny.to_tokens(PROMPT)[0].tolist()
        points = [Address("embed"), Address("resid_post", N_LAYERS - 1)]
        for layer in range(N_LAYERS):
            points += [Address(k, layer) for k in ("resid_pre", "resid_mid", "attn_pattern", "mlp_out")]
        caps = tiny.capture(tokens, points)
        self.embed = caps[Address("embed")]
        self.mlp_out = {layer: caps[Address("mlp_out", layer)] for layer in range(N_LAYERS)}
        self.patterns = [caps[Address("attn_pattern", layer)] for layer in range(N_LAYERS)]
        self.s1 = [_scale(caps[Address("resid_pre", layer)]) for layer in range(N_LAYERS)]
        self.s2 = [_scale(caps[Address("resid_mid", layer)]) for layer in range(N_LAYERS)]
        self.sf = _scale(caps[Address("resid_post", N_LAYERS - 1)])
        clean = tiny.capture(tokens, [Address(k, layer) for layer in range(N_LAYERS) for k in ("mlp_in", "resid_mid")])
        self.inputs = {
            k: {layer: clean[Address(k, layer)] for layer in range(N_LAYERS)} for k in ("mlp_in", "resid_mid")
        }

    @torch.no_grad()
    def __call__(
        self, embed: torch.Tensor, mlp_out: dict[int, torch.Tensor], rep: Replacement | None = None
    ) -> dict[str, Any]:
        """The frozen model's MLP inputs and last logits with each MLP output ``mlp_out[L]`` plus,
        for a skip transcoder of ``rep``, its skip path ``(x - x_0) @ W_skip.T`` on this run's input
        ``x`` (``x_0``: the prompt's)."""
        tr = self.hf.transformer
        x = embed.clone()
        n, d = x.shape
        mlp_in, resid_mid = {}, {}
        for layer, block in enumerate(tr.h):
            h = (x - x.mean(-1, keepdim=True)) / self.s1[layer] * block.ln_1.weight + block.ln_1.bias
            qkv = h @ block.attn.c_attn.weight + block.attn.c_attn.bias
            heads = self.patterns[layer].shape[0]
            v = qkv[:, 2 * d :].reshape(n, heads, d // heads).transpose(0, 1)
            z = (self.patterns[layer] @ v).transpose(0, 1).reshape(n, d)
            x = x + z @ block.attn.c_proj.weight + block.attn.c_proj.bias
            resid_mid[layer] = x.clone()
            mlp_in[layer] = (x - x.mean(-1, keepdim=True)) / self.s2[layer] * block.ln_2.weight + block.ln_2.bias
            out = mlp_out[layer]
            w_skip = rep.skip(layer) if rep is not None and layer in rep.layers else None
            if w_skip is not None:
                x_in = (mlp_in if rep.input_kind == "mlp_in" else resid_mid)[layer]  # type: ignore[union-attr]
                out = out + (x_in - self.inputs[rep.input_kind][layer]) @ w_skip.T  # type: ignore[union-attr]
            x = x + out
        f = (x - x.mean(-1, keepdim=True)) / self.sf * tr.ln_f.weight + tr.ln_f.bias
        logits = f[-1] @ tr.wte.weight.T
        return {"mlp_in": mlp_in, "resid_mid": resid_mid, "logits": logits}


@pytest.fixture(scope="module")
def oracle(tiny: Any) -> FrozenGpt2:
    return FrozenGpt2(tiny)


def _target(graph: AttributionGraph, rep: Replacement, index: int, out: dict[str, Any]) -> float:
    node = graph.nodes[index]
    if node.kind == "logit":
        logits = out["logits"]
        return float(logits[node.token] - logits.mean())
    assert node.layer is not None and node.feature is not None
    x = out[rep.input_kind][node.layer][node.position]
    return float(rep.pre_acts(node.layer, x)[node.feature])


def _removed(graph: AttributionGraph, oracle: FrozenGpt2, source: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The oracle's inputs with ``source``'s contribution removed."""
    node = graph.nodes[source]
    embed = oracle.embed.clone()
    mlp_out = {layer: v.clone() for layer, v in oracle.mlp_out.items()}
    if node.kind == "embedding":
        embed[node.position] -= graph.embeddings[source]
    elif node.kind == "error":
        assert node.layer is not None
        mlp_out[node.layer][node.position] -= graph.errors[source]
    else:
        for out_layer, scaled in graph.decoders[source]:
            mlp_out[out_layer][node.position] -= scaled
    return embed, mlp_out


def test_the_oracle_is_the_model(tiny: Any, oracle: FrozenGpt2) -> None:
    out = oracle(oracle.embed, oracle.mlp_out)
    logits = tiny.capture(tiny.to_tokens(PROMPT)[0].tolist(), [Address("logits")])[Address("logits")][-1]
    assert float((out["logits"] - logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("which", ["plt", "clt", "partial", "skip"])
def test_every_row_is_complete(request: pytest.FixtureRequest, oracle: FrozenGpt2, which: str) -> None:
    graph: AttributionGraph = request.getfixturevalue(f"{which}_graph")
    rep: Replacement = request.getfixturevalue(which)
    # every source removed: the token embeddings (the position embeddings stay: a constant),
    # each MLP output its replacement's decoder bias (a layer without a transcoder: zero)
    tokens = torch.tensor(graph.tokens)
    positions = oracle.hf.transformer.wpe(torch.arange(len(graph.tokens))).detach()
    assert torch.allclose(oracle.embed, oracle.hf.transformer.wte(tokens).detach() + positions, atol=1e-6)
    # (a skip transcoder's skip path stays: its output is b_dec + x @ W_skip.T, whatever x is)
    constants = {}
    for layer, v in oracle.mlp_out.items():
        constants[layer] = rep.decoder_bias(layer).expand_as(v) if layer in rep.layers else torch.zeros_like(v)
        w_skip = rep.skip(layer) if layer in rep.layers else None
        if w_skip is not None:
            constants[layer] = constants[layer] + oracle.inputs[rep.input_kind][layer] @ w_skip.T
    zero = oracle(positions, constants, rep)
    clean = oracle(oracle.embed, oracle.mlp_out, rep)
    rows = [n.index for n in graph.nodes if n.kind in ("feature", "logit")]
    assert len(rows) > 50
    worst = 0.0
    for i in rows:
        value = _target(graph, rep, i, clean)
        assert abs(value - float(graph.values[i])) <= TOL
        constant = _target(graph, rep, i, zero)
        worst = max(worst, abs(value - float(graph.adjacency[i].double().sum()) - constant))
    assert worst <= TOL


@pytest.mark.parametrize("which", ["plt", "clt", "partial", "skip"])
def test_sampled_edges_equal_removing_the_source(
    request: pytest.FixtureRequest, oracle: FrozenGpt2, which: str
) -> None:
    graph: AttributionGraph = request.getfixturevalue(f"{which}_graph")
    rep: Replacement = request.getfixturevalue(which)
    clean = oracle(oracle.embed, oracle.mlp_out, rep)
    rng = random.Random(0)
    targets = [n.index for n in graph.nodes_of("logit")] + rng.sample(
        [n.index for n in graph.nodes_of("feature") if n.layer and n.layer >= 2], 6
    )
    checked = {"feature": 0, "error": 0, "embedding": 0}
    for t in targets:
        sources = torch.nonzero(graph.adjacency[t]).flatten().tolist()
        strongest = sorted(sources, key=lambda s: -abs(float(graph.adjacency[t, s])))[:4]
        for s in strongest + rng.sample(sources, min(4, len(sources))):
            removed = oracle(*_removed(graph, oracle, s), rep)
            change = _target(graph, rep, t, clean) - _target(graph, rep, t, removed)
            assert abs(change - float(graph.adjacency[t, s])) <= TOL, (graph.nodes[s], graph.nodes[t])
            checked[graph.nodes[s].kind] += 1
    assert all(checked.values()), checked
    # a source after its target (a later position or layer) has no edge
    for t in targets:
        node = graph.nodes[t]
        for s in torch.nonzero(graph.adjacency[t]).flatten().tolist():
            assert graph.nodes[s].position <= node.position


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox", "qwen3", "opt", "phi3"])
def test_rows_are_complete_and_edges_exact_on_other_families(family: str) -> None:
    """On RMS-norm, sandwich-norm, parallel-attention and post-projection families, with the eager
    backend's own frozen forward as the evaluator (run without gradients, values only): each row
    sums to its target minus the target with every source removed, and sampled edges equal the
    change when their source alone is removed."""
    from interp_engine import load_model, sync_model
    from interp_engine.circuits import TranscoderSet, attribution_graph
    from interp_testkit.suite import PROMPT as TEXT
    from interp_testkit.suite import tiny_model_path

    model = sync_model(load_model(tiny_model_path(family), backend="eager"))
    try:
        d, n_layers = model.info.d_model, model.info.n_layers
        g = torch.Generator().manual_seed(3)
        from interp_engine import Sae

        rep = TranscoderSet(
            [
                Sae(
                    "transcoder",
                    torch.randn(d, 48, generator=g) / d**0.5,
                    torch.randn(48, generator=g) * 0.2,
                    torch.randn(48, d, generator=g) * 0.05,
                    torch.randn(d, generator=g) * 0.01,
                    f"mlp_in.{layer}",
                    hook_name_out=f"mlp_out.{layer}",
                )
                for layer in range(n_layers)
            ]
        )
        tokens = model.to_tokens(TEXT)[0].tolist()[:8]
        graph = attribution_graph(model, tokens, rep, batch_size=16)
        frozen = model.model.linearize(tokens, "mlp_in")
        clean = frozen.clean

        def targets(mlp_out: dict[int, torch.Tensor], embed: torch.Tensor) -> torch.Tensor:
            run = frozen.run(1, mlp_out=mlp_out, embed=embed, grad=False)
            out = torch.zeros(len(graph.nodes))
            for n in graph.nodes:
                if n.kind == "logit":
                    out[n.index] = run.logits[0, n.token] - run.logits[0].mean()
                elif n.kind == "feature":
                    assert n.layer is not None and n.feature is not None
                    out[n.index] = rep.pre_acts(n.layer, run.inputs[n.layer][0, n.position])[n.feature]
            return out

        base = targets(dict(clean.mlp_out), clean.embed)
        rows = [n.index for n in graph.nodes if n.kind in ("feature", "logit")]
        torch.testing.assert_close(base[rows], graph.values[rows], atol=1e-4, rtol=0)
        zero = targets(
            {layer: rep.decoder_bias(layer).expand_as(v) for layer, v in clean.mlp_out.items()},
            clean.embed - clean.token_embed,
        )
        completeness = (base - graph.adjacency.double().sum(1).float() - zero)[rows].abs().max()
        assert float(completeness) <= 1e-4, float(completeness)
        rng = random.Random(1)
        for t in [n.index for n in graph.nodes_of("logit")[:2]] + rng.sample(
            [n.index for n in graph.nodes_of("feature") if n.layer == n_layers - 1], 2
        ):
            sources = torch.nonzero(graph.adjacency[t]).flatten().tolist()
            for s in sorted(sources, key=lambda s: -abs(float(graph.adjacency[t, s])))[:3]:
                node = graph.nodes[s]
                mlp_out = {layer: v.clone() for layer, v in clean.mlp_out.items()}
                embed = clean.embed.clone()
                if node.kind == "embedding":
                    embed[node.position] -= graph.embeddings[s]
                elif node.kind == "error":
                    mlp_out[int(node.layer or 0)][node.position] -= graph.errors[s]
                else:
                    for out_layer, scaled in graph.decoders[s]:
                        mlp_out[out_layer][node.position] -= scaled
                change = float(base[t] - targets(mlp_out, embed)[t])
                assert abs(change - float(graph.adjacency[t, s])) <= 1e-4, (family, node, graph.nodes[t])
    finally:
        model.shutdown()
