"""The eager backend against its oracle, HF ``transformers`` on the same weights, for every family."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Address, capture_attention, run_with_cache, sync_model
from interp_testkit.suite import ALL_FAMILIES, PROMPT, hf_oracle, rel_diff

from ..support.engines import eager_model

TOL = 1e-4

pytestmark = pytest.mark.parametrize("family", ALL_FAMILIES)


def _tokens(family: str, text: str = PROMPT) -> torch.Tensor:
    return eager_model(family).to_tokens(text)


def _every_point(n_layers: int) -> list[str]:
    kinds = ("resid_pre", "resid_mid", "attn_out", "mlp_post", "mlp_out", "resid_post")
    return ["embed", *(f"{k}.{layer}" for layer in range(n_layers) for k in kinds), "final_norm", "logits"]


def _hf_run(family: str, tokens: torch.Tensor):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf_oracle(family)(tokens, output_hidden_states=True, output_attentions=True)


def test_every_address_hf_exposes_matches(family: str) -> None:
    model = eager_model(family)
    n = model.info.n_layers
    tokens = _tokens(family)
    cache = run_with_cache(model, tokens, _every_point(n))
    out = _hf_run(family, tokens)
    hidden = out.hidden_states
    assert rel_diff(cache["embed"], hidden[0]) <= TOL
    for layer in range(n):
        assert rel_diff(cache[Address("resid_pre", layer)], hidden[layer]) <= TOL, layer
        if layer < n - 1:  # HF's last hidden state is the final norm's output
            assert rel_diff(cache[Address("resid_post", layer)], hidden[layer + 1]) <= TOL, layer
    assert rel_diff(cache["final_norm"], hidden[n]) <= TOL
    assert rel_diff(cache["logits"], out.logits) <= TOL


def test_residual_identities(family: str) -> None:
    model = eager_model(family)
    n = model.info.n_layers
    # what each sublayer adds to the residual: its output, or on sandwich-norm families (Gemma 2/3,
    # OLMo 2) its post-norm's output (attn_out / mlp_out are the sublayers' own, before the norm)
    sandwich = "attn_out_post" in model.points()
    attn, mlp = ("attn_out_post", "mlp_out_post") if sandwich else ("attn_out", "mlp_out")
    extra = [f"{k}.{layer}" for k in (attn, mlp) for layer in range(n)] if sandwich else []
    cache = run_with_cache(model, _tokens(family), _every_point(n) + extra)
    for layer in range(n):
        post = cache[f"resid_post.{layer}"]
        if layer < n - 1:
            assert torch.equal(post, cache[f"resid_pre.{layer + 1}"])
        # sequential and parallel blocks alike add both block outputs to resid_pre
        total = cache[f"resid_pre.{layer}"] + cache[f"{attn}.{layer}"] + cache[f"{mlp}.{layer}"]
        assert rel_diff(total, post) <= TOL, layer
        assert rel_diff(cache[f"resid_mid.{layer}"] + cache[f"{mlp}.{layer}"], post) <= TOL, layer
        assert rel_diff(cache[f"resid_mid.{layer}"], cache[f"resid_pre.{layer}"] + cache[f"{attn}.{layer}"]) <= TOL
    assert cache[f"mlp_post.{n - 1}"].shape[-1] == model.info.d_mlp


def test_attention_patterns_match_hf_eager_attention(family: str) -> None:
    model = eager_model(family)
    tokens = _tokens(family)
    n = model.info.n_layers
    patterns = capture_attention(model, tokens, range(n))
    out = _hf_run(family, tokens)
    for layer in range(n):
        got = patterns[Address("attn_pattern", layer)]
        assert got.shape == (1, model.info.n_heads, tokens.shape[1], tokens.shape[1])
        assert rel_diff(got, out.attentions[layer]) <= TOL
        assert torch.allclose(got.sum(-1), torch.ones(()), atol=1e-5)
    # negative layers count from the end
    last = capture_attention(model, tokens, [-1])
    assert torch.equal(last[Address("attn_pattern", -1)], patterns[Address("attn_pattern", n - 1)])


def test_decode_residuals_is_the_logit_lens(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    tokens = _tokens(family)
    acts = sync.capture(tokens[0].tolist(), [Address("resid_post", -1), Address("resid_post", 0)])
    logits = sync.decode_residuals(acts[Address("resid_post", -1)])
    assert rel_diff(logits, _hf_run(family, tokens).logits[0]) <= TOL
    early = sync.decode_residuals(acts)
    assert isinstance(early, dict) and early[Address("resid_post", 0)].shape == logits.shape


def test_greedy_generation_matches_hf(family: str) -> None:
    model = eager_model(family)
    tokens = _tokens(family, "Once upon a time")
    sync = sync_model(model)
    completion = sync.generate(tokens[0].tolist(), max_tokens=10)
    hf = hf_oracle(family)
    with torch.no_grad():
        expected = hf.generate(tokens, max_new_tokens=10, do_sample=False)[0, tokens.shape[1] :].tolist()
    assert completion.token_ids == expected
    assert completion.text == model.tokenizer.decode(expected, skip_special_tokens=True)


def test_capture_generation_covers_prompt_and_every_generated_token(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    prompt = _tokens(family, "Once upon a time")[0].tolist()
    points = [Address("resid_post", 0), Address("mlp_post", -1), Address("attn_pattern", 1)]
    completion, acts = sync.capture_generation(prompt, points, max_tokens=6, ignore_eos=True)
    assert len(completion.token_ids) == 6
    full = prompt + completion.token_ids
    assert acts[points[0]].shape == (len(full), model.info.d_model)
    # the KV-cached decode equals one forward over the whole sequence, and HF
    whole = sync.capture(full, points)
    out = _hf_run(family, torch.tensor([full]))
    for point in points:
        assert rel_diff(acts[point], whole[point]) <= TOL, point
    assert rel_diff(acts[points[0]], out.hidden_states[1][0]) <= TOL
    assert rel_diff(acts[points[2]], out.attentions[1][0]) <= TOL


def test_stream_logprobs_match_hf(family: str) -> None:
    model = eager_model(family)
    prompt = _tokens(family, "Once upon a time")[0].tolist()
    steps = list(sync_model(model).stream(prompt, max_tokens=4, n_logprobs=5, ignore_eos=True))
    assert len(steps) == 4
    sequence = list(prompt)
    for step in steps:
        with torch.no_grad():
            logits = hf_oracle(family)(torch.tensor([sequence])).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), -1)
        ids = [t for t, _ in step.logprobs]
        assert ids[0] == step.token_id == int(logits.argmax())
        assert ids == torch.topk(logprobs, 5).indices.tolist()
        assert max(abs(lp - float(logprobs[t])) for t, lp in step.logprobs) <= 1e-4
        sequence.append(step.token_id)
    assert "".join(s.text for s in steps) == model.tokenizer.decode(sequence[len(prompt) :], skip_special_tokens=True)


def test_padded_batch_rows_equal_solo_runs(family: str) -> None:
    model = eager_model(family)
    texts = ["Hello", PROMPT, "A cat sat on the mat"]
    points = ["resid_post.1", "mlp_post.0", "attn_pattern.2", "logits"]
    cache = run_with_cache(model, texts, points)
    lengths = cache.lengths
    assert lengths is not None and lengths.tolist() == [len(model.to_tokens(t)[0]) for t in texts]
    for row, text in enumerate(texts):
        n = int(lengths[row])
        solo = run_with_cache(model, text, points)
        for point in points:
            got = cache[point][row]
            if point.startswith("attn_pattern"):
                assert rel_diff(got[:, :n, :n], solo[point][0]) <= TOL
                assert not got[:, n:].any() and not got[:, :, n:].any()
            else:
                assert rel_diff(got[:n], solo[point][0]) <= TOL
                assert not got[n:].any()
