"""The chat controls from Python: stop a turn, load the stored conversation, delete a
session (the worker's routes, docs/openapi.yaml). Each call is one request to any
worker; a refusal raises :class:`ControlRefused` with its status, code and reason.

Order of use (a screen that reloads)::

    page = await load_messages(http, worker_url, sid, token)
    transcript = Transcript(sid); transcript.load(page)
    async for frame in watch(relay_url, sid, token, page["resume_from"], gen=page["gen"]):
        transcript.apply(frame)
    ...
    await cancel(http, worker_url, sid, write_token)          # the Stop button
    await delete_session(http, worker_url, sid, write_token)
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["ControlRefused", "cancel", "delete_session", "load_messages"]


class ControlRefused(Exception):
    """The worker refused: ``status``, ``code`` (the body's ``error``), ``reason`` and
    the whole ``body`` (a 409 ``turn_finished`` names the terminal ``offset``)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.code = str(body.get("error", ""))
        self.reason = str(body.get("reason", ""))
        self.body = body
        super().__init__(f"{status} {self.code}: {self.reason}")


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, token: str, **kw: Any
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with http.request(method, url, headers=headers, **kw) as r:
        body: Any = await r.json(content_type=None) if r.status != 204 else {}
        if r.status >= 400:
            raise ControlRefused(r.status, body if isinstance(body, dict) else {})
        return body if isinstance(body, dict) else {}


async def cancel(
    http: aiohttp.ClientSession, worker_url: str, session: str, token: str, turn: int | None = None
) -> dict[str, Any]:
    """Stop ``turn`` (None: whichever runs or waits). Returns ``{"session", "turn",
    "status": "stopping" | "stopped", "offset"?}``; the turn's ``done`` frame (its
    ``finish_reason`` ``cancelled``) comes on every screen's watch."""
    base = f"{worker_url.rstrip('/')}/v1/sessions/{session}"
    url = f"{base}/cancel" if turn is None else f"{base}/turns/{turn}/cancel"
    return await _call(http, "POST", url, token)


async def load_messages(
    http: aiohttp.ClientSession,
    worker_url: str,
    session: str,
    token: str,
    *,
    limit: int | None = None,
    before: int | None = None,
    ui: bool = False,
) -> dict[str, Any]:
    """A page of the stored conversation (the newest turns first by page): ``messages``,
    and ``resume_from`` + ``gen`` to watch from with no gap and no duplicate."""
    params: dict[str, str] = {}
    if limit is not None:
        params["limit"] = str(limit)
    if before is not None:
        params["before"] = str(before)
    if ui:
        params["format"] = "ui"
    url = f"{worker_url.rstrip('/')}/v1/sessions/{session}/messages"
    return await _call(http, "GET", url, token, params=params)


async def delete_session(
    http: aiohttp.ClientSession, worker_url: str, session: str, token: str
) -> None:
    """Delete the session (its running turn stopped, its keys removed, its streams
    closed on every relay, its tokens refused from then on)."""
    await _call(http, "DELETE", f"{worker_url.rstrip('/')}/v1/sessions/{session}", token)
