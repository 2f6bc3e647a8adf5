"""Engine profiles (slots or a shared pool, rates, context) in the cost model, the
history trimmed to an engine's context, engines' error reasons, and engine reports."""

from __future__ import annotations

from collections import Counter

import pytest

from worker.chat.trim import estimate_tokens, trim_to_context
from worker.engines.errors import ENGINE_REFUSED, PROMPT_TOO_LONG, EngineHTTPError, clean_reason
from worker.engines.props import props_shape
from worker.engines.report import Report, chunk_report
from worker.routing.cost import TurnInfo
from worker.routing.lease import EngineSpec, Lease, LoadView
from worker.routing.profile import EngineProfile, Profiles, parse_profile_arg
from worker.routing.router import Router


def _router(n: int, profiles: dict[str, EngineProfile], cap: int = 4) -> Router:
    specs = [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=cap) for i in range(n)]
    return Router(specs, policy="cost_aware", queue=0.0, profiles=Profiles(profiles))


# -- profiles ------------------------------------------------------------------------------


def test_profile_flags_parse_and_refuse_with_a_reason() -> None:
    eid, p = parse_profile_arg("e1=slots:2,ctx:2048,prefill:90,decode:52.5,first_token_timeout:180")
    assert eid == "e1"
    assert p == EngineProfile(slots=2, context_tokens=2048, prefill_tok_per_s=90.0,
                              decode_tok_per_s=52.5, first_token_timeout_s=180.0)  # fmt: skip
    for bad, why in [("e1", "ID=key:value"), ("e1=slots", "unknown entry"),
                     ("e1=speed:3", "unknown entry"), ("e1=slots:two", "wants a number"),
                     ("e1=ctx:0", "must be > 0"), ("e1=prefill:nan", "must be > 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_profile_arg(bad)


def test_flags_win_over_what_the_engine_reported_and_fill_the_rest() -> None:
    p = Profiles({"*": EngineProfile(first_token_timeout_s=120), "e1": EngineProfile(slots=2)})
    p.learn_props("e1", slots=4, context_tokens=4096)
    p.learn_props("e2", slots=3)
    assert p.get("e1") == EngineProfile(slots=2, context_tokens=4096, first_token_timeout_s=120)
    assert p.get("e2") == EngineProfile(slots=3, first_token_timeout_s=120)
    p.learn_turn("e2", computed_tokens=100, prefill_s=1.0, completion_tokens=50, decode_s=1.0)
    p.learn_turn("e2", computed_tokens=200, prefill_s=1.0, completion_tokens=2, decode_s=0.01)
    got = p.get("e2")
    assert got.prefill_tok_per_s == pytest.approx(120.0)  # 100, then 20 % of the way to 200
    assert got.decode_tok_per_s == 50.0  # two tokens are no rate


# -- the cost model on slot engines --------------------------------------------------------


def test_sessions_arriving_one_at_a_time_spread_by_their_ring_position() -> None:
    """Ties went to the first engine: every session that came alone landed on engine 1."""
    r = _router(3, {})
    seen: Counter[str] = Counter()
    for i in range(60):
        key = f"conv-{i}"
        lease = r.route(key, turn=TurnInfo(prompt_tokens=500, key=key))
        assert lease.engine.id == r.preferred(key)
        seen[lease.engine.id] += 1
        lease.release()
    assert len(seen) == 3
    assert min(seen.values()) >= 10


def test_a_slot_engine_never_takes_more_live_sessions_than_slots_while_another_has_room() -> None:
    r = _router(2, {"*": EngineProfile(slots=2)}, cap=8)
    live = [r.route(f"c{i}", turn=TurnInfo(prompt_tokens=300, key=f"c{i}")) for i in range(4)]
    assert Counter(lease.engine.id for lease in live) == {"e0": 2, "e1": 2}
    fifth = r.route("c4", turn=TurnInfo(prompt_tokens=300, key="c4"))  # all slots live: queue
    assert fifth.engine.id in ("e0", "e1")


def test_a_full_slot_engine_is_passed_over_even_for_the_conversation_it_held() -> None:
    """cost_aware put a third live session on an engine with 2 slots (its cache looked
    cheapest) while the other engine held one: those turns waited and recomputed."""
    r = _router(2, {"*": EngineProfile(slots=2)}, cap=8)
    old = r.route("old", turn=TurnInfo(prompt_tokens=2000, key="old"))
    home = old.engine.id
    old.first_token()
    old.release()
    other = "e1" if home == "e0" else "e0"
    live = [r.route(k, avoid=other, turn=TurnInfo(prompt_tokens=50, key=k)) for k in "xy"]
    assert [lease.engine.id for lease in live] == [home, home]  # both its slots are live
    nxt = TurnInfo(prompt_tokens=2400, key="old", prev_engine=home, prev_tokens=2100)
    again = r.route("old", turn=nxt)
    assert again.engine.id == other
    again.release()
    live[0].release()
    # its next turn stays where its last one went (the home slots served x and y since)
    nxt = TurnInfo(prompt_tokens=2800, key="old", prev_engine=other, prev_tokens=2500)
    assert r.route("old", turn=nxt).engine.id == other


def test_a_slot_engine_holds_a_conversation_until_its_slots_served_others() -> None:
    r = _router(2, {"*": EngineProfile(slots=1, prefill_tok_per_s=100)})
    a = r.route("a", turn=TurnInfo(prompt_tokens=400, key="a"))
    home = a.engine.id
    a.release()
    nxt = TurnInfo(prompt_tokens=600, key="a", prev_engine=home, prev_tokens=450)
    back = r.route("a", turn=nxt)
    assert back.engine.id == home
    assert back.reason == "preferred"
    back.release()
    # another conversation takes that engine's only slot: "a" is no longer held there
    other = TurnInfo(prompt_tokens=400, key="b", prev_engine=home, prev_tokens=300)
    b = r.route("b", turn=other)
    assert b.engine.id == home
    b.release()
    later = r.route("a", turn=TurnInfo(prompt_tokens=800, key="a", prev_engine=home,
                                        prev_tokens=700))  # fmt: skip
    assert later.reason != "preferred"


def _evicted_and_back(r: Router, home: str, key: str, other: str, step: int) -> Lease:
    """``key``'s conversation on ``home`` (1 slot), then ``other``'s turn takes that slot,
    then ``key``'s next turn comes back to it (held or not, it is the least busy)."""
    b = r.route(other, turn=TurnInfo(prompt_tokens=400, key=other, prev_engine=home,
                                     prev_tokens=300))  # fmt: skip
    assert b.engine.id == home
    b.release()
    turn = TurnInfo(prompt_tokens=800 + step, key=key, prev_engine=home, prev_tokens=700)
    return r.route(key, turn=turn)


def test_a_slot_engine_that_restores_given_up_conversations_is_costed_as_keeping_them() -> None:
    """Seen on real llama-servers: a slot's conversation, given up to another, was
    reused whole when it came back (llama-server's prompt cache behind its slots,
    --cache-ram, on by default, which /props does not say), while the cost model took it
    as gone and moved conversations between the engines for nothing. After two such
    reports the engine is costed as holding its sessions' histories."""
    profiles = Profiles({"*": EngineProfile(slots=1, prefill_tok_per_s=100)})
    r = Router([EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=4) for i in range(2)],
               policy="cost_aware", queue=0.0, profiles=profiles)  # fmt: skip
    a = r.route("a", turn=TurnInfo(prompt_tokens=400, key="a"))
    home = a.engine.id
    a.release()
    for step in range(2):
        back = _evicted_and_back(r, home, "a", f"b{step}", step)
        assert back.reason != "preferred"  # taken as gone from its slot
        back.cached(690, 800 + step)  # the engine reused the whole history
        back.release()
        assert back.engine.id == home  # the least busy: it came back, to be reported on
    assert profiles.get(home).kv_tokens > 0
    back = _evicted_and_back(r, home, "a", "c", 9)
    assert (back.engine.id, back.reason) == (home, "preferred")
    back.release()


def test_a_reused_system_prompt_is_no_evidence_of_a_prompt_cache() -> None:
    """A follow-up whose slot went to a conversation on the same system prompt reuses
    that prompt only: the engine keeps nothing behind its slots."""
    profiles = Profiles({"*": EngineProfile(slots=1, prefill_tok_per_s=100)})
    r = Router([EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=4) for i in range(2)],
               policy="cost_aware", queue=0.0, profiles=profiles)  # fmt: skip
    a = r.route("a", turn=TurnInfo(prompt_tokens=400, key="a"))
    home = a.engine.id
    a.release()
    for step in range(3):
        back = _evicted_and_back(r, home, "a", f"b{step}", step)
        back.cached(60, 800)  # the system prompt's share, no more
        back.release()
    assert profiles.get(home).kv_tokens == 0


