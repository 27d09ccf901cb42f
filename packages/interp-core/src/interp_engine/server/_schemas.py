"""Request and response bodies of the HTTP API (pydantic models; they make the OpenAPI schema).

Every request model forbids unknown fields, so a misspelt field is a 422 naming it rather than
a silently ignored option, and is strict: a value of the wrong JSON type (``"stream": "yes"``,
``"scale": "2"``) is a 422 too, never coerced.

Feature readouts of an attached SAE (or probe) go in ``points`` next to addresses, as the core's
string form or as an object (:class:`FeaturesBody`)::

    {"text": "The capital of France is",
     "points": ["resid_post.2", "features:res:top8", {"sae": "res", "ids": [3, 17]}]}

and come back under ``features``, keyed by the readout's canonical string form, as plain lists
(:class:`ReadoutOut`; ``[n_tokens, k]`` per readout, ``ids`` ``-1`` where fewer fired)::

    {"token_ids": [...], "activations": {"resid_post.2": {...}},
     "features": {"features:res:top8": {"values": [[...]], "ids": [[...]], "error_norm": [...]},
                  "features:res:ids=3,17": {"values": [[...]], "ids": [[...]], "error_norm": [...]}}}

A steering spec's writes may be feature writes (:class:`FeatureWriteBody`, the core's
``FeatureWrite.to_dict``): ``{"sae": "res", "feature": 17, "op": "clamp", "value": 4.0}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag

from ..steering._writes import Op, param_doc

Format = Literal["json", "safetensors"]


class StrictBody(BaseModel):
    # strict: no coercion ("stream": "yes" or "scale": "2" are errors, not true and 2.0); an int
    # is still a float (JSON has one number type)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EncodedTensor(StrictBody):
    """A float32 tensor: ``data`` is the base64 of its little-endian bytes in C (row-major) order."""

    dtype: Literal["float32"] = "float32"
    shape: list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]] = Field(max_length=8)
    data: str


Floats = list[float] | list[list[float]] | list[list[list[float]]]


def _tensor_kind(value: Any) -> str:
    return "<tensor>" if isinstance(value, (dict, EncodedTensor)) else "<lists>"


TensorValue = Annotated[
    Annotated[EncodedTensor, Tag("<tensor>")] | Annotated[Floats, Tag("<lists>")],
    Discriminator(_tensor_kind),
]
"""A tensor: an encoded one (an object), or nested lists of numbers (up to three levels)."""


_POSITIONS = (
    "'all', 'prompt', 'generated', explicit indices, or a chat span name resolved against the request's messages "
    "('assistant', 'user[-1].last', 'reasoning[0]', 'system.turn')"
)
Positions = Annotated[str, Field(max_length=200)] | list[StrictInt]
"""A write's positions: ``"all"``, ``"prompt"``, ``"generated"``, a chat span name, or indices."""


class WriteBody(StrictBody):
    """One steering write (the core's ``Write.to_dict`` format; ``vector`` may also be an encoded
    tensor, e.g. activations returned by an earlier capture, for activation patching)."""

    address: str = Field(examples=["resid_post.1"])
    vector: TensorValue
    op: Op = "add"
    scale: float = 1.0
    positions: Positions = Field(default="all", description=_POSITIONS)
    heads: list[StrictInt] | None = Field(
        default=None, description="at attn_z/attn_v: the heads written (default every head)", examples=[[0]]
    )
    # the op-specific fields: which ops take each, and what it means, from the core's op registry
    target: TensorValue | None = Field(default=None, description=param_doc("target"))
    lo: float | None = Field(default=None, description=param_doc("lo"))
    hi: float | None = Field(default=None, description=param_doc("hi"))
    max_fraction: float | None = Field(default=None, description=param_doc("max_fraction"))


class FeatureWriteBody(StrictBody):
    """One write by SAE feature (the core's ``FeatureWrite.to_dict`` format): the SAE attached to
    the served model as ``sae`` is named, never sent. With ``f_i(x)`` the feature's activation and
    ``d_i`` its decoder row: ``clamp`` writes ``x + (value - f_i(x)) d_i`` (the SAE's error term
    kept), ``ablate`` is the clamp to 0, ``add`` writes ``x + value * d_i`` (a transcoder's at its
    output address)."""

    sae: str = Field(description="the name the SAE is attached under (GET /v1/model lists them)", examples=["res"])
    feature: StrictInt = Field(ge=0, description="the feature id, 0..d_sae-1", examples=[17])
    op: Literal["clamp", "add", "ablate"] = "clamp"
    value: float = Field(default=0.0, description="clamp: the feature's value; add: the coefficient of d_i")
    positions: Positions = Field(default="all", description=_POSITIONS)


