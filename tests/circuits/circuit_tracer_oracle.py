"""circuit-tracer's attribution graph of interp:tiny, as an outside oracle (not collected by pytest).

circuit-tracer pins ``transformers<=4.57.3`` (this project's environment has 5.x) and pulls
nnsight and an older transformer-lens, so it cannot join the dev environment; it runs in one of
its own::

    python3 -m venv /tmp/ctenv
    /tmp/ctenv/bin/pip install torch==2.13.0 circuit-tracer==0.5.0
    /tmp/ctenv/bin/python tests/circuits/circuit_tracer_oracle.py write MODEL_DIR TRANSCODERS OUT.pt
    .venv/bin/python tests/circuits/circuit_tracer_oracle.py compare MODEL_DIR TRANSCODERS OUT.pt

``write`` (in circuit-tracer's environment) builds a TransformerLens GPT-2 from the model folder's
weights, loads the transcoders (circuit-tracer's per-layer layout: ``TranscoderSet.save``) with
circuit-tracer's own loader, runs ``circuit_tracer.attribute`` on the prompt and saves its
adjacency and node lists. ``compare`` (in this project's environment) computes the graph with
``interp_engine.attribution_graph`` on the same tokens and prints the largest difference of the
two adjacency matrices, node by node (features by (layer, position, id), errors, token
embeddings, logits). One convention differs: circuit-tracer zeroes the error vectors at position 0
(the BOS position's MLP outputs become constants), where interp-engine keeps error nodes (with
the BOS features left out, their output is in them); those columns are reported apart.

Measured (interp:tiny, interp:tiny-transcoders, "<|endoftext|>The capital of France is"): 714
nodes, 678 features; activations within 1.9e-6, logit probabilities within 1e-6, every other edge
within 4.5e-6 (largest edge 7.6). A random cross-layer transcoder of tests/support/circuits.py
(``random_clt().save(folder)``, read by circuit-tracer's own ``load_clt``): 681 nodes, 645
features, activations within 1.7e-5, edges within 1.9e-5 (largest edge 36.6).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

PROMPT = "The capital of France is"


def write(model_dir: str, transcoders: str, out: str) -> None:
    import torch
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        n_ctx=c.n_positions,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        d_vocab=c.vocab_size,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
        dtype=torch.float32,
        device="cpu",
    )
    # transformers 4.x cannot name the tokenizer class 5.x saved: build it from tokenizer.json
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=f"{model_dir}/tokenizer.json", bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    model = TransformerLensReplacementModel(cfg)
    model.tokenizer = tokenizer  # TransformerLens's set_tokenizer wants a hub name
    model.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    if pathlib.Path(transcoders, "W_enc_0.safetensors").is_file():  # a cross-layer transcoder
        from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

        tcs = load_clt(
            transcoders,
            feature_input_hook="hook_resid_mid",
            feature_output_hook="hook_mlp_out",
            scan="interp-tiny-clt",
            device=torch.device("cpu"),
            dtype=torch.float32,
            lazy_decoder=False,
        )
        model._configure_replacement_model(tcs)
        return _attribute(model, tokenizer, out)
    paths = {layer: f"{transcoders}/layer_{layer}.safetensors" for layer in range(c.n_layer)}
    tcs = load_transcoder_set(
        paths,
        scan="interp-tiny",
        feature_input_hook="mlp.hook_in",
        feature_output_hook="mlp.hook_out",
        dtype=torch.float32,
        device=torch.device("cpu"),
        lazy_encoder=False,
        lazy_decoder=False,
    )
    model._configure_replacement_model(tcs)
    _attribute(model, tokenizer, out)


def _attribute(model: Any, tokenizer: Any, out: str) -> None:
    import torch
    from circuit_tracer import attribute

    # circuit-tracer starts every prompt with a special token (it prepends one otherwise): give both the same
    ids = torch.tensor([tokenizer.bos_token_id, *tokenizer(PROMPT)["input_ids"]])
    graph = attribute(ids, model, max_n_logits=10, desired_logit_prob=0.95, batch_size=64)
    active = graph.active_features[graph.selected_features]
    torch.save(
        {
            "tokens": ids.tolist(),
            "adjacency": graph.adjacency_matrix,
            "features": active.tolist(),  # (layer, position, feature) of each feature node, in order
            "activations": graph.activation_values[graph.selected_features],
            "logits": [t.vocab_idx for t in graph.logit_targets],
            "probabilities": graph.logit_probabilities,
        },
        out,
    )
    print(f"wrote {out}: {len(active)} features, {len(graph.logit_targets)} logits")


def compare(model_dir: str, transcoders: str, out: str) -> dict[str, float]:
    import torch

    from interp_engine import attribution_graph, load_model, load_transcoders

    theirs = torch.load(out)
    model = load_model(model_dir, backend="eager")
    graph = attribution_graph(model, theirs["tokens"], load_transcoders(transcoders), batch_size=64)
    n_layers, n_pos = graph.n_layers, len(graph.tokens)
    assert graph.tokens == theirs["tokens"], "different tokens"
    keys = [("feature", *f) for f in theirs["features"]]
    keys += [("error", layer, p) for layer in range(n_layers) for p in range(n_pos)]
    keys += [("embedding", p) for p in range(n_pos)]
    keys += [("logit", t) for t in theirs["logits"]]
    ours = [graph.node(k).index for k in keys]
    assert sorted(ours) == list(range(len(graph.nodes))), "different node sets"
    mine = graph.adjacency[ours][:, ours]
    diff = (mine - theirs["adjacency"].float()).abs()
    # circuit-tracer zeroes the error vectors at position 0 (the BOS position's MLP outputs are
    # constants there); here they are error nodes: compare those columns apart
    bos_errors = [i for i, k in enumerate(keys) if k[0] == "error" and k[2] == 0]
    rest = [i for i in range(len(keys)) if i not in bos_errors]
    acts = torch.tensor([graph.nodes[i].activation for i in ours[: len(theirs["features"])]])
    result = {
        "nodes": len(keys),
        "features": len(theirs["features"]),
        "max_abs_edge_difference": float(diff[:, rest].max()),
        "max_abs_edge_difference_position_0_errors": float(diff[:, bos_errors].max()),
        "their_position_0_error_edges": float(theirs["adjacency"][:, bos_errors].abs().max()),
        "max_abs_edge": float(mine.abs().max()),
        "max_activation_difference": float((acts - theirs["activations"].float()).abs().max()),
        "max_probability_difference": float(
            (torch.tensor([n.probability for n in graph.nodes_of("logit")]) - theirs["probabilities"].float())
            .abs()
            .max()
        ),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "write":
        write(*args)
    elif command == "compare":
        compare(*args)
    else:
        raise SystemExit(f"unknown command {command!r}: write or compare")