def test_a_follow_up_stays_when_only_its_engine_has_been_measured() -> None:
    """Seen on two real llama-servers: after the first turn the worker knew its engine's
    CPU prefill rate (from the timings) and nothing of the other, whose cost then came
    from the default profile's accelerator, thousands of tokens a second: the follow-up
    went to the unmeasured engine and recomputed its whole history. An engine not
    measured yet is taken to be as fast as its measured peers."""
    profiles = Profiles({"*": EngineProfile(slots=2)})
    r = Router([EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=4) for i in range(2)],
               policy="cost_aware", queue=0.0, profiles=profiles)  # fmt: skip
    a = r.route("a", turn=TurnInfo(prompt_tokens=60, key="a"))
    home = a.engine.id
    a.release()
    profiles.learn_turn(home, computed_tokens=60, prefill_s=0.7, completion_tokens=12,
                        decode_s=0.25)  # fmt: skip
    back = r.route("a", turn=TurnInfo(prompt_tokens=110, key="a", prev_engine=home,
                                      prev_tokens=72))  # fmt: skip
    assert back.engine.id == home, back.reason


# -- history trimmed to the context ----------------------------------------------------------


def _convo(turns: int, chars: int = 300) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        out += [{"role": "user", "content": f"q{i} " + "x" * chars},
                {"role": "assistant", "content": f"a{i} " + "y" * chars}]  # fmt: skip
    return [*out, {"role": "user", "content": "the new question"}]


