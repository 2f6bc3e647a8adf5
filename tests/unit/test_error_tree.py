"""One exception tree, one class per cause: the producer API's names are the transport's
classes (aliases kept so that applications' ``except`` clauses keep working)."""

from __future__ import annotations

import inspect

import pytest

import relay.broker.errors as broker_errors
import relay.producer as producer
import relay.producer.errors as producer_errors
from relay.broker.errors import Fenced, FrameTooLarge, RedisUnavailable, RelayError


def test_the_producer_names_are_the_transport_classes() -> None:
    assert producer.StaleEpoch is Fenced
    assert producer.RedisUnreachable is RedisUnavailable
    assert producer.FrameTooLarge is FrameTooLarge
    assert producer.ProducerError is RelayError


def test_an_except_clause_of_either_name_catches_the_other() -> None:
    with pytest.raises(producer.StaleEpoch):
        raise Fenced("s", 1, 2)
    with pytest.raises(producer.RedisUnreachable):
        raise RedisUnavailable("no answer")
    with pytest.raises(producer.ProducerError):  # every cause, as before
        raise producer.TurnBusy.__new__(producer.TurnBusy)


def _classes(module: object) -> set[type[BaseException]]:
    return {
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__.startswith("relay.")
    }


def test_one_class_per_cause_under_one_root() -> None:
    classes = _classes(broker_errors) | _classes(producer_errors)
    assert all(issubclass(c, RelayError) for c in classes if c.__name__ != "InvalidSessionId")
    # no class of the tree is a subclass made only to rename another one; the one
    # exception: InvalidSession hangs the protocol's InvalidSessionId (relay.protocol
    # imports nothing of the rest of relay, so it cannot hang from RelayError itself)
    for c in classes - {producer_errors.InvalidSession}:
        parents = [b for b in c.__bases__ if b in classes and b is not RelayError]
        assert not parents, f"{c.__name__} re-states {parents[0].__name__}"
