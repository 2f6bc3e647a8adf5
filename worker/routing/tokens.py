"""Pure: a prompt as the engine sees it (token ids) and its blocks' keys in the index.

What it is for: the engine hashes token ids, the router sees chat messages. To look a new
prompt up in the block index (:mod:`worker.routing.blockindex`) with no round trip, the
worker renders the messages with the served model's chat template and tokenizer, as
llm-d's precise scorer does, and keys the full blocks by :func:`block_keys`. A tokenizer is
a function ``messages -> token ids`` (:data:`Tokenizer`). Why a tokenizer, not the token
ids an engine returns (vLLM's ``return_token_ids``): those come after a turn, so they
cover a session's later turns (which the estimate already sends to the session's engine)
but never a first turn behind a shared system prompt, where precise routing wins most.

The one tokenizer here is the mock engine's (``python -m devstack engine`` renders prompts
with :func:`prompt_tokens` and keys its cache on :func:`prompt_ids`, so the router and the
engine agree by construction): a toy chat template (``<|role|>`` + the content's tokens +
``<|end|>`` per message, then ``<|assistant|>``), tokens the ``\\w+`` runs and single
non-space symbols, each token's id the first 31 bits of its blake2b digest. For any other
model the worker asks an engine serving it (:mod:`worker.engines.tokenizer`, a
:data:`PromptTokenizer`: llama-server's ``/apply-template`` and ``/tokenize``, vLLM's
``/tokenize``).

Keys: the index does not use the engine's block hashes (vLLM's depend on its hash
algorithm and a per-process seed unless ``PYTHONHASHSEED`` is set) but its own chain over
the token ids each ``BlockStored`` event carries: ``key = hash((parent key, block's
tokens))``, the first block's parent 0. Python hashes a tuple of ints the same in every
process (no seed), 64 bits; a collision costs a wrong estimate, never a wrong reply.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Final

__all__ = [
    "MOCK_MODEL",
    "PromptTokenizer",
    "Tokenizer",
    "block_keys",
    "chain_key",
    "clear_cache",
    "message_text",
    "prompt_ids",
    "prompt_tokens",
    "token_id",
    "tokenize",
]

Tokenizer = Callable[[Sequence[Mapping[str, object]]], list[int]]
# a tokenizer that asks (the served model's, worker.engines.tokenizer): None when it could
# not answer in time
PromptTokenizer = Callable[[Sequence[Mapping[str, object]]], Awaitable[list[int] | None]]
MOCK_MODEL: Final = "tokenrelay-mock"  # the model the mock engine serves with this tokenizer

_TOKEN_RE: Final = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Split text into tokens: runs of word characters and single other symbols."""
    return _TOKEN_RE.findall(text)


def message_text(content: object) -> str:
    """The text of an OpenAI message ``content``: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return " ".join(parts)
    return ""


def prompt_tokens(messages: Iterable[Mapping[str, object]]) -> list[str]:
    """Render chat messages with the toy template and tokenise them."""
    tokens: list[str] = []
    for message in messages:
        tokens.append(f"<|{message.get('role', 'user')}|>")
        tokens.extend(tokenize(message_text(message.get("content"))))
        tokens.append("<|end|>")
    tokens.append("<|assistant|>")
    return tokens


@lru_cache(maxsize=65_536)
def token_id(token: str) -> int:
    """The mock model's id of one token (deterministic, no vocabulary file)."""
    digest = hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def prompt_ids(messages: Sequence[Mapping[str, object]]) -> list[int]:
    """The mock model's :data:`Tokenizer`: the rendered prompt as token ids (each
    message's ids are cached: a session's history and a system prompt come back every
    turn)."""
    ids: list[int] = []
    for message in messages:
        ids += _message_ids(str(message.get("role", "user")), message_text(message.get("content")))
    ids.append(_ASSISTANT)
    return ids


def clear_cache() -> None:
    """Forget the cached messages (a benchmark's cold start)."""
    _message_ids.cache_clear()


@lru_cache(maxsize=16_384)
def _message_ids(role: str, text: str) -> tuple[int, ...]:
    return (token_id(f"<|{role}|>"), *map(token_id, tokenize(text)), token_id("<|end|>"))


_ASSISTANT: Final = token_id("<|assistant|>")


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """The index's key of one full block after the block keyed ``parent`` (0: the first)."""
    return hash((parent, tuple(tokens)))


def block_keys(ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Keys of the full blocks of ``ids`` (a partial tail block has none)."""
    keys: list[int] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start : start + block_size])))
        keys.append(parent)
    return keys
