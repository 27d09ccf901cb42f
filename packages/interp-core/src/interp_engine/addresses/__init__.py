"""Addresses: where in a model an activation is (``Address``), the kind vocabulary, and
TransformerLens hook names. Imports no torch: tooling reads the vocabulary without it."""
