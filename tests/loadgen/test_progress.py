"""Progress on stderr: a bar on a terminal, periodic plain lines in a log, nothing when off; prompt
preparation reports too (it can take a minute on long traces)."""

from __future__ import annotations

import io

from loadgen.client import EndpointConfig
from loadgen.progress import Progress, choose_mode
from loadgen.runner import BenchmarkConfig, prepare_requests
from loadgen.schedule import SchedulePlan


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_mode_follows_the_stream() -> None:
    assert choose_mode(False, _Terminal()) == "bar"
    assert choose_mode(False, io.StringIO()) == "lines"
    assert choose_mode(True, _Terminal()) == "off"


def test_lines_come_every_interval_and_at_the_end() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("sending", 10, "lines", interval_s=5.0, stream=out, clock=clock)
    progress.advance(failed=0, rejected=0)
    clock.now += 4.9
    progress.advance(failed=1, rejected=0)
    assert out.getvalue() == ""  # not before the interval
    clock.now += 0.2
    progress.advance(rejected=2)
    clock.now += 6.0
    progress.tick()  # nothing finished, but time passed: still a line
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "loadgen: sending: 3/10 req (30%), 1 failed, 2 rejected, after 5 s",
        "loadgen: sending: 3/10 req (30%), 1 failed, 2 rejected, after 11 s",
        "loadgen: sending: 3/10 req (30%), 1 failed, 2 rejected, done in 11 s",
    ]


def test_bar_on_a_terminal_and_silence_when_off() -> None:
    terminal, quiet = _Terminal(), io.StringIO()
    for stream, mode in ((terminal, "bar"), (quiet, "off")):
        progress = Progress("sending", 3, mode, stream=stream)
        progress.advance(3)
        progress.close()
    assert "3/3" in terminal.getvalue() and "\r" in terminal.getvalue()
    assert quiet.getvalue() == ""


def test_prompt_preparation_reports_its_steps_and_progress(tokenizer_dir, capsys) -> None:
    config = BenchmarkConfig(
        endpoint=EndpointConfig("http://unused", "m"), dataset="random:20:4", plan=SchedulePlan(),
        tokenizer=str(tokenizer_dir), num_requests=7, progress="lines", progress_interval_s=0.0,
    )
    requests = prepare_requests(config)
    err = capsys.readouterr().err.splitlines()
    assert len(requests) == 7
    assert err[0] == f"loadgen: loading tokenizer {tokenizer_dir}"
    assert "loadgen: reading dataset random:20:4" in err
    assert any(line.startswith("loadgen: preparing prompts: 1/7 prompt (14%)") for line in err)
    assert err[-1].startswith("loadgen: preparing prompts: 7/7 prompt (100%), done in")


def test_prompt_preparation_is_silent_when_progress_is_off(tokenizer_dir, capsys) -> None:
    config = BenchmarkConfig(endpoint=EndpointConfig("http://unused", "m"), dataset="random:20:4",
                             tokenizer=str(tokenizer_dir), num_requests=3)
    prepare_requests(config)
    assert capsys.readouterr().err == ""


async def test_a_run_in_a_log_prints_plain_progress_lines(tokenizer_dir, capsys) -> None:
    import asyncio

    from loadgen.cli import main

    from .fake_server import FakeBehaviour, FakeServer

    async with FakeServer(FakeBehaviour(chunks=2, reject_every=3)) as server:
        argv = ["run", "--endpoint", server.url, "--model", "fake-model", "--dataset", "random:8:2",
                "--tokenizer", str(tokenizer_dir), "--num-requests", "6", "--request-rate", "100"]
        assert await asyncio.to_thread(main, argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err  # stderr is not a terminal here: lines, no bar
    assert "loadgen: sending: 6/6 req (100%), 2 rejected, done in" in err
