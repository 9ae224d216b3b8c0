"""The argparse types the CLIs and benchmarks share (`shared/config.py`): a bad value is a clear
usage message naming it, never a traceback."""

from __future__ import annotations

import argparse
import math

import pytest

from shared.config import non_negative_int, non_negative_number, non_negative_or_inf, share_of_one


def test_whole_numbers_from_zero():
    assert non_negative_int("0") == 0 and non_negative_int("12") == 12
    for bad in ("-1", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 0"):
            non_negative_int(bad)


def test_finite_numbers_shares_and_inf():
    assert non_negative_number("2.5") == 2.5
    assert share_of_one("0.25") == 0.25 and non_negative_or_inf("inf") == math.inf
    for parse, bad in ((non_negative_number, "nan"), (non_negative_number, "-0.1"), (share_of_one, "1.5"),
                       (non_negative_or_inf, "-inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_a_parser_answers_a_bad_value_with_a_usage_error(capsys):
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--untold-every", type=non_negative_int, default=0)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--untold-every", "-2"])
    assert exit_info.value.code == 2
    assert "--untold-every: must be a whole number >= 0, got -2" in capsys.readouterr().err
