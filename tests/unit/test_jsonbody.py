"""The one bounded JSON-body reader: media type, size, parse, depth and shape, each a
clear 400 / 413 / 415 with a reason (never a traceback), answered in each front's
convention."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from unittest import mock

import orjson
import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from relay.protocol.codes import Refusal
from relay.service.httpbody import read_body, read_json, refused, refused_openai
from relay.service.jsonbody import MAX_DEPTH, BodyRefused, ClientGone, parse_json


def test_an_object_is_read() -> None:
    assert parse_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert parse_json(b"[1]", want_object=False) == [1]
    assert parse_json(b"  ", empty={}) == {}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "malformed_json"),
        (b"{", "malformed_json"),
        (b'{"a": 1,}', "malformed_json"),
        (b"\xff\xfe\x00{", "malformed_json"),
        (b'{"a": NaN}', "malformed_json"),
        (b"[" * 5000 + b"]" * 5000, "malformed_json"),  # past orjson's own limit
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "malformed_json"),  # past ours
        (b"[]", "invalid_body"),
        (b'"hi"', "invalid_body"),
        (b"null", "invalid_body"),
    ],
)
def test_what_is_not_a_body_is_a_400_with_a_reason(raw: bytes, code: str) -> None:
    with pytest.raises(BodyRefused) as info:
        parse_json(raw)
    assert (info.value.status, info.value.code, bool(info.value.reason)) == (400, code, True)


def test_a_deep_body_is_refused_by_the_standard_parser_too() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads would raise RecursionError
    with pytest.raises(BodyRefused, match=r"not valid JSON|nested"):
        parse_json(deep, want_object=False, loads=json.loads)
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(ok, want_object=False, loads=json.loads) is not None


def _request(
    body: bytes, ctype: str = "application/json", length: bool = True, app: Any = None
) -> Any:
    headers = {"Content-Type": ctype}
    if length:
        headers["Content-Length"] = str(len(body))
    payload = streams.StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    return make_mocked_request("POST", "/x", headers=headers, payload=payload, app=app)


async def test_the_reader_bounds_the_size_and_checks_the_media_type() -> None:
    assert await read_json(_request(b'{"a": 1}'), 100) == {"a": 1}
    cases = [
        (_request(b'{"a": 1}', "text/plain"), 415, "unsupported_media_type"),
        (_request(b"x" * 101), 413, "body_too_large"),  # by its Content-Length
        (_request(b"x" * 101, length=False), 413, "body_too_large"),  # as it arrives
    ]
    for request, status, code in cases:
        with pytest.raises(BodyRefused) as info:
            await read_body(request, 100)
        assert (info.value.status, info.value.code) == (status, code)


def test_each_convention_answers_a_refusal_its_way() -> None:
    r = BodyRefused(413, Refusal.BODY_TOO_LARGE, "too big")
    own = refused(r)
    assert own.status == 413
    assert isinstance(own.body, bytes)
    assert orjson.loads(own.body) == {"error": "body_too_large", "reason": "too big"}
    oa = refused_openai(r)
    assert isinstance(oa.body, bytes)
    assert orjson.loads(oa.body) == {"error": {"message": "too big", "type":
                                     "invalid_request_error", "param": None,
                                     "code": "body_too_large"}}  # fmt: skip
    assert refused(ClientGone()).status == refused_openai(ClientGone()).status == 400


async def test_the_jobs_route_refuses_an_unreadable_body_with_its_code() -> None:
    """The jobs front (no RabbitMQ needed: the body is refused before the queue)."""
    from aiohttp import web

    from worker.access import WorkerAccess
    from worker.jobs.api import JOBS, JobsApi, submit_job

    app = web.Application()
    none: Any = None  # the refused bodies never reach the store or the queue
    app[JOBS] = JobsApi(store=none, submitter=none, access=WorkerAccess(None), api_keys=(),
                        default_max_tokens=8, max_tokens_limit=8, max_prompt_chars=8,
                        max_body_bytes=16)  # fmt: skip
    for body, ctype, status, code in [
        (b"{", "application/json", 400, "malformed_json"),
        (b'{"prompt": "' + b"x" * 20 + b'"}', "application/json", 413, "body_too_large"),
        (b"{}", "text/plain", 415, "unsupported_media_type"),
    ]:
        resp = await submit_job(_request(body, ctype, app=app))
        assert isinstance(resp, web.Response)
        assert isinstance(resp.body, bytes)
        assert (resp.status, orjson.loads(resp.body)["error"]) == (status, code)
