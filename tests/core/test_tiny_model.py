"""The tiny trained model that ships with interp-core (``load_model("interp:tiny")``), on eager.

These tests check behaviours, not weights: the model completes the corpus's capitals, the logit
lens shows the answer forming in the later layers, one head is an induction head on repeated
random tokens, and adding the Germany-minus-France residual flips " Paris" to " Berlin". The
training script itself is run end to end with a handful of steps (the full run that produced the
shipped weights takes minutes; see docs/getting-started/tiny-model.md).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

import interp_engine
from interp_engine import (
    Address,
    ModelLoadError,
    SteeringSpec,
    SyncModel,
    Write,
    capture_attention,
    load_model,
    shipped_models,
    sync_model,
    tiny_model_path,
)
from interp_testkit.suite import ROOT

SCRIPTS = ROOT / "packages" / "interp-core" / "scripts"
FRANCE = "The capital of France is"
GERMANY = "The capital of Germany is"
STEER_LAYER = 2


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COUNTRIES: list[tuple[str, str]] = [(c[0], c[1]) for c in _script("make_tiny_corpus").COUNTRIES]


@functools.cache
def tiny() -> SyncModel:
    """The session's shipped tiny model on eager, behind its sync facade (never shut down)."""
    return sync_model(load_model("interp:tiny", backend="eager"))


def _ids(text: str) -> list[int]:
    return [int(i) for i in tiny().to_tokens(text)[0]]


def _token(text: str) -> int:
    ids = _ids(text)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


# -- the name, the files ------------------------------------------------------------------------


def test_the_name_resolves_to_the_shipped_directory() -> None:
    path = tiny_model_path()
    assert path.is_dir() and path.parent.parent == pathlib.Path(interp_engine.__file__).resolve().parent
    assert shipped_models() == ["interp:tiny"]
    model = load_model("interp:tiny", backend="eager")
    assert model.info.architecture == "gpt2"
    assert (model.info.n_layers, model.info.d_model, model.info.n_heads, model.info.n_ctx) == (4, 128, 4, 256)
    assert model.info.d_model // model.info.n_heads in (32, 64)  # vLLM's CPU kernels refuse head_dim 16


def test_an_unknown_shipped_name_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="interp:tiny") as info:
        load_model("interp:huge", backend="eager")
    assert "interp:huge" in str(info.value)


def test_shipped_files_are_small_float32_safetensors() -> None:
    path = tiny_model_path()
    weights = path / "model.safetensors"
    assert weights.stat().st_size < 8_000_000
    with safe_open(weights, framework="pt") as f:
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    assert dtypes == {torch.float32}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file(), name


def test_shipped_weights_come_from_the_scripts_defaults() -> None:
    """``training.json`` records the run; it must be the script's default run (the documented one)."""
    recorded = json.loads((tiny_model_path() / "training.json").read_text())["arguments"]
    defaults = vars(_script("train_tiny").parse_args([]))
    defaults = {k: (v.name if isinstance(v, pathlib.Path) else v) for k, v in defaults.items() if k != "out"}
    assert recorded == defaults


# -- the tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        FRANCE + " Paris.",
        "Alice walked to the market with a red basket.\nBob counted 12 dogs.",
        "  leading spaces, tabs\tand ünïcödé: 東京 😀 — all bytes are encodable ",
        "",
    ],
)
def test_the_tokenizer_round_trips(text: str) -> None:
    model = tiny()
    assert model.to_string(model.to_tokens(text)[0]) == text if text else model.to_tokens(text).numel() == 0


def test_the_tokenizer_loads_in_plain_transformers() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    assert tok(FRANCE)["input_ids"] == _ids(FRANCE)
    assert tok.convert_ids_to_tokens(_token(" Paris")) == "ĠParis"


def test_every_capital_is_one_token() -> None:
    for _, capital in COUNTRIES:
        _token(" " + capital)


# -- the behaviours --------------------------------------------------------------------------------


def _next_token_probs(text: str, spec: SteeringSpec | None = None) -> torch.Tensor:
    logits = tiny().capture(_ids(text), [Address("logits")], steering_spec=spec)[Address("logits")]
    return logits[-1].softmax(-1)