def _write_kind(value: Any) -> str:
    by_feature = isinstance(value, FeatureWriteBody) or (isinstance(value, dict) and "sae" in value)
    return "<feature_write>" if by_feature else "<write>"


AnyWriteBody = Annotated[
    Annotated[WriteBody, Tag("<write>")] | Annotated[FeatureWriteBody, Tag("<feature_write>")],
    Discriminator(_write_kind),
]
"""A write at an address, or (with ``sae``) a write by feature."""


class SteeringBody(StrictBody):
    """A per-request steering spec: ``SteeringSpec.to_dict()`` of the core (writes at addresses
    and writes by SAE feature, applied in order)."""

    writes: list[AnyWriteBody]


class FeaturesBody(StrictBody):
    """A feature readout of the SAE (or probe) attached as ``sae``: the core's
    ``Features.to_dict`` form. At most one of ``top_k`` (the k largest features per token),
    ``ids`` (these features' values) and ``dense`` (every feature); none of them: the top 16.
    ``dtype: "float16"`` halves the bytes a vLLM worker sends (the response is float32 either
    way). Equivalent strings: ``"features:res:top8"``, ``"features:res:ids=3,17"``,
    ``"features:res:dense"`` (``":float16"`` after any)."""

    sae: str = Field(examples=["res"])
    top_k: StrictInt | None = Field(default=None, ge=1, examples=[8])
    ids: list[StrictInt] | None = Field(default=None, examples=[[3, 17]])
    dense: bool = False
    dtype: Literal["float32", "float16"] = "float32"

    def to_dict(self) -> dict[str, Any]:
        """The fields the client set, as ``Features.from_dict`` reads them."""
        return self.model_dump(exclude_unset=True)


def _point_kind(value: Any) -> str:
    return "<readout>" if isinstance(value, (dict, FeaturesBody)) else "<address>"


Point = Annotated[
    Annotated[str, Tag("<address>")] | Annotated[FeaturesBody, Tag("<readout>")],
    Discriminator(_point_kind),
]
"""An address (``"resid_post.2"``), a readout's string form (``"features:res:top8"``) or a
readout object (``{"sae": "res", "top_k": 8}``)."""


class MessageBody(StrictBody):
    """One chat message, as the model's chat template reads it (``role`` and ``content``; the
    optional fields some templates use: ``reasoning_content`` (Qwen 3), ``name``, ``tool_call_id``)."""

    role: str = Field(min_length=1, max_length=64, examples=["user"])
    content: str = Field(examples=["What is the capital of France?"])
    reasoning_content: str | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)

    def to_dict(self) -> dict[str, Any]:
        """The message as the chat template gets it (the fields the client set)."""
        return self.model_dump(exclude_none=True)


class ChatInput(StrictBody):
    messages: list[MessageBody] | None = Field(
        default=None,
        description="or chat messages, formatted by the model's chat template (model.chat_tokens); the answer's "
        "'chat' names each message's span",
        examples=[[{"role": "user", "content": "What is the capital of France?"}]],
    )
    add_generation_prompt: bool = Field(
        default=True, description="with messages: end the prompt with the template's assistant header"
    )
    chat_template: str | None = Field(
        default=None, description="with messages: a Jinja chat template used instead of the model's own"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="with messages: variables passed to the template (enable_thinking, tools, ...)",
        examples=[{"enable_thinking": False}],
    )


class _Prompt(ChatInput):
    token_ids: list[StrictInt] | None = Field(default=None, description="the prompt's token ids")
    text: str | None = Field(default=None, description="or its text (tokenized with model.to_tokens)")
    adapter: str | None = Field(
        default=None,
        max_length=200,
        description="the LoRA adapter to run under: a name the server registered (interp serve --adapter "
        "NAME=PATH; GET /v1/model lists them); null: the base model",
        examples=["ft"],
    )


