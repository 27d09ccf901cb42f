"""What each backend serves of every model type the eager backend names, as the backends' own code
decides it: the documentation's model-type table (docs/reference/model-types.md) is rendered from
this, at build time.

No backend keeps a list of the families it accepts: each resolves a model from its module tree.
So the table is the backends' verdict on a tiny random-weight model of each type (built by
``interp_testkit``, as the tests build them):

- **eager**: ``load_model(path, backend="eager")`` (the module tree and one traced forward), and
  the kinds the loaded model serves (``model.points()``); or the ``UnsupportedArchitecture`` it
  raises;
- **vllm** and **vllm-static** (one front end): :func:`interp_vllm.model._resolve.resolve_without_weights`,
  which resolves vLLM's own model for the path on the meta device before any engine starts, and
  the kinds the front end serves for the resolved family (its ``_served_kinds``); or the
  ``UnsupportedArchitecture`` it raises.

The model types are :func:`interp_eager.verified_model_types` (the list the eager backend names in
its refusals). ``--backend eager|vllm --out FILE`` writes ``{model_type: entry}`` as JSON, each
entry ``{"status": "serves", "kinds": [...]}`` or ``{"status": "refused", "reason": "..."}``. Each
backend runs in a process of its own, as a server would: vLLM sets up a process group and logs to
stdout, and caches what its Transformers modeling backend finds per module class.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types
from collections.abc import Iterable
from typing import Any

Entry = dict[str, Any]


def _reason(exc: BaseException, path: pathlib.Path) -> str:
    """The refusal's message on one line, the tiny model's folder written as MODEL, without what
    vLLM's config errors append (every architecture it supports, the validator's details)."""
    text = " ".join(str(exc).replace(str(path.resolve()), "MODEL").replace(str(path), "MODEL").split())
    text = text.split(" Supported architectures:")[0].split(" [type=")[0]
    return (text if len(text) <= 400 else text[:399] + "…") or type(exc).__name__


def eager_support(path: pathlib.Path) -> Entry:
    """What the eager backend serves of the model at ``path``."""
    from interp_engine import UnsupportedArchitecture, load_model

    try:
        model = load_model(str(path), backend="eager")
    except UnsupportedArchitecture as exc:
        return {"status": "refused", "reason": _reason(exc, path)}
    return {"status": "serves", "kinds": list(model.points())}


def vllm_support(path: pathlib.Path) -> Entry:
    """What the vllm front end (shared by vllm-static) serves of the model at ``path``."""
    from interp_engine import KINDS, UnsupportedArchitecture
    from interp_vllm.frontend._engine import EngineClient
    from interp_vllm.model._resolve import resolve_without_weights

    try:
        family = resolve_without_weights(str(path), {})
    except UnsupportedArchitecture as exc:
        return {"status": "refused", "reason": _reason(exc, path)}
    # the front end's own method, on the family it resolved
    front = types.SimpleNamespace(family=family, supported_points=EngineClient.supported_points)
    served = EngineClient._served_kinds(front)  # type: ignore[arg-type]
    return {"status": "serves", "kinds": [kind for kind in KINDS if kind in served]}


BACKENDS = {"eager": eager_support, "vllm": vllm_support}


def support(backend: str, model_types: Iterable[str]) -> dict[str, Entry]:
    """``{model_type: entry}``: what ``backend`` serves of each of ``model_types``."""
    from interp_testkit.suite import tiny_model_path

    return {model_type: BACKENDS[backend](tiny_model_path(model_type)) for model_type in model_types}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the JSON file to write")
    parser.add_argument("--types", nargs="*", help="these model types (default: the eager backend's list)")
    args = parser.parse_args(argv)
    if args.types is None:
        from interp_eager import verified_model_types

        args.types = verified_model_types()
    table = support(args.backend, args.types)
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
