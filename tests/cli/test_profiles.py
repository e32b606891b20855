"""``foudre serve --profile``: a scenario's engine options as defaults that flags override."""

from __future__ import annotations

import argparse

import pytest

from foudre.cli import _apply_profile, build_parser
from foudre.engine.options import PROFILES, engine_config_from, profile_defaults


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    args = ["serve", *argv]
    _apply_profile(parser, args)
    return parser.parse_args(args)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_sets_its_options(name: str) -> None:
    args = _serve_args("--profile", name, "--model", "m")
    config = engine_config_from(args)
    for field, value in profile_defaults(name, "m").items():
        assert getattr(config, field) == value, field
    assert sorted(args.profile_fields) == sorted(profile_defaults(name, "m"))


def test_flags_override_the_profile() -> None:
    args = _serve_args("--profile", "edge", "--quantization", "int8", "--max-num-seqs=3")
    config = engine_config_from(args)
    assert config.quantization == "int8" and config.max_num_seqs == 3
    assert config.kv_cache_dtype == "int8"  # the rest of the profile stays


def test_realtime_speculates_with_a_given_draft_for_a_request_alone() -> None:
    plain = engine_config_from(_serve_args("--profile", "realtime"))
    assert plain.speculative_method is None and plain.speculative_max_batch_size == 1
    drafted = engine_config_from(
        _serve_args("--profile", "realtime", "--speculative-model", "d", "--model", "m")
    )
    assert drafted.speculative_method == "draft" and drafted.speculative_max_batch_size == 1
    on = engine_config_from(_serve_args("--profile", "realtime", "--speculative-method", "draft"))
    assert on.speculative_method == "draft"
    off = engine_config_from(
        _serve_args("--speculative-model", "d", "--speculative-method", "none")
    )
    assert off.speculative_method is None  # drafting turned off by its flag


def test_no_profile_keeps_the_defaults_and_unknown_ones_are_refused() -> None:
    assert engine_config_from(_serve_args()) == engine_config_from(
        build_parser().parse_args(["serve"])
    )
    with pytest.raises(SystemExit):
        _serve_args("--profile", "turbo")
    with pytest.raises(ValueError, match="unknown profile"):
        profile_defaults("turbo", None)