class _Sampling(StrictBody):
    temperature: float | None = Field(default=None, ge=0, description="0 (the default) is greedy")
    top_k: StrictInt | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = None
    ignore_eos: bool | None = Field(default=None, description="true: generate exactly max_tokens")

    def sampling(self) -> dict[str, Any]:
        """The sampling options the client set (others are left to the backend's defaults)."""
        names = ("temperature", "top_k", "top_p", "seed", "ignore_eos")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


_POINTS = (
    "addresses to capture, and feature readouts of attached SAEs (strings 'features:NAME:top8' or "
    "objects {'sae': NAME, 'top_k': 8}), answered under 'features'"
)


class CaptureRequest(_Prompt):
    points: list[Point] = Field(
        min_length=1, description=_POINTS, examples=[["resid_post.1", "logits"], ["resid_post.1", "features:res:top8"]]
    )
    steering: SteeringBody | None = None
    format: Format = "json"


class LensBody(StrictBody):
    """The logit lens to read while generating (the core's ``LensRequest.to_json``): at ``layers``
    (``resid_post`` of each, negative from the end), the ``top_k`` tokens and probabilities, at
    every position that produces a generated token, and with ``positions`` at those prompt
    positions too (``"prompt"``, indices, or a chat span name such as ``"user[-1].last"``)."""

    layers: list[StrictInt] = Field(min_length=1, examples=[[0, -1]])
    top_k: StrictInt = Field(default=5, ge=1)
    positions: Positions | None = Field(default=None, description="prompt positions to read too")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


class GenerateRequest(_Prompt, _Sampling):
    max_tokens: StrictInt = Field(default=16, ge=1)
    n_logprobs: StrictInt = Field(default=0, ge=0, description="top-n (token_id, logprob) pairs per step")
    stream: bool = Field(default=False, description="server-sent events, one per generated token")
    features: list[Point] | None = Field(
        default=None,
        description="feature readouts (as in points) of each generated token, at the position that produced "
        "it: in each stream event, or in 'steps'",
        examples=[["features:res:top8"]],
    )
    steering: SteeringBody | None = None
    lens: LensBody | None = Field(
        default=None,
        description="the logit lens read while generating: each step's top-k tokens per layer (in each stream "
        "event, or in 'steps'), and with 'positions' the prompt's lens ('prompt_lens', the first event)",
        examples=[{"layers": [0, -1], "top_k": 3}],
    )


class CaptureGenerationRequest(_Prompt, _Sampling):
    points: list[Point] = Field(min_length=1, description=_POINTS)
    max_tokens: StrictInt = Field(default=16, ge=1)
    steering: SteeringBody | None = None
    lens: LensBody | None = Field(
        default=None,
        description="the logit lens read while generating, answered under 'lens' over every position that "
        "produced a token (and the prompt positions asked)",
    )
    format: Format = "json"


class AttentionRequest(_Prompt):
    layers: list[StrictInt] = Field(min_length=1)
    steering: SteeringBody | None = None
    format: Format = "json"


class DecodeRequest(StrictBody):
    activations: TensorValue = Field(description="residual-stream vectors [..., d_model]")
    top_k: StrictInt = Field(default=10, ge=0, description="top tokens per vector")
    return_logits: bool = Field(default=False, description="also return the full logits [..., vocab]")


class TokenizeRequest(ChatInput):
    text: str | None = Field(default=None, description="a text (or messages, formatted by the chat template)")


# -- responses ------------------------------------------------------------------------------


class CompletionOut(BaseModel):
    token_ids: list[int]
    text: str
    finish_reason: str


class ReadoutOut(BaseModel):
    """One feature readout as plain lists: ``values [n_tokens, k]``; ``ids [n_tokens, k]`` (top-k:
    ``-1`` with value 0 where fewer than k fired; ``null`` for a dense readout, whose column j is
    feature j); ``error_norm [n_tokens]``, ``|x - reconstruct(x)|`` (``null`` for probes and
    transcoders). In a stream step, one token's: ``values [k]``, ``ids [k]``, ``error_norm`` a number."""

    values: list[Any]
    ids: list[Any] | None
    error_norm: list[float] | float | None


