"""The small corpus the harvest tests run over, and the tiny model's SAE they read features with."""

from __future__ import annotations

import pathlib

from interp_engine import tiny_model_path

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "A second document, somewhat longer than the first one, so that it spills over a row or two of the packing.",
    "Short.",
    "Numbers 1 2 3 4 5 6 7 8 9 10 and words after them to make the row longer still.",
    "The last one.",
] * 3
"""Six documents (one empty, one long enough to span rows), three times over."""

TINY_SAE = pathlib.Path(tiny_model_path()).parent / "tiny-sae"
"""The SAE shipped beside ``interp:tiny``."""
