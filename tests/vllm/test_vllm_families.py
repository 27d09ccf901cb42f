"""The families interpretability uses, on the vllm and vllm-static backends, resolved from vLLM's
module tree: every address each family has against the eager backend (itself checked against HF
``transformers``), the residual stream, attention patterns and logits against HF directly, greedy
generation against HF, steering against eager, and on a mixture of experts the router points,
with the expert indices and weights proven equal to what vLLM's fused MoE kernel used.

GPT-NeoX and OLMo 2 are served by vLLM's Transformers modeling backend (HF's modules with vLLM's
linear layers and attention; the attention kernel is called as ``attn.forward(q, k, v)``), Gemma 2
and 3 and Phi-3 and Mixtral by vLLM's own model classes. One engine per (family, backend), shut
down when that family's tests finish. Each (family, backend) that passes writes
``.cache/family-results/<backend>/<model_type>.json`` (for docs/reference/model-types.md's table).

The sweep over every other model type vLLM runs here is marked ``sweep`` (deselected by default;
``pytest -m sweep tests/vllm/test_vllm_families.py``).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    WEIGHT_NAMES,
    Address,
    KindNotInFamily,
    SteeringSpec,
    Write,
    load_model,
    logit_attribution,
    sync_model,
    weights,
)
from interp_testkit.suite import PROMPT, ROOT, hf_for, rel_diff, vllm_model_path

from ..support.points import every_point, writes_at_every_kind

TOL = 1e-4
FAMILIES = ("gpt_neox", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral")
BACKENDS = ("vllm", "vllm-static")
RESULTS = ROOT / ".cache" / "family-results"
INSECURE = "VLLM_ALLOW_INSECURE_SERIALIZATION"
PARTS = ("addresses", "generation", "steering")
STATIC_COMPILED = ("gpt_neox", "mixtral")
"""vllm-static engines compiled here: the Transformers backend's HF modules and a mixture of experts.
The others run their fixed taps uncompiled (``enforce_eager``) to keep CI short: vLLM's own dense
classes compiled with static taps are covered by test_vllm_static.py and test_vllm_points.py."""
MOE_PARTS = ("routing",)
SHARED = ("gemma2", "gemma3_text")
"""Families whose vllm engine is the session pool's (test_vllm_points reads them too): no
mixture of experts among them, so no routing test needs the pickled-callable RPC there."""
_checked: dict[tuple[str, str], dict[str, list[str]]] = {}
"""Per (family, backend): the parts whose test passed, with the kinds each checked."""


@functools.cache
def eager_twin(family: str) -> Any:
    """The eager backend on the very same checkpoint: the oracle for every address."""
    return sync_model(load_model(vllm_model_path(family), backend="eager"))


def _ids(model: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = model.to_tokens(text)[0].tolist()
    return ids


def _load(family: str, backend: str, compiled: bool = True) -> Any:
    path = vllm_model_path(family)
    if backend == "vllm":
        return sync_model(load_model(path, backend="vllm"))
    options = {} if compiled else {"enforce_eager": True}
    model = load_model(path, backend="vllm-static", static_points="auto", **options)
    points = [str(a) for a in every_point(model)]
    model.configure_static(points, static_writes=sorted({str(w.address) for w in writes_at_every_kind(model)}))
    return sync_model(model)


@pytest.fixture(scope="module", params=[(f, b) for f in FAMILIES for b in BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}")
def served(request: pytest.FixtureRequest, vllm_engines: Any) -> Iterator[tuple[str, str, Any]]:
    """One engine per (family, backend), shut down when that family's tests are done; the vllm
    engine of a family the session's pool holds too (:data:`SHARED`) is the pool's."""
    family, backend = request.param
    if backend == "vllm" and family in SHARED:
        yield family, backend, vllm_engines(family)
        return
    # the routing test runs a function in vLLM's worker (collective_rpc of a pickled callable)
    previous = os.environ.get(INSECURE)
    os.environ[INSECURE] = "1"
    model = _load(family, backend, compiled=family in STATIC_COMPILED)
    try:
        model.warmup()
        yield family, backend, model
    finally:
        model.shutdown()
        if previous is None:
            os.environ.pop(INSECURE, None)
        else:
            os.environ[INSECURE] = previous


def _passed(family: str, backend: str, part: str, kinds: list[str]) -> None:
    _checked.setdefault((family, backend), {})[part] = sorted(set(kinds))


def test_every_address_equals_eager_and_hf(served: tuple[str, str, Any]) -> None:
    family, backend, model = served
    ids = _ids(model)
    points = every_point(model)
    eager = eager_twin(family)
    assert set(model.points()) == set(eager.points()), "vLLM and eager serve different kinds"
    acts = model.capture(ids, points)
    expected = eager.capture(ids, points)
    for point in points:
        assert rel_diff(acts[point], expected[point]) <= TOL, point
    n = model.info.n_layers
    with torch.no_grad():
        out = hf_for(vllm_model_path(family))(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    assert rel_diff(acts[Address("embed")], out.hidden_states[0][0]) <= TOL
    for layer in range(n):
        assert rel_diff(acts[Address("resid_pre", layer)], out.hidden_states[layer][0]) <= TOL
        assert rel_diff(acts[Address("attn_pattern", layer)], out.attentions[layer][0]) <= TOL
        if layer < n - 1:
            assert rel_diff(acts[Address("resid_post", layer)], out.hidden_states[layer + 1][0]) <= TOL
    assert rel_diff(acts[Address("final_norm")], out.hidden_states[n][0]) <= TOL
    assert rel_diff(acts[Address("logits")], out.logits[0]) <= TOL
    _passed(family, backend, "addresses", [p.kind for p in points])


def test_greedy_generation_equals_hf(served: tuple[str, str, Any]) -> None:
    family, backend, model = served
    ids = _ids(model, "Once upon a time")
    completion = model.generate(ids, max_tokens=10, ignore_eos=True)
    with torch.no_grad():
        hf = hf_for(vllm_model_path(family)).generate(
            torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
    assert completion.token_ids == hf[0, len(ids) :].tolist()
    _passed(family, backend, "generation", [])


def test_steering_equals_eager(served: tuple[str, str, Any]) -> None:
    family, backend, model = served
    ids = _ids(model)
    n = model.info.n_layers
    points = [Address("resid_post", n - 1), Address("logits")]
    plain = model.capture(ids, points)
    for write in writes_at_every_kind(model):
        spec = SteeringSpec([write])
        got = model.capture(ids, points, steering_spec=spec)
        expected = eager_twin(family).capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(got[point], expected[point]) <= TOL, (write.address, point)
        assert not torch.allclose(got[Address("logits")], plain[Address("logits")]), write.address
    _passed(family, backend, "steering", [w.address.kind for w in writes_at_every_kind(model) if w.address is not None])


def test_mixture_of_experts_routing(served: tuple[str, str, Any]) -> None:
    """Router logits, expert indices and weights equal eager's (HF's routing); the indices and
    weights are exactly what vLLM's fused MoE kernel was given (recorded in the worker); ablating
    an expert through router_logits reroutes every token, as on eager; there is no single MLP
    hidden on an MoE layer."""
    family, backend, model = served
    if not model.info.n_experts:
        with pytest.raises(KindNotInFamily, match="mixture of experts"):
            model.capture(_ids(model), ["router_logits.0"])
        return
    ids = _ids(model)
    n, k = model.info.n_layers, model.info.experts_per_token
    kinds = ("router_logits", "expert_indices", "expert_weights", "mlp_out")
    points = [Address(kind, layer) for layer in range(n) for kind in kinds]
    # on vllm, record what the fused kernel is given (vllm-static's kernel runs inside the compiled
    # graph, where no Python wrapper runs: its indices are checked against eager's exactly)
    dynamic = backend == "vllm"
    if dynamic:
        _rpc(model, _record_kernel_routing, True)
    acts = model.capture(ids, points)
    kernel = _rpc(model, _record_kernel_routing, False) if dynamic else None
    expected = eager_twin(family).capture(ids, points)
    for layer in range(n):
        indices, weights = acts[Address("expert_indices", layer)], acts[Address("expert_weights", layer)]
        assert indices.dtype == torch.int64 and indices.shape == (len(ids), k)
        assert torch.equal(indices, expected[Address("expert_indices", layer)]), layer
        for kind in ("router_logits", "expert_weights", "mlp_out"):
            assert rel_diff(acts[Address(kind, layer)], expected[Address(kind, layer)]) <= TOL, (kind, layer)
        if kernel is not None:
            used_ids, used_weights = kernel[layer]
            assert torch.equal(indices, used_ids.to(torch.int64)), layer
            assert rel_diff(weights, used_weights) <= TOL, layer
    # ablating expert 0 at layer 1 through its logits: no token is routed to it, as on eager
    ablate = torch.zeros(model.info.n_experts)
    ablate[0] = -torch.inf
    spec = SteeringSpec([Write("router_logits.1", ablate)])
    watched = [Address("expert_indices", 1), Address("expert_weights", 1), Address("logits")]
    steered = model.capture(ids, watched, steering_spec=spec)
    assert bool((acts[Address("expert_indices", 1)] == 0).any()), "expert 0 was never chosen before the ablation"
    assert not bool((steered[Address("expert_indices", 1)] == 0).any())
    twin = eager_twin(family).capture(ids, watched, steering_spec=spec)
    assert torch.equal(steered[Address("expert_indices", 1)], twin[Address("expert_indices", 1)])
    for point in watched[1:]:
        assert rel_diff(steered[point], twin[point]) <= TOL, point
    for kind in ("mlp_pre", "mlp_post"):
        with pytest.raises(KindNotInFamily, match="no single MLP hidden"):
            model.capture(ids, [f"{kind}.0"])
    _passed(family, backend, "routing", list(kinds))


def _record_kernel_routing(worker: Any, start: bool) -> Any:
    """In vLLM's worker: wrap each MoE layer's ``forward_modular`` (the fused experts, called
    with the router's ``topk_weights`` and ``topk_ids``) to record what it is given; then
    return, per layer, the last call's ids and weights."""
    model = worker.model_runner.get_model()
    runners = [m for m in model.modules() if hasattr(m, "routed_experts") and hasattr(m, "router")]
    if start:
        for runner in runners:
            experts = runner.routed_experts
            experts.__dict__.pop("forward_modular", None)
            original = experts.forward_modular
            calls: list[tuple[torch.Tensor, torch.Tensor]] = []

            def forward_modular(
                x: Any, topk_weights: Any, topk_ids: Any, *a: Any, _o: Any = original, _c: Any = calls, **kw: Any
            ) -> Any:
                _c.append((topk_ids.detach().cpu().clone(), topk_weights.detach().float().cpu().clone()))
                return _o(x, topk_weights, topk_ids, *a, **kw)

            experts.forward_modular = forward_modular
            experts._interp_calls = calls
        return len(runners)
    out = []
    for runner in runners:
        calls = runner.routed_experts.__dict__.pop("_interp_calls", [])
        runner.routed_experts.__dict__.pop("forward_modular", None)
        assert calls, "the fused MoE kernel was not called through forward_modular"
        ids = torch.cat([c[0] for c in calls])
        weights = torch.cat([c[1] for c in calls])
        out.append((ids[-len(calls[-1][0]) :].tolist(), weights[-len(calls[-1][1]) :].tolist()))
    return out


def _rpc(model: Any, function: Any, *args: Any) -> Any:
    """Run ``function(worker, *args)`` in vLLM's worker (pickled by value) on the facade's loop."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = model.run(model.model._ready)
    answers = model.run(lambda: engine.collective_rpc(function, args=args))
    answer = answers[0]
    if isinstance(answer, list):
        return [(torch.tensor(ids), torch.tensor(weights)) for ids, weights in answer]
    return answer


def test_weights_and_logit_attribution_equal_eager(served: tuple[str, str, Any]) -> None:
    """The served weights (joined from the workers) equal the eager twin's, which are HF's own
    parameters (test_weights.py): the final norm's kind, eps and Gemma's 1 + w offset, the soft-cap,
    tied embeddings. Direct logit attribution equals eager's and sums to the model's own logit
    difference (before Gemma 2's soft-cap), per head where no sandwich norm forbids it."""
    family, _, model = served
    eager = eager_twin(family)
    got, expected = weights(model), weights(eager)
    assert got.layout == expected.layout
    for name in got.names:
        for layer in range(model.info.n_layers) if WEIGHT_NAMES[name].per_layer else [None]:
            assert torch.equal(got.get(name, layer), expected.get(name, layer)), (name, layer)
    ids = _ids(model)
    heads = "attn_out_post" not in model.points()
    dla = logit_attribution(model, ids, 5, 7, heads=heads)
    twin = logit_attribution(eager, ids, 5, 7, heads=heads)
    assert dla.labels("component") == twin.labels("component")
    assert torch.allclose(dla.values, twin.values, atol=1e-4)
    assert abs(float(dla.values.sum()) - dla.meta["logit_diff"]) <= 1e-4
    assert abs(dla.meta["logit_diff"] - twin.meta["logit_diff"]) <= 1e-4


def test_record_result(served: tuple[str, str, Any]) -> None:
    """Runs last for each (family, backend): writes its result file when every part passed."""
    family, backend, model = served
    out = RESULTS / backend / f"{model.info.architecture}.json"
    parts = _checked.get((family, backend), {})
    wanted = PARTS + (MOE_PARTS if model.info.n_experts else ())
    missing = [p for p in wanted if p not in parts]
    if missing:
        out.unlink(missing_ok=True)
        pytest.fail(f"{family} on {backend}: {', '.join(missing)} did not pass")
    kinds = sorted({kind for checked in parts.values() for kind in checked})
    _write_result(out, model.info.architecture, backend, "verified", kinds)


def _write_result(
    out: pathlib.Path, model_type: str, backend: str, status: str, kinds: list[str], reason: str = ""
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"model_type": model_type, "backend": backend, "status": status, "kinds": kinds, "reason": reason}
    out.write_text(json.dumps(record, indent=1) + "\n")


# -- resolution alone: vLLM's module tree built without weights (no engine) ---------------------------


def test_resolution_from_vllms_module_tree() -> None:
    """What the resolver reads off vLLM's module trees (native classes and the Transformers
    backend's HF modules), and a clear refusal naming the module it cannot place."""
    from interp_engine import UnsupportedArchitecture
    from interp_vllm.model._resolve import resolve_without_weights

    def resolve(family: str) -> Any:
        return resolve_without_weights(str(vllm_model_path(family)), {"dtype": "float32"})

    neox = resolve("gpt_neox")  # vLLM serves it through its Transformers backend
    assert neox.batched and neox.parallel and not neox.deferred_residual and not neox.gated
    assert (neox.attn, neox.attn_kernel, neox.attn_o_proj) == ("attention", "attention.attn", "attention.dense")
    assert neox.hidden_arg == (0, "hidden_states") and neox.residual_arg is None
    olmo2 = resolve("olmo2")  # post-norms, no pre-norms; q/k norms over every head
    assert (olmo2.attn_post_norm, olmo2.mlp_post_norm) == ("post_attention_layernorm", "post_feedforward_layernorm")
    assert olmo2.q_norm == "self_attn.q_norm" and not olmo2.parallel
    gemma2 = resolve("gemma2")  # deferred residual, sandwich norms, tied unembedding
    assert gemma2.deferred_residual and gemma2.hidden_arg == (1, "hidden_states")
    assert gemma2.residual_arg == (2, "residual") and gemma2.attn_post_norm == "post_attention_layernorm"
    assert gemma2.unembed == "model.embed_tokens"
    phi3 = resolve("phi3")  # fused qkv and gate_up
    assert phi3.gated and phi3.mlp_up == "mlp.gate_up_proj" and phi3.attn_post_norm is None
    mixtral = resolve("mixtral")
    assert (mixtral.router, mixtral.experts) == ("block_sparse_moe.gate", "block_sparse_moe.experts")
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.dense_mlp) == (4, 2, False)
    assert {"mlp_pre", "mlp_post"} <= mixtral.lacks() and "router_logits" not in mixtral.lacks()
    opt = resolve("opt")  # the layer holds its MLP's projections itself
    assert (opt.mlp_in_at, opt.mlp_out_at, opt.mlp_up, opt.mlp_down) == ("fc1", "fc2", "fc1", "fc2")
    with pytest.raises(UnsupportedArchitecture, match="BitNetAttention"):
        resolve("bitnet")  # an extra norm (attn_sub_norm) inside the attention, names the module


def test_resolution_after_the_eager_backend_tapped_attention_in_the_same_process() -> None:
    """The eager backend's attention taps patch transformers' attention lookup for the process;
    vLLM's Transformers modeling backend patches the same lookup's class while it traces a model to
    find its attention's output projection, and must still see its own patch. PhiMoE is served
    through that backend and resolved nowhere else in this module (vLLM caches what it finds per
    module class)."""
    from interp_engine import Address, load_model, run_with_cache
    from interp_vllm.model._resolve import resolve_without_weights

    path = str(vllm_model_path("phimoe"))
    cache = run_with_cache(load_model(path, backend="eager"), "The capital of France is", [Address("attn_pattern", 0)])
    assert cache[Address("attn_pattern", 0)].shape[-1] == cache[Address("attn_pattern", 0)].shape[-2]
    family = resolve_without_weights(path, {"dtype": "float32"})
    assert family.attn_o_proj == "self_attn.o_proj" and family.n_experts == 4


# -- the sweep: every other model type, not in CI (pytest -m sweep tests/vllm/test_vllm_families.py) --------


def _sweep_types() -> list[str]:
    from interp_testkit import FAMILIES as BUILDABLE

    return [t for t in BUILDABLE if t not in FAMILIES]


def _refusal(exc: BaseException) -> str:
    """The first line of a typed refusal (an architecture or head size vLLM's CPU build cannot run)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"


@pytest.mark.sweep
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", _sweep_types())
def test_sweep(model_type: str, backend: str) -> None:
    """One model type on one backend: every address against eager (where eager serves the type;
    else the residual stream, patterns and logits against HF), greedy generation against HF and
    steering against eager; or a clean refusal (``UnsupportedArchitecture``, or a ``BackendError``
    from an engine vLLM's CPU build cannot start) recorded with its reason."""
    from interp_engine import BackendError, UnsupportedArchitecture

    out = RESULTS / backend / f"{model_type}.json"
    out.unlink(missing_ok=True)
    try:
        model = _load(model_type, backend)
    except UnsupportedArchitecture as exc:
        _write_result(out, model_type, backend, "refused", [], _refusal(exc))
        return
    try:
        try:
            model.warmup()
        except BackendError as exc:
            _write_result(out, model_type, backend, "refused", [], _refusal(exc))
            return
        # plain vLLM first: where its own greedy output already differs from HF's, the family's
        # implementation in vLLM differs (no tap involved); recorded as such
        n = model.info.n_layers
        hf = hf_for(vllm_model_path(model_type))
        gen_ids = _ids(model, "Once upon a time")
        completion = model.generate(gen_ids, max_tokens=8, ignore_eos=True)
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([gen_ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        if completion.token_ids != greedy[0, len(gen_ids) :].tolist():
            raise VllmDiffers("plain vLLM's greedy output differs from HF's (vLLM's own implementation, no tap)")
        ids = _ids(model)
        points = every_point(model)
        acts = model.capture(ids, points)
        try:
            eager: Any = eager_twin(model_type)
        except Exception:  # the eager backend does not serve this type: HF alone
            eager = None
        checked = {"resid_pre", "resid_post", "attn_pattern", "logits", "final_norm", "embed"}
        if eager is not None:
            shared = [p for p in points if p.kind in eager.points()]
            expected = eager.capture(ids, shared)
            for point in sorted(shared, key=lambda a: a.sort_key()):  # forward order: the first that differs
                assert rel_diff(acts[point], expected[point]) <= TOL, point
            checked |= {p.kind for p in shared}
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        for layer in range(n):
            assert rel_diff(acts[Address("resid_pre", layer)], ref.hidden_states[layer][0]) <= TOL, layer
            assert rel_diff(acts[Address("attn_pattern", layer)], ref.attentions[layer][0]) <= TOL, layer
        assert rel_diff(acts[Address("logits")], ref.logits[0]) <= TOL
        if eager is not None:
            logits = [Address("logits")]
            for write in writes_at_every_kind(model):
                if write.address is None or write.address.kind not in eager.points():
                    continue
                spec = SteeringSpec([write])
                got = model.capture(ids, logits, steering_spec=spec)[logits[0]]
                assert rel_diff(got, eager.capture(ids, logits, steering_spec=spec)[logits[0]]) <= TOL, write.address
        _write_result(out, model_type, backend, "verified", sorted(checked))
    except Exception as exc:  # a failure is recorded too ("fails" in the model-types table), then raised
        _write_result(out, model_type, backend, "fails", [], _failure(exc))
        raise
    finally:
        model.shutdown()


class VllmDiffers(AssertionError):
    """vLLM's own output differs from HF's on this model type, before any tap."""


def _failure(exc: BaseException) -> str:
    """What failed, in one short line: the assertion's subject (an address, a layer) or the error."""
    text = " ".join(str(exc).split())
    if isinstance(exc, VllmDiffers):
        return text
    if isinstance(exc, AssertionError):
        text = text.split(" assert ")[0]
        return f"differs from HF/eager at {text}"[:160] if text else "differs from HF/eager"
    return f"{type(exc).__name__}: {text}"[:160]
