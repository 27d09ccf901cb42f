"""The ``interp`` command with chat prompts (``--chat FILE.json``) and the live logit lens
(``interp lens MODEL TEXT --generate N``), in process on ``interp:tiny`` (eager), each checked
against the model called directly; bad chat files and options are one line, status 1."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import torch
from safetensors import safe_open

from interp_engine import Address, Cache, LensRequest
from interp_engine.cli import main
from interp_engine.cli._common import show_token
from interp_testkit.chat_templates import ROLE_TAG_TEMPLATE, SAMPLE_CONVERSATION

TEMPLATE = ROLE_TAG_TEMPLATE  # given as the template override
MESSAGES = SAMPLE_CONVERSATION
PNG = b"\x89PNG\r\n\x1a\n"
TEXT = "The capital of France is"


@pytest.fixture
def chat_file(tmp_path: pathlib.Path) -> pathlib.Path:
    """The chat with its own template (the object form of --chat)."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": MESSAGES, "chat_template": TEMPLATE}))
    return path


def interp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def chat_of(direct: Any) -> Any:
    return direct.chat_tokens(MESSAGES, template=TEMPLATE)


# -- --chat wherever a command takes TEXT ----------------------------------------------------------


def test_lens_of_a_chat_names_its_spans(
    capsys: pytest.CaptureFixture[str], direct: Any, chat_file: pathlib.Path
) -> None:
    chat = chat_of(direct)
    status, out, err = interp(capsys, "lens", "interp:tiny", "--chat", str(chat_file), "--no-plots")
    assert status == 0, err
    assert "chat of 4 messages" in out and f"generation starts at {len(chat)}" in out
    for span in chat.messages:
        assert f"{span.index} {span.role:<10} tokens {span.start}..{span.end - 1}" in out
    assert f"logit lens of {len(chat)} tokens" in out
    # --positions takes a span name with --chat: the grid's columns are that span's tokens
    status, out, err = interp(
        capsys, "lens", "interp:tiny", "--chat", str(chat_file), "--positions", "user[-1]", "--no-plots"
    )
    assert status == 0, err
    header = next(line for line in out.splitlines() if line.startswith("layer "))
    tokens = direct.to_str_tokens(chat.ids)
    expected = [f"{p}:{show_token(tokens[p], 12)}" for p in chat.positions("user[-1]")]
    assert all(col in header for col in expected)
    assert [int(p) for p in re.findall(r"(?:^|\s)(\d+):['\"]", header)] == chat.positions("user[-1]")


def test_the_models_own_template_from_a_list_file(
    capsys: pytest.CaptureFixture[str], direct: Any, tmp_path: pathlib.Path
) -> None:
    """A plain list of messages uses the model's template (interp:tiny ships one)."""
    path = tmp_path / "list.json"
    path.write_text(json.dumps(MESSAGES))
    chat = direct.chat_tokens(MESSAGES)
    status, out, err = interp(capsys, "lens", "interp:tiny", "--chat", str(path), "--no-plots")
    assert status == 0, err
    assert f"logit lens of {len(chat)} tokens" in out