class SpanOut(BaseModel):
    """A message's (or a reasoning section's) tokens in the prompt: ``start``..``end`` (end
    exclusive) its content, ``turn_start``..``turn_end`` the whole turn with the template's tokens."""

    kind: str = Field(description="'message' or 'reasoning'")
    role: str
    index: int = Field(description="the message's index in messages")
    start: int
    end: int
    turn_start: int
    turn_end: int


class ChatOut(BaseModel):
    """What the positions of a chat prompt mean: each message's span (in order), the reasoning
    sections, where the generation starts (``null`` without a generation prompt) and the
    rendered template."""

    messages: list[SpanOut]
    reasoning: list[SpanOut]
    generation_start: int | None
    text: str


class LensOut(BaseModel):
    """The logit lens at one position: per layer (absolute), the top-k ``ids``, ``probs`` (over
    the whole vocabulary) and ``tokens`` (their text), ``[n_layers][k]``, best first."""

    layers: list[int]
    ids: list[list[int]]
    probs: list[list[float]]
    tokens: list[list[str]]


class LensResultOut(BaseModel):
    """The logit lens at several prompt positions: ``ids``, ``probs``, ``tokens``
    ``[n_layers][n_positions][k]``."""

    layers: list[int]
    positions: list[int]
    ids: list[Any]
    probs: list[Any]
    tokens: list[Any]


class StepOut(BaseModel):
    token_id: int
    text: str
    logprobs: list[tuple[int, float]]
    position: int = Field(
        default=-1, description="the position whose forward pass produced the token (-1: not reported)"
    )
    features: dict[str, dict[str, Any]] | None = Field(
        default=None, description="when features were asked: each readout (a ReadoutOut of one token) by its key"
    )
    lens: LensOut | None = Field(default=None, description="when lens was asked: the lens at position")


class GenerateResponse(CompletionOut):
    steps: list[StepOut] | None = Field(default=None, description="per-token logprobs when n_logprobs > 0")
    chat: ChatOut | None = Field(default=None, description="with messages: the prompt's chat spans")
    prompt_lens: LensResultOut | None = Field(default=None, description="with lens.positions: the prompt's lens")


_FEATURES_OUT = "the feature readouts asked for in points, keyed by their canonical string form (features:res:top8)"


class CaptureResponse(BaseModel):
    token_ids: list[int]
    chat: ChatOut | None = Field(default=None, description="with messages: the prompt's chat spans")
    activations: dict[str, EncodedTensor]
    features: dict[str, ReadoutOut] = Field(default_factory=dict, description=_FEATURES_OUT)


class CaptureGenerationResponse(BaseModel):
    token_ids: list[int] = Field(description="the prompt's ids")
    chat: ChatOut | None = Field(default=None, description="with messages: the prompt's chat spans")
    completion: CompletionOut
    activations: dict[str, EncodedTensor] = Field(description="over prompt + generated tokens")
    features: dict[str, ReadoutOut] = Field(
        default_factory=dict, description=_FEATURES_OUT + ", over prompt + generated tokens"
    )
    lens: LensResultOut | None = Field(default=None, description="with lens: the lens over the generation")


class AttentionResponse(BaseModel):
    token_ids: list[int]
    chat: ChatOut | None = Field(default=None, description="with messages: the prompt's chat spans")
    patterns: dict[str, EncodedTensor] = Field(description="attn_pattern.L -> [heads, q, k]")


class TopTokens(BaseModel):
    token_ids: list[Any] = Field(description="[..., k], best first")
    tokens: list[Any] = Field(description="the text of each token id, [..., k]")
    logits: list[Any]
    logprobs: list[Any]


class DecodeResponse(BaseModel):
    shape: list[int] = Field(description="shape of the logits, [..., vocab]")
    top: TopTokens
    logits: EncodedTensor | None = None


class TokenizeResponse(BaseModel):
    token_ids: list[int]
    str_tokens: list[str]
    chat: ChatOut | None = Field(default=None, description="with messages: the chat spans")


class ErrorOut(BaseModel):
    error: str = Field(description="the error type, e.g. LayerOutOfRange, ValidationError, LimitExceeded")
    message: str
    field: str | None = Field(default=None, description="the request field at fault, when known")
    valid: Any = Field(default=None, description="what would have been accepted, when known")
