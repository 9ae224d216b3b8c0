"""Bad input on the command line: one clear line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _loadgen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadgen.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _assert_one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loadgen: error:"), result.stderr
    assert fragment in lines[0]


def test_unknown_dataset_kind() -> None:
    result = _loadgen("run", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", "nosuch:/x")
    _assert_one_line_error(result, "unknown dataset kind")


def test_missing_dataset_file(tmp_path) -> None:
    missing = tmp_path / "absent.jsonl"
    dataset = f"mooncake:{missing}"
    result = _loadgen("run", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", dataset)
    _assert_one_line_error(result, "no such file")


def test_unreachable_endpoint(tokenizer_dir) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    result = _loadgen("run", "--endpoint", url, "--model", "m", "--dataset", "random:8:4",
                      "--num-requests", "2", "--tokenizer", str(tokenizer_dir))
    _assert_one_line_error(result, "cannot reach endpoint")


def test_compare_missing_file(tmp_path) -> None:
    result = _loadgen("compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    _assert_one_line_error(result, "cannot read result file")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--goodput", "ttfx:3"], "goodput"),
        (["--max-tokens", "lots"], "--max-tokens"),
        (["--percentiles", "50,abc"], "--percentiles"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--send-token-ids"], "--api completions"),
        (["--trace-timestamps"], "timestamps"),
    ],
)
def test_bad_options_are_clear_errors(extra: list[str], fragment: str, capsys) -> None:
    from loadgen.cli import main

    base = ["run", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", "random:8:4"]
    code = main([*base, *extra])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]


def test_subcommands_are_registered() -> None:
    choices = build_parser()._subparsers._group_actions[0].choices
    assert {"run", "compare"} <= set(choices)
