"""The algebra of a write, once for every backend.

:func:`apply_op` is what ``add``, ``set`` and ``ablate`` do to activations; :class:`Affine` is
the same algebra folded into one affine map per token (``x -> keep*x - ablate*(x.u)u + shift``),
which is how a compiled graph applies several writes at one address from a table. Backends
call :meth:`Write.apply <interp_engine.Write.apply>` (which selects heads and calls
:func:`apply_op`) or fold writes with :meth:`Affine.then`; neither is written anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._errors import InvalidSteering


def apply_op(op: str, scale: float, x: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``x`` after one write (a new tensor): ``vector`` broadcasts against ``x`` over the last axis.

    - ``add``: ``x + scale * vector``;
    - ``set``: ``scale * vector`` everywhere ``x`` is (activation patching);
    - ``ablate``: ``x - scale * (x . d) d`` with ``d = vector / |vector|`` (per row of ``vector``).
    """
    vector = vector.to(device=x.device, dtype=x.dtype)
    if op == "add":
        return x + scale * vector
    if op == "set":
        constant: torch.Tensor = torch.broadcast_to(scale * vector, x.shape)
        return constant.clone()
    if op == "ablate":
        direction = vector / vector.norm(dim=-1, keepdim=True)
        projection = (x * direction).sum(-1, keepdim=True)
        ablated: torch.Tensor = x - scale * projection * direction
        return ablated
    raise InvalidSteering(f"unknown steering op {op!r}; valid ops: add, set, ablate")


@dataclass(frozen=True)
class Affine:
    """One token's writes folded into ``x -> keep * x - ablate * (x . u) u + shift`` (float32, CPU).

    ``u`` is a unit vector (or zeros). Folding ``add`` moves the shift, ``set`` makes the map
    constant, ``ablate`` sets the direction; two ablations along different directions have no
    single map of this form and raise ``InvalidSteering``.
    """

    keep: float
    ablate: float
    direction: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def identity(cls, width: int) -> Affine:
        return cls(1.0, 0.0, torch.zeros(width), torch.zeros(width))

    def then(self, op: str, scale: float, vector: torch.Tensor) -> Affine:
        """This map followed by one write of ``vector`` (``[width]``)."""
        width = self.shift.shape[0]
        v = vector.detach().to("cpu", torch.float32).reshape(width)
        if op == "add":
            return Affine(self.keep, self.ablate, self.direction, self.shift + scale * v)
        if op == "set":
            return Affine(0.0, 0.0, torch.zeros(width), scale * v)
        if op != "ablate":
            raise InvalidSteering(f"unknown steering op {op!r}; valid ops: add, set, ablate")
        unit = v / v.norm()
        if self.ablate == 0.0:
            return Affine(self.keep, scale * self.keep, unit, self.shift - scale * (self.shift @ unit) * unit)
        if abs(float(self.direction @ unit)) > 1 - 1e-6:  # the same line: ablations stack
            u = self.direction
            return Affine(
                self.keep, self.ablate + scale * (self.keep - self.ablate), u, self.shift - scale * (self.shift @ u) * u
            )
        raise InvalidSteering(
            "two ablations along different directions on the same token cannot be folded into one "
            "affine map (as vllm-static applies writes); apply them at different addresses or tokens, "
            "or use the vllm or eager backend"
        )

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The map applied to rows ``x`` (``[..., width]``)."""
        direction = self.direction.to(device=x.device, dtype=x.dtype)
        projection = (x * direction).sum(-1, keepdim=True)
        return x * self.keep - (self.ablate * projection) * direction + self.shift.to(device=x.device, dtype=x.dtype)