def test_trimming_drops_whole_oldest_turns_and_keeps_system_and_the_new_message() -> None:
    prompt = _convo(10)
    kept, dropped = trim_to_context(prompt, 900, 128)
    assert dropped > 0
    assert dropped % 2 == 0
    assert kept[0] == prompt[0]
    assert kept[-1] == prompt[-1]
    assert kept[1:-1] == prompt[1 + dropped : -1]  # the newest turns, in order
    assert estimate_tokens(kept) + 128 <= 900
    assert trim_to_context(prompt, 0, 128) == (prompt, 0)  # context unknown: whole
    assert trim_to_context(prompt, 100_000, 128) == (prompt, 0)


def test_a_prompt_that_cannot_fit_keeps_the_system_and_the_new_message() -> None:
    prompt = _convo(3, chars=3000)
    kept, dropped = trim_to_context(prompt, 200, 64)
    assert [m["content"] for m in kept] == ["be brief", "the new question"]
    assert dropped == 6


# -- engines' errors and reports -------------------------------------------------------------


def test_an_engine_context_overflow_is_prompt_too_long_with_its_reason() -> None:
    said = (
        "request (3796 tokens) exceeds the available context size (2048 tokens), try increasing it"
    )
    exc = EngineHTTPError(400, "{}", engine_message=said, engine_type="exceed_context_size_error")
    assert exc.code == PROMPT_TOO_LONG
    assert exc.public_reason == f"engine answered HTTP 400: {said}"
    vllm = "This model's maximum context length is 4096 tokens. However, you requested 5000"
    assert EngineHTTPError(400, "", engine_message=vllm).code == PROMPT_TOO_LONG
    other = EngineHTTPError(400, "", engine_message="'temperature' must be a number")
    assert other.code == ENGINE_REFUSED  # the engine refused it: a retry will not help
    assert EngineHTTPError(503, "", engine_message="context size").code is None


def test_engine_reasons_are_cleaned_and_bounded() -> None:
    raw = "bad\x00 thing\n\n at http://10.0.0.7:8080/v1/x  " + "z" * 500
    out = clean_reason(raw)
    assert "\x00" not in out
    assert "\n" not in out
    assert "10.0.0.7" not in out
    assert out.startswith("bad thing at <url> z")
    assert len(out) == 200


def test_reports_merge_from_every_place_an_engine_says_them() -> None:
    timings = {"cache_n": 30, "prompt_n": 12, "prompt_ms": 120.0}
    r = chunk_report({"timings": timings})
    assert (r.prompt_tokens, r.cached_tokens, r.computed_tokens) == (42, 30, 12)
    r = r.merged(chunk_report({"usage": {"prompt_tokens": 42, "completion_tokens": 9}}))
    assert (r.completion_tokens, r.prefill_s) == (9, 0.12)
    assert Report().empty
    assert chunk_report({"usage": {"prompt_tokens": -1, "completion_tokens": True}}).empty


def test_llama_server_props_give_slots_and_context() -> None:
    said = {"total_slots": 2, "default_generation_settings": {"n_ctx": 2048, "params": {}}}
    assert props_shape(said) == (2, 2048)
    assert props_shape({"total_slots": "x"}) == (0, 0)
    assert props_shape([1, 2]) == (0, 0)


def test_a_conversation_another_worker_routed_is_held_on_the_engine_its_session_names() -> None:
    """Turns go to the workers in turn: a worker that never routed a conversation took
    its slot engine as not holding it, and moved it."""
    r = _router(2, {"*": EngineProfile(slots=2)})
    for home in ("e0", "e1"):
        turn = TurnInfo(prompt_tokens=900, key=f"conv-{home}", prev_engine=home, prev_tokens=800)
        lease = r.route(turn.key, turn=turn)
        assert lease.engine.id == home
        assert lease.reason == "preferred"
        lease.release()


def test_a_follow_up_is_not_kept_off_its_engine_by_its_own_turn_in_a_stale_load_view() -> None:
    """The other workers' report, a quarter second old, may still count the session's
    own previous turn there: a follow-up right after it must not move for that."""
    r = _router(2, {"*": EngineProfile(slots=2)})
    r.apply_load_view(LoadView(others={"e0": 2}, allowance={}))
    turn = TurnInfo(prompt_tokens=900, key="conv", prev_engine="e0", prev_tokens=800)
    lease = r.route("conv", turn=turn)
    assert lease.engine.id == "e0"
    lease.release()
    r.apply_load_view(LoadView(others={"e0": 3}, allowance={}))  # two others really live
    moved = r.route("conv", turn=turn)
    assert moved.engine.id == "e1"
