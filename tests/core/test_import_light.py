"""``import interp_engine`` is light: tooling reads addresses, the kind vocabulary, the error tree
and the installed backends without loading torch, numpy or safetensors; every tensor-holding name
is imported on first use and is then the same object as before."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "numpy", "safetensors", "transformers", "vllm")


def _modules_after(code: str) -> list[str]:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    loaded: list[str] = json.loads(out.splitlines()[-1])
    return loaded


def _heavy(loaded: list[str]) -> list[str]:
    return [name for name in loaded if name.split(".")[0] in HEAVY]


def test_the_light_names_import_no_torch() -> None:
    loaded = _modules_after(
        "from interp_engine import ALIASES, KINDS, Address, InterpError, KindInfo, PointInfo, UnknownKind\n"
        "from interp_engine import hookimpl, installed_backends, shipped_models, tiny_model_path\n"
        "import interp_engine.hookspecs\n"
        "from interp_engine.backend import KINDS as SDK_KINDS, NEEDS, hookimpl as sdk_hookimpl, lacking\n"
        "assert SDK_KINDS is KINDS and sdk_hookimpl is hookimpl and 'mlp_pre_linear' in lacking(NEEDS[:1])\n"
        "assert Address.parse('resid_post.5') == Address('resid_post', 5)\n"
        "assert 'resid_post' in KINDS and issubclass(UnknownKind, InterpError)\n"
        "installed_backends()\n"
    )
    assert "interp_engine" in loaded
    assert _heavy(loaded) == []


def test_a_tensor_name_is_imported_on_first_use() -> None:
    assert "torch" in _modules_after("import interp_engine\ninterp_engine.Cache\n")
    assert "torch" in _modules_after("from interp_engine.backend import ModelBase\n")


def test_lazy_names_are_the_defining_modules_objects() -> None:
    import interp_engine
    from interp_engine.results._cache import Cache
    from interp_engine.steering._spec import Write

    assert interp_engine.Cache is Cache
    assert interp_engine.Write is Write
    assert {"Cache", "Write", "run_with_cache", "sync_model"} <= set(dir(interp_engine))


def test_an_unknown_name_is_an_attribute_error() -> None:
    import interp_engine

    try:
        interp_engine.NoSuchName  # noqa: B018
    except AttributeError as error:
        assert "NoSuchName" in str(error)
    else:
        raise AssertionError("no AttributeError")


def test_the_check_sees_a_heavy_import() -> None:
    assert "torch" in _heavy(_modules_after("from interp_eager import EagerModel"))