def test_it_completes_the_capitals_of_the_corpus() -> None:
    model = tiny()
    paris = _next_token_probs(FRANCE)[_token(" Paris")]
    assert paris > 0.5, f"p(' Paris') = {float(paris):.3f}"
    assert model.generate(_ids(FRANCE), max_tokens=2).text == " Paris."
    right = [
        c for c, cap in COUNTRIES if model.generate(_ids(f"The capital of {c} is"), max_tokens=1).text == " " + cap
    ]
    assert len(right) >= 0.9 * len(COUNTRIES), f"only {len(right)}/{len(COUNTRIES)}: {right}"
    # not a country-independent guess: a different country gives a different answer
    assert model.generate(_ids(GERMANY), max_tokens=1).text == " Berlin"


def test_the_logit_lens_shows_the_answer_rising_through_the_layers() -> None:
    model = tiny()
    n_layers = 4
    points = [Address("embed")] + [Address("resid_post", layer) for layer in range(n_layers)]
    acts = model.capture(_ids(FRANCE), points)
    paris = _token(" Paris")
    ranks, probs = [], []
    for point in points:
        p = model.decode_residuals(acts[point][-1]).softmax(-1)
        ranks.append(int((p > p[paris]).sum()))
        probs.append(float(p[paris]))
    table = ", ".join(f"{pt}: rank {r} p {p:.3f}" for pt, r, p in zip(points, ranks, probs, strict=True))
    # the embedding of " is" knows nothing of France; the first layer's guess is unsure; each layer
    # after it raises the answer's probability, and only the last makes it the top token
    assert ranks[0] > 10, f"the answer is already near the top before any layer: {table}"
    assert all(b > a for a, b in itertools.pairwise(probs[1:])), f"not rising through the layers: {table}"
    assert ranks[-1] == 0 and probs[-1] > 0.5, table
    assert probs[1] < 0.75 * probs[-1], f"the first layer already decides: {table}"


def _induction_scores(tokens: torch.Tensor, offset: int) -> torch.Tensor:
    """[layer, head]: mean attention from each query ``i`` in the second half to key ``i - offset``."""
    attn = capture_attention(tiny(), tokens, list(range(4)))
    n = tokens.shape[1] // 2
    q = torch.arange(n, 2 * n)
    return torch.stack(
        [attn[Address("attn_pattern", layer)][:, :, q, q - offset].mean(dim=(0, 2)) for layer in range(4)]
    )


def test_one_head_is_an_induction_head_on_repeated_random_tokens() -> None:
    """On runs of random tokens shown twice, some head of a later layer looks from each token of
    the second copy to the token that followed its first occurrence; the same head does not look
    there when the second half is fresh random tokens (not a positional habit)."""
    vocab = tiny().info.vocab_size
    gen = torch.Generator().manual_seed(11)
    for length in (12, 30):
        run = torch.randint(2, vocab, (4, length), generator=gen)
        repeated = _induction_scores(torch.cat([run, run], dim=1), length - 1)
        layer, head = divmod(int(repeated.argmax()), repeated.shape[1])
        assert layer >= 1 and float(repeated.max()) > 0.5, repeated
        fresh = torch.cat([run, torch.randint(2, vocab, (4, length), generator=gen)], dim=1)
        assert float(_induction_scores(fresh, length - 1)[layer, head]) < 0.1


def test_a_steering_vector_flips_the_answer() -> None:
    model = tiny()
    point = Address("resid_post", STEER_LAYER)
    france = model.capture(_ids(FRANCE), [point])[point][-1]
    germany = model.capture(_ids(GERMANY), [point])[point][-1]
    spec = SteeringSpec([Write(point, germany - france, op="add", positions=[-1])])
    assert model.generate(_ids(FRANCE), max_tokens=1).text == " Paris"
    assert model.generate(_ids(FRANCE), max_tokens=1, steering_spec=spec).text == " Berlin"
    probs = _next_token_probs(FRANCE, spec)
    assert int(probs.argmax()) == _token(" Berlin") and probs[_token(" Paris")] < 0.1
    # the direction matters, not just the size of the push
    other = torch.randn(france.shape, generator=torch.Generator().manual_seed(0))
    other = other * (germany - france).norm() / other.norm()
    random_push = SteeringSpec([Write(point, other, op="add", positions=[-1])])
    assert model.generate(_ids(FRANCE), max_tokens=1, steering_spec=random_push).text != " Berlin"


