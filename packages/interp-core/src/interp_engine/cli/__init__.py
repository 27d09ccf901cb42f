"""The ``interp`` command: a tour, capture to files, the logit lens, attention, and serving.

    interp demo [MODEL]
    interp capture MODEL TEXT | --input prompts.txt | --chat chat.json --points resid_post.5,... --out acts.safetensors
    interp lens MODEL TEXT [--generate N --layers L,M --top-k K --plot PATH]
    interp attention MODEL TEXT --layer L
    interp features MODEL TEXT --sae NAME_OR_PATH [--top-k K] [--json] [--plot FILE]
    interp harvest MODEL CORPUS OUT --points resid_post.2,... [--sae NAME=PATH] [--context-size N] [--replicas N]
    interp harvest show OUT [--sae NAME] [--feature N] [--html FILE]

TEXT may be replaced by ``--chat FILE.json``: chat messages formatted by the model's chat template.
    interp serve MODEL --backend eager --host 127.0.0.1 --port 8000 [--sae NAME=PATH]

Every command works on any backend (``--backend``) through the model protocol. A mistake in the
input prints one line (``interp: error: ...``) and exits non-zero; ``--help`` on each command
says the rest. ``import interp_engine`` never imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .. import __version__
from .._errors import InterpError
from ._capture import add_capture
from ._common import UserError, add_adapter_option, add_model_options, add_sae_option, load_options, parse_option
from ._demo import add_demo
from ._features import add_features
from ._harvest import add_harvest, add_harvest_show
from ._views import add_attention, add_lens

__all__ = ["main"]

SERVE_HINT = "the HTTP server is not installed: pip install 'interp-core[serve]'"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line (``interp: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        hint = f"see 'interp {command} --help'" if command else "see 'interp --help'"
        self.exit(2, f"interp: error: {message} ({hint})\n")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from ..server import ServerLimits, run
    except ModuleNotFoundError as exc:
        raise UserError(f"{SERVE_HINT} (missing module {exc.name})") from None
    limits = None
    if args.limit:
        known = sorted(f.name for f in dataclasses.fields(ServerLimits))
        unknown = sorted({key for key, _ in args.limit} - set(known))
        if unknown:
            raise UserError(f"unknown server limit {', '.join(unknown)}; valid: {', '.join(known)}")
        try:
            limits = ServerLimits(**dict(args.limit))
        except (TypeError, ValueError) as exc:
            raise UserError(str(exc)) from None
    api_key = None
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as handle:
                api_key = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the API key file {args.api_key_file}: {exc}") from None
        if not api_key:
            raise UserError(f"the API key file {args.api_key_file} is empty")
    extra: dict[str, Any] = {"insecure_no_auth": True} if args.insecure_no_auth else {}
    if args.trust_request_chat_template:
        extra["trust_request_chat_template"] = True
    try:
        run(
            args.model,
            backend=args.backend,
            host=args.host,
            port=args.port,
            limits=limits,
            api_key=api_key,
            **extra,
            **load_options(args),
        )
    except ValueError as exc:  # a key that cannot travel in a header
        if isinstance(exc, InterpError):
            raise
        raise UserError(f"bad API key: {exc}") from None
    return 0


def add_serve(sub: Any) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model over HTTP (needs interp-core[serve])",
        description="Serve MODEL over HTTP with interp_engine.server (install interp-core[serve]). "
        "Binds to the loopback interface unless --host says otherwise; any other address needs an API key "
        "(--api-key-file, or $INTERP_API_KEY) that clients send as 'Authorization: Bearer <key>', or an explicit "
        "--insecure-no-auth. SAEs given with --sae are attached "
        "before the engine is built: requests read their features (points: features:NAME:top8) and steer "
        "by feature ({'sae': NAME, 'feature': i, 'op': 'clamp', 'value': v}).",
        epilog="example: interp serve path/to/model --backend vllm --port 8000 --limit max_body_bytes=1048576 "
        "--sae res=path/to/sae",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--limit",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="a server limit (repeatable), e.g. --limit max_body_bytes=1048576",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="a file holding the API key every request but /v1/health must send as 'Authorization: Bearer <key>' "
        "(default: $INTERP_API_KEY; none: no authentication, loopback only)",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches the port can use the model)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run the Jinja chat templates requests send (chat_template); off by default, as a template is code "
        "whose time and memory the server cannot bound",
    )
    add_sae_option(parser)
    add_adapter_option(parser)
    add_model_options(parser)
    parser.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="interp",
        description="interp-engine on the command line: capture, logit lens, attention, SAE features, steering, "
        "serving.",
        epilog="Models are local HF directories, hub ids or interp:tiny. Addresses are interp-engine's "
        "(resid_post.5) or TransformerLens hook names (blocks.5.hook_resid_post).",
    )
    parser.add_argument("--version", action="version", version=f"interp-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo(sub)
    add_capture(sub)
    add_lens(sub)
    add_attention(sub)
    add_features(sub)
    add_harvest(sub)
    add_harvest_show(sub)
    add_serve(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


_NEGATIVE_LIST = re.compile(r"-[0-9]+(,-?[0-9]+)*")
LIST_OPTIONS = ("--positions",)
"""Options whose value is a comma-separated list of integers that may start with a minus sign."""


def join_negative_lists(argv: Sequence[str]) -> list[str]:
    """``--positions -3,-2,-1`` as ``--positions=-3,-2,-1``: argparse reads a value that starts
    with ``-`` and is not one negative number as an option, and refuses the line."""
    out: list[str] = []
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            out.extend(args[index:])
            break
        following = args[index + 1] if index + 1 < len(args) else None
        if arg in LIST_OPTIONS and following is not None and _NEGATIVE_LIST.fullmatch(following):
            out.append(f"{arg}={following}")
            index += 2
            continue
        out.append(arg)
        index += 1
    return out


def harvest_show(argv: Sequence[str]) -> list[str]:
    """``interp harvest show ...`` as the ``harvest-show`` command (``interp harvest MODEL ...``
    takes its model first: a model folder named ``show`` is ``./show``)."""
    args = list(argv)
    if args[:2] == ["harvest", "show"]:
        return ["harvest-show", *args[2:]]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``interp`` command; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(harvest_show(join_negative_lists(sys.argv[1:] if argv is None else argv)))
    if args.command is None:
        parser.error("choose a command: demo, capture, lens, attention, features, harvest or serve")
    try:
        status: int = args.func(args)
    except (UserError, InterpError, OSError) as exc:
        print(f"interp: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interp: interrupted (interp capture resumes when run again)", file=sys.stderr)
        return 130
    return status
