"""The rough edges a newcomer hit on ``interp:tiny`` (issue 15), each fixed: one point given
bare, negative layers resolved once against the model, a missing model directory, the CLI's
negative positions and early option checks, the tests' toy backend hidden from users, the free
``decode_residuals`` and ``Cache.stack(..., include_embed=True)``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import interp_engine
from interp_engine import (
    Address,
    BackendNotFound,
    Cache,
    Features,
    InvalidAddress,
    LayerOutOfRange,
    ModelLoadError,
    capture_attention,
    capture_generation,
    decode_residuals,
    generate_stream,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_engine._plugins import local_model
from interp_engine.cli import join_negative_lists

from ..support.cli import interp, our_lines

TEXT = "The capital of France is"
N_LAYERS = 4  # interp:tiny


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    m = load_model("interp:tiny", backend="eager", saes={"res": "interp:tiny-sae"})
    yield m
    sync_model(m).shutdown()


@pytest.fixture(scope="module")
def ids(model: Any) -> list[int]:
    out: list[int] = model.to_tokens(TEXT)[0].tolist()
    return out


# -- one point, given bare -------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["resid_post.1", Address("resid_post", 1), "blocks.1.hook_resid_post"], ids=str)
def test_run_with_cache_takes_one_point_bare(model: Any, ids: list[int], point: Any) -> None:
    cache = run_with_cache(model, ids, point)
    assert list(cache) == [Address("resid_post", 1)]
    expected = sync_model(model).capture(ids, [Address("resid_post", 1)])[Address("resid_post", 1)]
    assert torch.equal(cache["resid_post.1"][0], expected)


def test_every_free_function_takes_one_point_bare(model: Any, ids: list[int]) -> None:
    completion, cache = capture_generation(model, ids, "resid_post.-1", max_tokens=2)
    assert list(cache) == [Address("resid_post", 3)]
    assert cache["resid_post.3"].shape == (1, len(ids) + len(completion.token_ids), 128)
    readout = run_with_cache(model, ids, "features:res:top4")["features:res:top4"]
    assert readout.ids is not None and readout.ids.shape == (1, len(ids), 4)
    # a readout given bare to generate_stream is one readout, not its characters
    steps = list(generate_stream(model, ids, max_tokens=2, features="features:res:top3"))
    assert [list(s.features) for s in steps] == [[Features("res", 3)]] * 2
    by_list = list(generate_stream(model, ids, max_tokens=2, features=[Features("res", 3)]))
    for one, other in zip(steps, by_list, strict=True):
        assert torch.equal(one.features[Features("res", 3)].values, other.features[Features("res", 3)].values)
    # one layer given bare to capture_attention; a negative one counts from the end
    assert list(capture_attention(model, ids, -1)) == [Address("attn_pattern", 3)]


def test_the_model_methods_take_one_point_bare(model: Any, ids: list[int]) -> None:
    sync = sync_model(model)
    acts = sync.capture(ids, "resid_post.1")
    assert list(acts) == [Address("resid_post", 1)]
    assert list(sync.capture(ids, Address("resid_post", 1))) == [Address("resid_post", 1)]


def test_a_string_key_on_capture_results_says_why_it_is_refused(model: Any, ids: list[int]) -> None:
    acts = sync_model(model).capture(ids, ["resid_post.1"])
    with pytest.raises(KeyError) as info:
        acts["resid_post.1"]  # type: ignore[call-overload]
    message = str(info.value)
    assert "by design" in message and "Address.parse('resid_post.1')" in message
    assert "Cache" in message and "resid_post.1" in message
    with pytest.raises(KeyError, match=r"resid_post\.2 is not in these results; they hold resid_post\.1"):
        acts[Address("resid_post", 2)]
    assert acts[Address.parse("resid_post.1")] is acts[Address("resid_post", 1)]


def test_points_that_are_not_points_are_an_address_error(model: Any, ids: list[int]) -> None:
    with pytest.raises(InvalidAddress, match="one address"):
        run_with_cache(model, ids, 3)  # type: ignore[arg-type]


# -- negative layers ---------------------------------------------------------------------------------


def test_negative_layers_are_resolved_once_against_the_model(model: Any, ids: list[int]) -> None:
    cache = run_with_cache(model, ids, ["resid_post.0", "resid_post.-1", "resid_post.2"])
    assert cache.n_layers == N_LAYERS
    assert cache.layers("resid_post") == [0, 2, 3]
    direct = sync_model(model).capture(ids, [Address("resid_post", layer) for layer in (0, 2, 3)])
    stacked = cache.stack("resid_post")
    for row, layer in enumerate((0, 2, 3)):
        assert torch.equal(stacked[row, 0], direct[Address("resid_post", layer)])
    assert cache["resid_post.-1"] is cache["resid_post.3"]
    assert cache[Address("resid_post", -1)] is cache[Address("resid_post", 3)]
    assert "resid_post.-1" in cache and "resid_post.-2" in cache and "resid_post.-3" not in cache


def test_minus_one_and_the_last_layer_together_are_one_point(model: Any, ids: list[int]) -> None:
    cache = run_with_cache(model, ids, ["resid_post.-1", "resid_post.3", Address("resid_post", -1)])
    assert list(cache) == [Address("resid_post", 3)]
    assert cache.stack("resid_post").shape == (1, 1, len(ids), 128)


def test_a_layer_out_of_range_is_refused_before_any_compute(model: Any, ids: list[int]) -> None:
    with pytest.raises(LayerOutOfRange, match=r"-4\.\.3"):
        run_with_cache(model, ids, ["resid_post.0", "resid_post.-5"])
    cache = run_with_cache(model, ids, "resid_post.0")
    with pytest.raises(LayerOutOfRange):
        cache["resid_post.-5"]
    with pytest.raises(KeyError, match=r"resid_post\.3 is not in this cache"):
        cache["resid_post.-1"]


def test_the_cache_keeps_its_layer_count_through_save_and_load(model: Any, ids: list[int], tmp_path: Any) -> None:
    cache = run_with_cache(model, [ids, ids[:3]], ["resid_post.-1", "attn_pattern.-2"])
    cache.save(tmp_path / "c.safetensors")
    loaded = Cache.load(tmp_path / "c.safetensors")
    assert loaded.n_layers == N_LAYERS
    assert list(loaded) == [Address("attn_pattern", 2), Address("resid_post", 3)]
    assert torch.equal(loaded["resid_post.-1"], cache["resid_post.3"])
    assert loaded.to("cpu").n_layers == N_LAYERS


def test_a_cache_without_a_layer_count_refuses_negative_layers() -> None:
    with pytest.raises(InvalidAddress, match="n_layers="):
        Cache({"resid_post.-1": torch.zeros(1, 2, 3)})
    cache = Cache({"resid_post.3": torch.zeros(1, 2, 3)})
    with pytest.raises(InvalidAddress, match="does not know the model's layer count"):
        cache["resid_post.-1"]
    assert "resid_post.-1" not in cache
    resolved = Cache({"resid_post.-1": torch.zeros(1, 2, 3)}, n_layers=4)
    assert list(resolved) == [Address("resid_post", 3)]
    with pytest.raises(InvalidAddress, match="different values"):
        Cache({"resid_post.-1": torch.zeros(1, 2, 3), "resid_post.3": torch.ones(1, 2, 3)}, n_layers=4)


def test_the_cli_stores_resolved_layers_and_the_layer_count(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "acts.safetensors"
    status, _, err = interp(
        capsys, "capture", "interp:tiny", TEXT, "--points", "resid_post.-1,resid_post.3", "--out", str(out)
    )
    assert status == 0, err
    cache = Cache.load(out)
    assert list(cache) == [Address("resid_post", 3)] and cache.n_layers == N_LAYERS
    assert torch.equal(cache["resid_post.-1"], cache["resid_post.3"])


# -- a missing model directory -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "vllm", "vllm-static", "toy"])
@pytest.mark.parametrize(
    "name", ["/nonexistent/model", "./no/such/model", "~/no-such-model-dir", "a/b/c", "bad name", "C:\\x"]
)
def test_a_missing_directory_is_said_so_on_every_backend(backend: str, name: str) -> None:
    # the core refuses it before it picks the backend: the same error wherever a backend is installed
    with pytest.raises(ModelLoadError, match="no such directory") as info:
        load_model(name, backend=backend)
    assert repr(name) in str(info.value)
    assert isinstance(info.value, OSError)


def test_a_missing_path_object_is_a_missing_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(tmp_path / "model", backend="eager")


def test_hub_ids_and_existing_paths_pass_through(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for hub_id in ("gpt2", "openai-community/gpt2", "meta-llama/Llama-3.1-8B", "org/model.v2_x-1"):
        assert local_model(hub_id) == hub_id
    assert local_model(tmp_path) == str(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert local_model("~/m") == str(tmp_path / "m")
    assert local_model("interp:tiny") == str(interp_engine.tiny_model_path())


def test_the_cli_says_no_such_directory(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = interp(capsys, "lens", "/nonexistent/model", "hi")
    assert status == 1 and out == ""
    assert our_lines(err) == [line for line in err.splitlines() if line]
    assert "no such directory: '/nonexistent/model'" in our_lines(err)[0]


# -- the CLI: negative positions, options checked first ------------------------------------------------


def lens_header(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("layer "))


def test_lens_takes_negative_positions_as_the_readme_shows(capsys: pytest.CaptureFixture[str]) -> None:
    assert join_negative_lists(["lens", "m", "t", "--positions", "-3,-2,-1"]) == [
        "lens",
        "m",
        "t",
        "--positions=-3,-2,-1",
    ]
    assert join_negative_lists(["--", "--positions", "-1,-2"]) == ["--", "--positions", "-1,-2"]
    status, out, err = interp(capsys, "lens", "interp:tiny", TEXT, "--no-plots", "--positions", "2,3,4")
    assert status == 0, err
    header = lens_header(out)
    assert header.split()[1:] == ["2:'", "of'", "3:'", "France'", "4:'", "is'"]
    for spelled in (["--positions", "-3,-2,-1"], ["--positions=-3,-2,-1"], ["--positions", "-3,3,-1"]):
        status, out, err = interp(capsys, "lens", "interp:tiny", TEXT, "--no-plots", *spelled)
        assert status == 0, err
        assert lens_header(out) == header
    status, _, err = interp(capsys, "lens", "interp:tiny", TEXT, "--no-plots", "--positions", "-9,-1")
    assert status == 1 and "-9 is outside the 5-token text" in our_lines(err)[0]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--max-tokens", "100000"], "--max-tokens 100000"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--induction-length", "1000"], "--induction-length 1000"),
        (["--induction-length", "1"], "--induction-length"),
        (["--layer", "9"], "--layer 9"),
        (["--ablate-heads", "-2"], "--ablate-heads"),
        (["--scale", "nan"], "--scale"),
    ],
)
def test_demo_checks_every_option_before_printing(
    capsys: pytest.CaptureFixture[str], options: list[str], expected: str
) -> None:
    status, out, err = interp(capsys, "demo", "--no-plots", *options)
    assert status == 1
    assert out == ""  # nothing printed before the error
    lines = our_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interp: error: ") and expected in lines[0], err


# -- the tests' toy backend is not a user's ------------------------------------------------------------


def run_fresh(code: str, env: dict[str, str]) -> Any:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


TOY_CODE = """
import json
from importlib.metadata import entry_points
import interp_engine
try:
    interp_engine.load_model("toy-model", backend="toy")
    refused = None
