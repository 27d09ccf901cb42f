"""Gradients on the eager backend (``run_with_gradients``), against ``torch.autograd`` run directly
on the plain HF model.

The oracle adds a zero tensor that requires grad to HF's own tensors with hooks written here (a
forward or pre-forward hook on the module that makes or takes the value; for ``attn_q``/``attn_k``
the family's attention function, swapped in its module's namespace), runs HF's forward, and
differentiates the same metric with ``torch.autograd.grad``: no code is shared with the backend's
plan. Steering writes are applied by the oracle's own hooks too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    GradientCapture,
    InvalidOption,
    InvalidTokens,
    SteeringSpec,
    UnsupportedAddress,
    UnsupportedOperation,
    Write,
    load_model,
    metrics,
    run_with_cache,
    run_with_gradients,
    sync_model,
)
from interp_testkit.suite import PROMPT, hf_oracle, rel_diff

from ..support.engines import eager_model

TOL = 1e-4
FAMILIES = ("gpt2", "llama")
KINDS = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post", "final_norm")
HEAD_KINDS = ("attn_z", "attn_q", "attn_k")

# -- where HF keeps each value (the oracle's own table) -----------------------------------------
LAYERS = {"gpt2": "transformer.h", "llama": "model.layers", "gptj": "transformer.h", "mixtral": "model.layers"}
FINAL_NORM = {"gpt2": "transformer.ln_f", "llama": "model.norm", "gptj": "transformer.ln_f"}
ATTN = {"gpt2": "attn", "llama": "self_attn", "gptj": "attn"}
O_PROJ = {"gpt2": "attn.c_proj", "llama": "self_attn.o_proj", "gptj": "attn.out_proj"}
DOWN = {"gpt2": "mlp.c_proj", "llama": "mlp.down_proj", "gptj": "mlp.fc_out"}


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _layer(family: str, layer: int) -> Any:
    return _get(hf_oracle(family), LAYERS[family])[layer]


Edit = Callable[[torch.Tensor], torch.Tensor]
"""An oracle steering edit: the value ``[batch, pos, ...]`` as the address sees it -> the new value."""


class Probe:
    """One address of the oracle: the zero tensor added there (made on first use, shaped as the
    address reads) and the value seen before it was added."""

    def __init__(self, edit: Edit | None = None) -> None:
        self.delta: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.edit = edit
        self.plus: torch.Tensor | None = None
        """Added to the value read (resid_mid: the block's input plus the attention's output)."""

    def __call__(self, view: torch.Tensor) -> torch.Tensor:
        if self.edit is not None:
            view = self.edit(view)
        self.value = view.detach().clone()
        self.delta = torch.zeros_like(view, requires_grad=True)
        return view + self.delta


def _hook_in(module: Any, view: Callable[[torch.Tensor], torch.Tensor], unview: Edit, probe: Probe) -> Any:
    def hook(mod: Any, args: Any, kwargs: Any) -> Any:
        if args:
            return (unview(probe(view(args[0]))), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": unview(probe(view(kwargs["hidden_states"])))}

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _hook_out(module: Any, probe: Probe) -> Any:
    def hook(mod: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (probe(output[0]), *output[1:])
        return probe(output)

    return module.register_forward_hook(hook)


@contextmanager
def _hook_query_key(family: str, layer: int, which: str, probe: Probe) -> Iterator[None]:
    """Add the probe to the query or key the family's attention function receives at ``layer``."""
    attn = _get(_layer(family, layer), ATTN[family])
    index = 0 if which == "attn_q" else 1

    def swap(qk: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        out = list(qk)
        out[index] = probe(out[index].transpose(1, 2)).transpose(1, 2)  # [b, h, n, d] read as [b, n, h, d]
        return out

    if family == "gptj":  # GPT-J's own attention method
        original = attn._attn
        prior = attn.__dict__.get("_attn")  # another probe's, at the same module

        def method(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            query, key = swap((query, key))
            return original(query, key, *args, **kwargs)

        attn.__dict__["_attn"] = method
        try:
            yield
        finally:
            if prior is None:
                del attn.__dict__["_attn"]
            else:
                attn.__dict__["_attn"] = prior
        return
    namespace = type(attn).forward.__globals__
    original_fn = namespace["eager_attention_forward"]

    def function(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is attn:
            query, key = swap((query, key))
        return original_fn(module, query, key, *args, **kwargs)

    namespace["eager_attention_forward"] = function
    try:
        yield
    finally:
        namespace["eager_attention_forward"] = original_fn


def _install(stack: ExitStack, family: str, address: Address, probe: Probe) -> None:
    """Hook the oracle's probe in at ``address``."""
    kind, layer = address.kind, address.layer
    hf = hf_oracle(family)
    same: Edit = lambda x: x  # noqa: E731
    handle: Any
    if kind == "embed":
        handle = _hook_in(_layer(family, 0), same, same, probe)
    elif kind == "final_norm":
        handle = _hook_out(_get(hf, FINAL_NORM[family]), probe)
    elif kind in ("attn_q", "attn_k"):
        assert layer is not None
        stack.enter_context(_hook_query_key(family, layer, kind, probe))
        return
    else:
        assert layer is not None
        block = _layer(family, layer)
        if kind == "resid_pre":
            handle = _hook_in(block, same, same, probe)
        elif kind == "resid_post":
            handle = _hook_out(block, probe)
        elif kind in ("attn_out", "resid_mid"):  # resid_mid = resid_pre + attn_out: a delta on either
            handle = _hook_out(_get(block, ATTN[family]), probe)
            if kind == "resid_mid":

                def keep(mod: Any, args: Any, kwargs: Any) -> None:
                    probe.plus = (args[0] if args else kwargs["hidden_states"]).detach().clone()

                stack.callback(block.register_forward_pre_hook(keep, with_kwargs=True).remove)
        elif kind == "mlp_out":
            handle = _hook_out(block.mlp, probe)
        elif kind == "mlp_post":
            handle = _hook_in(_get(block, DOWN[family]), same, same, probe)
        elif kind == "attn_z":
            info = eager_model(family).info

            def heads(x: torch.Tensor) -> torch.Tensor:
                return x.view(*x.shape[:-1], info.n_heads, info.d_head)

            handle = _hook_in(_get(block, O_PROJ[family]), heads, lambda x: x.flatten(-2), probe)
        else:  # pragma: no cover - the tests ask for the kinds above
            raise AssertionError(kind)
    stack.callback(handle.remove)


def _oracle(
    family: str,
    rows: list[list[int]],
    points: list[Address],
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    edits: dict[Address, Edit] | None = None,
) -> tuple[dict[Address, torch.Tensor], dict[Address, torch.Tensor], float]:
    """Activations, gradients and the metric's value, by autograd on HF with the hooks above (one
    batch, right-padded, masked; padded positions' logits zeroed as the backend does)."""
    hf = hf_oracle(family)
    lengths = torch.tensor([len(r) for r in rows])
    n = int(lengths.max())
    ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
    mask = (torch.arange(n)[None, :] < lengths[:, None]).long()
    edits = dict(edits or {})
    probes: dict[Address, Probe] = {}
    with ExitStack() as stack:
        for address in points:
            probes[address] = Probe(edits.pop(address, None))
            _install(stack, family, address, probes[address])
        for address, edit in edits.items():  # steering where no gradient is taken
            _install(stack, family, address, Probe(edit))
        logits = hf(input_ids=ids, attention_mask=mask).logits.float()
    logits = torch.where(mask.bool()[..., None], logits, 0.0)
    value = metric(logits, lengths)
    deltas = [probes[a].delta for a in points]
    assert all(d is not None for d in deltas)
    grads = torch.autograd.grad(value, deltas)  # type: ignore[arg-type]
    for parameter in hf.parameters():
        parameter.grad = None
    acts = {a: p.value if p.plus is None else p.value + p.plus for a, p in probes.items()}  # type: ignore[operator]
    return acts, dict(zip(points, grads, strict=True)), float(value.detach())  # type: ignore[return-value]


def _targets(family: str, n: int, seed: int = 0) -> torch.Tensor:
    vocab = eager_model(family).info.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logprob_metric(targets: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Every real position's log-probability of a fixed target token, summed over positions and
    rows (so every position gets a gradient, and a batch's rows are independent)."""

    def metric(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n = logits.shape[1]
        real = (torch.arange(n)[None, :] < lengths[:, None]).to(logits.dtype)
        picked = logits.log_softmax(-1).gather(-1, targets[:n].expand(logits.shape[0], n)[..., None])[..., 0]
        return (picked * real).sum()

    return metric


def _points(family: str, kinds: tuple[str, ...]) -> list[Address]:
    n_layers = eager_model(family).info.n_layers
    out = []
    for kind in kinds:
        if kind in ("embed", "final_norm"):
            out.append(Address(kind))
        else:
            out += [Address(kind, 0), Address(kind, n_layers - 1)]
    return out


def _check(got: Any, expected: dict[Address, torch.Tensor], lengths: list[int] | None = None) -> None:
    for address, want in expected.items():
        have = got[address]
        if lengths is not None:  # compare real positions only
            for row, n in enumerate(lengths):
                assert rel_diff(have[row, :n], want[row, :n]) <= TOL, (address, row)
        else:
            assert rel_diff(have, want) <= TOL, address


# -- against autograd on HF -----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_autograd_on_hf(family: str) -> None:
    model = eager_model(family)
    ids = model.to_tokens(PROMPT)[0].tolist()
    metric = _logprob_metric(_targets(family, len(ids)))
    points = _points(family, KINDS + HEAD_KINDS)
    result = run_with_gradients(model, [ids], points, metric)
    acts, grads, value = _oracle(family, [ids], points, metric)
    _check(result.activations, acts)
    _check(result.gradients, grads)
    assert result.metric == pytest.approx(value, rel=1e-5)
    for address in points:  # shapes as the activations', and not trivially zero
        assert result.gradients[address].shape == result.activations[address].shape
        assert float(result.gradients[address].abs().max()) > 0
    assert result.gradients["attn_z.0"].shape[2:] == (model.info.n_heads, model.info.d_head)
    assert result.gradients["attn_k.0"].shape[2:] == (model.info.n_kv_heads, model.info.d_head)
    assert all(p.grad is None for p in model.hf_model.parameters())  # no .grad gathered


def test_router_logit_gradients_equal_autograd_on_hf() -> None:
    """Mixtral's router logits (read and written by a router tap): the oracle runs its own copy of
    the router's forward with the probe added to the logits before softmax and top-k."""
    model = eager_model("mixtral")
    ids = model.to_tokens(PROMPT)[0].tolist()
    metric = _logprob_metric(_targets("mixtral", len(ids)))
    points = [Address("router_logits", 1), Address("resid_post", 1)]
    result = run_with_gradients(model, [ids], points, metric)

    gate = hf_oracle("mixtral").model.layers[1].mlp.gate
    probe = Probe()

    def router(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, gate.hidden_dim)
        logits = probe(torch.nn.functional.linear(flat, gate.weight).view(1, len(ids), -1)).view(len(ids), -1)
        top, chosen = torch.topk(logits.float().softmax(-1), gate.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), chosen

    resid = Probe()
    gate.__dict__["forward"] = router
    handle = _hook_out(_layer("mixtral", 1), resid)
    try:
        logits = hf_oracle("mixtral")(torch.tensor([ids])).logits.float()
    finally:
        del gate.__dict__["forward"]
        handle.remove()
    value = metric(logits, torch.tensor([len(ids)]))
    assert probe.delta is not None and resid.delta is not None
    assert probe.value is not None and resid.value is not None
    grads = torch.autograd.grad(value, [probe.delta, resid.delta])
    assert rel_diff(result.activations["router_logits.1"], probe.value) <= TOL
    assert rel_diff(result.gradients["router_logits.1"], grads[0]) <= TOL
    assert rel_diff(result.gradients["resid_post.1"], grads[1]) <= TOL
    assert result.gradients["router_logits.1"].shape == (1, len(ids), model.info.n_experts)


def test_query_key_gradients_through_a_familys_own_attention_method() -> None:
    """GPT-J computes attention in its own ``_attn``: the probe goes into what it receives."""
    model = eager_model("gptj")
    ids = model.to_tokens(PROMPT)[0].tolist()
    metric = _logprob_metric(_targets("gptj", len(ids)))
    points = [Address("attn_q", 1), Address("attn_k", 1), Address("attn_z", 1), Address("resid_post", 1)]
    result = run_with_gradients(model, [ids], points, metric)
    acts, grads, _ = _oracle("gptj", [ids], points, metric)
    _check(result.activations, acts)
    _check(result.gradients, grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_equals_each_row_alone(family: str) -> None:
    model = eager_model(family)
    long = model.to_tokens(PROMPT)[0].tolist()
    short = long[:5]
    metric = _logprob_metric(_targets(family, len(long), seed=1))
    points = _points(family, ("resid_pre", "mlp_post", "attn_z", "attn_q"))
    batch = run_with_gradients(model, [short, long], points, metric)
    assert batch.activations.lengths is not None and batch.activations.lengths.tolist() == [5, len(long)]
    solo = [run_with_gradients(model, [row], points, metric) for row in (short, long)]
    assert batch.metric == pytest.approx(solo[0].metric + solo[1].metric, rel=1e-5)
    for address in points:
        for row, alone in enumerate(solo):
            n = alone.gradients[address].shape[1]
            assert rel_diff(batch.gradients[address][row, :n], alone.gradients[address][0]) <= TOL, (address, row)
            assert rel_diff(batch.activations[address][row, :n], alone.activations[address][0]) <= TOL
        assert not bool(batch.gradients[address][0, 5:].any())  # padded positions: zero
        assert not bool(batch.activations[address][0, 5:].any())
    _, grads, _ = _oracle(family, [short, long], points, metric)  # and the batch equals HF's
    _check(batch.gradients, grads, [5, len(long)])


def test_logit_diff_position_is_each_rows_own_last_token() -> None:
    model = eager_model("gpt2")
    long = model.to_tokens(PROMPT)[0].tolist()
    rows = [long[:4], long]
    metric = metrics.logit_diff([7, 8], [9, 10])  # one answer and one wrong token per row
    batch = run_with_gradients(model, rows, ["resid_post.1"], metric)
    solo = [
        run_with_gradients(model, [r], ["resid_post.1"], metrics.logit_diff(a, w))
        for r, a, w in zip(rows, [7, 8], [9, 10], strict=True)
    ]
    assert batch.metric == pytest.approx((solo[0].metric + solo[1].metric) / 2, rel=1e-5)  # the mean over rows
    for row, alone in enumerate(solo):
        n = len(rows[row])
        assert rel_diff(batch.gradients["resid_post.1"][row, :n], alone.gradients["resid_post.1"][0] / 2) <= TOL
    logits = run_with_cache(model, rows, ["logits"])["logits"]
    direct = [float(logits[0, 3, 7] - logits[0, 3, 9]), float(logits[1, -1, 8] - logits[1, -1, 10])]
    assert batch.metric == pytest.approx(sum(direct) / 2, rel=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_steering_applies_before_the_gradient(family: str) -> None:
    """An ``add`` at resid_post.0 (every position) and a ``set`` of neuron values at mlp_post.1
    (position 2): gradients are the oracle's with the same edits made by its own hooks, the one at
    mlp_post.1 with respect to the value after the ``set``."""
    model = eager_model(family)
    info = model.info
    ids = model.to_tokens(PROMPT)[0].tolist()
    push = torch.randn(info.d_model, generator=torch.Generator().manual_seed(3))
    neurons = torch.randn(info.d_mlp, generator=torch.Generator().manual_seed(4))
    spec = SteeringSpec(
        [Write("resid_post.0", push, op="add", scale=2.0), Write("mlp_post.1", neurons, op="set", positions=[2])]
    )

    def add(x: torch.Tensor) -> torch.Tensor:
        return x + 2.0 * push

    def put(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[:, 2] = neurons
        return out

    metric = _logprob_metric(_targets(family, len(ids), seed=2))
    points = [Address("resid_pre", 2), Address("mlp_post", 1), Address("attn_z", 1)]
    steered = run_with_gradients(model, ids, points, metric, steering_spec=spec)
    edits: dict[Address, Edit] = {Address("resid_post", 0): add, Address("mlp_post", 1): put}
    acts, grads, value = _oracle(family, [ids], points, metric, edits=edits)
    _check(steered.activations, acts)
    _check(steered.gradients, grads)
    assert steered.metric == pytest.approx(value, rel=1e-5)
    plain = run_with_gradients(model, ids, points, metric)
    assert rel_diff(plain.gradients["resid_pre.2"], steered.gradients["resid_pre.2"]) > 1e-3  # the writes mattered
    # per-row specs: one forward, each row as alone under its own spec
    rows = run_with_gradients(model, [ids, ids], points, metric, steering_spec=[spec, None])
    for address in points:
        assert rel_diff(rows.gradients[address][0], steered.gradients[address][0]) <= TOL
        assert rel_diff(rows.gradients[address][1], plain.gradients[address][0]) <= TOL


# -- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["attn_pattern", "attn_scores", "logits", "logits_raw"])
def test_read_only_kinds_are_refused_naming_where_gradients_work(kind: str) -> None:
    model = eager_model("gpt2")
    address = Address(kind, 1) if kind.startswith("attn") else Address(kind)
    with pytest.raises(UnsupportedAddress, match="gradients are taken at") as caught:
        run_with_gradients(model, PROMPT, [address], _logprob_metric(_targets("gpt2", 20)))
    assert "resid_post" in caught.value.valid and "attn_q" in caught.value.valid
    assert kind not in caught.value.valid


@pytest.mark.parametrize("family", ["bloom", "gpt_neo"])
def test_queries_and_keys_are_refused_where_attention_runs_inside_the_module(family: str) -> None:
    """Bloom computes attention in its own forward, GPT-Neo's scores are read at its softmax:
    their queries and keys cannot be replaced, so there is no gradient there (attn_z works)."""
    model = eager_model(family)
    metric = _logprob_metric(_targets(family, 30))
    with pytest.raises(UnsupportedAddress, match="cannot be replaced; take it at attn_in, attn_v or attn_z"):
        run_with_gradients(model, PROMPT, ["attn_q.0"], metric)
    result = run_with_gradients(model, PROMPT, ["attn_z.0", "attn_v.0"], metric)
    assert float(result.gradients["attn_z.0"].abs().max()) > 0


def test_bad_metrics_and_feature_points_are_refused() -> None:
    model = eager_model("gpt2")
    with pytest.raises(InvalidOption, match="scalar"):
        run_with_gradients(model, PROMPT, ["resid_post.0"], lambda logits: logits[0, -1])
    with pytest.raises(InvalidOption, match="does not depend on the logits"):
        run_with_gradients(model, PROMPT, ["resid_post.0"], lambda logits: torch.tensor(1.0))
    with pytest.raises(InvalidOption, match="callable"):
        run_with_gradients(model, PROMPT, ["resid_post.0"], 3)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedAddress, match="feature readouts"):
        run_with_gradients(model, PROMPT, [Features("res", top_k=4)], lambda logits: logits.sum())
    # a metric of the logits alone works (one argument: no lengths passed)
    result = run_with_gradients(model, PROMPT, "resid_post.0", lambda logits: logits[:, -1, 5].sum())
    assert result.gradients["resid_post.0"].shape == result.activations["resid_post.0"].shape


def test_backends_without_gradients_raise_unsupported_operation() -> None:
    toy = load_model("toy", backend="toy")
    assert not isinstance(toy, GradientCapture)
    assert isinstance(eager_model("gpt2"), GradientCapture)
    with pytest.raises(UnsupportedOperation, match=r"gradients need the eager backend.*backend='eager'"):
        run_with_gradients(toy, "hello", ["resid_post.0"], lambda logits: logits.sum())
    with pytest.raises(UnsupportedOperation, match="eager"):
        run_with_gradients(sync_model(toy), "hello", ["resid_post.0"], lambda logits: logits.sum())


def test_metric_helpers() -> None:
    assert not metrics.takes_lengths(lambda logits: logits.sum())
    assert metrics.takes_lengths(lambda logits, lengths: logits.sum())
    assert not metrics.takes_lengths(lambda logits, answer=5: logits.sum())  # a default: not the lengths
    assert metrics.takes_lengths(metrics.logit_diff(1, 2))
    logits = torch.randn(2, 4, 10)
    diff = metrics.logit_diff([3, 4], 5, position=-2)
    expected = ((logits[0, 1, 3] - logits[0, 1, 5]) + (logits[1, 2, 4] - logits[1, 2, 5])) / 2
    assert float(metrics.evaluate(diff, logits, torch.tensor([3, 4]))) == pytest.approx(float(expected))
    assert float(diff(logits)) == pytest.approx(float((logits[:, 2, [3, 4]].diag() - logits[:, 2, 5]).mean()))
    with pytest.raises(InvalidOption, match="one id or one per row"):
        metrics.logit_diff([1, 2, 3], 4)(logits)
    with pytest.raises(InvalidOption, match="outside a row"):
        metrics.logit_diff(1, 2, position=-4)(logits, torch.tensor([3, 4]))
    with pytest.raises(InvalidTokens, match="vocabulary"):
        metrics.logit_diff(10, 2)(logits)
    with pytest.raises(InvalidTokens, match="model="):
        metrics.logit_diff(" Paris", 2)
    tiny = eager_model("gpt2")
    with pytest.raises(InvalidTokens, match="tokens; give one token"):
        metrics.logit_diff("The capital of", 2, model=tiny)
    assert metrics.logit_diff(" the", 2, model=tiny).answer == [metrics.token_id(tiny, " the")]
