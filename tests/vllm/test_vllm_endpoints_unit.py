"""The ``vllm serve`` plugin's wiring without a server: what it does on a server it cannot serve
(no engine, a compiled model, a vLLM whose server moved), how it reads its configuration, the API
key check of its ``/interp`` routes, and presets."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from interp_engine import InvalidOption, SteeringSpec
from interp_vllm import _compat
from interp_vllm.serve._answers import Steps
from interp_vllm.serve._endpoints import InterpEndpoints, plugin
from interp_vllm.serve._requests import Refused
from interp_vllm.serve._routes import api_keys


def _engine(enforce_eager: bool = True, additional: Any = None) -> Any:
    model_config = SimpleNamespace(
        enforce_eager=enforce_eager,
        model="m",
        tokenizer="m",
        max_model_len=64,
        hf_text_config=SimpleNamespace(num_hidden_layers=4),
    )
    config = SimpleNamespace(model_config=model_config, additional_config=additional or {})
    return SimpleNamespace(vllm_config=config, generate=lambda *a, **k: None)


def test_the_entry_point_is_a_zero_argument_factory_with_vllms_plugin_shape() -> None:
    made = plugin()
    assert made.name == "interp_vllm" and made.required_tasks == ("generate",)
    assert callable(made.attach_router) and asyncio.iscoroutinefunction(made.init_state)


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        (None, "no engine"),
        (_engine(additional={"interp": {"sae": {}}}), "unknown 'interp' settings"),
        (_engine(additional={"interp": {"points_max_values": 0}}), "points_max_values is a positive int"),
        (_engine(additional={"interp": {"static": {"points": "resid_post.1"}}}), "interp.static.points is a list"),
        (_engine(additional={"interp": {"static": {"writes": ["resid_post.4"]}}}), "resid_post.4"),
    ],
    ids=["render-only", "misspelt-setting", "points-cap", "static-form", "static-layer"],
)
def test_a_server_the_plugin_cannot_serve_runs_on_without_it(engine: Any, says: str, caplog: Any) -> None:
    endpoints = InterpEndpoints()
    with caplog.at_level(logging.WARNING):
        asyncio.run(endpoints.init_state(engine, SimpleNamespace(), SimpleNamespace(api_key=None)))
    assert endpoints.refusal is not None and says in endpoints.refusal
    assert endpoints.model is None


def test_a_vllm_whose_server_moved_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def moved() -> None:
        raise _compat.ENGINE_GENERATE._error("AsyncLLM.generate takes (self, request)")

    monkeypatch.setattr(_compat, "check_server", moved)
    endpoints = InterpEndpoints()
    asyncio.run(endpoints.init_state(_engine(), SimpleNamespace(), SimpleNamespace(api_key=None)))
    assert endpoints.refusal is not None and "AsyncLLM.generate" in endpoints.refusal
    monkeypatch.undo()
    _compat.check_server()  # the installed vLLM has what the plugin wraps and reads


def test_a_server_without_the_wrapped_routes_gets_only_what_it_has(caplog: Any) -> None:
    app = FastAPI()
    with caplog.at_level(logging.WARNING):
        InterpEndpoints().attach_router(app)
    assert "no /v1/completions" in caplog.text
    assert any(getattr(r, "path", None) == "/interp" for r in app.routes)


def _scope(header: bytes | None, path: str = "/interp/v1/generate") -> dict[str, Any]:
    headers = [] if header is None else [(b"authorization", header)]
    return {"type": "http", "path": path, "headers": headers}


def test_the_interp_routes_take_any_of_the_servers_keys() -> None:
    endpoints = InterpEndpoints()
    assert endpoints._authorized(_scope(None))  # a server without keys: open, as vLLM's own routes
    endpoints.api_keys = ("one", "two")
    assert endpoints._authorized(_scope(b"Bearer one")) and endpoints._authorized(_scope(b"bearer two"))
    for header in (None, b"Bearer three", b"Basic one", b"one", b"Bearer "):
        assert not endpoints._authorized(_scope(header))
    assert endpoints._authorized(_scope(None, "/interp/v1/health"))


def test_a_preset_needs_a_new_name_and_a_spec() -> None:
    endpoints = InterpEndpoints()
    endpoints.base_names = ("served",)
    spec = {"writes": [{"address": "resid_post.0", "vector": [1.0, 2.0]}]}
    endpoints.set_preset("calm", spec)
    assert isinstance(endpoints.presets["calm"], SteeringSpec)
    with pytest.raises(InvalidOption, match="new model name"):
        endpoints.set_preset("served", spec)
    with pytest.raises(Exception, match="address"):
        endpoints.set_preset("other", {"writes": [{"vector": [1.0]}]})
    held = endpoints.presets
    assert endpoints.drop_preset("calm") and not endpoints.drop_preset("calm")
    assert "calm" in held  # a request that read the presets before keeps what it read


def test_an_interp_object_is_read_from_the_body_or_vllm_xargs() -> None:
    endpoints = InterpEndpoints()
    endpoints.refusal = None
    spec = {"writes": [{"address": "resid_post.0", "vector": [1.0, 2.0]}]}
    body = SimpleNamespace(model="m", model_extra={"interp": {"steering": spec}}, vllm_xargs=None)
    call = endpoints._call_of(body)
    assert call is not None and call.spec is not None and len(call.spec.writes) == 1
    assert "interp" not in body.model_extra  # not left for vLLM to warn about
    import json

    xargs = SimpleNamespace(model="m", model_extra={}, vllm_xargs={"interp": json.dumps({"steering": spec})})
    assert endpoints._call_of(xargs) is not None and xargs.vllm_xargs == {}
    for bad in ("{not json", json.dumps([1])):
        with pytest.raises(Refused):
            endpoints._call_of(SimpleNamespace(model="m", model_extra={}, vllm_xargs={"interp": bad}))
    assert endpoints._call_of(SimpleNamespace(model="m", model_extra={}, vllm_xargs=None)) is None


def test_the_interp_routes_take_the_keys_vllms_own_routes_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(SimpleNamespace(api_key=None)) == ("from-env",)
    assert api_keys(SimpleNamespace(api_key=["a", "b"])) == ("a", "b")  # the flag wins, as in vLLM
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys(SimpleNamespace(api_key=None)) == ()
    assert api_keys(SimpleNamespace(api_key=[""])) == ()


@pytest.mark.parametrize(
    ("interp", "param"),
    [
        ({"points": ["resid_post.1"]}, "interp.positions"),
        ({"positions": [0]}, "interp.positions"),
        ({"points": [], "positions": [0]}, "interp.points"),
        ({"points": [{"sae": "res"}], "positions": [0]}, "interp.points"),
        ({"points": ["resid_post.1"], "positions": [0, -1]}, "interp.positions"),
        ({"points": ["resid_post.1"], "positions": [True]}, "interp.positions"),
        ({"points": ["resid_post.1"], "positions": "generated"}, "interp.positions"),
        ({"points": ["resid_post.1"], "positions": []}, "interp.positions"),
    ],
    ids=["no-positions", "no-points", "empty", "readout", "negative", "bool", "generated", "no-position"],
)
def test_points_and_positions_of_the_wrong_shape_are_refused_by_field(interp: Any, param: str) -> None:
    endpoints = InterpEndpoints()
    endpoints.refusal = None
    with pytest.raises(Refused) as refused:
        endpoints._call_of(SimpleNamespace(model="m", model_extra={"interp": interp}, vllm_xargs=None))
    assert refused.value.param == param and isinstance(refused.value.error, InvalidOption)


def test_points_asked_make_a_call_that_holds_them() -> None:
    endpoints = InterpEndpoints()
    endpoints.refusal = None
    for positions in ([0, 3], "prompt", "user[-1].last"):
        asked = {"points": ["resid_post.1", "mlp_out.0"], "positions": positions}
        call = endpoints._call_of(SimpleNamespace(model="m", model_extra={"interp": asked}, vllm_xargs=None))
        assert call is not None and call.spec is None and call.steps is not None
        assert call.points == ("resid_post.1", "mlp_out.0") and call.positions == positions
        assert not call.steps.per_token  # no steps list: the answer holds the points alone


def test_an_answer_carries_no_inf_or_nan() -> None:
    steps = Steps(per_token=True)
    steps.ready.append({"position": 3, "lens": {"probs": [[float("nan"), 0.5]]}})
    steps.points = {"positions": [0], "activations": {"resid_post.1": [[float("inf"), 1.0]]}}
    import json

    whole = steps.whole()
    json.dumps(whole, allow_nan=False)  # JSON has neither: they are null
    assert whole["steps"][0]["lens"]["probs"] == [[None, 0.5]]
    assert whole["activations"]["resid_post.1"] == [[None, 1.0]]
