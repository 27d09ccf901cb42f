"""Results: what a capture returns and what analyses build from it (``Cache``, ``Labelled``,
the lens results)."""