def test_capture_of_a_chat_keeps_its_spans(
    capsys: pytest.CaptureFixture[str], direct: Any, chat_file: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    chat = chat_of(direct)
    out_path = tmp_path / "acts.safetensors"
    status, _, err = interp(
        capsys, "capture", "interp:tiny", "--chat", str(chat_file), "--points", "resid_post.1", "--out", str(out_path)
    )
    assert status == 0, err
    cache = Cache.load(out_path)
    expected = direct.capture(chat, ["resid_post.1"])[Address("resid_post", 1)]
    assert torch.equal(cache["resid_post.1"][0], expected) and cache.lengths.tolist() == [len(chat)]
    with safe_open(str(out_path), "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["interp.token_ids"]) == [chat.ids]
    assert json.loads(metadata["interp.prompts"]) == [chat.text]
    assert json.loads(metadata["interp.chat"]) == [chat.to_json()]


def test_attention_and_features_of_a_chat(
    capsys: pytest.CaptureFixture[str], direct: Any, chat_file: pathlib.Path
) -> None:
    chat = chat_of(direct)
    status, out, err = interp(
        capsys, "attention", "interp:tiny", "--chat", str(chat_file), "--layer", "0", "--no-plots"
    )
    assert status == 0, err
    assert f"over {len(chat)} tokens" in out
    status, out, err = interp(
        capsys, "features", "interp:tiny", "--chat", str(chat_file), "--sae", "interp:tiny-sae", "--json"
    )
    assert status == 0, err
    document = json.loads(out)
    assert [t["token_id"] for t in document["tokens"]] == chat.ids


# -- the live lens -------------------------------------------------------------------------------


def _rows(out: str) -> list[str]:
    """The live table's rows (after the header and its rule)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_lens_generate_prints_a_row_per_token_and_a_plot(
    capsys: pytest.CaptureFixture[str], direct: Any, tmp_path: pathlib.Path
) -> None:
    plot = tmp_path / "live.png"
    status, out, err = interp(
        capsys, "lens", "interp:tiny", TEXT, "--generate", "5", "--layers", "0,-1", "--top-k", "3", "--plot", str(plot)
    )
    assert status == 0, err
    ids = direct.to_tokens(TEXT)[0].tolist()
    steps = list(direct.stream(ids, max_tokens=5, lens=LensRequest([0, 3], top_k=3)))
    rows = _rows(out)
    assert len(rows) == 5
    header = next(line for line in out.splitlines() if line.startswith("step"))
    assert header.split() == ["step", "pos", "token", "L0", "L3"]
    for index, (row, step) in enumerate(zip(rows, steps, strict=True)):
        assert row.split()[:2] == [str(index), str(step.position)]
        assert show_token(step.text, 16) in row
        assert step.lens is not None
        for layer_row in range(2):
            name = direct.to_str_tokens([int(step.lens.ids[layer_row, 0])])[0]
            assert f"{show_token(name, 14)} {float(step.lens.probs[layer_row, 0]):.2f}" in row
    assert f"generated: {''.join(s.text for s in steps)!r}" in out
    assert plot.read_bytes()[:8] == PNG and f"wrote {plot}" in out


def test_lens_generate_of_a_chat_shows_the_prompt_lens_at_a_span(
    capsys: pytest.CaptureFixture[str], direct: Any, chat_file: pathlib.Path
) -> None:
    chat = chat_of(direct)
    status, out, err = interp(
        capsys,
        "lens",
        "interp:tiny",
        "--chat",
        str(chat_file),
        "--generate",
        "3",
        "--positions",
        "user[-1].last",
        "--no-plots",
    )
    assert status == 0, err
    (position,) = chat.positions("user[-1].last")
    assert "the prompt's lens at 1 position:" in out
    grid_header = next(line for line in out.splitlines() if line.startswith("layer "))
    assert grid_header.split()[1].startswith(f"{position}:") and len(grid_header.split()) == 2
    rows = _rows(out)
    assert len(rows) == 3 and rows[0].split()[1] == str(len(chat) - 1)
    # the default layers of a 4-layer model: all of them
    assert next(line for line in out.splitlines() if line.startswith("step")).split()[3:] == ["L0", "L1", "L2", "L3"]


# -- mistakes: one line, status 1 ----------------------------------------------------------------


def _bad_files(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    files = {
        "not json": "{",
        "not a list": json.dumps({"role": "user", "content": "x"}),
        "empty": "[]",
        "unknown key": json.dumps({"messages": MESSAGES, "tools": []}),
        "bad generation flag": json.dumps({"messages": MESSAGES, "add_generation_prompt": "yes"}),
        "bad message": json.dumps({"messages": [{"role": "user"}], "chat_template": TEMPLATE}),
        "template raises": json.dumps({"messages": MESSAGES, "chat_template": "{{ raise_exception('no') }}"}),
    }
    out = {}
    for name, text in files.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(text)
        out[name] = path
    return out


def test_bad_chat_files_and_options_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, chat_file: pathlib.Path
) -> None:
    for name, path in _bad_files(tmp_path).items():
        status, _, err = interp(capsys, "lens", "interp:tiny", "--chat", str(path), "--no-plots")
        lines = [line for line in err.splitlines() if line.startswith("interp")]
        assert status == 1 and len(lines) == 1 and lines[0].startswith("interp: error: "), (name, err)
    cases = [
        ("lens", "interp:tiny", "--chat", str(tmp_path / "missing.json")),
        ("lens", "interp:tiny", TEXT, "--chat", str(chat_file)),
        ("lens", "interp:tiny"),
        ("lens", "interp:tiny", TEXT, "--generate", "0"),
        ("lens", "interp:tiny", TEXT, "--generate", "2", "--layers", "9"),
        ("lens", "interp:tiny", TEXT, "--generate", "2", "--layers", "1,-3"),
        ("lens", "interp:tiny", TEXT, "--generate", "2", "--layers", "a"),
        ("lens", "interp:tiny", TEXT, "--layers", "1"),
        ("lens", "interp:tiny", TEXT, "--generate", "2", "--plot", str(tmp_path / "x.notaformat")),
        ("lens", "interp:tiny", "--chat", str(chat_file), "--positions", "tool[0]", "--no-plots"),
        ("capture", "interp:tiny", TEXT, "--chat", str(chat_file), "--points", "embed"),
        ("attention", "interp:tiny", "--layer", "0"),
    ]
    for argv in cases:
        status, _, err = interp(capsys, *argv)
        lines = [line for line in err.splitlines() if line.startswith("interp")]
        assert status == 1 and len(lines) == 1 and lines[0].startswith("interp: error: "), (argv, err)


def test_serve_passes_the_trust_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import interp_engine.server

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(interp_engine.server, "run", lambda model, **kwargs: calls.append(kwargs))
    assert interp(capsys, "serve", "interp:tiny")[0] == 0
    assert "trust_request_chat_template" not in calls[-1]
    assert interp(capsys, "serve", "interp:tiny", "--trust-request-chat-template")[0] == 0
    assert calls[-1]["trust_request_chat_template"] is True
