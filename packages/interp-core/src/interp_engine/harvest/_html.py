"""A small HTML view of one feature's top-activating contexts, from a harvest's ``top/<sae>.json``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .._errors import InvalidFeatures


def top_contexts(folder: str | Path, sae: str) -> dict[str, Any]:
    """The top contexts a harvest kept for ``sae`` (``harvest(..., top_contexts=N)``): ``features``
    maps each feature id that fired (as a string) to its entries, highest first, each with
    ``value``, ``row``, ``position``, ``tokens`` (the window around it; the middle one activated)
    and ``text`` (those tokens as strings)."""
    path = Path(folder) / "top" / f"{sae}.json"
    if not path.exists():
        raise InvalidFeatures(
            f"{folder} holds no top contexts of {sae!r}: harvest with saes including {sae!r} and top_contexts=N"
        )
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def feature_html(folder: str | Path, sae: str, feature: int) -> str:
    """A standalone HTML page of ``feature``'s top contexts: one line per context, each token
    shaded by nothing but the activating one (bold, its value beside the line)."""
    data = top_contexts(folder, sae)
    entries = data["features"].get(str(feature), [])
    window = int(data["window"])
    lines = []
    for entry in entries:
        pieces = []
        for i, text in enumerate(entry["text"]):
            if entry["tokens"][i] < 0:
                continue
            escaped = html.escape(text).replace(" ", "&nbsp;").replace("\n", "&#x21b5;")
            pieces.append(f"<b class='hit'>{escaped}</b>" if i == window else f"<span>{escaped}</span>")
        lines.append(
            f"<tr><td class='v'>{entry['value']:.3f}</td><td class='ctx'>{''.join(pieces)}</td>"
            f"<td class='at'>row {entry['row']}, pos {entry['position']}</td></tr>"
        )
    body = "\n".join(lines) if lines else "<tr><td>this feature never reached a token's top-k in the harvest</td></tr>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(sae)} feature {feature}</title>"
        "<style>body{font-family:sans-serif}td{padding:2px 8px}.ctx{font-family:monospace}"
        ".hit{background:#fc8}.v{text-align:right}.at{color:#888}</style></head><body>"
        f"<h1>{html.escape(sae)} feature {feature}</h1><p>top {len(entries)} activations</p>"
        f"<table>{body}</table></body></html>"
    )
