"""Activation-patching sweeps (``interp_engine.patching.sweep``) against a patch loop written by
hand on the HF model (forward hooks on HF's own modules, one forward per cell), on GPT-2 and
Llama; the head sweep against a hand patch of the output projection's input; vLLM's sweep
against eager's; and the errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from interp_engine import (
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    Labelled,
    SteeringSpec,
    UnknownKind,
    Write,
    load_model,
    patching,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import hf_oracle, rel_diff, vllm_model_path

from ..support.engines import eager_model

TOL = 1e-4
CLEAN = [5, 17, 42, 9, 33, 61, 8, 12]
CORRUPT = [5, 17, 42, 70, 33, 61, 8, 12]  # one token differs


def _blocks(hf: Any) -> Any:
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _out_proj(hf: Any, layer: int) -> Any:
    block = _blocks(hf)[layer]
    return block.attn.c_proj if hasattr(block, "attn") else block.self_attn.o_proj


def _hf_logits(hf: Any, ids: list[int], hooks: list[tuple[Any, str, Callable[..., Any]]] = ()) -> torch.Tensor:  # type: ignore[assignment]
    handles = []
    for module, when, fn in hooks:
        handles.append(module.register_forward_pre_hook(fn) if when == "pre" else module.register_forward_hook(fn))
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits.float()
    finally:
        for handle in handles:
            handle.remove()


def _hand_resid_post_sweep(hf: Any, clean: list[int], corrupt: list[int], answer: int, wrong: int) -> torch.Tensor:
    """Denoising by hand: the clean run's block outputs recorded, then each (layer, position)
    written into the corrupt run by a forward hook on the block."""
    blocks = _blocks(hf)
    recorded: dict[int, torch.Tensor] = {}

    def record(layer: int) -> Callable[..., Any]:
        def hook(module: Any, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            recorded[layer] = hidden.detach().clone()

        return hook

    _hf_logits(hf, clean, [(blocks[i], "post", record(i)) for i in range(len(blocks))])
    table = torch.zeros(len(blocks), len(clean))
    for layer in range(len(blocks)):
        for position in range(len(clean)):

            def patch(module: Any, args: Any, output: Any, layer: int = layer, position: int = position) -> Any:
                hidden = output[0] if isinstance(output, tuple) else output
                hidden = hidden.clone()
                hidden[:, position] = recorded[layer][:, position]
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

            logits = _hf_logits(hf, corrupt, [(blocks[layer], "post", patch)])
            table[layer, position] = logits[0, -1, answer] - logits[0, -1, wrong]
    return table


def _hand_head_sweep(
    hf: Any, clean: list[int], corrupt: list[int], answer: int, wrong: int, d_head: int
) -> torch.Tensor:
    """Each head's output (the output projection's input, split per head) from the clean run
    written into the corrupt run at every position."""
    n_layers = len(_blocks(hf))
    recorded: dict[int, torch.Tensor] = {}

    def record(layer: int) -> Callable[..., Any]:
        def hook(module: Any, args: Any) -> None:
            recorded[layer] = args[0].detach().clone()

        return hook

    _hf_logits(hf, clean, [(_out_proj(hf, i), "pre", record(i)) for i in range(n_layers)])
    n_heads = recorded[0].shape[-1] // d_head
    table = torch.zeros(n_layers, n_heads)
    for layer in range(n_layers):
        for head in range(n_heads):
            cols = slice(head * d_head, (head + 1) * d_head)

            def patch(module: Any, args: Any, layer: int = layer, cols: slice = cols) -> Any:
                z = args[0].clone()
                z[..., cols] = recorded[layer][..., cols]
                return (z, *args[1:])

            logits = _hf_logits(hf, corrupt, [(_out_proj(hf, layer), "pre", patch)])
            table[layer, head] = logits[0, -1, answer] - logits[0, -1, wrong]
    return table


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_resid_sweep_equals_a_hand_patch_loop_on_hf(family: str) -> None:
    model = eager_model(family)
    hf = hf_oracle(family)
    answer, wrong = 3, 4
    result = patching.sweep(model, CLEAN, CORRUPT, "resid_post", answer=answer, wrong=wrong, progress=False)
    assert isinstance(result, Labelled)
    assert result.dims == ("layer", "position")
    assert result.labels("layer") == list(range(model.info.n_layers))
    assert result.labels("position")[3].startswith("3 ") and "/" in result.labels("position")[3]
    expected = _hand_resid_post_sweep(hf, CLEAN, CORRUPT, answer, wrong)
    assert rel_diff(result.values, expected) <= TOL
    # the baselines: the unpatched runs
    clean = _hf_logits(hf, CLEAN)[0, -1]
    corrupt = _hf_logits(hf, CORRUPT)[0, -1]
    assert abs(result.meta["clean"] - float(clean[answer] - clean[wrong])) <= 1e-4
    assert abs(result.meta["corrupt"] - float(corrupt[answer] - corrupt[wrong])) <= 1e-4
    # patching the last layer's last position restores the clean run exactly; positions that do
    # not differ before the first differing token change nothing
    assert abs(float(result.values[-1, -1]) - result.meta["clean"]) <= 1e-4
    assert torch.allclose(result.values[:, :3], torch.full((model.info.n_layers, 3), result.meta["corrupt"]), atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_sweep_equals_a_hand_patch_of_the_output_projection_input(family: str) -> None:
    model = eager_model(family)
    answer, wrong = 3, 4
    result = patching.sweep(model, CLEAN, CORRUPT, "attn_z", heads=True, answer=answer, wrong=wrong, progress=False)
    assert result.dims == ("layer", "head")
    expected = _hand_head_sweep(hf_oracle(family), CLEAN, CORRUPT, answer, wrong, model.info.d_head)
    assert rel_diff(result.values, expected) <= TOL
    # per position as well: patching every position of a head one at a time
    by_pos = patching.sweep(
        model,
        CLEAN,
        CORRUPT,
        "attn_z",
        heads=[1],
        layers=[0, -1],
        positions=[3, -1],
        by_position=True,
        answer=answer,
        wrong=wrong,
        progress=False,
    )
    assert by_pos.dims == ("layer", "position", "head")
    assert by_pos.shape == (2, 2, 1)
    assert by_pos.labels("layer") == [0, model.info.n_layers - 1]


def test_noise_direction_normalize_and_a_custom_metric() -> None:
    model = eager_model("gpt2")
    answer, wrong = 3, 4
    noised = patching.sweep(
        model, CLEAN, CORRUPT, "resid_pre", direction="noise", answer=answer, wrong=wrong, progress=False
    )
    # noising resid_pre.0 at the differing position gives the corrupt run's metric exactly
    assert abs(noised.at(layer=0, position=noised.labels("position")[3]) - noised.meta["corrupt"]) <= 1e-4
    normalized = patching.sweep(
        model, CLEAN, CORRUPT, "resid_pre", normalize=True, answer=answer, wrong=wrong, progress=False
    )
    assert abs(float(normalized.values[0, 3]) - 1.0) <= 1e-4  # restores the clean run
    assert abs(float(normalized.values[0, 0])) <= 1e-4  # an identical token: nothing changes

    def prob(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].softmax(-1)[:, answer].mean()

    custom = patching.sweep(model, CLEAN, CORRUPT, "mlp_out", metric=prob, layers=[1], progress=False, batch_size=3)
    assert custom.shape == (1, len(CLEAN))
    by_hand = []
    clean = run_with_cache(model, CLEAN, ["mlp_out.1"])["mlp_out.1"][0]
    for position in range(len(CLEAN)):
        spec = SteeringSpec([Write("mlp_out.1", clean[position], op="set", positions=[position])])
        logits = run_with_cache(model, CORRUPT, ["logits"], steering_spec=spec)["logits"]
        by_hand.append(float(prob(logits)))
    assert rel_diff(custom.values[0], torch.tensor(by_hand)) <= TOL


def test_the_sweep_is_batched_and_shows_progress(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = eager_model("gpt2")
    calls: list[int] = []
    original = type(model).capture_batch

    async def counting(self: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(rows))
        return await original(self, rows, *args, **kwargs)

    monkeypatch.setattr(type(model), "capture_batch", counting)
    blocking = type(model).capture_batch_blocking  # what the synchronous facade calls on eager

    def counting_blocking(self: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(rows))
        return blocking(self, rows, *args, **kwargs)

    monkeypatch.setattr(type(model), "capture_batch_blocking", counting_blocking)
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)  # the plain counter
    result = patching.sweep(model, CLEAN, CORRUPT, "resid_post", answer=3, wrong=4, batch_size=10)
    cells = model.info.n_layers * len(CLEAN)
    assert calls == [2] + [10] * (cells // 10) + ([cells % 10] if cells % 10 else [])  # the baselines, then batches
    assert f"{cells}/{cells} cells" in capsys.readouterr().err
    assert result.values.numel() == cells


def test_sweep_errors_are_typed() -> None:
    model = eager_model("gpt2")
    with pytest.raises(InvalidTokens, match="same length"):
        patching.sweep(model, CLEAN, CORRUPT[:-1], progress=False)
    with pytest.raises(UnknownKind, match="resid_postt"):
        patching.sweep(model, CLEAN, CORRUPT, "resid_postt", progress=False)
    with pytest.raises(InvalidOption, match="no head axis"):
        patching.sweep(model, CLEAN, CORRUPT, "resid_post", heads=True, progress=False)
    with pytest.raises(InvalidOption, match="layer 9"):
        patching.sweep(model, CLEAN, CORRUPT, layers=[9], progress=False)
    with pytest.raises(InvalidOption, match="position 8"):
        patching.sweep(model, CLEAN, CORRUPT, positions=[8], answer=3, wrong=4, progress=False)
    with pytest.raises(InvalidOption, match="scalar"):
        patching.sweep(model, CLEAN, CORRUPT, metric=lambda logits: logits[:, -1], layers=[0], progress=False)
    with pytest.raises(InvalidOption, match="direction"):
        patching.sweep(model, CLEAN, CORRUPT, direction="sideways", progress=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokens, match="outside the vocabulary"):
        patching.sweep(model, CLEAN, CORRUPT, answer=10**6, wrong=3, progress=False)
    with pytest.raises(InvalidSteering, match="read-only"):
        patching.sweep(model, CLEAN, CORRUPT, "attn_pattern", answer=3, wrong=4, progress=False)
    with pytest.raises(InvalidOption, match="no layers"):
        patching.sweep(model, CLEAN, CORRUPT, "embed", layers=[0], progress=False)
    identical = patching.sweep(model, CLEAN, CLEAN, "embed", answer=3, wrong=4, progress=False)
    assert torch.allclose(identical.values, torch.full_like(identical.values, identical.meta["clean"]))
    with pytest.raises(InvalidOption, match="top tokens"):
        patching.sweep(model, CLEAN, CLEAN, progress=False)  # same prompt: same top token, no default metric


def test_the_sweep_on_vllm_equals_the_sweep_on_eager(vllm_engines: Any) -> None:
    """On vLLM the cells go as concurrent requests (one spec each) that vLLM batches."""
    model = vllm_engines("gpt2")
    twin = sync_model(load_model(vllm_model_path("gpt2"), backend="eager"))
    args: dict[str, Any] = {"answer": 3, "wrong": 4, "progress": False}
    for kind, extra in (
        ("resid_post", {}),
        ("attn_z", {"heads": True}),
        ("mlp_post", {"layers": [1], "positions": [2, 3, -1]}),
    ):
        got = patching.sweep(model, CLEAN, CORRUPT, kind, **args, **extra)
        want = patching.sweep(twin, CLEAN, CORRUPT, kind, **args, **extra)
        assert got.dims == want.dims and got.coords == want.coords
        assert rel_diff(got.values, want.values) <= TOL, kind
    twin.shutdown()


def test_sweep_positions_named_by_chat_span_equal_the_same_explicit_positions() -> None:
    model = load_model("interp:tiny", backend="eager")
    chat = model.chat_tokens(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The capital of France is"}]
    )
    corrupt = list(chat)
    user = chat.positions("user[-1]")
    corrupt[user[-2]] = model.to_tokens(" Italy")[0, -1].item()  # " France" -> " Italy", one token each
    named = patching.sweep(model, chat, corrupt, "resid_pre", layers=[0, 2], positions="user[-1]", progress=False)
    explicit = patching.sweep(model, chat, corrupt, "resid_pre", layers=[0, 2], positions=user, progress=False)
    assert named.labels("position") == explicit.labels("position") and len(user) == named.shape[1]
    assert torch.equal(named.values, explicit.values)
    attributed = patching.attribution_patch(model, chat, corrupt, "resid_pre", positions="user[-1].last")
    assert attributed.shape[1] == 1 and attributed.labels("position") == explicit.labels("position")[-1:]
    with pytest.raises(InvalidOption, match="chat span"):
        patching.sweep(model, corrupt, corrupt, "resid_pre", positions="user[-1]", progress=False)