except interp_engine.BackendNotFound as error:
    refused = str(error)
registered = [ep.name for ep in entry_points(group="interp_engine.backends")]
print(json.dumps([interp_engine.installed_backends(), registered, refused]))
"""


def test_the_toy_backend_is_hidden_from_users_of_a_dev_install() -> None:
    user = {k: v for k, v in os.environ.items() if k != "INTERP_TOY_BACKEND"}
    backends, registered, refused = run_fresh(TOY_CODE, user)
    assert "toy" in registered  # the entry point is installed (a dev install)...
    assert "toy" not in backends and "eager" in backends  # ...and a user does not see it
    assert refused is not None and "Installed backends:" in refused
    assert "toy" not in refused.split("Installed backends:")[1]
    backends, _, refused = run_fresh(TOY_CODE, {**user, "INTERP_TOY_BACKEND": "1"})  # the test session
    assert "toy" in backends and refused is None


def test_this_session_uses_the_toy_backend_through_its_entry_point() -> None:
    assert "toy" in interp_engine.installed_backends()
    with pytest.raises(BackendNotFound):
        load_model("toy-model", backend="toy-not")
    assert type(load_model("toy-model", backend="toy")).__module__ == "interp_toy.model"


# -- decode_residuals and the embedding in stacks ------------------------------------------------------


def test_decode_residuals_is_a_free_function(model: Any, ids: list[int]) -> None:
    assert "decode_residuals" in interp_engine.__all__
    cache = run_with_cache(model, ids, ["embed", "resid_post.0", "resid_post.-1", "logits"])
    logits = decode_residuals(model, cache["resid_post.3"])
    assert isinstance(logits, torch.Tensor) and logits.shape == (1, len(ids), model.info.vocab_size)
    torch.testing.assert_close(logits, cache["logits"], rtol=0, atol=1e-4)  # the last layer is the model's own
    sync = sync_model(model)
    assert torch.equal(decode_residuals(sync, cache["resid_post.0"]), sync.decode_residuals(cache["resid_post.0"]))
    by_key = decode_residuals(model, {"resid_post.0": cache["resid_post.0"][0], Address("embed"): cache["embed"][0]})
    assert isinstance(by_key, dict) and list(by_key) == [Address("resid_post", 0), Address("embed")]
    assert torch.equal(by_key[Address("resid_post", 0)], sync.decode_residuals(cache["resid_post.0"][0]))
    lens = decode_residuals(model, cache.stack("resid_post", include_embed=True))
    assert isinstance(lens, torch.Tensor) and lens.shape == (3, 1, len(ids), model.info.vocab_size)
    torch.testing.assert_close(lens[0], sync.decode_residuals(cache["embed"]), rtol=0, atol=1e-5)


def test_stack_includes_the_embedding_as_accumulated_resid(model: Any, ids: list[int]) -> None:
    points = ["embed", *[f"resid_post.{layer}" for layer in range(N_LAYERS)]]
    cache = run_with_cache(model, ids, points)
    accumulated = cache.stack("resid_post", include_embed=True)
    assert accumulated.shape == (N_LAYERS + 1, 1, len(ids), 128)
    assert cache.stack_labels("resid_post", include_embed=True) == points
    assert cache.stack_labels("resid_post") == points[1:]
    # TransformerLens's accumulated_resid: resid_pre of every layer, then the last resid_post,
    # read here at those addresses, independently
    pre = [f"resid_pre.{layer}" for layer in range(N_LAYERS)]
    other = run_with_cache(model, ids, [*pre, f"resid_post.{N_LAYERS - 1}"])
    expected = torch.stack([*(other[p] for p in pre), other[f"resid_post.{N_LAYERS - 1}"]])
    torch.testing.assert_close(accumulated, expected, rtol=0, atol=1e-5)
    with pytest.raises(InvalidAddress, match="d_model kind"):
        cache.stack("attn_pattern", include_embed=True)
    with pytest.raises(KeyError, match="needs embed"):
        run_with_cache(model, ids, "resid_post.0").stack("resid_post", include_embed=True)


def test_a_served_cache_file_with_negative_layers_loads(model: Any, ids: list[int], tmp_path: pathlib.Path) -> None:
    import httpx

    from interp_engine.server import create_app

    from ..support.servers import LiveServer

    with LiveServer(create_app(model)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        request = {"token_ids": ids, "points": ["resid_post.-1", "resid_post.3", "embed"], "format": "safetensors"}
        response = client.post("/v1/capture", json=request)
    assert response.status_code == 200, response.text
    path = tmp_path / "served.safetensors"
    path.write_bytes(response.content)
    cache = Cache.load(path)  # keys as requested; the file carries the layer count
    assert cache.n_layers == N_LAYERS
    assert list(cache) == [Address("embed"), Address("resid_post", 3)]
    direct = sync_model(model).capture(ids, ["resid_post.3"])[Address("resid_post", 3)]
    assert torch.equal(cache["resid_post.-1"][0], direct)
