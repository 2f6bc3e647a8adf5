"""Pure tests: a malformed request costs one INFO line, not an ERROR with a traceback."""

from __future__ import annotations

import logging
import sys

from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from relay.service.runtime import ClientErrorFilter


def record(exc: BaseException, name: str = "aiohttp.server") -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        name, logging.ERROR, __file__, 1, "Error handling request from %s", ("127.0.0.1",), info
    )


def test_a_malformed_request_becomes_one_info_line_without_traceback() -> None:
    logging.getLogger("aiohttp.server").setLevel(logging.INFO)
    try:
        for exc in (BadHttpMessage("Bad status line 'GET /v1/sessio'"), LineTooLong("x" * 9000)):
            rec = record(exc)
            assert ClientErrorFilter().filter(rec)
            assert (rec.levelno, rec.levelname, rec.exc_info) == (logging.INFO, "INFO", None)
            msg = rec.getMessage()
            assert msg.startswith("Error handling request from 127.0.0.1: 400 ")
            assert "\n" not in msg
            assert len(msg) < 300
    finally:
        logging.getLogger("aiohttp.server").setLevel(logging.NOTSET)


def test_dropped_when_the_logger_is_above_info() -> None:
    logging.getLogger("aiohttp.server").setLevel(logging.WARNING)
    try:
        assert not ClientErrorFilter().filter(record(BadHttpMessage("bad")))
    finally:
        logging.getLogger("aiohttp.server").setLevel(logging.NOTSET)


def test_a_server_bug_keeps_its_error_and_traceback() -> None:
    rec = record(ValueError("our bug"))
    assert ClientErrorFilter().filter(rec)
    assert rec.levelno == logging.ERROR
    assert rec.exc_info is not None
