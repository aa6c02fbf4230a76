"""A short shared token on a coordinator reachable from other machines is warned about (it signs every message:
one frame seen on the network lets it be guessed offline); on a loopback address, or long enough, nothing is said."""
from __future__ import annotations

import argparse
import logging

import pytest

from model_parallel.cli.coordinator import MIN_TOKEN_BYTES, _coordinator_token
from model_parallel.coordinator.protocol import TOKEN_ENV


def _token(host: str, token: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="model_parallel.cli.coordinator"):
        got, where = _coordinator_token(argparse.Namespace(token=token, token_file=None, host=host))
    assert (got, where) == (token.encode(), "--token")
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_short_token_on_an_open_address_is_warned_about(caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    warnings = _token("0.0.0.0", "s3cret", caplog, monkeypatch)
    assert len(warnings) == 1 and "6 bytes" in warnings[0] and "0.0.0.0" in warnings[0]
    assert "secrets.token_hex(16)" in warnings[0]
    assert _token("node7.cluster", "s3cret", caplog, monkeypatch)  # a host name may be any interface


@pytest.mark.parametrize("host, token", [("127.0.0.1", "s3cret"), ("::1", "s3cret"), ("localhost", "s3cret"),
                                         ("0.0.0.0", "x" * MIN_TOKEN_BYTES)])
def test_loopback_or_long_enough_says_nothing(host: str, token: str, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert _token(host, token, caplog, monkeypatch) == []
