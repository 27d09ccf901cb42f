"""The async model protocol every backend implements, the values it returns, and the optional
capabilities some backends add.

:class:`InterpModel` is what every backend's model offers. What only some offer is a
protocol of its own, declared here and checked with ``isinstance`` where it is used (never with
``getattr``, ``hasattr`` or a class name), so a third-party backend gains a capability by
implementing its methods, nothing else:

- :class:`BatchCapture` (``capture_batch``): one batched forward over several prompts.
  ``run_with_cache`` uses it when present, else runs one ``capture`` per prompt concurrently and
  pads. The eager backend has it.
- :class:`BlockingCapture` (``capture_batch_blocking``): the same batched capture, called without
  an event loop from the thread that waits for it. ``run_with_cache`` (and what calls it) uses it
  when present, so a blocking call costs no trip through the sync facade's loop. The eager backend
  has it.
- :class:`StaticTaps` (``static_points``, ``static_writes``, ``configure_static``): a fixed tap
  set declared before the engine is built (``vllm-static``). The server reports the declared
  set in ``GET /v1/model``.
- :class:`WorkerStats` (``worker_stats``): per-worker counters of a backend that runs its model
  in worker processes (``vllm``, ``vllm-static``), for leak and recompilation checks.
- :class:`GradientCapture` (``capture_gradients``): gradients of a scalar metric of the logits
  with respect to activations, for ``run_with_gradients`` and attribution patching. The eager
  backend has it; vLLM runs under inference mode and does not.

All are ``@runtime_checkable``: ``isinstance`` checks that the members exist, not their
signatures; the signatures here are the contract.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload, runtime_checkable

import torch

from ..addresses._address import Address, AddressLike
from ..results._lens import LensRequest, LensResult, LensTopK
from ..sae._readouts import FeatureReadout, Features
from ..steering._spec import RowSpecs, SteeringSpec


@dataclass(frozen=True)
class ModelInfo:
    """Shapes and names of a loaded model, read from its config."""

    architecture: str
    n_layers: int
    d_model: int
    d_mlp: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_ctx: int
    parallel_attn: bool = False
    d_head: int = 0
    """Width of one attention head (``0``: ``d_model // n_heads``, filled in)."""
    n_experts: int = 0
    """Experts per mixture-of-experts layer (``0``: a dense model)."""
    experts_per_token: int = 0
    """How many experts each token is routed to (top-k) on a mixture-of-experts layer."""

    def __post_init__(self) -> None:
        if not self.d_head:
            object.__setattr__(self, "d_head", self.d_model // max(self.n_heads, 1))


@dataclass(frozen=True)
class Completion:
    """A finished generation: the generated ids only (no prompt) and their text."""

    token_ids: list[int]
    text: str
    finish_reason: str = "length"
    """``"length"`` when ``max_tokens`` was reached, ``"stop"`` at an end-of-sequence token."""


@dataclass(frozen=True)
class StreamStep:
    """One generated token: its id, its text piece and the top-n ``(token_id, logprob)`` pairs.

    With ``features=`` asked of ``stream``, ``features`` holds each readout at ``position``: the
    sequence position whose forward pass produced this token (the prompt's last token for the
    first step), one token's values (``values [k]``, ``ids [k]``, ``error_norm []``)."""

    token_id: int
    text: str
    logprobs: list[tuple[int, float]] = field(default_factory=list)
    position: int = -1
    """The position of the forward pass that produced this token (``-1``: not reported)."""
    features: dict[Features, FeatureReadout] = field(default_factory=dict)
    lens: LensTopK | None = None
    """With ``lens=`` asked of ``stream``: the logit lens's top-k at ``position``, per layer."""
    prompt_lens: LensResult | None = None
    """On the first step only, with ``LensRequest(positions=...)``: the lens at those prompt positions."""

    @property
    def token_str(self) -> str:
        """:attr:`text` (the public ``interp-engine`` package's name for a step's text piece)."""
        return self.text


Points = Iterable[AddressLike | Features | str]
RowAdapters = str | Sequence[str | None] | None
"""One adapter (a registered name or a folder; ``None``: the base model) for every row of a
batch, or a list of one per row."""
Activations = dict[Address, torch.Tensor]


class Results(dict[Address | Features | LensRequest, Any]):
    """What a capture returns: a plain dict of activations by :class:`Address` and feature
    readouts (:class:`FeatureReadout`) by :class:`Features`, keyed as the caller asked (a string
    key is a ``KeyError``, as for any dict keyed by ``Address``; ``Cache`` takes strings). The
    class only types the lookups."""

    @overload
    def __getitem__(self, key: Address) -> torch.Tensor: ...

    @overload
    def __getitem__(self, key: Features) -> FeatureReadout: ...

    @overload
    def __getitem__(self, key: LensRequest) -> LensResult: ...

    def __getitem__(self, key: Address | Features | LensRequest) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            raise KeyError(self._missing(key)) from None

    def _missing(self, key: object) -> str:
        held = ", ".join(str(k) for k in self) or "nothing"
        if isinstance(key, str):
            parse = "Features.parse" if Features.is_form(key) else "Address.parse"
            return (
                f"{key!r} is a string, and capture results are keyed by Address and Features only, by design "
                "(an Address is never equal to its string: keys stay typed); look it up with "
                f"{parse}({key!r}) or bind what you asked for to a variable. run_with_cache "
                f"returns a Cache, which takes strings. These results hold {held}"
            )
        return f"{key} is not in these results; they hold {held} (keyed as asked for, e.g. a negative layer as given)"


@runtime_checkable
class InterpModel(Protocol):
    """What every backend's model offers. Everything that computes is async.

    Results from :meth:`capture` are plain dicts keyed by :class:`Address`, without a batch
    axis (``[n_tokens, width]``; head addresses ``[n_tokens, heads, d_head]``; attention
    ``[heads, q, k]``), float32 on the CPU.
    """

    backend: str
    info: ModelInfo

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        """Token ids ``[1, n]`` (a list of texts: ``[batch, n_max]``, right-padded)."""
        ...

    def to_string(self, tokens: Any) -> str | list[str]:
        """Text of ids (a 2-D input gives one string per row)."""
        ...

    def to_str_tokens(self, tokens: Any) -> list[str]:
        """One string per token, of a text or of ids."""
        ...

    async def warmup(self) -> None:
        """Build the engine now, on the running loop."""
        ...

    async def capture(
        self,
        token_ids: Sequence[int],
        points: Points,
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Results:
        """Activations at ``points`` over the prompt tokens, and feature readouts
        (:class:`FeatureReadout`) under each :class:`Features` asked for; under the LoRA
        ``adapter`` registered by that name (or an adapter folder), ``None``: the base model."""
        ...

    async def generate(self, token_ids: Sequence[int], *, max_tokens: int, **sampling: Any) -> Completion:
        """Greedy completion unless sampling parameters are given (``adapter=`` as for :meth:`capture`)."""
        ...

    async def capture_generation(
        self,
        token_ids: Sequence[int],
        points: Points,
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> tuple[Completion, Results]:
        """A completion and activations (and readouts) over prompt + every generated token; with
        ``lens=``, a :class:`LensResult` under the request at every position that produced a
        generated token (and the request's prompt positions)."""
        ...

    def stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
        features: Iterable[Any] = (),
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamStep]:
        """Generated tokens one at a time, each with its top-n logprobs (and, with
        ``features=[Features(...)]``, those readouts at the position that produced it; with
        ``lens=LensRequest(...)``, the logit lens's top-k there, per layer)."""
        ...

    async def capture_attention(
        self,
        token_ids: Sequence[int],
        layers: Iterable[int],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Activations:
        """Attention probabilities ``[heads, q, k]`` keyed by ``Address("attn_pattern", L)``,
        under ``steering_spec`` if given."""
        ...

    async def decode_residuals(
        self, acts: torch.Tensor | Mapping[Address, torch.Tensor]
    ) -> torch.Tensor | dict[Address, torch.Tensor]:
        """Final norm + unembedding of residual-stream vectors (the logit lens)."""
        ...

    async def shutdown(self) -> None:
        """Release the model; idempotent, callable from any loop or thread."""
        ...


@runtime_checkable
class BatchCapture(Protocol):
    """A model that captures several prompts in one batched forward."""

    async def capture_batch(
        self,
        rows: Sequence[Sequence[int]],
        points: Points,
        *,
        steering_spec: RowSpecs = None,
        adapter: RowAdapters = None,
    ) -> Results:
        """Activations ``[batch, n_max, width]`` (head addresses ``[batch, n_max, heads,
        d_head]``) over prompts of any lengths, right-padded with zeros; each row equals its
        solo ``capture``. ``steering_spec`` is one spec for every row or a list of one spec (or
        ``None``) per row; ``adapter`` likewise."""
        ...


@runtime_checkable
class BlockingCapture(Protocol):
    """A model whose batched capture can be called without an event loop, blocking the caller."""

    def capture_batch_blocking(
        self,
        rows: Sequence[Sequence[int]],
        points: Points,
        *,
        steering_spec: RowSpecs = None,
        adapter: RowAdapters = None,
    ) -> Results:
        """What :meth:`BatchCapture.capture_batch` returns, from a thread running no event loop
        (the forward may still run on a worker thread of the model's own)."""
        ...


@runtime_checkable
class StaticTaps(Protocol):
    """A model whose capture and write points are fixed before its engine is built
    (``vllm-static``): requests outside the declared set raise ``UndeclaredAddress``."""

    @property
    def static_points(self) -> list[Address]:
        """The declared capture points."""
        ...

    @property
    def static_writes(self) -> list[Address]:
        """The declared write points (where a steering spec may write)."""
        ...

    def configure_static(self, points: Iterable[Any] | str, static_writes: Iterable[Any] | None = None) -> None:
        """Declare the points (and write points) of the engine to build; raises
        ``StaticConfigError`` once the engine exists."""
        ...


@runtime_checkable
class WorkerStats(Protocol):
    """A model served by worker processes that report counters."""

    async def worker_stats(self) -> list[dict[str, int]]:
        """One dict of counters per worker (e.g. ``live_requests``: request state still held)."""
        ...


GradientMetric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""What ``capture_gradients`` differentiates: ``metric(logits, lengths)`` with the logits ``[batch,
n_max, vocab]`` (float32, zero at right-padded positions) and each row's real length ``[batch]``
(int64), to a scalar tensor."""


@runtime_checkable
class GradientCapture(Protocol):
    """A model that backpropagates a metric of its logits to its activations."""

    async def capture_gradients(
        self,
        rows: Sequence[Sequence[int]],
        points: Points,
        metric: GradientMetric,
        *,
        steering_spec: RowSpecs = None,
    ) -> tuple[Results, Results, float]:
        """One forward with autograd over ``rows`` (right-padded), then one backward of
        ``metric``: the activations at ``points`` and the metric's gradient with respect to
        each, both ``[batch, n_max, width]`` (head addresses ``[batch, n_max, heads, d_head]``,
        float32, on the CPU, zero at padded positions), and the metric's value. Steering
        writes apply first: the gradient is with respect to the value after them. The model's
        parameters gather no ``.grad``."""
        ...
