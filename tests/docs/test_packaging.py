"""Packaging: installing interp-vllm does not require the eager package (SPEC §2).

Statically, no module of interp-vllm imports ``interp_eager`` and interp-vllm's metadata does not
ask for it; no shipped module imports the dev-only ``interp_testkit`` (``tests/testkit``, which
builds the tests' tiny models from ``transformers`` alone). Then the claim is run: a fresh
interpreter whose ``interp_eager`` is a stub that records the attempt and raises ``ImportError``
(on ``PYTHONPATH``, ahead of site-packages and inherited by vLLM's engine-core and worker
processes) loads a tiny model with ``backend="vllm"``, captures ``resid_post.0`` (checked against
plain ``transformers``), generates 2 tokens, shuts down through its sync facade and exits with
nothing on stderr of the faults vLLM's teardown used to print (the lifecycle tests' check, for
the facade's shutdown); nothing anywhere tried to import the eager package. One eager-mode vLLM
engine (~30 s on CPU).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import torch

from interp_testkit.suite import ROOT, hf_for, rel_diff, vllm_model_path

from ..support.procs import EXIT_FAULTS

PACKAGES = ROOT / "packages"
VLLM_SRC = PACKAGES / "interp-vllm" / "src"
TOL = 1e-4

_STUB = """\
import os, traceback
with open({marker!r}, "a") as f:
    f.write(f"pid {{os.getpid()}}:\\n" + "".join(traceback.format_stack()) + "\\n")
raise ImportError("interp_eager is not installed here (tests/docs/test_packaging.py)")
"""

_CHILD = """\
import importlib.util
import json
import sys

if __name__ == "__main__":  # vLLM's workers re-import the main module when they are spawned
    path, stub_dir = sys.argv[1], sys.argv[2]
    spec = importlib.util.find_spec("interp_eager")
    assert spec is not None and spec.origin.startswith(stub_dir), spec  # the stub shadows the real one

    import torch

    from interp_engine import Address, installed_backends, load_model, sync_model
    from interp_engine import _plugins

    point = Address("resid_post", 0)
    model = sync_model(load_model(path, backend="vllm"))
    try:
        ids = model.to_tokens("The quick brown fox jumps over the lazy dog because")[0].tolist()
        acts = model.capture(ids, [point])
        completion = model.generate(ids, max_tokens=2, ignore_eos=True)
    finally:
        model.shutdown()
    torch.save({"ids": ids, "resid_post.0": acts[point]}, sys.argv[3])
    result = {
        "backends": installed_backends(),
        "broken": dict(_plugins._broken),
        "generated": list(completion.token_ids),
        "eager_loaded": "interp_eager" in sys.modules,
    }
    with open(sys.argv[4], "w") as f:  # not stdout: vLLM logs there
        json.dump(result, f)