# -- the training script -------------------------------------------------------------------------


@pytest.mark.slow
def test_the_training_script_runs_end_to_end(tmp_path: pathlib.Path) -> None:
    """A few steps of the real script (its CLI, tokenizer, data, loop, save and report), then load the result."""
    out = tmp_path / "tiny"
    args = ["--out", str(out), "--steps", "4", "--batch-size", "4", "--warmup", "2", "--log-every", "1"]
    args += ["--circuit-steps", "2", "--circuit-batch", "2"]
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "train_tiny.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "circuit     1" in run.stdout and "step     3" in run.stdout, run.stdout
    assert "greedy capitals:" in run.stdout and "best induction head:" in run.stdout, run.stdout
    record: dict[str, Any] = json.loads((out / "training.json").read_text())
    assert record["arguments"]["steps"] == 4
    model = sync_model(load_model(out, backend="eager"))
    try:
        assert (model.info.n_layers, model.info.d_model, model.info.n_heads) == (4, 128, 4)
        assert model.to_string(model.to_tokens(FRANCE + " Paris.")[0]) == FRANCE + " Paris."
        assert len(model.generate(model.to_tokens(FRANCE)[0].tolist(), max_tokens=3, ignore_eos=True).token_ids) == 3
    finally:
        model.shutdown()


def test_the_corpus_is_what_its_generator_writes() -> None:
    generator = _script("make_tiny_corpus")
    shipped = (SCRIPTS / "tiny_corpus.txt").read_text(encoding="utf-8")
    assert shipped == "\n".join(generator.documents()) + "\n"
    assert len(shipped.encode()) < 400_000
    assert shipped.count(FRANCE + " Paris.") >= 20


def test_the_demo_runs_on_the_tiny_model_by_default(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    from interp_engine.cli import main

    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model interp:tiny on eager: gpt2, 4 layers")
    plain = next(line for line in out.splitlines() if line.strip().startswith("plain:"))
    steered = next(line for line in out.splitlines() if line.strip().startswith("steered:"))
    assert "' Paris" in plain and "' Berlin" in steered, out
    assert (tmp_path / "lens.png").stat().st_size > 0


def test_the_tiny_model_on_vllm_answers_and_steers_like_eager() -> None:
    model = sync_model(load_model("interp:tiny", backend="vllm"))
    try:
        point = Address("resid_post", STEER_LAYER)
        france = model.capture(_ids(FRANCE), [point, "logits"])
        germany = model.capture(_ids(GERMANY), [point])[point][-1]
        eager = tiny().capture(_ids(FRANCE), [point, "logits"])
        assert float((france[point] - eager[point]).abs().max()) <= 1e-4 * float(eager[point].abs().max())
        spec = SteeringSpec([Write(point, germany - france[point][-1], op="add", positions=[-1])])
        assert model.generate(_ids(FRANCE), max_tokens=1).text == " Paris"
        assert model.generate(_ids(FRANCE), max_tokens=1, steering_spec=spec).text == " Berlin"
        # the logit lens through the served unembedding (the vocabulary, 1015, is padded in vLLM)
        lens = model.decode_residuals(france[point])
        assert lens.shape == (len(_ids(FRANCE)), model.info.vocab_size)
        assert torch.allclose(lens, tiny().decode_residuals(eager[point]), atol=1e-4)
        # the circuit on vLLM too: zero-ablating the previous-token head 0.0 silences induction head 1.0
        from interp_engine.cli._demo import head_scores, repeated_random

        ids, start = repeated_random(model, 16, 0)
        plain, _ = head_scores(model, ids, start, [1])
        off = SteeringSpec([Write("attn_z.0", torch.zeros(model.info.d_head), op="set", heads=[0])])
        ablated, _ = head_scores(model, ids, start, [1], off)
        eager_ablated, _ = head_scores(tiny(), ids, start, [1], off)
        assert float(plain[0, 0]) > 0.5 and float(ablated[0, 0]) < 0.2
        assert torch.allclose(ablated, eager_ablated, atol=1e-4)
    finally:
        model.shutdown()
