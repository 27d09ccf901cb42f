"""The ``interp`` command: each command on a tiny local model, in process; the installed entry
point in a real subprocess; one-line errors for user mistakes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
from safetensors import safe_open

from interp_engine import Address, Cache, load_model, run_with_cache, sync_model
from interp_engine.cli import _capture, _common
from interp_engine.cli._common import show_token
from interp_testkit.suite import tiny_model_path

from ..support.cli import interp, is_png, our_lines
from ..support.engines import eager_model

PROMPTS = ["The quick brown fox", "jumps over the lazy dog because it can", "Hello", "a b c d e", "one two"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(tiny_model_path("gpt2"))


@pytest.fixture(scope="module")
def sync() -> Any:
    return sync_model(eager_model("gpt2"))


def test_installed_entry_point_runs_in_a_subprocess() -> None:
    exe = pathlib.Path(sys.executable).parent / "interp"
    assert exe.exists(), "interp-core's [project.scripts] entry point is not installed"
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("demo", "capture", "lens", "attention", "serve"):
        assert command in done.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = interp(capsys, "--version")
    assert status == 0 and out.startswith("interp-engine ")


@pytest.mark.parametrize("command", ["demo", "capture", "lens", "attention", "serve"])
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    status, out, _ = interp(capsys, command, "--help")
    assert status == 0
    assert f"usage: interp {command}" in out
    assert "example:" in out
    if command != "serve":
        assert "--backend" in out


# -- lens and attention -----------------------------------------------------------------------


def test_lens_table_and_heatmap(capsys: pytest.CaptureFixture[str], model_path: str, sync: Any, tmp_path: Any) -> None:
    text = "The quick brown fox jumps"
    status, out, err = interp(capsys, "lens", model_path, text, "--out", str(tmp_path), "--top-k", "3")
    assert status == 0, err
    ids = sync.to_tokens(text)[0].tolist()
    argmax = sync.capture(ids, ["logits"])[Address("logits")].argmax(-1).tolist()
    last_layer = f"resid_post.{sync.model.info.n_layers - 1}"
    grid, top_k = out.split("\ntop 3 at position")
    rows = {line.split()[0]: line for line in grid.splitlines() if line.startswith(("embed", "resid_post"))}
    assert list(rows) == ["embed"] + [f"resid_post.{i}" for i in range(sync.model.info.n_layers)]
    # the last layer's lens is the model's own prediction, at every position
    cursor = 0
    for token_id in argmax:
        cell = show_token(sync.to_str_tokens([token_id])[0], 12)
        cursor = rows[last_layer].index(cell, cursor) + len(cell)
    last_row = next(line for line in top_k.splitlines() if line.startswith(last_layer))
    assert show_token(sync.to_str_tokens([argmax[-1]])[0]) in last_row.split("  ")[1]
    assert is_png(tmp_path / "lens.png")


def test_attention_summary_and_heatmaps(
    capsys: pytest.CaptureFixture[str], model_path: str, sync: Any, tmp_path: Any
) -> None:
    text = "a b c a b c"
    status, out, err = interp(capsys, "attention", model_path, text, "--layer", "-1", "--out", str(tmp_path))
    assert status == 0, err
    info = sync.model.info
    layer = info.n_layers - 1
    ids = sync.to_tokens(text)[0].tolist()
    pattern = sync.capture_attention(ids, [layer])[Address("attn_pattern", layer)]
    tokens = sync.to_str_tokens(ids)
    lines = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(lines) == info.n_heads
    for head, line in enumerate(lines):
        target = int(pattern[head, -1].argmax())
        assert line.split()[0] == str(head)
        assert f"{target}:{show_token(tokens[target])}" in line
    assert is_png(tmp_path / f"attention_L{layer}.png")


def test_plots_missing_still_prints_tables(
    capsys: pytest.CaptureFixture[str], model_path: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    status, out, err = interp(capsys, "lens", model_path, "Hello there", "--out", str(tmp_path))
    assert status == 0, err
    assert "resid_post.0" in out
    assert our_lines(err) == [f"interp: {_common.PLOTS_HINT}"]
    assert "pip install 'interp-core[plots]'" in err
    assert not list(tmp_path.iterdir())


# -- capture --------------------------------------------------------------------------------------

POINTS = "resid_post.1,blocks.0.mlp.hook_post,attn_pattern.-1,embed"


def expected_cache(sync: Any, prompts: list[str]) -> Cache:
    return run_with_cache(sync, prompts, [Address.parse(p) for p in POINTS.split(",")])


def assert_same(actual: Cache, expected: Cache, n_layers: int) -> None:
    assert actual.lengths is not None and expected.lengths is not None
    assert actual.lengths.tolist() == expected.lengths.tolist()
    for address, value in expected.items():
        stored = actual[address.resolve(n_layers)]
        assert stored.shape == value.shape, address
        torch.testing.assert_close(stored, value, rtol=0, atol=1e-5)


def write_prompts(tmp_path: pathlib.Path, prompts: list[str]) -> pathlib.Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts[:2]) + "\n\n" + "\n".join(prompts[2:]) + "\n")  # a blank line is skipped
    return path


def test_capture_file_equals_a_direct_capture(
    capsys: pytest.CaptureFixture[str], model_path: str, sync: Any, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "acts.safetensors"
    prompts_file = write_prompts(tmp_path, PROMPTS)
    status, stdout, err = interp(
        capsys, "capture", model_path, "--input", str(prompts_file), "--points", POINTS, "--out", str(out)
    )
    assert status == 0, err
    assert f"wrote {out}: 5 prompts" in stdout
    cache = Cache.load(out)
    assert_same(cache, expected_cache(sync, PROMPTS), sync.model.info.n_layers)
    assert [str(a) for a in cache] == ["embed", "mlp_post.0", "resid_post.1", "attn_pattern.2"]
    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["interp.prompts"]) == PROMPTS
    assert json.loads(metadata["interp.token_ids"])[2] == sync.to_tokens("Hello")[0].tolist()
    assert not (tmp_path / "acts.safetensors.parts").exists()
    # the finished file is not overwritten by accident
    status, _, err = interp(capsys, "capture", model_path, "hi", "--points", "embed", "--out", str(out))
    assert status == 1 and our_lines(err) == [f"interp: error: {out} exists; pass --overwrite to replace it"]
    status, _, err = interp(capsys, "capture", model_path, "hi", "--points", "embed", "--out", str(out), "--overwrite")
    assert status == 0, err
    assert Cache.load(out)[Address("embed")].shape[0] == 1


def test_capture_resumes_after_an_interruption(
    capsys: pytest.CaptureFixture[str],
    model_path: str,
    sync: Any,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "acts.safetensors"
    argv = ["capture", model_path, "--input", str(write_prompts(tmp_path, PROMPTS))]
    argv += ["--points", POINTS, "--out", str(out), "--batch-size", "2"]
    real_write = _capture.write_shard
    written: list[int] = []

    def interrupted(parts: Any, index: int, *rest: Any) -> None:
        if len(written) == 3:
            raise KeyboardInterrupt  # Ctrl-C after three prompts were saved
        written.append(index)
        real_write(parts, index, *rest)

    monkeypatch.setattr(_capture, "write_shard", interrupted)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain counter, not tqdm
    status, _, err = interp(capsys, *argv)
    assert status == 130
    assert "interrupted" in our_lines(err)[-1]
    assert not out.exists()
    parts = tmp_path / "acts.safetensors.parts"
    assert sorted(p.name for p in parts.glob("*.safetensors")) == [f"{i:06d}.safetensors" for i in range(3)]

    # a different command does not resume someone else's progress
    status, _, err = interp(capsys, *argv[:-4], "--points", "embed", "--out", str(out))
    assert status == 1 and "--overwrite" in our_lines(err)[0]

    # the same command continues where it stopped: only the two missing prompts run
    written.clear()
    monkeypatch.setattr(
        _capture, "write_shard", lambda parts, index, *rest: (written.append(index), real_write(parts, index, *rest))
    )
    status, _, err = interp(capsys, *argv)
    assert status == 0, err
    assert written == [3, 4]
    assert "capture: 5/5 prompts" in err
    assert_same(Cache.load(out), expected_cache(sync, PROMPTS), sync.model.info.n_layers)


# -- demo and serve ---------------------------------------------------------------------------------


def test_demo_defaults_to_the_shipped_model_and_writes_plots(
    capsys: pytest.CaptureFixture[str], model_path: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def load(name: str, **kwargs: Any) -> Any:  # interp:tiny comes from another branch: stand in for it
        asked.append(name)
        return load_model(model_path, **kwargs)

    monkeypatch.setattr(_common, "load_model", load)
    status, out, err = interp(capsys, "demo", "--out", str(tmp_path), "--max-tokens", "2", "--induction-length", "6")
    assert status == 0, err
    assert asked == ["interp:tiny"]
    for heading in ("1. capture", "2. logit lens", "3. attention", "4. heads", "5. steering", "strongest: layer"):
        assert heading in out
    assert "steered prompt" in out and "plain:" in out
    assert is_png(tmp_path / "lens.png") and is_png(tmp_path / "induction.png")


def test_serve_without_the_server_installed(
    capsys: pytest.CaptureFixture[str], model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "interp_engine.server", None)
    status, _, err = interp(capsys, "serve", model_path)
    assert status == 1
    assert err.count("\n") == 1 and "pip install 'interp-core[serve]'" in err


def test_serve_passes_its_options_to_the_server(
    capsys: pytest.CaptureFixture[str], model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import interp_engine.server

    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(interp_engine.server, "run", lambda model, **kwargs: calls.append((model, kwargs)))
    argv = ["serve", model_path, "--backend", "vllm", "--port", "8123", "--limit", "max_body_bytes=1000"]
    status, _, err = interp(capsys, *argv, "--dtype", "bfloat16", "-o", "max_model_len=256")
    assert status == 0, err
    assert calls == [
        (
            model_path,
            {
                "backend": "vllm",
                "host": "127.0.0.1",
                "port": 8123,
                "limits": interp_engine.server.ServerLimits(max_body_bytes=1000),
                "api_key": None,
                "dtype": "bfloat16",
                "max_model_len": 256,
            },
        )
    ]
    for bad, message in (("max_widgets=3", "unknown server limit max_widgets"), ("max_points=0", "max_points")):
        status, _, err = interp(capsys, "serve", model_path, "--limit", bad)
        assert status == 1 and err.count("\n") == 1 and message in err


# -- user mistakes: one line, non-zero, no traceback --------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["capture", "{model}", "hi", "--points", "resid_post.x"], "resid_post.x"),
        (["capture", "{model}", "hi", "--points", "hook_embed"], "use 'embed'"),
        (["capture", "{model}", "hi", "--points", "resid_post.99"], "out of range"),
        (["capture", "{model}", "--input", "{tmp}/missing.txt", "--points", "embed"], "not found"),
        (["capture", "{model}", "--points", "embed"], "either TEXT or --input"),
        (["lens", "{model}", "hi", "--backend", "no-such-backend"], "no-such-backend"),
        (["lens", "{tmp}/no-model-here", "hi"], "no-model-here"),
        (["lens", "{model}", "hi", "--positions", "7,x"], "--positions"),
        (["attention", "{model}", "hi", "--layer", "40"], "--layer 40"),
        (["attention", "{model}", "hi"], "--layer"),
        (["lens", "{model}"], "TEXT"),
        (["frobnicate"], "frobnicate"),
        ([], "choose a command"),
    ],
)
def test_user_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], model_path: str, tmp_path: Any, argv: list[str], expected: str
) -> None:
    argv = [a.format(model=model_path, tmp=tmp_path) for a in argv]
    status, _, err = interp(capsys, *argv)
    assert status in (1, 2)
    lines = our_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interp: error: "), err
    assert expected in lines[0]
    assert "Traceback" not in err


# -- any backend, through the protocol ----------------------------------------------------------


def test_commands_on_a_third_party_backend(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    # the toy backend (tests/toy_backend) serves residual addresses and logits, no attention
    toy = ["--backend", "toy", "--no-plots"]
    status, out, err = interp(capsys, "lens", "toy", "hello", *toy)
    assert status == 0, err
    assert "resid_post.2" in out
    status, out, err = interp(capsys, "demo", "toy", *toy, "--prompt", "abc", "--contrast", "xyz")
    assert status == 0, err
    assert "skipped:" in out and "5. steering" in out
    status, _, err = interp(capsys, "attention", "toy", "hello", "--layer", "0", *toy)
    assert status == 1 and "attn_pattern.0" in our_lines(err)[0]
    out_file = tmp_path / "toy.safetensors"
    status, _, err = interp(
        capsys,
        "capture",
        "toy",
        "hello",
        "--points",
        "blocks.1.hook_resid_post",
        "--out",
        str(out_file),
        "--backend",
        "toy",
    )
    assert status == 0, err
    direct = run_with_cache(load_model("toy", backend="toy"), "hello", ["resid_post.1"])
    assert torch.equal(Cache.load(out_file)["resid_post.1"], direct["resid_post.1"])