"""


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Absolute module names ``path`` imports (``import``/``from`` statements anywhere, and
    ``importlib.import_module``/``__import__`` with a literal name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def _importers(files: list[pathlib.Path], package: str) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name == package or name.startswith(package + ".")
    )


def test_interp_vllm_never_imports_interp_eager() -> None:
    files = sorted(VLLM_SRC.rglob("*.py"))
    assert len(files) > 5  # the walk found the package
    assert _importers(files, "interp_eager") == []


def test_interp_vllm_metadata_does_not_require_interp_eager() -> None:
    text = (PACKAGES / "interp-vllm" / "pyproject.toml").read_text()
    assert "interp-eager" not in text and "interp_eager" not in text


def test_no_shipped_module_imports_the_testkit() -> None:
    files = sorted(p for p in PACKAGES.rglob("*.py") if ".egg-info" not in str(p))
    assert any(p.is_relative_to(VLLM_SRC) for p in files) and len(files) > 20
    assert _importers(files, "interp_testkit") == []


def test_the_testkit_needs_no_backend() -> None:
    files = sorted((ROOT / "tests" / "testkit" / "src").rglob("*.py"))
    assert files
    for package in ("interp_engine", "interp_eager", "interp_vllm"):
        assert _importers(files, package) == []


def test_vllm_backend_runs_without_interp_eager(tmp_path: pathlib.Path) -> None:
    path = vllm_model_path("gpt2")  # built here, by interp_testkit, before the child starts
    stub_dir = tmp_path / "no-eager"
    (stub_dir / "interp_eager").mkdir(parents=True)
    marker = tmp_path / "eager-import-attempts.txt"
    (stub_dir / "interp_eager" / "__init__.py").write_text(_STUB.format(marker=str(marker)))
    script = tmp_path / "run_vllm.py"
    script.write_text(_CHILD)
    out, result_file = tmp_path / "acts.pt", tmp_path / "result.json"

    env = {k: v for k, v in os.environ.items() if k != "INTERP_ENGINE_BACKEND"}
    pythonpath = [str(stub_dir), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env |= {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "INTERP_ENGINE_BACKENDS": "vllm",  # the core loads the vllm plugin only
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    done = subprocess.run(
        [sys.executable, str(script), str(path), str(stub_dir), str(out), str(result_file)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for fault in EXIT_FAULTS:
        assert fault not in done.stderr, done.stderr[-4000:]
    result = json.loads(result_file.read_text())
    attempts = marker.read_text() if marker.exists() else ""
    assert attempts == "", f"something tried to import interp_eager:\n{attempts}"
    assert result["broken"] == {}
    assert "eager" not in result["backends"] and "vllm" in result["backends"]
    assert not result["eager_loaded"]
    assert len(result["generated"]) == 2

    saved = torch.load(out)
    with torch.no_grad():
        hf = hf_for(path)(torch.tensor([saved["ids"]]), output_hidden_states=True)
    assert rel_diff(saved["resid_post.0"], hf.hidden_states[1][0]) < TOL


def _pip_config_to_uv():
    spec = importlib.util.spec_from_file_location("pip_config_to_uv", ROOT / "scripts" / "pip_config_to_uv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_setup_hands_uv_the_indexes_pip_is_configured_with() -> None:
    listing = (
        ":env:.default-timeout='180'\n"
        ":env:.find-links='/opt/wheels'\n"
        "global.cert='/etc/ssl/certs/ca.crt'\n"
        "global.constraint='/etc/xdg/pip/constraints.txt'\n"
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'\n"
        "global.find-links='/opt/wheels'\n"
        "install.index-url='https://mirror.example/simple'\n"
        "install.no-index='false'\n"
    )
    assert _pip_config_to_uv().uv_args(listing) == [
        "UV_HTTP_TIMEOUT=180",
        "--find-links=/opt/wheels",  # once, though the environment and a file both set it
        "SSL_CERT_FILE=/etc/ssl/certs/ca.crt",
        "--constraint=/etc/xdg/pip/constraints.txt",
        "--extra-index-url=file:///opt/a/simple",
        "--extra-index-url=file:///opt/b/simple",
        "--index-url=https://mirror.example/simple",
    ]
    assert _pip_config_to_uv().uv_args("global.no-index='true'\n") == ["--no-index"]


def test_the_setup_reads_this_machines_pip_configuration() -> None:
    """`pip config list` of this interpreter, as setup.sh runs it: the script prints what its
    function makes of that listing, and only options and variables uv knows."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pip_config_to_uv.py")], capture_output=True, text=True, check=True
    )
    printed = done.stdout.split()
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert printed == _pip_config_to_uv().uv_args(listing)
    for arg in printed:
        assert arg.split("=", 1)[0] in (
            "--index-url",
            "--extra-index-url",
            "--find-links",
            "--constraint",
            "--no-index",
            "SSL_CERT_FILE",
            "UV_HTTP_TIMEOUT",
            "UV_HTTP_RETRIES",
        ), arg
