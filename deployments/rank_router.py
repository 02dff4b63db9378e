"""Which decode rank a new request goes to (the DecodeGroup's routing, kept free of Ray).

Policies (`routing.policy`):

- `session_affinity`: a request with a session id goes to the rank its session last used, so
  its growing prefix is found in that rank's cache, until that rank is saturated (then the
  least loaded rank takes the session over). A request without a session is keyed by the
  head of its prompt when `prefix_aware` is on, else goes to the least loaded rank.
- `prefix`: every request, with or without a session, is keyed by the head of its prompt
  (its system prompt and first user turn; see `prefix_key`) and bound like a session.
- `least_loaded`: the rank with the fewest running requests (lowest index on a tie); no
  binding, so a session's turns land wherever the load says.
- `power_of_two`: the less loaded of two ranks drawn at random (Ray Serve's default request
  router's policy); with two ranks it is `least_loaded`.
- `random`: a rank drawn uniformly at random.

Load is the rank's count of running requests (decode cost follows the request count, not
the context length); the group is the only router to its ranks, so the counts are exact.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict

POLICIES = ("session_affinity", "prefix", "least_loaded", "power_of_two", "random")


def prefix_key(request: dict, chars: int = 2048) -> str | None:
    """A key for requests that are likely to share a cached prefix. Chat: the system prompt
    and the first user turn in full (agents sharing a long system prompt differ in their first
    turn; keying on the system prompt alone would send them all to one rank). Text or token
    prompts: their first `chars` characters."""
    messages = request.get("messages")
    if messages:
        head = json.dumps(messages[:2], sort_keys=True)
    else:
        head = request.get("prompt") or request.get("prompt_token_ids")
        head = str(head)[:chars] if head else None
    if not head:
        return None
    return "prefix:" + hashlib.blake2b(head.encode(), digest_size=12).hexdigest()


class RankRouter:
    def __init__(self, policy: str = "session_affinity", saturated_at: int = 64, max_keys: int = 100_000,
                 prefix_aware: bool = True, seed: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy, self.saturated_at, self.max_keys, self.prefix_aware = policy, saturated_at, max_keys, prefix_aware
        self.bindings: OrderedDict[str, int] = OrderedDict()  # session or prefix key -> rank
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.bindings)

    def clear(self) -> None:
        self.bindings.clear()

    def key(self, session_id: str | None, request: dict | None) -> str | None:
        """What binds a request to a rank under the sticky policies (None: nothing)."""
        if self.policy == "session_affinity":
            if session_id is not None:
                return session_id
            return prefix_key(request) if self.prefix_aware and request is not None else None
        if self.policy == "prefix":
            return prefix_key(request) if request is not None else None
        return None

    def pick(self, running: list[int], session_id: str | None = None, request: dict | None = None) -> int:
        """The rank for a new request, given each rank's running requests."""
        n = len(running)
        least = min(range(n), key=lambda r: running[r])
        if self.policy == "random":
            return self.rng.randrange(n)
        if self.policy == "power_of_two":
            if n < 3:
                return least
            a, b = self.rng.sample(range(n), 2)
            return a if running[a] <= running[b] else b
        key = self.key(session_id, request)
        if key is None:
            return least
        bound = self.bindings.get(key)
        rank = bound if bound is not None and bound < n and running[bound] < self.saturated_at else least
        self.bindings[key] = rank
        self.bindings.move_to_end(key)
        if len(self.bindings) > self.max_keys:
            self.bindings.popitem(last=False)
        return rank
