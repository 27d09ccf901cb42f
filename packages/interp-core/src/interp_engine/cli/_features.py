"""``interp features``: an SAE's strongest features at each token of one text (and a heatmap).

The SAE is a folder in SAELens's format or the name of a shipped one (``interp:tiny-sae``). If
its folder holds a ``features.json`` that names features (as the shipped SAE's does:
``{"features": [{"feature": 813, "category": "country"}, ...]}``), the names are shown next to
the ids.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .. import plot
from .._plugins import load_model
from .._shipped import PREFIX, resolve_sae
from .._sync import SyncModel, sync_model
from ..sae._readouts import FeatureReadout, Features
from ..sae._sae import Sae, load_sae
from ._common import (
    UserError,
    add_model_options,
    add_prompt_arguments,
    load_options,
    note,
    plots_available,
    prompt_tokens,
    read_prompt_source,
    show_token,
    table,
)

NAMES_FILE = "features.json"
"""The file beside an SAE's weights that may name its features (the shipped SAE's report)."""

MAX_PLOT_FEATURES = 48
"""At most this many features (columns) in ``--plot``'s heatmap: the strongest of the union."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def attach_name(source: str) -> str:
    """The name an SAE given as ``source`` is attached under: ``tiny-sae`` for
    ``interp:tiny-sae``, the folder's name (made a valid name) for a folder."""
    text = source[len(PREFIX) :] if source.startswith(PREFIX) else pathlib.Path(source).name
    if text in ("cfg.json", "sae_weights.safetensors"):
        text = pathlib.Path(source).parent.name
    name = _UNSAFE.sub("_", text).lstrip(".-")[:64]
    return name or "sae"


def feature_names(source: str | os.PathLike[str]) -> dict[int, str]:
    """Feature id -> name, from the ``features.json`` beside the SAE at ``source`` (a folder,
    one of its files, or a shipped name); empty when there is none. A file that cannot be read
    is reported on stderr and ignored: names are a help, not the readout."""
    try:
        folder = pathlib.Path(resolve_sae(source))
    except (OSError, ValueError):
        return {}
    if folder.is_file():
        folder = folder.parent
    path = folder / NAMES_FILE
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        entries = report["features"] if isinstance(report, Mapping) else []
        names: dict[int, str] = {}
        for entry in entries:
            name = entry.get("name", entry.get("category"))
            if isinstance(entry.get("feature"), int) and isinstance(name, str):
                names[entry["feature"]] = name
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        note(f"feature names skipped: cannot read {path} ({type(exc).__name__}: {exc})")
        return {}
    return names


def describe_sae(source: str, sae: Sae) -> str:
    """``interp:tiny-sae (topk, 1024 features at resid_post.2, k=16)``."""
    where = f"{sae.address} -> {sae.address_out}" if sae.is_transcoder else str(sae.address)
    k = f", k={sae.k}" if sae.k is not None else ""
    return f"{source} ({sae.architecture}, {sae.d_sae} features at {where}{k})"


def fired(readout: FeatureReadout, position: int) -> list[tuple[int, float]]:
    """The (id, value) pairs of one token of a top-k readout, strongest first, without the
    ``-1`` ids of features that did not fire."""
    if readout.ids is None:
        raise ValueError("fired() reads a top-k readout, not a dense one")
    pairs = zip(readout.ids[position].tolist(), readout.values[position].tolist(), strict=True)
    return [(int(i), float(v)) for i, v in pairs if i >= 0]


def label(feature: int, names: Mapping[int, str]) -> str:
    """``813 (country)`` for a named feature, ``81`` otherwise."""
    name = names.get(feature)
    return f"{feature} ({name})" if name else str(feature)


def feature_cells(pairs: Sequence[tuple[int, float]], names: Mapping[int, str]) -> str:
    """``813 (country):18.50  81:12.60 ...``; ``-`` when none fired."""
    return "  ".join(f"{label(i, names)}:{v:.2f}" for i, v in pairs) or "-"


def features_table(tokens: Sequence[str], readout: FeatureReadout, names: Mapping[int, str]) -> str:
    rows = []
    for position, token in enumerate(tokens):
        error = "-" if readout.error_norm is None else f"{float(readout.error_norm[position]):.2f}"
        rows.append([position, show_token(token), error, feature_cells(fired(readout, position), names)])
    return table(["pos", "token", "error", "top features (id:value, strongest first)"], rows)


