"""How long the mock engine's replies are: a distribution like real chat replies.

Pure (stdlib only). Real chat replies run to hundreds of tokens with a long tail (a
public conversation trace averages about 340 output tokens); a fixed short reply would
make every drill and soak stream for about a second. The length is drawn from a
log-normal distribution whose mean is ``mean`` tokens, clipped to ``min_tokens`` ..
``max_tokens``, seeded by a hash of the prompt: the same prompt always gets the same
length (the mock engine's replies stay deterministic per prompt).

Order of use: ``ReplyLength(mean=300, max_tokens=2000)`` once per engine, then
``dist.length(prompt_tokens)`` per request.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReplyLength"]


@dataclass(frozen=True, slots=True)
class ReplyLength:
    """Log-normal reply lengths: ``mean`` tokens on average (before clipping), spread
    ``sigma`` (of the underlying normal), clipped to ``min_tokens`` .. ``max_tokens``.
    ``sigma=0`` gives every reply exactly ``mean`` tokens (clipped)."""

    mean: float = 300.0
    max_tokens: int = 2000
    min_tokens: int = 8
    sigma: float = 0.8

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("reply lengths need 1 <= min_tokens <= max_tokens")
        if self.mean <= 0 or self.sigma < 0:
            raise ValueError("reply length mean must be > 0 and sigma >= 0")

    def length(self, prompt: Sequence[str]) -> int:
        """The reply length for a prompt (its tokens): the same prompt, the same length."""
        digest = hashlib.blake2b(
            "\x00".join(prompt).encode("utf-8", "surrogatepass"), person=b"reply-len"
        ).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        mu = math.log(self.mean) - self.sigma**2 / 2  # E[exp(N(mu, sigma))] = mean
        n = round(math.exp(rng.gauss(mu, self.sigma)))
        return max(self.min_tokens, min(self.max_tokens, n))
