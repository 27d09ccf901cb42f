"""Request and response bodies of the HTTP API (pydantic models; they make the OpenAPI schema).

Every request model forbids unknown fields, so a misspelt field is a 422 naming it rather than
a silently ignored option.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

Format = Literal["json", "safetensors"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EncodedTensor(_Body):
    """A float32 tensor: ``data`` is the base64 of its little-endian bytes in C (row-major) order."""

    dtype: Literal["float32"] = "float32"
    shape: list[StrictInt]
    data: str


class WriteBody(_Body):
    """One steering write (the core's ``Write.to_dict`` format; ``vector`` may also be an encoded
    tensor, e.g. activations returned by an earlier capture, for activation patching)."""

    address: str = Field(examples=["resid_post.1"])
    vector: list[float] | list[list[float]] | list[list[list[float]]] | EncodedTensor
    op: Literal["add", "set", "ablate", "cap", "rescale", "norm_add", "swap"] = "add"
    scale: float = 1.0
    positions: Literal["all", "prompt", "generated"] | list[StrictInt] = "all"
    heads: list[StrictInt] | None = Field(
        default=None, description="at attn_z/attn_v: the heads written (default every head)", examples=[[0]]
    )
    target: list[float] | list[list[float]] | list[list[list[float]]] | EncodedTensor | None = Field(
        default=None, description="swap only: the direction the component along vector moves onto"
    )
    lo: float | None = Field(default=None, description="cap only: lower bound of the projection x.d")
    hi: float | None = Field(default=None, description="cap only: upper bound of the projection x.d")
    max_fraction: float | None = Field(
        default=None, description="norm_add only: the added vector's norm is at most max_fraction * |x|"
    )


class SteeringBody(_Body):
    """A per-request steering spec: ``SteeringSpec.to_dict()`` of the core."""

    writes: list[WriteBody]


class _Prompt(_Body):
    token_ids: list[StrictInt] | None = Field(default=None, description="the prompt's token ids")
    text: str | None = Field(default=None, description="or its text (tokenized with model.to_tokens)")


class _Sampling(_Body):
    temperature: float | None = Field(default=None, ge=0, description="0 (the default) is greedy")
    top_k: StrictInt | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = None
    ignore_eos: bool | None = Field(default=None, description="true: generate exactly max_tokens")

    def sampling(self) -> dict[str, Any]:
        """The sampling options the client set (others are left to the backend's defaults)."""
        names = ("temperature", "top_k", "top_p", "seed", "ignore_eos")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class CaptureRequest(_Prompt):
    points: list[str] = Field(min_length=1, examples=[["resid_post.1", "logits"]])
    steering: SteeringBody | None = None
    format: Format = "json"


class GenerateRequest(_Prompt, _Sampling):
    max_tokens: StrictInt = Field(default=16, ge=1)
    n_logprobs: StrictInt = Field(default=0, ge=0, description="top-n (token_id, logprob) pairs per step")
    stream: bool = Field(default=False, description="server-sent events, one per generated token")
    steering: SteeringBody | None = None


class CaptureGenerationRequest(_Prompt, _Sampling):
    points: list[str] = Field(min_length=1)
    max_tokens: StrictInt = Field(default=16, ge=1)
    steering: SteeringBody | None = None
    format: Format = "json"


class AttentionRequest(_Prompt):
    layers: list[StrictInt] = Field(min_length=1)
    steering: SteeringBody | None = None
    format: Format = "json"


class DecodeRequest(_Body):
    activations: EncodedTensor | list[float] | list[list[float]] = Field(
        description="residual-stream vectors [..., d_model]"
    )
    top_k: StrictInt = Field(default=10, ge=0, description="top tokens per vector")
    return_logits: bool = Field(default=False, description="also return the full logits [..., vocab]")


class TokenizeRequest(_Body):
    text: str


# -- responses ------------------------------------------------------------------------------


class CompletionOut(BaseModel):
    token_ids: list[int]
    text: str
    finish_reason: str


class StepOut(BaseModel):
    token_id: int
    text: str
    logprobs: list[tuple[int, float]]


class GenerateResponse(CompletionOut):
    steps: list[StepOut] | None = Field(default=None, description="per-token logprobs when n_logprobs > 0")


class CaptureResponse(BaseModel):
    token_ids: list[int]
    activations: dict[str, EncodedTensor]


class CaptureGenerationResponse(BaseModel):
    token_ids: list[int] = Field(description="the prompt's ids")
    completion: CompletionOut
    activations: dict[str, EncodedTensor] = Field(description="over prompt + generated tokens")


class AttentionResponse(BaseModel):
    token_ids: list[int]
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


class ErrorOut(BaseModel):
    error: str = Field(description="the error type, e.g. LayerOutOfRange, ValidationError, LimitExceeded")
    message: str
    field: str | None = Field(default=None, description="the request field at fault, when known")
    valid: Any = Field(default=None, description="what would have been accepted, when known")