def features_json(
    args: argparse.Namespace,
    sync: SyncModel,
    sae: Sae,
    spec: Features,
    ids: Sequence[int],
    readout: FeatureReadout,
    names: Mapping[int, str],
) -> dict[str, Any]:
    """What ``--json`` prints: the SAE, the readout's name, and per token its features (ids
    that did not fire left out) and reconstruction error norm (``null`` for probes and
    transcoders)."""
    tokens = sync.to_str_tokens(list(ids))
    return {
        "model": str(args.model),
        "backend": sync.model.backend,
        "sae": {
            "source": args.sae,
            "name": spec.sae,
            "architecture": sae.architecture,
            "address": str(sae.address),
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
        },
        "readout": str(spec),
        "tokens": [
            {
                "position": position,
                "token": token,
                "token_id": int(token_id),
                "features": [{"id": i, "value": v, "name": names.get(i)} for i, v in fired(readout, position)],
                "error_norm": None if readout.error_norm is None else float(readout.error_norm[position]),
            }
            for position, (token, token_id) in enumerate(zip(tokens, ids, strict=True))
        ],
    }


def plot_class(plot: str | None) -> Any:
    """matplotlib's ``Figure`` for ``--plot FILE`` (``None`` without ``--plot``, or after saying
    how to get plots); a suffix matplotlib cannot write is refused before the model loads."""
    if not plot or not plots_available():
        return None
    from matplotlib.figure import Figure

    suffix = pathlib.Path(plot).suffix.lstrip(".").lower()
    known = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in known:
        valid = ", ".join(sorted(known))
        raise UserError(f"--plot {plot}: matplotlib cannot write .{suffix} files; use one of {valid}")
    return Figure


def write_plot(
    args: argparse.Namespace, tokens: Sequence[str], readout: FeatureReadout, names: Mapping[int, str]
) -> None:
    path = pathlib.Path(args.plot)
    title = f"{args.sae}: top {args.top_k} features per token"
    fig = plot.features(readout, tokens=tokens, names=names, max_features=MAX_PLOT_FEATURES, title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    if args.json:  # stdout is the JSON document
        note(f"wrote {path}")
    else:
        print(f"wrote {path}")


def cmd_features(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {args.top_k}")
    chat_file = read_prompt_source(args)
    sae = load_sae(args.sae)  # a bad folder or name is one line, before the model loads
    figure = plot_class(args.plot)
    names = feature_names(args.sae)
    spec = Features(attach_name(args.sae), top_k=args.top_k)
    options = load_options(args)
    options["saes"] = {spec.sae: sae}
    if args.json:  # stdout is the JSON document: vLLM logs to stdout unless told otherwise
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sync = sync_model(load_model(args.model, backend=args.backend, **options))
    try:
        ids = list(prompt_tokens(sync, args, chat_file))
        readout = sync.capture(ids, [spec])[spec]
        tokens = sync.to_str_tokens(ids)
        if args.json:
            print(json.dumps(features_json(args, sync, sae, spec, ids, readout, names), indent=1))
        else:
            named = f" (names from its {NAMES_FILE})" if names else ""
            print(f"{describe_sae(args.sae, sae)} on {args.model}, {len(ids)} tokens")
            print(f"the top {args.top_k} features per token{named}; error: |x - reconstruct(x)|\n")
            print(features_table(tokens, readout, names))
        if figure is not None:
            write_plot(args, tokens, readout, names)
    finally:
        sync.shutdown()
    return 0


def add_features(sub: Any) -> None:
    parser = sub.add_parser(
        "features",
        help="an SAE's top features at each token of a text (and a heatmap PNG)",
        description="Attach an SAE (a folder in SAELens's format, cfg.json + sae_weights.safetensors, or a "
        "shipped name such as interp:tiny-sae) to MODEL, read its top-k features at every token of TEXT, "
        "and print per token its strongest features (id:value; names from a features.json beside the SAE) "
        "and the reconstruction error's norm. --json prints the same as JSON; --plot writes a heatmap.",
        epilog="example: interp features interp:tiny 'The capital of France is' --sae interp:tiny-sae --top-k 4",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    add_prompt_arguments(parser)
    parser.add_argument(
        "--sae",
        required=True,
        metavar="NAME_OR_PATH",
        help="the SAE: a folder in SAELens's format or a shipped SAE's name (interp:tiny-sae)",
    )
    parser.add_argument("--top-k", type=int, default=8, help="features shown per token (8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE", help="write a heatmap (tokens x their top features), e.g. f.png")
    add_model_options(parser)
    parser.set_defaults(func=cmd_features)
