"""Plots of interpretability results: the logit lens, attention patterns, induction, patching
sweeps, direct logit attribution, SAE features and model diffs (:func:`~interp_engine.compare`),
drawn with matplotlib.

matplotlib is the optional extra ``interp-core[plots]``. ``import interp_engine.plot`` works
without it; a function called without it raises ``ImportError`` naming the install command.

Every function takes plain tensors (or a :class:`~interp_engine.Labelled` result) and labels,
never a model, so it draws what you computed. It draws on a new ``Figure`` (no pyplot state:
safe in scripts, servers and threads) or on ``ax=`` (an ``Axes`` of yours, e.g. from
``plt.subplots()``), and returns the figure: ``fig.savefig("lens.png")``, or leave it as a
notebook cell's value to show it. Tokens keep their edges visible (``token_label``: ``" Paris"``
is drawn ``␣Paris``), and every heatmap has a colorbar.
"""

from ._attention import attention, induction
from ._diff import diff_features, diff_lens, diff_norms
from ._draw import INSTALL as INSTALL
from ._draw import token_label
from ._features import MAX_FEATURES as MAX_FEATURES
from ._features import features
from ._lens import lens, logit_lens
from ._tables import dla, patching

__all__ = [
    "attention",
    "diff_features",
    "diff_lens",
    "diff_norms",
    "dla",
    "features",
    "induction",
    "lens",
    "logit_lens",
    "patching",
    "token_label",
]
