"""TransformerLens itself as the oracle of our TransformerLens hook-name aliases.

For every family TransformerLens's ``HookedTransformer`` supports, a HookedTransformer is built on
the same tiny checkpoint the eager backend loads, with every weight-processing switch off (no
folding, centering or refactoring), converted by TransformerLens's own config and weight
conversion. Nothing is downloaded. For each TransformerLens name in ``TL_PER_LAYER`` and
``TL_MODEL_LEVEL``, at every layer, ``run_with_cache(model, tokens, [name])`` must hold
TransformerLens's ``run_with_cache`` value for that name, or, where the two legitimately differ,
the relation written next to the case in ``_relation`` (the test checks that it is not plain
equality, so a differing alias cannot pass by accident). docs/reference/addresses.md "Checked against TransformerLens
itself" lists the differences.

Run alone: ``.venv/bin/python -m pytest -q tests/eager/test_tl_oracle.py``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import tempfile
from typing import Any

import pytest
import torch

from interp_engine import KindNotInFamily, run_with_cache
from interp_engine.addresses._tl_names import TL_MODEL_LEVEL, TL_PER_LAYER
from interp_testkit.suite import ALL_FAMILIES, PROMPT, SWEEP_FAMILIES, rel_diff, tiny_model_path

from ..support.engines import eager_model

TOL = 1e-4
DIFFERS = 1e-3
"""A relation other than equality is only asserted where the values are also this far apart."""

NOT_IN_TRANSFORMERLENS = {"stablelm": "StableLmForCausalLM"}
"""Families whose architecture TransformerLens's HookedTransformer does not implement."""
SWEEP_IN_TRANSFORMERLENS = ("apertus", "bloom", "gpt_neo", "gpt_oss", "mixtral", "olmo3", "olmoe")
"""Model types of the eager breadth sweep (``interp_testkit.suite.SWEEP_FAMILIES``) that TransformerLens builds from
a local checkpoint's config (the sweep's others: its ``convert_hf_model_config`` has no branch for
them, or, OLMo's, only a hub-name one)."""
TL_FAMILIES = tuple(f for f in ALL_FAMILIES if f not in NOT_IN_TRANSFORMERLENS) + SWEEP_IN_TRANSFORMERLENS
assert set(SWEEP_IN_TRANSFORMERLENS) <= set(SWEEP_FAMILIES)

LAYER_NORM = {"gpt2", "gpt_neox", "opt", "phi", "gptj", "gpt_neo", "bloom"}  # LayerNorm; the rest RMSNorm
NOT_ROTARY = {"gpt2", "opt", "gpt_neo", "bloom"}  # learned positions or ALiBi
PARALLEL = {"gpt_neox", "phi", "gptj"}  # attention and MLP both read resid_pre
NOT_GATED = {"gpt2", "gpt_neox", "opt", "phi", "gptj", "gpt_neo", "bloom", "apertus"}
MOE = {"gpt_oss", "mixtral", "olmoe"}  # every layer a mixture of experts: no single MLP hidden
SINKS = {"gpt_oss"}  # attention also normalises over a sink logit per head: no attn_scores
SANDWICH = {"gemma2", "gemma3_text"}  # pre- and post-sublayer norms
POST_NORM = {"olmo2", "olmo3"}  # post-sublayer norms only

BY_NAME = {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"}
"""Architectures whose TransformerLens config comes from the model's hub name, not its config."""

ALIASES = [f"blocks.L.{suffix}" for suffix in TL_PER_LAYER] + list(TL_MODEL_LEVEL)


def _by_name_config(raw: dict[str, Any]) -> dict[str, Any]:
    """TransformerLens's config for the architectures it only knows by hub name (its
    ``convert_hf_model_config`` branches ``google/gemma-*``, ``google/gemma-2-*``,
    ``google/gemma-3-*``, ``allenai/OLMo-2-*``), with the tiny model's sizes: the same keys."""
    arch = raw["architectures"][0]
    rope = raw["rope_parameters"]
    layer_types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    attn_types = ["local" if t == "sliding_attention" else "global" for t in layer_types]
    d_head = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    cfg: dict[str, Any] = {
        "d_model": raw["hidden_size"],
        "d_head": d_head,
        "n_heads": raw["num_attention_heads"],
        "d_mlp": raw["intermediate_size"],
        "n_layers": raw["num_hidden_layers"],
        "n_ctx": raw["max_position_embeddings"],
        "eps": raw["rms_norm_eps"],
        "d_vocab": raw["vocab_size"],
        "act_fn": raw.get("hidden_activation") or raw["hidden_act"],
        "initializer_range": raw["initializer_range"],
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "gated_mlp": True,
        "original_architecture": arch,
    }
    if arch == "Olmo2ForCausalLM":
        cfg.update(rotary_base=rope["rope_theta"], attn_types=attn_types)
        return cfg
    cfg.update(
        final_rms=True,
        use_attn_scale=True,
        attn_scale=raw.get("query_pre_attn_scalar", d_head) ** 0.5,
        n_key_value_heads=raw["num_key_value_heads"],
    )
    if arch == "GemmaForCausalLM":
        cfg.update(rotary_base=rope["rope_theta"], rotary_dim=d_head)
    elif arch == "Gemma2ForCausalLM":
        cfg.update(
            rotary_base=rope["rope_theta"],
            window_size=raw["sliding_window"],
            use_local_attn=True,
            attn_types=attn_types,
            attn_scores_soft_cap=raw["attn_logit_softcapping"],
            output_logits_soft_cap=raw["final_logit_softcapping"],
            use_normalization_before_and_after=True,
        )
    else:  # Gemma3ForCausalLM
        cfg.update(
            rotary_base=rope["full_attention"]["rope_theta"],
            rotary_base_local=rope["sliding_attention"]["rope_theta"],
            window_size=raw["sliding_window"],
            use_local_attn=True,
            attn_types=attn_types,
            use_normalization_before_and_after=True,
            use_qk_norm=True,
        )
    return cfg


def _tl_config_dict(path: pathlib.Path) -> dict[str, Any]:
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    raw = json.loads((path / "config.json").read_text())
    if raw["architectures"][0] in BY_NAME:
        return _by_name_config(raw)
    # convert_hf_model_config reads a local directory's config.json, but first matches substrings
    # of the path ("llama", "gemma") to pick name-only branches: give it a copy under a neutral name.
    if raw["model_type"] == "gpt2":
        # it reads GPT2Config.n_ctx, which transformers 5 no longer defines (the hub's gpt2
        # config.json still carries it as an extra key)
        raw.setdefault("n_ctx", raw["n_positions"])
    with tempfile.TemporaryDirectory(prefix="tl-oracle-") as tmp:
        copy = pathlib.Path(tmp) / "model"
        copy.mkdir()
        (copy / "config.json").write_text(json.dumps(raw))
        return convert_hf_model_config(str(copy))


@functools.cache
def tl_model(family: str) -> Any:
    """The family's tiny checkpoint as a TransformerLens HookedTransformer, unprocessed."""
    from transformers import AutoModelForCausalLM

    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
        from transformer_lens.loading_from_pretrained import get_pretrained_state_dict
    except ImportError as exc:  # 4.x removed HookedTransformer
        pytest.fail(f"this oracle needs transformer-lens 3.x (the dev extra pins 3.9.0): {exc}")

    path = tiny_model_path(family)
    cfg = _tl_config_dict(path)
    # what get_pretrained_model_config adds; no tokenizer (token ids are given), no BOS
    cfg.update(
        model_name=family,
        tokenizer_name=None,
        init_weights=False,
        dtype=torch.float32,
        device="cpu",
        n_devices=1,
        default_prepend_bos=False,
        from_checkpoint=False,
    )
    config = HookedTransformerConfig.from_dict(cfg)
    # a private HF copy: TransformerLens's conversion must not touch the session's shared oracle
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")  # in eval mode
    state_dict = get_pretrained_state_dict(str(path), config, hf_model=hf)
    model = HookedTransformer(config, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return model.eval()


@functools.cache
def _tokens(family: str) -> torch.Tensor:
    row = eager_model(family).to_tokens(PROMPT)[:, :10]
    return torch.cat([row, row.flip(-1)])  # two prompts of one length: the batch axis, no padding


@functools.cache
def tl_cache(family: str) -> Any:
    """TransformerLens's ``run_with_cache`` on the test tokens: every hook."""
    with torch.no_grad():
        _, cache = tl_model(family).run_with_cache(_tokens(family))
    return cache


def _ours(family: str, points: list[str]) -> Any:
    return run_with_cache(eager_model(family), _tokens(family), points)


def _relation(family: str, suffix: str) -> str:
    """How our value of the TransformerLens name relates to TransformerLens's (see docs/reference/addresses.md)."""
    if suffix in ("ln1.hook_normalized", "ln2.hook_normalized", "ln_final.hook_normalized"):
        if family in POST_NORM and suffix != "ln_final.hook_normalized":
            return "post_norm_ln"
        return "norm_affine"
    if suffix in ("hook_attn_out", "hook_mlp_out") and family in SANDWICH | POST_NORM:
        return "post_norm_out"
    if suffix in ("attn.hook_q", "attn.hook_k"):
        if family not in NOT_ROTARY:
            return "rotary"
        if family == "opt" and suffix == "attn.hook_q":
            return "opt_query_scaled"
    if suffix in ("attn.hook_rot_q", "attn.hook_rot_k") and family in NOT_ROTARY:
        return "tl_has_no_rot"
    if suffix == "hook_resid_mid" and family in PARALLEL:
        return "tl_has_no_resid_mid"
    if suffix == "mlp.hook_pre_linear" and family in NOT_GATED:
        return "neither"
    if suffix in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post") and family in MOE:
        return "neither"  # TransformerLens hooks each expert's hidden, we have no single MLP hidden
    if suffix == "mlp.hook_expert_indices":  # dense families: no experts on either side
        return "tl_flattens_tokens" if family in MOE else "neither"
    if suffix == "attn.hook_attn_scores":
        if family in SINKS:
            return "tl_scores_without_sinks"
        return "alibi_shifted" if family == "bloom" else "scores"
    return "equal"


def _differs(ours: torch.Tensor, tl: torch.Tensor, name: str) -> None:
    assert rel_diff(ours, tl) > DIFFERS, (
        f"{name}: ours equals TransformerLens's value here; the relation asserted instead no longer "
        f"tells them apart (update _relation and docs/reference/addresses.md)"
    )


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("family", TL_FAMILIES)
def test_alias_against_transformerlens(family: str, alias: str) -> None:
    model = tl_model(family)
    cache = tl_cache(family)
    suffix = alias.removeprefix("blocks.L.")
    per_layer = alias.startswith("blocks.L.")
    names = [f"blocks.{layer}.{suffix}" for layer in range(model.cfg.n_layers)] if per_layer else [alias]
    relation = _relation(family, suffix)

    if relation == "tl_scores_without_sinks":
        assert all(n in cache for n in names)
        with pytest.raises(KindNotInFamily, match="sink logit"):
            _ours(family, names)
        return
    if relation == "neither":
        # gated-MLP only: TransformerLens has no hook, we have no such address on this family
        assert all(name not in cache for name in names)
        with pytest.raises(KindNotInFamily):
            _ours(family, names)
        return

    ours = _ours(family, names)
    for layer, name in enumerate(names):
        got = ours[name]
        block = model.blocks[layer] if per_layer else None
        if relation == "equal":
            assert rel_diff(got, cache[name]) <= TOL, name
        elif relation == "scores":
            # -inf where masked in both; compare the rest
            tl = cache[name]
            kept = torch.isfinite(tl)
            assert torch.equal(torch.isfinite(got), kept), name
            assert rel_diff(got[kept], tl[kept]) <= TOL, name
        elif relation == "norm_affine":
            # TransformerLens fires hook_normalized before the norm's weight (and bias): RMSNorm
            # x / rms(x), LayerNorm (x - mean) / std. Ours is the norm's output, what the
            # sublayer (or the unembedding) reads: TransformerLens's value * w (+ b).
            norm = model.ln_final if block is None else getattr(block, suffix.split(".")[0])
            expected = cache[name] * norm.w + (norm.b if family in LAYER_NORM else 0)
            assert rel_diff(got, expected) <= TOL, name
            _differs(got, cache[name], name)
        elif relation == "post_norm_ln":
            # OLMo 2 has no pre-norms: TransformerLens's ln1/ln2 are its post-attention/post-MLP
            # norms, so ln1.hook_normalized * w is our attn_out_post (ln2: mlp_out_post). Our
            # attn_in/mlp_in there are what the sublayer reads, the bare residual.
            post = "attn_out_post" if suffix.startswith("ln1") else "mlp_out_post"
            norm = getattr(block, suffix.split(".")[0])
            ours_post = _ours(family, [f"{post}.{layer}"])[f"{post}.{layer}"]
            assert rel_diff(ours_post, cache[name] * norm.w) <= TOL, name
            residual = "hook_resid_pre" if suffix.startswith("ln1") else "hook_resid_mid"
            assert rel_diff(got, cache[f"blocks.{layer}.{residual}"]) <= TOL, name
            _differs(got, cache[name], name)
        elif relation == "post_norm_out":
            # Gemma 2/3 (sandwich norms) and OLMo 2 (post-norms): TransformerLens fires
            # hook_attn_out/hook_mlp_out after the post-sublayer norm, i.e. on our
            # attn_out_post/mlp_out_post; ours is the sublayer's output before that norm, the norm's
            # input: its hook_normalized * hook_scale (RMSNorm: x = (x / rms) * rms).
            sub = "attn" if suffix == "hook_attn_out" else "mlp"
            post_norm = ("ln1" if sub == "attn" else "ln2") + ("_post" if family in SANDWICH else "")
            norm_in = (
                cache[f"blocks.{layer}.{post_norm}.hook_normalized"] * cache[f"blocks.{layer}.{post_norm}.hook_scale"]
            )
            assert rel_diff(got, norm_in) <= TOL, name
            post = f"{sub}_out_post.{layer}"
            assert rel_diff(_ours(family, [post])[post], cache[name]) <= TOL, name
            _differs(got, cache[name], name)
        elif relation == "rotary":
            # rotary models: TransformerLens's hook_q/hook_k are before rotary (and before any q/k
            # norm); our attn_q/attn_k are what the product uses, its hook_rot_q/hook_rot_k
            rotated = name.replace(".hook_", ".hook_rot_")
            assert rel_diff(got, cache[rotated]) <= TOL, name
            _differs(got, cache[name], name)
        elif relation == "opt_query_scaled":
            # HF's OPT scales the query by d_head**-0.5 before the product, and our attn_q is the
            # query the product uses; TransformerLens applies the scale to the scores instead
            expected = cache[name] * model.cfg.d_head**-0.5
            assert rel_diff(got, expected) <= TOL, name
            _differs(got, cache[name], name)
        elif relation == "tl_has_no_rot":
            # no rotary: TransformerLens has no hook_rot_q/k; the name still reads our attn_q/k,
            # which is TransformerLens's hook_q/hook_k (OPT's query: times d_head**-0.5, as above)
            assert name not in cache
            plain = cache[name.replace(".hook_rot_", ".hook_")]
            scale = model.cfg.d_head**-0.5 if family == "opt" and suffix.endswith("_q") else 1.0
            assert rel_diff(got, plain * scale) <= TOL, name
        elif relation == "tl_flattens_tokens":
            # TransformerLens keeps the chosen experts [batch * pos, k]; ours [batch, pos, k]: the
            # same experts in the same order
            tl = cache[name]
            assert got.dtype == torch.int64 and torch.equal(got.reshape(tl.shape), tl.to(torch.int64)), name
        elif relation == "alibi_shifted":
            # Bloom's ALiBi: HF adds slope * key position (what the softmax sees, ours),
            # TransformerLens slope * (key - query) position: each query row shifted by a constant
            tl = cache[name]
            kept = torch.isfinite(tl)
            assert torch.equal(torch.isfinite(got), kept), name
            shift = torch.where(kept, got - tl, 0.0)
            per_row = torch.where(kept, shift[..., :1].expand_as(shift), 0.0)  # key 0 is never masked
            assert rel_diff(shift, per_row) <= TOL, name
            assert rel_diff(got.softmax(-1), tl.softmax(-1)) <= TOL, name
            _differs(got[kept], tl[kept], name)
        elif relation == "tl_has_no_resid_mid":
            # parallel attention: TransformerLens has no hook_resid_mid; ours is resid_pre + attn_out
            assert name not in cache
            expected = cache[f"blocks.{layer}.hook_resid_pre"] + cache[f"blocks.{layer}.hook_attn_out"]
            assert rel_diff(got, expected) <= TOL, name
        else:  # pragma: no cover
            raise AssertionError(relation)


@pytest.mark.parametrize("family", TL_FAMILIES)
def test_transformerlens_model_is_the_checkpoint(family: str) -> None:
    """The oracle itself: TransformerLens's logits equal the eager model's on the same tokens."""
    with torch.no_grad():
        tl_logits = tl_model(family)(_tokens(family))
    assert rel_diff(_ours(family, ["logits"])["logits"], tl_logits) <= TOL


@pytest.mark.parametrize("family", sorted(NOT_IN_TRANSFORMERLENS))
def test_families_transformerlens_cannot_build(family: str) -> None:
    """Left out above because HookedTransformer has no such architecture: noticed once it does."""
    with pytest.raises(NotImplementedError, match=NOT_IN_TRANSFORMERLENS[family]):
        _tl_config_dict(tiny_model_path(family))
